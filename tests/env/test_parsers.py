import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.core.errors import UserError
from agentrl.env.parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    get_parser,
    json_depth,
    register_parser,
)


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
    with pytest.raises(UserError, match="unknown tool-call parser 'hermez'. Did you mean 'hermes'"):
        get_parser("hermez")
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes", HermesParser)


def test_a_parser_that_cannot_write_calls_is_refused_by_name():
    class ReadOnly:
        name = "read-only"
        format_hint = "CALL name(args)"

        def parse(self, text):
            return HermesParser().parse(text)

    register_parser("read-only", ReadOnly)
    try:
        with pytest.raises(TypeError, match="has no system_block, render_calls, render_call.*ToolCallFormat"):
            get_parser("read-only")
    finally:
        PARSERS.pop("read-only")


# --- each format in all three directions: what the model is told, what is written, what is read ---------

ARGUMENTS = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(st.text(max_size=30), st.integers(-(10**9), 10**9), st.booleans(), st.none()),
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(
    parser=st.sampled_from(["hermes", "llama3-json"]),
    calls=st.lists(
        st.tuples(st.from_regex(r"[a-z_]{1,12}", fullmatch=True), ARGUMENTS), min_size=1, max_size=4
    ),
)
def test_what_a_format_writes_it_reads_back(parser, calls):
    fmt = get_parser(parser)
    parsed = fmt.parse(fmt.render_calls(calls))
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == calls


def test_render_call_takes_any_argument_name():
    """The tool's name is positional only: a tool may have an argument called `name` or `tool`."""
    call = get_parser("llama3-json").render_call("lookup", name="x", tool="y")
    assert json.loads(call) == {"name": "lookup", "parameters": {"name": "x", "tool": "y"}}


SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run code.",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def test_each_format_advertises_its_own_calls():
    hermes, llama = (
        get_parser("hermes").system_block(SCHEMAS),
        get_parser("llama3-json").system_block(SCHEMAS),
    )
    assert "<tools>" in hermes and "<tool_call>" in hermes and '"arguments"' in hermes
    assert "<tools>" not in llama and "<tool_call>" not in llama
    assert '"parameters": dictionary of argument name and its value' in llama and '"name": "python"' in llama


# --- model text that would make a naive decoder raise: an error, never an exception ----


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        ("[" * 1000 + "]" * 1000, "nests more than 32 levels deep"),
        ('{"a":' * 1000 + "1" + "}" * 1000, "nests more than 32 levels deep"),
        ("NaN", "NaN is not JSON"),
        ("-Infinity", "-Infinity is not JSON"),
        ("1e999", "too large for a float"),
        ("9" * 5000, "an integer has 5000 digits; the limit is 4300"),
        ('"\\ud800"', "lone UTF-16 surrogate"),
    ],
)
@pytest.mark.parametrize("parser", ["hermes", "llama3-json"])
def test_hostile_json_is_a_parse_error(parser, arguments, needle):
    key = "arguments" if parser == "hermes" else "parameters"
    call = f'{{"name": "python", "{key}": {{"code": {arguments}}}}}'
    parsed = get_parser(parser).parse(f"<tool_call>{call}</tool_call>" if parser == "hermes" else call)
    assert parsed.calls == []
    assert len(parsed.errors) == 1 and needle in parsed.errors[0].message


def test_depth_limit_counts_brackets_outside_strings_only():
    code = "[" * 100  # a string full of brackets is not nesting
    parsed = HermesParser().parse(
        f'<tool_call>{{"name": "python", "arguments": {{"code": "{code}", "x": {"[" * 30 + "]" * 30}}}}}</tool_call>'
    )
    assert parsed.errors == [] and parsed.calls[0].arguments["code"] == code
    assert json_depth('{"a": "[[[["}') == 1
    assert json_depth("[" * 5 + "]" * 5) == 5


def test_arguments_given_as_a_json_string_are_held_to_the_same_rules():
    inner = json.dumps("[" * 100 + "]" * 100)
    parsed = HermesParser().parse(f'<tool_call>{{"name": "bash", "arguments": {inner}}}</tool_call>')
    assert parsed.calls == [] and "nests more than 32 levels deep" in parsed.errors[0].message


def test_valid_unicode_and_large_finite_numbers_still_parse():
    parsed = HermesParser().parse(
        '<tool_call>{"name": "x", "arguments": {"s": "\\ud83d\\ude00 \\u00e9", "n": 1e308, "i": '
        + "9" * 4300
        + "}}</tool_call>"
    )
    assert parsed.errors == []
    assert parsed.calls[0].arguments["s"] == "\U0001f600 é" and parsed.calls[0].arguments["n"] == 1e308


HOSTILE_TEXT = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.characters(), st.integers(0xD800, 0xDFFF).map(chr)), max_size=200).map("".join),
    st.integers(0, 5000).map(lambda d: "[" * d),
    st.integers(0, 5000).map(lambda d: "{" * d + "}" * d),
    st.integers(0, 10000).map(lambda n: "1" * n),
    st.sampled_from(
        ["NaN", "Infinity", "1e999", '"\\ud800"', '"\\', "<tool_call>", "</tool_call>", ";", "{}"]
    ),
)


@settings(max_examples=500, deadline=None)
@given(parser=st.sampled_from(sorted(PARSERS)), pieces=st.lists(HOSTILE_TEXT, max_size=8))
def test_parsers_never_raise(parser, pieces):
    text = "".join(pieces)
    for wrapped in (text, f"<tool_call>{text}</tool_call>", f'{{"name": "x", "parameters": {text}}}'):
        parsed = get_parser(parser).parse(wrapped)
        for call in parsed.calls:
            assert isinstance(call.name, str) and isinstance(call.arguments, dict)
