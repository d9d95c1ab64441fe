import pytest

from agentrl.task import Task
from agentrl.tools import BUILTIN_TOOLS, ToolBox, ToolContext, ToolError, run_tool, tool


@tool
def add(ctx: ToolContext, a: int, b: int = 2, label: str | None = None) -> str:
    """Add two integers.

    Args:
        a: First addend.
        b: Second addend; a long description
            that continues on the next line.
        label: Optional label.
    """
    if a < 0:
        raise ToolError("a must be non-negative")
    if a == 13:
        raise RuntimeError("unlucky")
    return f"{label or 'sum'}={a + b}"


CTX = ToolContext(sandbox=None, task=Task(id="t", prompt="p"))


def test_schema_from_signature_and_docstring():
    s = add.schema
    assert s["type"] == "function"
    f = s["function"]
    assert f["name"] == "add"
    assert f["description"] == "Add two integers."
    props = f["parameters"]["properties"]
    assert props["a"] == {"type": "integer", "description": "First addend."}
    assert props["b"]["default"] == 2
    assert props["b"]["description"] == "Second addend; a long description that continues on the next line."
    assert f["parameters"]["required"] == ["a"]
    assert f["parameters"]["additionalProperties"] is False


def test_run_tool_ok_and_defaults():
    assert run_tool(add, CTX, {"a": 1}).content == "sum=3"
    assert run_tool(add, CTX, {"a": 1, "b": 5, "label": "x"}).content == "x=6"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ({}, "a: Field required"),
        ({"a": "one"}, "a: Input should be a valid integer"),
        ({"a": 1, "zzz": 1}, "zzz: Extra inputs are not permitted"),
        ({"a": [1]}, "a: Input should be a valid integer"),
    ],
)
def test_bad_arguments_become_error_observations(args, needle):
    out = run_tool(add, CTX, args)
    assert out.is_error
    assert out.content.startswith("Error: bad arguments for tool 'add'")
    assert needle in out.content
    assert "Expected {a: integer, b: integer (optional)" in out.content


def test_tool_error_and_crash_are_observations():
    out = run_tool(add, CTX, {"a": -1})
    assert out.is_error and out.content == "Error: a must be non-negative"
    out = run_tool(add, CTX, {"a": 13})
    assert out.is_error and "RuntimeError: unlucky" in out.content


def test_tool_definition_errors_are_clear():
    with pytest.raises(TypeError, match="first parameter must be `ctx"):

        @tool
        def bad(x: int) -> str:
            """Doc."""

    with pytest.raises(TypeError, match="needs a docstring"):

        @tool
        def nodoc(ctx: ToolContext, x: int) -> str:
            return ""

    with pytest.raises(TypeError, match="needs a type annotation"):

        @tool
        def untyped(ctx: ToolContext, x) -> str:
            """Doc."""


def test_submit_is_terminal_and_needs_no_sandbox():
    out = run_tool(BUILTIN_TOOLS["submit"], CTX, {"answer": " 42 "})
    assert out.terminal and out.submission == "42"
    assert not ToolBox.of(["submit"]).needs_sandbox
    assert ToolBox.of(["python", "submit"]).needs_sandbox


def test_toolbox_rejects_unknown_and_duplicate_tools():
    with pytest.raises(ValueError, match="unknown built-in tool 'pyhton'"):
        ToolBox.of(["pyhton"])
    with pytest.raises(ValueError, match="two tools are named 'submit'"):
        ToolBox.of(["submit", "submit"])


def test_sandbox_tool_without_sandbox_is_an_error_observation():
    out = run_tool(BUILTIN_TOOLS["bash"], CTX, {"command": "ls"})
    assert out.is_error and "no sandbox" in out.content
