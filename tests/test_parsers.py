import pytest

from agentrl.parsers import HermesParser, Llama3JsonParser, get_parser, register_parser


def test_hermes_parallel_calls_in_order():
    text = (
        'Let me compute.\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>\n'
        '<tool_call>{"name": "submit", "arguments": {"answer": "1"}}</tool_call>'
    )
    parsed = HermesParser().parse(text)
    assert [c.name for c in parsed.calls] == ["python", "submit"]
    assert parsed.calls[0].arguments == {"code": "print(1)"}
    assert [c.id for c in parsed.calls] == ["call_0", "call_1"]
    assert parsed.errors == []
    assert parsed.content == "Let me compute."


def test_hermes_arguments_as_json_string():
    parsed = HermesParser().parse(
        '<tool_call>{"name": "bash", "arguments": "{\\"command\\": \\"ls\\"}"}</tool_call>'
    )
    assert parsed.calls[0].arguments == {"command": "ls"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('<tool_call>{"name": "bash", "arguments": {"command": }</tool_call>', "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>["bash"]</tool_call>', "JSON object"),
        ('<tool_call>{"name": "bash", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "bash", "arguments": {}}', "unterminated"),
    ],
)
def test_hermes_malformed_calls_are_errors_not_exceptions(text, needle):
    parsed = HermesParser().parse(text)
    assert parsed.calls == []
    assert len(parsed.errors) == 1
    assert needle in parsed.errors[0].message


def test_hermes_good_and_bad_calls_mixed():
    parsed = HermesParser().parse(
        '<tool_call>{bad}</tool_call><tool_call>{"name": "x", "arguments": {}}</tool_call>'
    )
    assert [c.name for c in parsed.calls] == ["x"]
    assert len(parsed.errors) == 1


def test_hermes_plain_text_has_no_calls():
    parsed = HermesParser().parse("The answer is 4.")
    assert parsed.calls == [] and parsed.errors == [] and parsed.content == "The answer is 4."


def test_llama3_json_calls():
    p = Llama3JsonParser()
    parsed = p.parse(
        '<|python_tag|>{"name": "python", "parameters": {"code": "print(2)"}}; {"name": "submit", "parameters": {"answer": "2"}}<|eom_id|>'
    )
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("python", {"code": "print(2)"}),
        ("submit", {"answer": "2"}),
    ]
    assert p.parse("just text").calls == []
    assert p.parse('{"name": "x", "parameters": ').errors


def test_parser_registry():
    assert get_parser("hermes").name == "hermes"
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_parser("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes", HermesParser)
