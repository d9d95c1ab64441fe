"""Tools: typed Python functions the agent calls; their JSON schema comes from the signature and docstring.

    @tool
    def python(ctx: ToolContext, code: str) -> str:
        '''Run Python 3 code in the workspace and return what it printed.

        Args:
            code: The program; print what you want to see.
        '''

The first parameter is always the `ToolContext` (the sandbox, the task, the episode's
state); it is not part of the schema. Everything that goes wrong inside a tool (bad arguments,
an exception, a timeout) becomes a `ToolOutcome` with `is_error=True` that the model reads as
an observation: a tool never raises out of `run_tool`, except `SandboxDead`, `ToolTimeout` and
`ToolServerLost` (an MCP server that died), which end the episode.

A tool may be `async def`. With a deadline (`run_tool(..., timeout_s=...)`, which `ToolEnv` always
gives: `tool_timeout_s`) a call runs on a thread of its own, and one that overruns it is abandoned:
Python cannot stop a thread, so it is left to finish and whatever it returns is dropped (an async
tool is cancelled at the deadline too, through `asyncio.timeout`).
"""

from __future__ import annotations

import asyncio
import inspect
import re
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import AliasChoices, BaseModel, ConfigDict, ValidationError, create_model

from agentrl.core.deadline import DeadlineExceeded, ThreadLimitReached, call_with_deadline
from agentrl.core.task import Task
from agentrl.sandbox.base import (
    ExecResult,
    FileTooLargeError,
    NotRegularFileError,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxPathError,
)


class ToolError(Exception):
    """Raised by a tool for an error the model should read (bad path, no match, ...)."""


class ToolServerLost(Exception):
    """The process serving a tool (an MCP server) exited, broke its protocol or stopped answering. Like
    `SandboxDead`, it ends the episode (`env_error`), with this exception's message as the reason."""


class ToolTimeout(Exception):
    """A tool call ran past its deadline and was abandoned; like `SandboxDead`, it ends the episode.

    The call is not stopped (a thread cannot be): it is left to finish and its result is dropped,
    so the episode that made it must not go on reading or writing state the call may still touch.
    """

    def __init__(self, tool: str, timeout_s: float):
        super().__init__(
            f"tool '{tool}' did not return within its {timeout_s:g}s deadline (tool_timeout_s), so the call "
            "was abandoned; make the tool return sooner, or raise the environment's tool_timeout_s"
        )
        self.tool, self.timeout_s = tool, timeout_s


