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
  all; the calls past either are not run, and the observation says so. These limits, the turn
  limit and the message length are pieces in `agentrl.env.step_limits`, composed by `step_limits()`.
- Nothing the env runs can stall it: every tool call has a deadline (`tool_timeout_s`), host-side
  Python included; a call past it is abandoned and ends the episode `env_error`. The verifier has
  one too (`verifier_timeout_s`): past it, reward 0 with the reason.
- `close()` is idempotent; `reset()` after `close()` works; `with env:` closes.

Settings are typed: `ToolEnvSettings` (`agentrl.env.settings`), or a subclass's own model named
by `settings_model`. Subclasses (see `agentrl.envs`) supply a task generator, tools, a verifier and
an oracle.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium
from pydantic import ValidationError

from agentrl.core.episode import Episode, ToolCallRecord
from agentrl.core.task import Task, TaskGenerator
from agentrl.core.types import CallStatus, FinishReason, Message, Role, StepInfo
from agentrl.env.parsers import ParsedAction, ParseError, ToolCall, ToolCallParser, get_parser
from agentrl.env.settings import EnvSettingsError, ToolEnvSettings, settings_error
from agentrl.env.spaces import Messages, UnicodeText
from agentrl.env.step_limits import (
    MessageLengthLimit,
    Refusal,
    StepLimit,
    StepLimits,
    StepState,
    StepTimeLimit,
    ToolCallLimit,
    TurnLimit,
)
from agentrl.env.tasksource import TaskSource, as_task_source, coerce_task
from agentrl.env.tools import ToolBox, ToolContext, ToolOutcome, ToolServerLost, ToolTimeout, run_tool
from agentrl.sandbox.base import (
    DEFAULT_WORKDIR,
    EngineUnavailable,
    Sandbox,
    SandboxDead,
    SandboxError,
)
from agentrl.sandbox.provider import SandboxProvider
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


def _setting(name: str) -> property:
    """An attribute that reads and writes `self.settings.<name>` (validated on assignment), documented
    by the setting's own description in `ToolEnvSettings`."""

    def get(self: ToolEnv) -> Any:
        return getattr(self.settings, name)

    def set_(self: ToolEnv, value: Any) -> None:
        self.set_setting(name, value)

    return property(get, set_, doc=ToolEnvSettings.model_fields[name].description)


