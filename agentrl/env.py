"""`ToolEnv`: a Gymnasium environment where the agent acts by calling tools in a sandbox.

The contract is Gymnasium's, exactly:

    obs, info = env.reset(seed=0)                # obs: [system message, user message]
    obs, reward, terminated, truncated, info = env.step(assistant_text)

- An observation is the list of *new* messages since the last step (tool results).
- `terminated` when the agent submits; `truncated` at the turn limit or when the sandbox
  dies (`info["finish_reason"]` says which). The verifier runs when the episode ends, and
  its reward comes back from that `step` (0 before).
- Malformed calls, unknown tools, bad arguments, crashed or hung tools become error
  observations the model can read; `step` does not raise for anything the model writes.
- One message runs at most `max_tool_calls_per_step` tool calls, within `step_timeout_s` in
  all; the calls past either are not run, and the observation says so.
- Nothing the env runs can stall it: every tool call has a deadline (`tool_timeout_s`), host-side
  Python included; a call past it is abandoned and ends the episode `env_error`. The verifier has
  one too (`verifier_timeout_s`): past it, reward 0 with the reason.
- `close()` is idempotent; `reset()` after `close()` works; `with env:` closes.

Subclasses (see `agentrl.envs`) supply a task generator, tools, a verifier and an oracle.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import gymnasium

from agentrl.episode import Episode, ToolCallRecord
from agentrl.parsers import ParsedAction, ParseError, ToolCall, ToolCallParser, get_parser
from agentrl.sandbox.base import (
    DEFAULT_WORKDIR,
    EngineUnavailable,
    Limits,
    Sandbox,
    SandboxDead,
    SandboxError,
    open_sandbox,
)
from agentrl.spaces import Messages, UnicodeText
from agentrl.task import Task, TaskGenerator
from agentrl.tasksource import TaskSource, as_task_source, coerce_task
from agentrl.tools import Tool, ToolBox, ToolContext, ToolOutcome, ToolTimeout, run_tool
from agentrl.types import FinishReason, Message, Split, StepInfo
from agentrl.verifiers import Verdict, Verifier, get, run_verifier
from agentrl.verifiers.base import verifier_deadline

log = logging.getLogger(__name__)


class EnvError(RuntimeError):
    """The environment could not start an episode (sandbox would not start, task set-up failed)."""


# Default of `max_tool_calls_per_step`. verl's multi-turn rollout runs 1 call per turn
# (`max_parallel_calls: 1`) and silently drops the rest; PrimeIntellect's verifiers runs every call
# a message holds. Tool-calling chat templates (Hermes/Qwen, Llama 3.1) let a model emit several,
# and reading two files at once is ordinary, so 1 would punish a normal habit; no bound lets one
# message stand for a whole episode (100 parallel guesses win guess-number, 8 x `sleep 4` make a
# 32 s step). 4 keeps parallel reads and bounds the rest; the model is told what was not run.
DEFAULT_MAX_TOOL_CALLS_PER_STEP = 4
# Longest tool name echoed back in an error: a model may write a megabyte where a name belongs.
_NAME_ECHO = 80
# What `tool_timeout_s` adds to `exec_timeout_s` when unset. A built-in tool runs one command,
# killed at `exec_timeout_s`; the margin covers starting it, killing it and reading its output on
# a loaded engine, and the tool's own work around it. Only a tool that hangs ever reaches it.
TOOL_DEADLINE_MARGIN_S = 30.0


class ToolEnv(gymnasium.Env[list, str]):
    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"]}

    #: Instructions at the top of the system prompt; subclasses override.
    instructions = (
        "You are a helpful agent. Use the tools to solve the task, then call `submit` with your answer."
    )
    #: `max_tool_calls_per_step` when the caller does not set it; a game may allow fewer.
    default_max_tool_calls_per_step: ClassVar[int] = DEFAULT_MAX_TOOL_CALLS_PER_STEP
    #: The procedural task supply of a subclass, `task_generator(seed)`, used when no `tasks` are given.
    task_generator: ClassVar[Callable[[int], TaskGenerator] | None] = None

    def __init__(
        self,
        *,
        tasks: TaskGenerator | Sequence[Task] | Any,
        tools: Sequence[Tool | str],
        verifier: Verifier | str | tuple[str, dict] = "exact-match",
        max_turns: int = 10,
        split: Split = "train",
        backend: str = "docker",
        limits: Limits | dict | None = None,
        use_pool: bool = True,
        parser: str = "hermes",
        tools_in_prompt: bool = True,
        exec_timeout_s: float = 30.0,
        verifier_timeout_s: float | None = None,
        max_action_chars: int = 65536,
        max_tool_calls_per_step: int | None = None,
        step_timeout_s: float | None = None,
        tool_timeout_s: float | None = None,
        sandbox_env: dict[str, str] | None = None,
        env_id: str | None = None,
        render_mode: str | None = None,
        oracle: Callable[[Task], Any] | None = None,
    ):
        """
        max_tool_calls_per_step: most tool calls one message runs (None: the class's
            `default_max_tool_calls_per_step`, 4 for ToolEnv, see `DEFAULT_MAX_TOOL_CALLS_PER_STEP`
            for why); the rest are not run and the observation says so.
        step_timeout_s: wall-clock budget of all the tool calls of one message (None: twice
            `exec_timeout_s`). Each call's command timeout is cut to what is left of it; calls that
            find it spent are not run. The verifier's time is not part of it.
        tool_timeout_s: wall-clock deadline of one tool call, whatever the tool does (host-side
            Python included; None: `exec_timeout_s` + `TOOL_DEADLINE_MARGIN_S`). A call past it is
            abandoned and ends the episode `env_error`, with the reason in `error`; the call's
            thread cannot be stopped, so it is left to finish and its result is dropped. Raise it
            for a tool that runs several long commands.
        verifier_timeout_s: wall-clock deadline of the verifier (None: the verifier's own
            `timeout_s` + `agentrl.verifiers.base.VERIFIER_DEADLINE_MARGIN_S` when it declares one,
            else `DEFAULT_VERIFIER_TIMEOUT_S`, 300 s). Past it the verifier is abandoned and the
            episode scores 0, the reason in the verdict's `details`.
        """
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_tool_calls_per_step is not None and max_tool_calls_per_step < 1:
            raise ValueError(f"max_tool_calls_per_step must be >= 1, got {max_tool_calls_per_step}")
        if step_timeout_s is not None and step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0 seconds, got {step_timeout_s}")
        if tool_timeout_s is not None and tool_timeout_s <= 0:
            raise ValueError(
                f"tool_timeout_s must be > 0 seconds (or None for the default), got {tool_timeout_s}"
            )
        if verifier_timeout_s is not None and verifier_timeout_s <= 0:
            raise ValueError(
                f"verifier_timeout_s must be > 0 seconds (or None for the default), got {verifier_timeout_s}"
            )
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode {render_mode!r} not supported; use 'ansi' or None")
        # Generators, lists, JSONL paths, datasets: one validated view (agentrl.tasksource).
        self.tasks: TaskSource = as_task_source(tasks, name=env_id or type(self).__name__)
        self.parser = get_parser(parser)
        if oracle is not None:  # the reference solution: oracle(task) -> an agent (README: Oracles)
            self.oracle = _in_format(oracle, self.parser)
        self.toolbox = ToolBox.of(list(tools))
        if isinstance(verifier, str):
            verifier = get(verifier)
        elif isinstance(verifier, tuple):
            verifier = get(verifier[0], **verifier[1])
        self.verifier: Verifier = verifier
        self.max_turns = max_turns
        self.split: Split = split
        self.backend = backend
        self.limits = limits if isinstance(limits, Limits) else Limits(**(limits or {}))
        self.use_pool = use_pool
        self.tools_in_prompt = tools_in_prompt
        self.exec_timeout_s = exec_timeout_s
        self.verifier_timeout_s = verifier_timeout_s
        self.max_action_chars = max_action_chars
        self.max_tool_calls_per_step = (
            self.default_max_tool_calls_per_step
            if max_tool_calls_per_step is None
            else max_tool_calls_per_step
        )
        self.step_timeout_s = step_timeout_s
        self.tool_timeout_s = tool_timeout_s
        # Environment variables every sandbox of this env starts with (the agent can change them
        # in its own commands; verifiers run with their own clean environment).
        self.sandbox_env = dict(sandbox_env or {})
        self.env_id = env_id or type(self).__name__
        self.render_mode = render_mode
        self.observation_space = Messages()
        self.action_space = UnicodeText(max_length=max_action_chars)
        self.sandbox: Sandbox | None = None
        self.task: Task | None = None
        self.episode: Episode | None = None
        self._ctx: ToolContext | None = None
        if backend == "docker":
            # From the main thread (where envs are usually made), so that SIGTERM/SIGINT remove
            # this process's containers even when a rollout opens them on worker threads.
            from agentrl.sandbox.reaper import install_signal_handlers

            install_signal_handlers()

    @property
    def step_budget_s(self) -> float:
        """The wall-clock budget of one message's tool calls: `step_timeout_s`, else 2 x `exec_timeout_s`."""
        return self.step_timeout_s if self.step_timeout_s is not None else 2 * self.exec_timeout_s

    @property
    def tool_deadline_s(self) -> float:
        """The deadline of one tool call: `tool_timeout_s`, else `exec_timeout_s` + `TOOL_DEADLINE_MARGIN_S`."""
        if self.tool_timeout_s is not None:
            return self.tool_timeout_s
        return self.exec_timeout_s + TOOL_DEADLINE_MARGIN_S

    @property
    def verifier_deadline_s(self) -> float:
        """The verifier's deadline: `verifier_timeout_s`, else its own `timeout_s` plus a margin, else 300 s."""
        return verifier_deadline(self.verifier, self.verifier_timeout_s)

    # --- hooks for subclasses ---------------------------------------------------------
    @property
    def needs_sandbox(self) -> bool:
        return self.toolbox.needs_sandbox or getattr(self.verifier, "needs_sandbox", False)

    def initial_state(self, task: Task) -> Any:
        """Per-episode state handed to tools as `ctx.state` (a game's secret, ...)."""
        return None

    def system_prompt(self) -> str:
        if not self.tools_in_prompt:
            return self.instructions
        return f"{self.instructions}\n\n{self.parser.system_block(self.toolbox.schemas)}"

    # --- task selection -----------------------------------------------------------------
    @classmethod
    def make_tasks(
        cls, *, tasks: Any = None, seed: int = 0, env_id: str | None = None, **_: Any
    ) -> TaskSource | None:
        """The tasks an environment built with these keyword arguments poses, without building it.

        `agentrl.task_source(env_id)` calls it with the keyword arguments `make` would pass the
        constructor (those it does not need are ignored). `tasks` wins; without them a subclass's
        `task_generator(seed)` supplies them. A subclass that makes its tasks another way (a dataset
        loaded per `split`) overrides this, and its constructor passes the result on as `tasks=`.
        None: only an instance can tell (a subclass that picks its tasks in `__init__`).
        """
        if tasks is None:
            if cls.task_generator is None:
                return None
            tasks = cls.task_generator(seed)
        return as_task_source(tasks, name=env_id or cls.__name__)

    def _pick_task(self, options: dict | None) -> Task:
        options = options or {}
        if "task" in options:
            return coerce_task(options["task"])
        split = options.get("split", self.split)
        if "index" in options:
            return self.tasks.get(int(options["index"]), split)
        size = self.tasks.size(split)  # None: an unbounded generator
        return self.tasks.get(int(self.np_random.integers(size or 2**31 - 1)), split)

    # --- sandbox ---------------------------------------------------------------------------
    def _release_sandbox(self) -> None:
        sb, self.sandbox = self.sandbox, None
        if sb is not None:
            try:
                sb.close()
            except Exception as exc:  # a sandbox that will not close must not stop the next episode
                log.warning("closing sandbox %s failed: %s", getattr(sb, "id", "?"), exc)

    def _acquire_sandbox(self, task: Task) -> Sandbox:
        labels = {"agentrl.env_id": self.env_id}
        kwargs = dict(
            image=task.image, limits=self.limits, workdir=DEFAULT_WORKDIR, env=self.sandbox_env, labels=labels
        )
        if self.use_pool and self.backend == "docker":
            from agentrl.sandbox.hosts import default_host_pool

            # sandbox.docker_hosts / AGENTRL_DOCKER_HOSTS: placed on the least-loaded engine.
            if (hosts := default_host_pool()) is not None:
                return hosts.acquire(**kwargs)
        if self.use_pool:
            from agentrl.sandbox.pool import get_default_pool

            return get_default_pool().acquire(backend=self.backend, **kwargs)
        return open_sandbox(self.backend, **kwargs)

    def _prepare_sandbox(self, task: Task) -> Sandbox:
        sb = self._acquire_sandbox(task)
        try:
            for path, content in task.files.items():
                sb.write_file(path, content)
            for cmd in task.setup:
                res = sb.exec(["/bin/sh", "-c", cmd], timeout=max(self.exec_timeout_s, 60.0))
                if not res.ok:
                    raise EnvError(
                        f"task {task.id}: set-up command {cmd!r} failed "
                        f"(exit {res.exit_code}, timed_out={res.timed_out}): {res.stderr.strip()[-500:]}"
                    )
        except BaseException:
            sb.close()
            raise
        return sb

    # --- Gymnasium API ---------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[list[Message], dict]:
        super().reset(seed=seed)
        self._release_sandbox()
        task = self._pick_task(options)
        if self.needs_sandbox:
            try:
                self.sandbox = self._prepare_sandbox(task)
            except (SandboxError, EnvError):
                raise
            except Exception as exc:
                raise EnvError(f"could not start a {self.backend} sandbox for task {task.id}: {exc}") from exc
        self.task = task
        self.episode = Episode(task_id=task.id)
        self._ctx = ToolContext(
            sandbox=self.sandbox,
            task=task,
            exec_timeout_s=self.exec_timeout_s,
            state=self.initial_state(task),
        )
        obs = [{"role": "system", "content": self.system_prompt()}, {"role": "user", "content": task.prompt}]
        self.episode.messages.extend(obs)
        info = {
            "task_id": task.id,
            "split": task.split,
            "tools": self.toolbox.schemas,
            "sandbox_id": getattr(self.sandbox, "id", None),
            **self.episode.stats(),
        }
        return obs, info

    def step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        if self.episode is None or self._ctx is None or self.task is None:
            raise RuntimeError("call reset() before step()")
        if self.episode.done:
            raise RuntimeError(
                f"the episode is over ({self.episode.finish_reason}); call reset() to start a new one"
            )
        ep = self.episode
        ep.turns += 1
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        ep.messages.append({"role": "assistant", "content": action})
        step_calls = step_errors = step_timeouts = 0
        obs: list[Message] = []

        if len(action) > self.max_action_chars:
            ep.format_errors += 1
            step_errors += 1
            obs.append(
                self._error_message(
                    f"Error: your message is {len(action)} characters long; the limit is {self.max_action_chars}. "
                    "Nothing was run. Send a shorter message with one tool call."
                )
            )
            parsed = ParsedAction()
        else:
            parsed = self._parse(action)

        for err in parsed.errors:
            ep.format_errors += 1
            step_errors += 1
            obs.append(
                self._error_message(
                    f"Error: {err.message}. Got: {err.raw}\nWrite tool calls exactly like this:\n{self.parser.format_hint}",
                    role="tool",
                )
            )
        if not parsed.calls and not parsed.errors and len(action) <= self.max_action_chars:
            ep.format_errors += 1
            step_errors += 1
            obs.append(
                self._error_message(
                    "Error: no tool call found in your message. Call a tool (or `submit` your answer) like this:\n"
                    f"{self.parser.format_hint}"
                )
            )

        calls = list(parsed.calls)
        limit = self.max_tool_calls_per_step
        deadline = time.monotonic() + self.step_budget_s
        not_run: list[ToolCall] = []
        not_run_why = ""
        for i, call in enumerate(calls):
            if i >= limit:
                not_run = calls[i:]
                not_run_why = f"at most {limit} tool call(s) run per message in this environment; "
                not_run_why += "call the others in your next message"
                ep.format_errors += 1
                step_errors += 1
                break
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                not_run = calls[i:]
                not_run_why = f"this message's tool calls used up its time budget of {self.step_budget_s:g}s"
                break
            step_calls += 1
            ep.tool_calls += 1
            # A tool's commands get what is left of the step's budget, never more than their own timeout.
            self._ctx.exec_timeout_s = min(self.exec_timeout_s, left_s)
            try:
                outcome, record = self._run_call(call)
            except SandboxDead as exc:
                if isinstance(exc, EngineUnavailable):
                    ep.error = f"{_name(call)}: {exc}"
                    content = f"Error: the sandbox's engine stopped answering; the episode ends. ({exc})"
                else:
                    ep.error = f"sandbox died during {_name(call)}: {exc}"
                    content = "Error: the sandbox died; the episode ends."
                ep.finish_reason = "env_error"
                ep.calls.append(ToolCallRecord(_name(call), "ran", is_error=True))
                obs.append({"role": "tool", "name": _name(call), "tool_call_id": call.id, "content": content})
                break
            except ToolTimeout as exc:
                # The call goes on in its abandoned thread and may still touch this episode's tool
                # state (`ctx.state`, the sandbox): the episode cannot go on, and is not scored.
                # Nothing of the call reaches the episode's record but this.
                ep.error = str(exc)
                ep.finish_reason = "env_error"
                ep.tool_errors += 1
                ep.tool_timeouts += 1
                step_errors += 1
                step_timeouts += 1
                ep.calls.append(
                    ToolCallRecord(
                        _name(call), "ran", is_error=True, timed_out=True, duration_s=exc.timeout_s
                    )
                )
                content = (
                    f"Error: tool '{_name(call)}' did not finish within {exc.timeout_s:g}s; the episode ends."
                )
                obs.append({"role": "tool", "name": _name(call), "tool_call_id": call.id, "content": content})
                break
            finally:
                self._ctx.exec_timeout_s = self.exec_timeout_s
            ep.calls.append(record)
            step_errors += outcome.is_error
            step_timeouts += outcome.timed_out
            ep.tool_errors += outcome.is_error
            ep.tool_timeouts += outcome.timed_out
            obs.append(
                {"role": "tool", "name": _name(call), "tool_call_id": call.id, "content": outcome.content}
            )
            if outcome.terminal:
                ep.submission = outcome.submission
                ep.finish_reason = "submitted"
                skipped = calls[i + 1 :]
                ep.calls.extend(ToolCallRecord(_name(c), "not_run") for c in skipped)
                if skipped:
                    obs[-1]["content"] += (
                        f" ({len(skipped)} later tool call(s) in the same message were not run.)"
                    )
                break
        if not_run:
            ep.calls.extend(ToolCallRecord(_name(c), "not_run") for c in not_run)
            names = ", ".join(_name(c) for c in not_run[:8]) + (", ..." if len(not_run) > 8 else "")
            obs.append(
                self._error_message(
                    f"Error: {len(not_run)} tool call(s) of your message were not run ({names}): {not_run_why}.",
                    role="tool",
                )
            )

        if not ep.done and ep.turns >= self.max_turns:
            ep.finish_reason = "max_turns"
        ep.messages.extend(obs)

        terminated = ep.finish_reason == "submitted"
        truncated = ep.done and not terminated
        verdict = self._finish() if ep.done else None
        info = StepInfo(
            step_tool_calls=step_calls,
            step_tool_calls_not_run=len(not_run),
            step_tool_errors=step_errors,
            step_tool_timeouts=step_timeouts,
            **ep.stats(),
            verdict=verdict,
            error=ep.error if ep.done else None,
        )
        reward = verdict.reward if verdict is not None else 0.0
        return obs, reward, terminated, truncated, info.as_dict()

    def _parse(self, action: str) -> ParsedAction:
        """The parser's reading of `action`, never an exception: a parser (ours or a plugin) that
        raises, or returns calls of the wrong shape, is a format error the model reads."""
        try:
            parsed = self.parser.parse(action)
        except Exception as exc:
            log.warning("tool-call parser %r raised on a model message: %r", self.parser.name, exc)
            return ParsedAction(
                errors=[ParseError(f"the message could not be parsed ({type(exc).__name__})", action[:200])]
            )
        calls: list[ToolCall] = []
        errors = list(parsed.errors)
        for call in parsed.calls:
            if not isinstance(call.name, str) or not call.name:
                errors.append(ParseError("a tool call needs a non-empty name string", repr(call.name)[:200]))
            elif not isinstance(call.arguments, Mapping):
                errors.append(
                    ParseError(
                        f"the arguments of tool '{_name(call)}' must be a JSON object",
                        repr(call.arguments)[:200],
                    )
                )
            else:
                calls.append(call)
        return ParsedAction(calls, errors, parsed.content)

    def _run_call(self, call: ToolCall) -> tuple[ToolOutcome, ToolCallRecord]:
        """Run one well-formed call; its outcome, and the record of whether it ran."""
        assert self._ctx is not None
        tool = self.toolbox.tools.get(call.name)
        if tool is None:
            close = difflib.get_close_matches(call.name[:200], list(self.toolbox.tools), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            outcome = ToolOutcome(
                f"Error: unknown tool '{_name(call)}'.{hint} Available tools: {', '.join(self.toolbox.tools)}.",
                is_error=True,
                ran=False,
            )
            return outcome, ToolCallRecord(_name(call), "unknown_tool", is_error=True)
        outcome = run_tool(tool, self._ctx, call.arguments, timeout_s=self.tool_deadline_s)
        status = "ran" if outcome.ran else "invalid_arguments"
        record = ToolCallRecord(tool.name, status, outcome.is_error, outcome.timed_out, outcome.duration_s)
        return outcome, record

    def _finish(self) -> Verdict:
        """Run the verifier on the finished episode, then release the sandbox."""
        assert self.episode is not None and self.task is not None
        if self.episode.finish_reason == "env_error":
            verdict = Verdict(0.0, False, f"episode ended by an environment error: {self.episode.error}")
        else:
            verdict = run_verifier(
                self.verifier, self.sandbox, self.task, self.episode, self.verifier_deadline_s
            )
        self.episode.verdict = verdict
        self._release_sandbox()
        return verdict

    def end_episode(self, reason: FinishReason, error: str | None = None) -> Verdict:
        """End the episode from outside (the rollout engine's token or wall-time limits) and score it."""
        if self.episode is None:
            raise RuntimeError("call reset() first")
        if self.episode.done:
            raise RuntimeError(f"the episode is already over ({self.episode.finish_reason})")
        self.episode.finish_reason = reason
        self.episode.error = error
        return self._finish()

    @staticmethod
    def _error_message(content: str, role: str = "user") -> Message:
        # Errors echo parts of the model's text: keep them encodable (a lone surrogate would
        # break the tokenizer or the trajectory file downstream, not here).
        content = content.encode("utf-8", "backslashreplace").decode("utf-8")
        return (
            {"role": role, "name": "error", "content": content}
            if role == "tool"
            else {"role": role, "content": content}
        )

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self.episode is None:
            return None
        return "\n".join(f"[{m['role']}] {m['content']}" for m in self.episode.messages)

    def close(self) -> None:
        self._release_sandbox()
        super().close()


def _in_format(oracle: Callable[..., Any], parser: ToolCallParser) -> Callable[[Task], Any]:
    """`oracle(task)` writing its calls in the env's format: a factory that takes `parser` gets it."""
    try:
        takes_parser = "parser" in inspect.signature(oracle).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_parser = False
    return functools.partial(oracle, parser=parser) if takes_parser else oracle


def _name(call: ToolCall) -> str:
    """A call's tool name as echoed back to the model: bounded, whatever the model wrote."""
    name = str(call.name)
    return name if len(name) <= _NAME_ECHO else name[:_NAME_ECHO] + "..."