@dataclass
class ToolContext:
    """What a tool may touch during one episode."""

    sandbox: Sandbox | None
    task: Task
    exec_timeout_s: float = 30.0
    # Environment-specific episode state (a game's secret, a counter); owned by the env.
    state: Any = None


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call produced, as the model will read it."""

    content: str
    is_error: bool = False
    timed_out: bool = False
    # A terminal tool (submit) ends the episode; `submission` is what it submitted.
    terminal: bool = False
    submission: str | None = None
    duration_s: float = 0.0
    # Whether the tool itself ran: False when the arguments failed validation (nothing happened).
    # Gates such as `tool-used` count only calls that ran.
    ran: bool = True


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    fn: Callable[..., Any]
    params_model: type[BaseModel]
    parameters: dict[str, Any]
    terminal: bool = False
    needs_sandbox: bool = True
    # Checks the arguments another way than `params_model` (an MCP server's JSON schema): returns the
    # keyword arguments of `fn`, or raises `ToolError` saying what is wrong (the call does not run).
    check_arguments: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """OpenAI/Hermes function schema, the form chat templates and vLLM expect in `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """Google-style docstring -> (description, {arg: description})."""
    doc = inspect.cleandoc(doc or "")
    parts = re.split(r"^\s*(?:Args|Arguments|Parameters):\s*$", doc, maxsplit=1, flags=re.M)
    description = parts[0].strip()
    args: dict[str, str] = {}
    if len(parts) == 2:
        current = None
        for line in parts[1].splitlines():
            if re.match(r"^\s*(Returns|Raises|Yields|Examples?):\s*$", line):
                break
            m = re.match(r"^\s{0,8}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
            if m:
                current = m.group(1)
                args[current] = m.group(2).strip()
            elif current and line.strip():
                args[current] += " " + line.strip()
    return description, args


def uses_sandbox(fn: Callable) -> bool:
    """Whether `fn`'s body names a sandbox: `ctx.sandbox`, or a helper with `sandbox` in its name
    (nested functions and comprehensions included). How `@tool` infers `needs_sandbox`."""
    stack = [getattr(inspect.unwrap(fn), "__code__", None)]
    while stack:
        code = stack.pop()
        if code is None:
            continue
        if any("sandbox" in n.lower() for n in code.co_names):
            return True
        stack.extend(c for c in code.co_consts if inspect.iscode(c))
    return False


def tool(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    terminal: bool = False,
    needs_sandbox: bool | None = None,
    aliases: Mapping[str, Sequence[str]] | None = None,
) -> Any:
    """Turn a typed function `(ctx, **args) -> str` into a `Tool`. Usable bare or with options.
    The function may be `async def` (awaited on the call's own thread, cancelled at its deadline).

    `needs_sandbox`: whether an episode must start a sandbox for this tool. Left unset, it is
    inferred from the body: a tool that touches `ctx.sandbox` (or calls a helper whose name
    contains `sandbox`) needs one, a pure-Python tool does not, so an environment of pure tools
    resets in microseconds instead of starting a container. Declare it when the sandbox is only
    reached indirectly (through a helper the inference cannot see).

    `aliases`: other names a call may give a parameter, `{"old": ["old_str"]}`, for agents written
    against other harnesses' tools. The schema the model reads names only the parameter; a call
    that gives both names is refused as ambiguous.
    """

    def wrap(f: Callable) -> Tool:
        sig = inspect.signature(f)
        hints = typing.get_type_hints(f)
        params = list(sig.parameters.values())
        if not params or params[0].name not in ("ctx", "context"):
            raise TypeError(f"tool {f.__name__!r}: the first parameter must be `ctx: ToolContext`")
        description, arg_docs = _parse_docstring(f.__doc__ or "")
        if not description:
            raise TypeError(f"tool {f.__name__!r} needs a docstring: it is the description the model reads")
        fields: dict[str, Any] = {}
        unknown = set(aliases or {}) - {p.name for p in params[1:]}
        if unknown:
            raise TypeError(
                f"tool {f.__name__!r}: aliases for parameters it does not have: {sorted(unknown)}"
            )
        for p in params[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise TypeError(f"tool {f.__name__!r}: *args/**kwargs cannot be described to a model")
            if p.name not in hints:
                raise TypeError(f"tool {f.__name__!r}: parameter {p.name!r} needs a type annotation")
            from pydantic import Field

            default: Any = ... if p.default is inspect.Parameter.empty else p.default
            other_names = list((aliases or {}).get(p.name, ()))
            choices: dict[str, Any] = (
                {"validation_alias": AliasChoices(p.name, *other_names)} if other_names else {}
            )
            fields[p.name] = (hints[p.name], Field(default, description=arg_docs.get(p.name), **choices))
        model = create_model(f"{f.__name__}_args", __config__=ConfigDict(extra="forbid"), **fields)
        schema = model.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        return Tool(
            name=name or f.__name__,
            description=description,
            fn=f,
            params_model=model,
            parameters=schema,
            terminal=terminal,
            needs_sandbox=uses_sandbox(f) if needs_sandbox is None else needs_sandbox,
        )

    return wrap(fn) if fn is not None else wrap


def _format_validation_error(tool: Tool, exc: ValidationError) -> str:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(arguments)"
        problems.append(f"{loc}: {err['msg']}")
    expected = ", ".join(
        f"{k}: {v.get('type', 'any')}" + ("" if k in tool.parameters.get("required", []) else " (optional)")
        for k, v in tool.parameters.get("properties", {}).items()
    )
    return (
        f"Error: bad arguments for tool '{tool.name}': " + "; ".join(problems) + f". Expected {{{expected}}}."
    )


def run_tool(
    t: Tool, ctx: ToolContext, arguments: Mapping[str, Any], timeout_s: float | None = None
) -> ToolOutcome:
    """Validate `arguments` and run the tool, within `timeout_s` seconds when given (see the module
    docstring; None: in this thread, unbounded). Never raises, except `SandboxDead`, `ToolTimeout`
    and `ToolServerLost`, which end the episode."""
    if timeout_s is None:
        return _run_tool(t, ctx, arguments, None)
    try:
        return call_with_deadline(
            _run_tool, t, ctx, arguments, timeout_s, timeout_s=timeout_s, name=f"tool-{t.name}"
        )
    except DeadlineExceeded:
        raise ToolTimeout(t.name, timeout_s) from None
    except ThreadLimitReached as exc:
        return ToolOutcome(
            f"Error: tool '{t.name}' could not run: {exc}; earlier calls that overran are still running.",
            is_error=True,
            ran=False,
        )


def _run_tool(
    t: Tool, ctx: ToolContext, arguments: Mapping[str, Any], timeout_s: float | None
) -> ToolOutcome:
    t0 = time.perf_counter()
    if not isinstance(arguments, Mapping):
        return ToolOutcome(
            f"Error: the arguments of tool '{t.name}' must be a JSON object, got {type(arguments).__name__}.",
            is_error=True,
            ran=False,
        )
    if t.check_arguments is not None:
        try:
            kwargs = t.check_arguments(dict(arguments))
        except ToolError as exc:
            return ToolOutcome(f"Error: bad arguments for tool '{t.name}': {exc}", is_error=True, ran=False)
        return _call_tool(t, ctx, kwargs, timeout_s, t0)
    try:
        args = t.params_model.model_validate(dict(arguments))
    except ValidationError as exc:
        return ToolOutcome(_format_validation_error(t, exc), is_error=True, ran=False)
    except Exception as exc:  # a validator that crashed on odd input: still the model's bad arguments
        return ToolOutcome(
            f"Error: bad arguments for tool '{t.name}': {type(exc).__name__}: {exc}", is_error=True, ran=False
        )
    return _call_tool(t, ctx, {k: getattr(args, k) for k in t.params_model.model_fields}, timeout_s, t0)


def _call_tool(
    t: Tool, ctx: ToolContext, kwargs: dict[str, Any], timeout_s: float | None, t0: float
) -> ToolOutcome:
    try:
        result = t.fn(ctx, **kwargs)
        if inspect.isawaitable(result):
            # With a deadline, on run_tool's own thread: no event loop runs there.
            result = asyncio.run(_awaited(result, t.name, timeout_s))
    except (SandboxDead, ToolTimeout, ToolServerLost):
        raise
    except ToolError as exc:
        return ToolOutcome(f"Error: {exc}", is_error=True, duration_s=time.perf_counter() - t0)
    except Exception as exc:  # a crashed tool is an observation, not a crashed run
        hint = ""
        if ctx.sandbox is None and isinstance(exc, AttributeError) and "NoneType" in str(exc):
            # Most likely a sandbox the tool reaches through a helper: the inference could not see it.
            hint = " (this tool ran without a sandbox; declare it with @agentrl.tool(needs_sandbox=True) if it uses one)"
        return ToolOutcome(
            f"Error: tool '{t.name}' failed: {type(exc).__name__}: {exc}{hint}",
            is_error=True,
            duration_s=time.perf_counter() - t0,
        )
    if isinstance(result, ToolOutcome):
        return result
    if t.terminal:
        return ToolOutcome(
            "Submitted.", terminal=True, submission=str(result), duration_s=time.perf_counter() - t0
        )
    return ToolOutcome(str(result), duration_s=time.perf_counter() - t0)


async def _awaited(awaitable: Any, name: str, timeout_s: float | None) -> Any:
    """An async tool's result, cancelled at `timeout_s` (unlike a thread, a coroutine can be stopped).
    A `TimeoutError` the tool raises itself stays the tool's error, not an overrun."""
    try:
        async with asyncio.timeout(timeout_s) as scope:
            return await awaitable
    except TimeoutError:
        if scope.expired():
            raise ToolTimeout(name, timeout_s or 0.0) from None
        raise


# --- built-in tools ----------------------------------------------------------------------

# What a model reads back from one command: enough to debug, bounded so one `cat` of a big file
# cannot blow the context. The sandbox caps raw output earlier (Limits.output_limit_bytes).
MAX_OBSERVATION_CHARS = 8000


def clip_observation(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    """`text` as a tool's observation: at most `limit` characters, its start and end kept."""
    return _clip(text, limit)


def _clip(text: str, limit: int = MAX_OBSERVATION_CHARS) -> str:
    if len(text) <= limit:
        return text
    head = limit * 3 // 4
    tail = limit - head
    return f"{text[:head]}\n[... {len(text) - limit} characters omitted ...]\n{text[-tail:]}"


def format_exec(res: ExecResult, timeout_s: float) -> ToolOutcome:
    parts = []
    if res.stdout:
        parts.append(res.stdout.rstrip("\n"))
    if res.stderr:
        parts.append("[stderr]\n" + res.stderr.rstrip("\n"))
    if res.timed_out:
        parts.append(f"[timed out after {timeout_s:g}s: the command and its children were killed]")
    elif res.exit_code != 0:
        parts.append(f"[exit code {res.exit_code}]")
    if res.truncated:
        parts.append("[output truncated]")
    content = _clip("\n".join(parts)) if parts else "[no output]"
    return ToolOutcome(
        content,
        is_error=res.timed_out or res.exit_code != 0,
        timed_out=res.timed_out,
        duration_s=res.duration_s,
    )


def _sandbox(ctx: ToolContext) -> Sandbox:
    if ctx.sandbox is None:
        raise ToolError("this environment has no sandbox")
    return ctx.sandbox


@tool
def bash(ctx: ToolContext, command: str) -> ToolOutcome:
    """Run a bash command in the workspace and return its output and exit code.

    Args:
        command: The command line, run with `bash -c` in the workspace directory.
    """
    res = _sandbox(ctx).exec(["bash", "-c", command], timeout=ctx.exec_timeout_s)
    return format_exec(res, ctx.exec_timeout_s)


@tool
def python(ctx: ToolContext, code: str) -> ToolOutcome:
    """Run a Python 3 program in the workspace and return what it printed.

    Args:
        code: The program. Use print() to see values.
    """
    res = _sandbox(ctx).exec(["python3", "-"], stdin=code, timeout=ctx.exec_timeout_s)
    return format_exec(res, ctx.exec_timeout_s)


# What the read_file tool reads at most; the model sees at most MAX_OBSERVATION_CHARS of it anyway.
READ_FILE_TOOL_BYTES = 1024 * 1024


def _file_error(path: str, exc: Exception) -> ToolError:
    """The model-facing words for a file a tool cannot read (and what to do instead)."""
    if isinstance(exc, FileNotFoundError):
        return ToolError(f"no such file: {path}")
    if isinstance(exc, IsADirectoryError):
        return ToolError(f"{path} is a directory; use bash with `ls` to list it")
    if isinstance(exc, NotRegularFileError):
        return ToolError(
            f"{path} is not a regular file (a device, FIFO or socket); only regular files can be read"
        )
    if isinstance(exc, FileTooLargeError):
        return ToolError(
            f"{path} is larger than {exc.limit} bytes; work on it with bash (`sed -n`, `grep`, `head`)"
        )
    if isinstance(exc, SandboxPathError):
        return ToolError(str(exc))
    if isinstance(exc, PermissionError):
        return ToolError(f"permission denied: {path}")
    return ToolError(f"cannot read {path}: {exc}")


@tool(aliases={"path": ["file_path"]})
def read_file(ctx: ToolContext, path: str) -> str:
    """Read a text file.

    Args:
        path: File path, relative to the workspace or absolute.
    """
    try:
        # One byte over the limit says whether the file was cut; never more is read.
        data = _sandbox(ctx).read_file(path, max_bytes=READ_FILE_TOOL_BYTES + 1, truncate=True)
    except (OSError, SandboxError) as exc:
        if isinstance(exc, SandboxDead):
            raise
        raise _file_error(path, exc) from None
    text = data[:READ_FILE_TOOL_BYTES].decode("utf-8", errors="replace")
    if len(data) <= READ_FILE_TOOL_BYTES:
        return _clip(text)
    head = text[:MAX_OBSERVATION_CHARS]
    return (
        f"{head}\n[... {path} is larger than {READ_FILE_TOOL_BYTES} bytes; this is its start. "
        "Read other parts with bash (`sed -n '100,200p' FILE`, `tail -c`).]"
    )


@tool(aliases={"path": ["file_path"], "content": ["file_text"]})
def write_file(ctx: ToolContext, path: str, content: str) -> str:
    """Create or overwrite a text file.

    Args:
        path: File path, relative to the workspace or absolute.
        content: The whole new content of the file.
    """
    try:
        _sandbox(ctx).write_file(path, content)
    except NotRegularFileError:
        raise ToolError(
            f"{path} is not a regular file (a device, FIFO or socket); write a regular file"
        ) from None
    except PermissionError:
        raise ToolError(f"permission denied: {path} (only the workspace and /tmp are writable)") from None
    return f"Wrote {len(content.encode())} bytes to {path}."


# The argument names of the editing tools most agent harnesses ship (SWE-agent's and OpenHands'
# str_replace_editor, Anthropic's text editor): an agent written for them calls ours unchanged.
@tool(aliases={"path": ["file_path"], "old": ["old_str"], "new": ["new_str"]})
def str_replace(ctx: ToolContext, path: str, old: str, new: str) -> str:
    """Replace one exact occurrence of `old` with `new` in a text file.

    Args:
        path: File path, relative to the workspace or absolute.
        old: Text to find; it must occur exactly once in the file.
        new: Replacement text.
    """
    sb = _sandbox(ctx)
    try:
        text = sb.read_file(path).decode("utf-8")
    except UnicodeDecodeError:
        raise ToolError(f"{path} is not a UTF-8 text file") from None
    except (OSError, SandboxError) as exc:
        if isinstance(exc, SandboxDead):
            raise
        raise _file_error(path, exc) from None
    count = text.count(old)
    if count != 1:
        raise ToolError(
            f"`old` occurs {count} times in {path}; it must occur exactly once (add surrounding lines)"
        )
    try:
        sb.write_file(path, text.replace(old, new, 1))
    except PermissionError:
        raise ToolError(f"permission denied: {path}") from None
    return f"Replaced 1 occurrence in {path}."


@tool(terminal=True, needs_sandbox=False)
def submit(ctx: ToolContext, answer: str) -> str:
    """Submit your final answer and end the episode.

    Args:
        answer: The final answer (for a number, just the number).
    """
    return answer.strip()


BUILTIN_TOOLS: dict[str, Tool] = {
    t.name: t for t in (bash, python, read_file, write_file, str_replace, submit)
}


@dataclass
class ToolBox:
    """The tools of one environment, looked up by name with a helpful error."""

    tools: dict[str, Tool] = field(default_factory=dict)

    @classmethod
    def of(cls, tools: list[Tool | str]) -> ToolBox:
        box: dict[str, Tool] = {}
        for t in tools:
            if isinstance(t, str):
                if t not in BUILTIN_TOOLS:
                    raise ValueError(f"unknown built-in tool {t!r}; built-ins are {sorted(BUILTIN_TOOLS)}")
                t = BUILTIN_TOOLS[t]
            if t.name in box:
                raise ValueError(f"two tools are named {t.name!r}")
            box[t.name] = t
        return cls(box)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    @property
    def needs_sandbox(self) -> bool:
        return any(t.needs_sandbox for t in self.tools.values())
