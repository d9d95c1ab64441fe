import asyncio
import threading
import time

import pytest

from agentrl.core.task import Task
from agentrl.env.tools import (
    BUILTIN_TOOLS,
    ToolBox,
    ToolContext,
    ToolError,
    ToolTimeout,
    run_tool,
    tool,
)


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


def test_aliases_name_only_parameters_the_tool_has():
    with pytest.raises(TypeError, match=r"aliases for parameters it does not have: \['nope'\]"):

        @tool(aliases={"nope": ["other"]})
        def aliased(ctx: ToolContext, x: int) -> str:
            """Doc."""

    @tool(aliases={"a": ["first"]})
    def plus(ctx: ToolContext, a: int, b: int = 1) -> str:
        """Add.

        Args:
            a: First.
            b: Second.
        """
        return str(a + b)

    assert run_tool(plus, CTX, {"first": 2}).content == "3" == run_tool(plus, CTX, {"a": 2}).content
    assert set(plus.parameters["properties"]) == {"a", "b"}


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


# --- deadlines: every call ends within its own, host-side Python included ------------------------


@tool
def nap(ctx: ToolContext, seconds: float) -> str:
    """Sleep on the host (a pure-Python tool: no sandbox, so no command timeout covers it).

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


@tool
async def anap(ctx: ToolContext, seconds: float) -> str:
    """Sleep, asynchronously.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "awake"


@tool
def own_timeout(ctx: ToolContext) -> str:
    """A tool whose own work times out (a socket, say): its error, not an overrun of its deadline."""
    raise TimeoutError("the upstream service did not answer")


def test_a_hanging_host_tool_is_abandoned_at_its_deadline():
    assert not nap.needs_sandbox
    t0 = time.monotonic()
    with pytest.raises(
        ToolTimeout, match=r"tool 'nap' did not return within its 1s deadline \(tool_timeout_s\)"
    ):
        run_tool(nap, CTX, {"seconds": 3600}, timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 3
    # Left to finish on a daemon thread: it never keeps the process from exiting.
    abandoned = [t for t in threading.enumerate() if t.name == "tool-nap"]
    assert abandoned and all(t.daemon for t in abandoned)
    # Within the deadline, the same call is an ordinary one.
    assert run_tool(nap, CTX, {"seconds": 0.01}, timeout_s=5.0).content == "awake"


def test_async_tools_are_awaited_and_cancelled_at_their_deadline():
    assert run_tool(anap, CTX, {"seconds": 0.01}, timeout_s=5.0).content == "awake"
    assert run_tool(anap, CTX, {"seconds": 0.01}).content == "awake"  # no deadline: awaited here
    t0 = time.monotonic()
    with pytest.raises(ToolTimeout, match="tool 'anap' did not return within its 0.5s deadline"):
        run_tool(anap, CTX, {"seconds": 3600}, timeout_s=0.5)
    assert time.monotonic() - t0 < 0.5 + 3


def test_a_timeout_inside_a_tool_is_its_error_not_an_overrun():
    out = run_tool(own_timeout, CTX, {}, timeout_s=5.0)
    assert out.is_error and "TimeoutError: the upstream service did not answer" in out.content


def test_a_full_thread_table_is_a_tool_error_not_a_crash(monkeypatch):
    from agentrl.env.tools import ToolContext, run_tool, tool

    @tool
    def echo(ctx: ToolContext, text: str) -> str:
        """Echo.

        Args:
            text: what to echo.
        """
        return text

    def refuse(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    out = run_tool(echo, ToolContext(sandbox=None, task=Task(id="t", prompt="p")), {"text": "x"}, timeout_s=5)
    assert out.is_error and not out.ran and "could not start a thread" in out.content