class ToolEnv(gymnasium.Env[list, str]):
    """A Gymnasium environment where the agent acts by calling tools (see the module docstring).

        ToolEnv(tasks=..., tools=["bash", "submit"], verifier="exact-match", max_turns=6, backend="local")

    Every keyword but `env_id`, `oracle` and `settings` is a setting of `settings_model`
    (`ToolEnvSettings`, or a subclass's own): validated, with one-line errors naming the setting,
    and documented by `agentrl env show ID`. `settings=` takes them as one model (or mapping), the
    keywords then override it. `env.settings` holds them; `env.max_turns`, `env.exec_timeout_s`, ...
    read and write it.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}  # noqa: RUF012  (as gymnasium.Env declares it)

    #: Instructions at the top of the system prompt; subclasses override.
    instructions = (
        "You are a helpful agent. Use the tools to solve the task, then call `submit` with your answer."
    )
    #: The settings this class takes; a subclass with settings of its own names its subclass here.
    settings_model: ClassVar[type[ToolEnvSettings]] = ToolEnvSettings
    #: `max_tool_calls_per_step` when the caller does not set it; a game may allow fewer.
    default_max_tool_calls_per_step: ClassVar[int] = DEFAULT_MAX_TOOL_CALLS_PER_STEP
    #: The procedural task supply of a subclass, `task_generator(seed)`, used when no `tasks` are given.
    task_generator: ClassVar[Callable[[int], TaskGenerator] | None] = None
    #: Maps a task's image to the one its sandbox starts from (a harness env's: the image with its agent
    #: installed, `agentrl.gateway.images`); None: the task's own.
    sandbox_image: Callable[[str], str] | None = None

    split = _setting("split")
    backend = _setting("backend")
    limits = _setting("limits")
    use_pool = _setting("use_pool")
    tools_in_prompt = _setting("tools_in_prompt")
    max_turns = _setting("max_turns")
    max_action_chars = _setting("max_action_chars")
    exec_timeout_s = _setting("exec_timeout_s")
    step_timeout_s = _setting("step_timeout_s")
    tool_timeout_s = _setting("tool_timeout_s")
    verifier_timeout_s = _setting("verifier_timeout_s")
    sandbox_env = _setting("sandbox_env")
    render_mode = _setting("render_mode")

    def __init__(
        self,
        *,
        settings: ToolEnvSettings | Mapping[str, Any] | None = None,
        env_id: str | None = None,
        oracle: Callable[[Task], Any] | None = None,
        **overrides: Any,
    ):
        """
        settings: the settings as one model or mapping (`settings_model`'s fields); `overrides`, the
            same fields as keywords, replace its values. Unknown names and values of the wrong type
            are an `EnvSettingsError` (a `UserError`, a `ValueError`).
        env_id: the registered id (`agentrl.make` passes it): names the sandboxes and the errors.
        oracle: the reference solution, `oracle(task)` -> an agent (docs/ENVIRONMENTS.md, Oracles), for a class
            that does not define an `oracle` method.

        The time limits, in short (`ToolEnvSettings` has them all): `step_timeout_s` is the budget of
        one message's tool calls (None: 2 x `exec_timeout_s`); `tool_timeout_s` the deadline of one
        call whatever it does (None: `exec_timeout_s` + `TOOL_DEADLINE_MARGIN_S`; past it the call is
        abandoned and the episode ends `env_error`, its thread left to finish); `verifier_timeout_s`
        the verifier's (None: its own `timeout_s` + `VERIFIER_DEADLINE_MARGIN_S`, else
        `DEFAULT_VERIFIER_TIMEOUT_S`; past it the episode scores 0 with the reason).
        """
        self.env_id = env_id or type(self).__name__
        self.settings = s = self.settings_model.build(settings, what=self.env_id, **overrides)
        # Generators, lists, JSONL paths, datasets: one validated view (agentrl.env.tasksource).
        tasks = (
            as_task_source(s.tasks, name=self.env_id)
            if s.tasks is not None
            else type(self).make_tasks(**s.as_kwargs(), env_id=self.env_id)
        )
        if tasks is None:
            raise EnvSettingsError(
                f"{self.env_id} has no tasks: give tasks= (a generator, a list of tasks, a JSONL path, a "
                "dataset), or set task_generator on the class"
            )
        self.tasks: TaskSource = tasks
        if s.tools is None and not s.mcp_servers:
            raise EnvSettingsError(
                f"{self.env_id} has no tools: give tools= (@agentrl.tool functions or built-in names like "
                "'bash' and 'submit') or mcp_servers="
            )
        self.parser = get_parser(s.parser)
        if (
            oracle is not None
        ):  # the reference solution: oracle(task) -> an agent (docs/ENVIRONMENTS.md, Oracles)
            self.oracle = _in_format(oracle, self.parser)
        self.toolbox = ToolBox.of(list(s.tools or []))
        # The env's own tools; an episode's toolbox adds the tools its MCP servers list at reset.
        self._own_tools = dict(self.toolbox.tools)
        self._mcp: Any = None  # the episode's MCP connections (agentrl.env.mcp.client.MCPTools)
        self.verifier: Verifier = self.make_verifier()
        self.observation_space = Messages()
        self.action_space = UnicodeText(max_length=s.max_action_chars)
        self.sandbox: Sandbox | None = None
        # The pool `sandbox` came from (None: started here): it gets the sandbox back after the episode.
        self._lender: Any = None
        self._step_thread: int | None = None  # the thread inside step() now, if any
        self.task: Task | None = None
        self.episode: Episode | None = None
        self._ctx: ToolContext | None = None
        self.offered_tools: frozenset[str] | None = None
        """The tools the model was offered, when not all of the toolbox's (a harness agent that declares
        tools of its own: `agentrl.gateway.harness`): a call to another one is refused, not run."""
        if self.needs_sandbox:
            # From the main thread (where envs are usually made), so that SIGTERM/SIGINT remove this
            # process's sandboxes (docker's outlive it) even when a rollout opens them on worker threads.
            SandboxProvider(s.backend, pooled=s.use_pool).install_exit_handlers()

    @property
    def max_tool_calls_per_step(self) -> int:
        """Most tool calls one message runs: the setting, else the class's `default_max_tool_calls_per_step`."""
        value = self.settings.max_tool_calls_per_step
        return self.default_max_tool_calls_per_step if value is None else value

    @max_tool_calls_per_step.setter
    def max_tool_calls_per_step(self, value: int | None) -> None:
        self.set_setting("max_tool_calls_per_step", value)

    def set_setting(self, name: str, value: Any) -> None:
        """Change one setting, validated (an `EnvSettingsError` in one line when it does not)."""
        try:
            setattr(self.settings, name, value)
        except ValidationError as exc:
            raise settings_error(exc, type(self.settings), self.env_id) from None

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

    def step_limits(self) -> list[StepLimit]:
        """The limits every step applies, in order (`agentrl.env.step_limits`); a subclass adds its own."""
        return [
            MessageLengthLimit(self.max_action_chars),
            ToolCallLimit(self.max_tool_calls_per_step),
            StepTimeLimit(self.step_budget_s),
            TurnLimit(self.max_turns),
        ]

    # --- hooks for subclasses ---------------------------------------------------------
    def make_verifier(self) -> Verifier:
        """The verifier `settings.verifier` names: a registered name, (name, kwargs), or an instance.
        A subclass whose default depends on its other settings overrides this."""
        verifier = self.settings.verifier
        if isinstance(verifier, str):
            return get(verifier)
        if isinstance(verifier, tuple | list):  # a list: (name, kwargs) as YAML writes it
            name, kwargs = verifier
            return get(name, **kwargs)
        return verifier

    @property
    def needs_sandbox(self) -> bool:
        return (
            self.toolbox.needs_sandbox
            or getattr(self.verifier, "needs_sandbox", False)
            or any(server.in_sandbox for server in self.settings.mcp_servers)
        )

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
    def _start_mcp(self, task: Task) -> None:
        """Connect the episode's MCP servers (a command starts in its sandbox) and add their tools."""
        from agentrl.env.mcp.client import MCPServerError
        from agentrl.env.mcp.tools import MCPTools

        try:
            self._mcp = MCPTools.start(self.settings.mcp_servers, self.sandbox)
        except MCPServerError as exc:
            raise EnvError(f"task {task.id}: {exc}") from None
        tools = dict(self._own_tools)
        for t in self._mcp.tools:
            if t.name in tools:
                self._close_mcp()
                raise EnvError(
                    f"{self.env_id}: an MCP server lists a tool named {t.name!r}, as another tool is; give the "
                    "server a prefix (MCPServer(prefix=...)) or keep only some of its tools (tools=[...])"
                )
            tools[t.name] = t
        self.toolbox = ToolBox(tools)

    def _close_mcp(self) -> None:
        mcp, self._mcp = self._mcp, None
        if mcp is not None:
            try:
                mcp.close()
            except Exception as exc:  # a server that will not stop must not stop the next episode
                log.warning("closing the MCP servers of %s failed: %s", self.env_id, exc)

    def _release_sandbox(self) -> None:
        self._close_mcp()  # an MCP server in the sandbox dies with the episode, before the sandbox goes
        sb, self.sandbox = self.sandbox, None
        lender, self._lender = self._lender, None
        # A step still running on another thread (the rollout gave up on a hung tool and ended the
        # episode) may send its next command to this sandbox: it must never be another episode's.
        stepping = self._step_thread not in (None, threading.get_ident())
        if sb is not None:
            try:
                if lender is not None and not stepping:
                    lender.release(sb)  # reset and handed out again, or closed (the pool decides)
                else:
                    sb.close()
            except Exception as exc:  # a sandbox that will not close must not stop the next episode
                log.warning("closing sandbox %s failed: %s", getattr(sb, "id", "?"), exc)

    def sandbox_workdir(self, task: Task) -> str:
        """Where the agent's workspace is mounted for `task` (a task image's own WORKDIR, say)."""
        return DEFAULT_WORKDIR

    def _acquire_sandbox(self, task: Task) -> Sandbox:
        labels = {"agentrl.env_id": self.env_id}
        image = task.image if self.sandbox_image is None else self.sandbox_image(task.image)
        kwargs = dict(
            image=image,
            limits=self.limits,
            workdir=self.sandbox_workdir(task),
            env=self.sandbox_env,
            labels=labels,
        )
        provider = SandboxProvider(self.backend, pooled=self.use_pool)
        sb = provider.acquire(**kwargs)
        self._lender = provider  # gets it back after the episode: reset and reused, or closed
        return sb

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
            self._drop_unprepared(sb)
            raise
        return sb

    def _drop_unprepared(self, sb: Sandbox) -> None:
        """Close a sandbox whose task set-up failed (half set up: never handed out again)."""
        self._lender = None
        sb.close()

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
        if self.settings.mcp_servers:
            try:
                self._start_mcp(task)
            except BaseException:
                if self.sandbox is not None:
                    sb, self.sandbox = self.sandbox, None
                    self._drop_unprepared(sb)  # a server may have left processes: never handed out again
                raise
        self.task = task
        self.episode = Episode(task_id=task.id)
        self._ctx = ToolContext(
            sandbox=self.sandbox,
            task=task,
            exec_timeout_s=self.exec_timeout_s,
            state=self.initial_state(task),
        )
        obs: list[Message] = [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": task.prompt},
        ]
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
        self._step_thread = threading.get_ident()
        try:
            return self._step(action)
        finally:
            self._step_thread = None

    def _step(self, action: str) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        action = self._begin_turn(action)
        limits = StepLimits(tuple(self.step_limits()))
        st = _Step()
        calls = self._read_calls(action, limits, st)  # parse: a message past its length limit runs nothing
        self._run_calls(calls, limits, st)  # run the tools: the call and time limits admit each call
        ep = self.episode
        assert ep is not None
        if not ep.done:  # the limits that end an episode between turns (the turn limit)
            ep.finish_reason = limits.ends_episode(ep)
        ep.messages.extend(st.obs)
        return self._step_result(st)

    def _step_result(self, st: _Step) -> tuple[list[Message], float, bool, bool, dict[str, Any]]:
        """The observation, and the verdict's reward when the episode is over (the verifier runs here)."""
        ep = self.episode
        assert ep is not None
        terminated = ep.finish_reason == "submitted"
        truncated = ep.done and not terminated
        verdict = self._finish() if ep.done else None
        info = StepInfo(
            step_tool_calls=st.calls_run,
            step_tool_calls_not_run=st.not_run,
            step_tool_errors=st.errors,
            step_tool_timeouts=st.timeouts,
            **ep.stats(),
            verdict=verdict,
            error=ep.error if ep.done else None,
        )
        reward = verdict.reward if verdict is not None else 0.0
        return st.obs, reward, terminated, truncated, info.as_dict()

    def _begin_turn(self, action: Any) -> str:
        """Count the turn and record the assistant's message, whatever it is, as text (returned)."""
        if self.episode is None or self._ctx is None or self.task is None:
            raise RuntimeError("call reset() before step()")
        if self.episode.done:
            raise RuntimeError(
                f"the episode is over ({self.episode.finish_reason}); call reset() to start a new one"
            )
        if not isinstance(action, str):
            action = "" if action is None else str(action)
        self.episode.turns += 1
        self.episode.messages.append({"role": "assistant", "content": action})
        return action

    def _read_calls(self, action: str, limits: StepLimit, st: _Step) -> list[ToolCall]:
        """The message's well-formed tool calls; what is wrong with it becomes error observations."""
        refusal = limits.check_action(action)
        if refusal is not None:
            st.format_error(self.episode, self._error_message(f"Error: {refusal.reason}."))
            return []
        parsed = self._parse(action)
        for err in parsed.errors:
            message = f"Error: {err.message}. Got: {err.raw}\nWrite tool calls exactly like this:\n"
            st.format_error(self.episode, self._error_message(message + self.parser.format_hint, role="tool"))
        if not parsed.calls and not parsed.errors:
            st.format_error(
                self.episode,
                self._error_message(
                    "Error: no tool call found in your message. Call a tool (or `submit` your answer) like "
                    f"this:\n{self.parser.format_hint}"
                ),
            )
        return list(parsed.calls)

    def _run_calls(self, calls: list[ToolCall], limits: StepLimit, st: _Step) -> None:
        """Run the calls in order until one ends the episode or a limit refuses the rest."""
        ep = self.episode
        assert ep is not None and self._ctx is not None
        st.started_s = time.monotonic()  # the step's time budget covers the calls, not the parsing
        for i, call in enumerate(calls):
            refusal = limits.admit_call(i, st)
            if refusal is not None:
                self._not_run(calls[i:], refusal, st)
                return
            st.calls_run += 1
            ep.tool_calls += 1
            # A tool's commands get what is left of the step's budget, never more than their own timeout.
            self._ctx.exec_timeout_s = limits.cap_exec_timeout(self.exec_timeout_s, st)
            try:
                outcome = self._run_one(call, st)
            finally:
                self._ctx.exec_timeout_s = self.exec_timeout_s
            if outcome is None:  # the sandbox or the tool failed: the episode is over
                return
            if outcome.terminal:
                ep.submission = outcome.submission
                ep.finish_reason = "submitted"
                skipped = calls[i + 1 :]
                ep.calls.extend(ToolCallRecord(_name(c), "not_run") for c in skipped)
                if skipped:
                    st.obs[-1]["content"] += (
                        f" ({len(skipped)} later tool call(s) in the same message were not run.)"
                    )
                return

    def _run_one(self, call: ToolCall, st: _Step) -> ToolOutcome | None:
        """Run one call and record it; None when it ended the episode (`env_error`)."""
        ep = self.episode
        assert ep is not None
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
            st.obs.append(_tool_message(call, content))
            return None
        except ToolServerLost as exc:
            # The process serving the tool (an MCP server) is gone or hung: the episode cannot go on.
            ep.error = str(exc)
            ep.finish_reason = "env_error"
            ep.tool_errors += 1
            st.errors += 1
            ep.calls.append(ToolCallRecord(_name(call), "ran", is_error=True))
            st.obs.append(_tool_message(call, f"Error: {exc}; the episode ends."))
            return None
        except ToolTimeout as exc:
            # The call goes on in its abandoned thread and may still touch this episode's tool
            # state (`ctx.state`, the sandbox): the episode cannot go on, and is not scored.
            # Nothing of the call reaches the episode's record but this.
            ep.error = str(exc)
            ep.finish_reason = "env_error"
            ep.tool_errors += 1
            ep.tool_timeouts += 1
            st.errors += 1
            st.timeouts += 1
            ep.calls.append(
                ToolCallRecord(_name(call), "ran", is_error=True, timed_out=True, duration_s=exc.timeout_s)
            )
            content = (
                f"Error: tool '{_name(call)}' did not finish within {exc.timeout_s:g}s; the episode ends."
            )
            st.obs.append(_tool_message(call, content))
            return None
        ep.calls.append(record)
        st.errors += outcome.is_error
        st.timeouts += outcome.timed_out
        ep.tool_errors += outcome.is_error
        ep.tool_timeouts += outcome.timed_out
        st.obs.append(_tool_message(call, outcome.content))
        return outcome

    def _not_run(self, calls: list[ToolCall], refusal: Refusal, st: _Step) -> None:
        """Record the calls a limit refused, and tell the model which and why."""
        assert self.episode is not None
        self.episode.calls.extend(ToolCallRecord(_name(c), "not_run") for c in calls)
        names = ", ".join(_name(c) for c in calls[:8]) + (", ..." if len(calls) > 8 else "")
        message = self._error_message(
            f"Error: {len(calls)} tool call(s) of your message were not run ({names}): {refusal.reason}.",
            role="tool",
        )
        st.not_run = len(calls)
        if refusal.format_error:
            st.format_error(self.episode, None)
        st.obs.append(message)

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
        offered = self.offered_tools
        if tool is not None and offered is not None and call.name not in offered:
            # As OpenAI's API would never call a function the request did not declare: refused, not run.
            listed = ", ".join(sorted(offered)) or "none"
            outcome = ToolOutcome(
                f"Error: tool '{_name(call)}' was not offered to you (the tools you have: {listed}).",
                is_error=True,
                ran=False,
            )
            return outcome, ToolCallRecord(_name(call), "unknown_tool", is_error=True)
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
        status: CallStatus = "ran" if outcome.ran else "invalid_arguments"
        record = ToolCallRecord(tool.name, status, outcome.is_error, outcome.timed_out, outcome.duration_s)
        return outcome, record

    def _finish(self) -> Verdict:
        """Run the verifier on the finished episode, then release the sandbox."""
        assert self.episode is not None and self.task is not None
        check = getattr(self.sandbox, "check_intact", None)
        if self.episode.finish_reason != "env_error" and check is not None:
            try:
                check()  # what ran the agent's commands was killed or replaced from inside
            except SandboxDead as exc:
                self.episode.finish_reason, self.episode.error = "env_error", str(exc)
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
    def _error_message(content: str, role: Role = "user") -> Message:
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


def _tool_message(call: ToolCall, content: str) -> Message:
    return {"role": "tool", "name": _name(call), "tool_call_id": call.id, "content": content}


@dataclass
class _Step(StepState):
    """One step in progress: what its limits see (`StepState`), its observation and its counts."""

    obs: list[Message] = field(default_factory=list)
    errors: int = 0
    timeouts: int = 0
    not_run: int = 0

    def format_error(self, episode: Episode | None, message: Message | None) -> None:
        """Count one format error of the model's (and say what it was, when `message` is given)."""
        assert episode is not None
        episode.format_errors += 1
        self.errors += 1
        if message is not None:
            self.obs.append(message)
