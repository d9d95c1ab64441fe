"""Harness environments: an episode is the user's own agent, written against the OpenAI API, playing
against its session URL.

    async def agent(client: openai.AsyncOpenAI, task: HarnessTask) -> None:
        messages = list(task.messages)                       # the environment's system and user messages
        while not task.done:
            reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            messages += await task.step(message)             # the environment runs the calls, as today

    agentrl.register("me/calc-agent-v0", entry_point="agentrl.gateway:HarnessEnv",
                     env="agentrl/calc-v0", agent="my_pkg.agents:agent")

An agent that is a program of its own runs inside the episode's sandbox instead (`SandboxCommand`):

    agentrl.register("me/repair-mini-v0", entry_point="agentrl.gateway:HarnessEnv",
                     env="agentrl/python-repair-v0", command="mini -y ... -t \"$AGENTRL_TASK\"",
                     install=["mini-swe-agent==2.4.6"])

`HarnessEnv(env, agent)` wraps an environment: its tasks, tools, limits and verifier are the wrapped
environment's (built with `tools_in_prompt=False`: the tools reach the model through the chat
template's `tools`, as OpenAI's API passes them). The rollout (`agentrl.rollout.loop`, so `agentrl
train`, `agentrl eval` and `agentrl rollout` alike) hands each episode of such an environment to its
driver (`HarnessEnv.episode_driver`, the rollout's `agentrl.rollout.driver` protocol), which opens one
gateway session for it and runs `agent(client, task)` with `client` an `openai.AsyncOpenAI` pointed
at it. `task.step(message)` steps the environment with the text the policy sampled for that reply,
and returns the observation as OpenAI messages to append.

The episode ends, with its reason recorded, when the first of these happens:

- the environment ends it (`submit`, its turn limit, a sandbox failure): the reason is the environment's;
- the agent returns: `submitted` (the verifier scores the final state);
- the agent raises: `agent_error`, with the exception in `error` (scored, and not trained on);
- the agent asks for more completions than the turn limit: `max_turns`; a conversation past the
  context budget: `max_tokens`;
- the episode runs past the rollout's `episode_timeout_s`: `timeout` (an agent that hangs).

Whatever ends it, the agent is cancelled, the session closed (its URL answers 404 from then on), and
the verifier's reward is the episode's; nothing the agent sends can set it. The episode's calls become
one trajectory per branch (`agentrl.gateway.session`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agentrl.gateway.protocol import ChatMessage, normal_message
from agentrl.gateway.session import Session
from agentrl.rollout.assemble import branch_trajectories
from agentrl.rollout.driver import EpisodeContext
from agentrl.rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from agentrl.core.task import Task
    from agentrl.core.types import FinishReason, Message
    from agentrl.env.protocols import AgentEnv
    from agentrl.gateway.server import Gateway

log = logging.getLogger(__name__)

AgentFn = Callable[[Any, "HarnessTask"], Awaitable[None]]
"""`async def agent(client: openai.AsyncOpenAI, task: HarnessTask) -> None`."""

# How long a cancelled agent may take to unwind before the episode goes on without it.
_CANCEL_GRACE_S = 5.0


def load_agent(agent: str | AgentFn) -> AgentFn:
    """`agent` itself, or the callable a `"package.module:function"` string names."""
    from agentrl.core.errors import UserError

    if callable(agent):
        return agent
    module, _, attr = str(agent).partition(":")
    if not module or not attr:
        raise UserError(f"agent {agent!r} must be a callable or a 'package.module:function' string")
    from agentrl.env.registry import import_user_module

    try:
        fn = getattr(import_user_module(module), attr, None)
    except ImportError as exc:
        raise UserError(
            f"agent {agent!r}: cannot import {module!r} ({exc}); install the package that holds it, or run from "
            "the directory that holds it"
        ) from exc
    if not callable(fn):
        raise UserError(f"agent {agent!r}: {module} has no callable {attr!r}")
    return fn


def is_async_agent(agent: Any) -> bool:
    """Whether `agent(client, task)` is a coroutine function (an `async def`, or an object whose `__call__`
    is one); a plain `def` agent blocks, and runs on a thread of its own (`HarnessEpisode`)."""
    return inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(type(agent).__call__)


async def tool_loop_agent(client: Any, task: HarnessTask) -> None:
    """The plainest OpenAI-API agent: ask for a reply with the environment's tools, let the environment
    run it, append both, until the episode is over. The native loop's agent, written as a harness:
    `agent="agentrl.gateway:tool_loop_agent"` trains a harness env exactly as the env itself."""
    messages = list(task.messages)
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += await task.step(message)


async def responses_loop_agent(client: Any, task: HarnessTask) -> None:
    """`tool_loop_agent` written against the Responses API (`client.responses`): the same episodes, the same
    prompts and trajectories (one session logic behind every dialect)."""
    instructions = "\n\n".join(m["content"] for m in task.messages if m["role"] == "system") or None
    items: list[dict[str, Any]] = [
        {"role": m["role"], "content": m["content"]} for m in task.messages if m["role"] != "system"
    ]
    tools = [{"type": "function", **t["function"]} for t in task.tools]
    while not task.done:
        r = await client.responses.create(
            model=task.model, instructions=instructions, input=items, tools=tools
        )
        calls = [o for o in r.output if o.type == "function_call"]
        message: dict[str, Any] = {"role": "assistant", "content": r.output_text or None}
        if calls:
            message["tool_calls"] = [
                {"id": o.call_id, "type": "function", "function": {"name": o.name, "arguments": o.arguments}}
                for o in calls
            ]
        items += [o.model_dump(exclude_none=True) for o in r.output]
        for m in await task.step(message):
            if m["role"] == "tool":
                items.append(
                    {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
                )
            else:
                items.append({"role": m["role"], "content": m["content"]})


async def messages_loop_agent(_client: Any, task: HarnessTask) -> None:
    """`tool_loop_agent` written against Anthropic's Messages API (the `anthropic` SDK, at the session's
    `task.anthropic_url`)."""
    import anthropic

    system = "\n\n".join(m["content"] for m in task.messages if m["role"] == "system")
    messages: list[dict[str, Any]] = [
        {"role": m["role"], "content": m["content"]} for m in task.messages if m["role"] != "system"
    ]
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"].get("description", ""),
            "input_schema": t["function"].get("parameters") or {"type": "object"},
        }
        for t in task.tools
    ]
    async with anthropic.AsyncAnthropic(
        base_url=task.anthropic_url, api_key="agentrl-session", max_retries=0
    ) as c:
        while not task.done:
            r = await c.messages.create(
                model=task.model, max_tokens=4096, system=system, messages=messages, tools=tools
            )
            text = "".join(b.text for b in r.content if b.type == "text")
            uses = [b for b in r.content if b.type == "tool_use"]
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if uses:
                message["tool_calls"] = [
                    {
                        "id": b.id,
                        "type": "function",
                        "function": {"name": b.name, "arguments": json.dumps(b.input)},
                    }
                    for b in uses
                ]
            messages.append(
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]}
            )
            results: list[dict[str, Any]] = []
            for m in await task.step(message):
                if m["role"] == "tool":
                    results.append(
                        {"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}
                    )
                else:
                    results.append({"type": "text", "text": m["content"]})
            messages.append({"role": "user", "content": results})


class SandboxCommand:
    """A harness that is a command inside the episode's sandbox: the agent's own tool calls run there, in
    its container, and its model calls reach the episode's gateway session through a relay
    (`agentrl.gateway.relay`); the sandbox keeps no network.

    command: a shell command (`/bin/sh -c`) or an argv, run in the workspace as the agent, with
        `OPENAI_BASE_URL` (and `OPENAI_API_BASE`) the session's URL inside the sandbox, `OPENAI_API_KEY`
        set, `AGENTRL_MODEL` the model name to ask for, `AGENTRL_TASK` the task's statement (also in the
        file `AGENTRL_TASK_FILE`), and `env` on top; python: the image's python that runs the relay.

    It returns when the command exits 0; another exit is `agent_error` with the end of its output.
    """

    TASK_FILE = "/tmp/agentrl-task.md"

    def __init__(
        self, command: str | Sequence[str], *, env: Mapping[str, str] | None = None, python: str = "python3"
    ):
        if isinstance(command, str):
            if not command.strip():
                raise ValueError("command must be a non-empty shell command or argv")
            self.argv = ["/bin/sh", "-c", command]
        else:
            self.argv = [str(a) for a in command]
            if not self.argv:
                raise ValueError("command must be a non-empty shell command or argv")
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.python = python
        self.output = ""
        """The last run's output (stdout and stderr together, its first 64 KiB)."""

    async def __call__(self, client: Any, task: HarnessTask) -> None:
        from urllib.parse import urlsplit

        from agentrl.gateway.relay import CommandRelay, relay_argv

        ep = task._episode
        sandbox = getattr(ep.env.env, "sandbox", None)
        session = ep.session
        if sandbox is None or session is None:
            raise RuntimeError(f"{ep.env.env_id} has no sandbox for a harness command to run in")
        env = {
            "OPENAI_API_KEY": "agentrl-session",  # the session URL is the credential
            "AGENTRL_MODEL": task.model,
            "AGENTRL_TASK": task.prompt,
            "AGENTRL_TASK_FILE": self.TASK_FILE,
            **self.env,
        }
        await ep.env_call(sandbox.write_file, self.TASK_FILE, task.prompt)
        transport = await ep.env_call(sandbox.attach, relay_argv(self.python))
        relay = CommandRelay(transport, connect=ep.gateway.connect)
        try:
            relay.start(self.argv, env=env, cwd=sandbox.workdir, path=urlsplit(session.url).path)
            # A thread waits; cancelling this task (the episode ended first) closes the relay below,
            # which kills the command's process group and lets that thread go.
            code = await asyncio.to_thread(relay.wait)
        finally:
            relay.close()
            self.output = relay.output
        if relay.broken is not None:
            raise RuntimeError(relay.broken)
        if code != 0:
            tail = relay.output.strip()[-800:]
            raise RuntimeError(
                f"the harness command exited {code}" + (f"; its output ends: {tail}" if tail else "")
            )


class HarnessEnv:
    """An environment whose episodes a harness agent plays (see the module docstring).

    env: the environment that poses the tasks, runs the tools and scores (an id for `agentrl.make`, or an
        instance); agent: the harness, a callable or a `"module:function"` string; command: instead of
        `agent`, a command run inside the episode's sandbox (`SandboxCommand`), with `command_env` added to
        its environment; install: packages (pip requirement strings) the command needs, installed into a
        layer on each task's image (`agentrl.gateway.images`, docker); max_calls: the most completions an
        episode may ask for (default: the environment's `max_turns`); env_tools: tools of the environment it
        runs even when the agent's request did not declare them (by default a call to a tool the request did
        not offer is refused, as OpenAI's API never calls an undeclared function); model_aliases: model names
        the agent asks for (one it hard-codes) that the gateway answers as its own. Other keyword arguments
        (`max_turns`, `verifier`, settings) go to `agentrl.make(env, ...)`. service: instead of `agent`, an
        address ("127.0.0.1:8765") where each episode is offered to an agent process of yours
        (`agentrl.gateway.service`); pickup_timeout_s: how long an offered episode waits to be taken.

    Everything else (`reset`, `step`, `tasks`, `toolbox`, `episode`, ...) is the wrapped environment's,
    so the checks (`agentrl env check`, `agentrl verifier audit`) run on it unchanged.
    """

    def __init__(
        self,
        env: str | AgentEnv,
        agent: str | AgentFn | None = None,
        *,
        command: str | Sequence[str] | None = None,
        command_env: Mapping[str, str] | None = None,
        install: Sequence[str] | None = None,
        env_id: str | None = None,
        max_calls: int | None = None,
        env_tools: Sequence[str] = (),
        model_aliases: Sequence[str] = (),
        service: str | None = None,
        pickup_timeout_s: float = 120.0,
        **env_kwargs: Any,
    ):
        if sum(x is not None for x in (agent, command, service)) != 1:
            raise ValueError(
                "a harness env takes one of agent= (a callable or 'module:function'), command= and service="
            )
        if install and command is None:
            raise ValueError("install= is for a harness command (it installs into the sandbox's image)")
        if isinstance(env, str):
            from agentrl.env.registry import make

            env = make(env, **env_kwargs)
        elif env_kwargs:
            raise ValueError(
                f"HarnessEnv got settings {sorted(env_kwargs)} for an environment instance; pass an id to build it"
            )
        self.env = env
        self.install = tuple(install or ())
        if command is not None:
            from agentrl.gateway.images import harness_env, harness_image

            extra = {**(harness_env() if self.install else {}), **(command_env or {})}
            self.agent: AgentFn = SandboxCommand(command, env=extra)
            if self.install:
                packages = self.install
                env.sandbox_image = lambda image: harness_image(image, packages)
        elif service is not None:
            from agentrl.gateway.service import ServiceAgent

            self.agent = ServiceAgent(service, pickup_timeout_s=pickup_timeout_s)
        else:
            self.agent = load_agent(agent)
        self.max_calls = max_calls
        self.env_id = env_id or env.env_id
        self.env_tools = frozenset(env_tools)
        self.model_aliases = tuple(model_aliases)
        unknown = sorted(self.env_tools - set(env.toolbox.tools))
        if unknown:
            raise ValueError(
                f"env_tools {unknown} are not tools of {env.env_id} ({', '.join(env.toolbox.tools)})"
            )

    def __getattr__(self, name: str) -> Any:
        if name == "env":  # not set yet (a failed __init__): no recursion
            raise AttributeError(name)
        return getattr(self.env, name)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return self.env.reset(seed=seed, options=options)

    def step(self, action: str, offered: Sequence[str] | None = None) -> Any:
        """The wrapped environment's step; with `offered` (the tools the agent's request declared), a call to
        any other tool (but `env_tools`) is refused instead of run."""
        if offered is None or not hasattr(self.env, "offered_tools"):
            return self.env.step(action)
        self.env.offered_tools = frozenset(offered) | self.env_tools
        try:
            return self.env.step(action)
        finally:
            self.env.offered_tools = None

    def end_episode(self, reason: FinishReason, error: str | None = None) -> Any:
        return self.env.end_episode(reason, error)

    def episode_driver(self, context: EpisodeContext) -> HarnessEpisode:
        """One episode of a rollout (`agentrl.rollout.driver`): the agent plays it through a session of the
        gateway the rollout's policy is served by (one per policy and process: `shared_gateway`)."""
        from agentrl.gateway.server import shared_gateway

        return HarnessEpisode(self, shared_gateway(context.policy, context.masker), context)

    def close(self) -> None:
        self.env.close()

    def __enter__(self) -> HarnessEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_harness_env(env: Any) -> bool:
    return isinstance(env, HarnessEnv)


class HarnessTask:
    """What a harness agent gets beside its client: the task, the first messages, the tools, the model name,
    and `step`, which runs a reply's tool calls in the environment."""

    def __init__(self, episode: HarnessEpisode, task: Task, first_messages: list[Message]):
        self._episode = episode
        self.task = task
        """The environment's `Task` (id, prompt, metadata): what the agent works on."""
        self.prompt = task.prompt
        self.tools: list[dict[str, Any]] = [dict(s) for s in episode.env.toolbox.schemas]
        self.messages: list[dict[str, Any]] = _without_tools(first_messages, episode.env, self.tools)
        """The environment's first messages (system instructions, the task), as OpenAI messages; the tools
        are not written in them (they go as `tools`, and the session writes them where the env does)."""
        """The environment's tools as OpenAI tool schemas (`tools=` of a chat completion)."""
        self.model: str = episode.gateway.model_name
        session = episode.session
        self.url: str = session.url if session is not None else ""
        """The session's OpenAI base URL (what `client` points at), for an agent that brings its own client."""
        self.anthropic_url: str = session.anthropic_url if session is not None else ""
        """The session's base URL for Anthropic's clients (the Messages API)."""
        self.done = False
        """True once the episode is over: further steps do nothing, further completions get 404."""
        self._lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()

    def step(self, message: Any) -> Any:
        """Run `message`'s tool calls (an assistant message the client returned, or its dict) in the environment;
        the observation as OpenAI messages (tool results, or what was wrong with the message). A reply the
        gateway gave is stepped as the exact text the policy sampled for it. A call to a tool the agent's
        request did not declare is refused, not run (`HarnessEnv(env_tools=...)` names exceptions).

        `await task.step(message)` in an `async def` agent; in a plain `def` agent (it runs on a thread of
        its own) `task.step(message)` returns the messages."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            return self._step(message)
        future = asyncio.run_coroutine_threadsafe(self._step(message), self._loop)
        return future.result() if running is None else asyncio.wrap_future(future)

    async def _step(self, message: Any) -> list[dict[str, Any]]:
        async with self._lock:  # the environment takes one step at a time
            ep = self._episode
            session = ep.session
            if self.done or session is None or session.closed or ep.env.episode.done:
                self.done = True
                return []
            normal = _normal(message)
            sample = session.sample_for(normal) if normal is not None else None
            if sample is not None:
                text = sample.action_text
                offered = _tool_names(sample.tools)
            else:  # a message the agent wrote itself: in the environment's tool-call format
                text = _render(normal, ep.env.parser) if normal is not None else str(message)
                offered = _declared(session, self.tools)
            # A request without tools declared none through the API: the agent reads the text itself.
            obs, _reward, terminated, truncated, _info = await ep.env_call(ep.env.step, text, offered or None)
            if terminated or truncated:
                self.done = True
                episode = ep.env.episode
                session.close(episode.finish_reason, episode.error)
            ids = _call_ids(ep.env.parser, text, normal)
            return [
                {**m, "tool_call_id": ids[m["tool_call_id"]]} if m.get("tool_call_id") in ids else dict(m)
                for m in obs
            ]


def _tool_names(tools: Sequence[dict[str, Any]] | None) -> frozenset[str]:
    """The function names of OpenAI tool schemas (`{"type": "function", "function": {"name": ...}}`)."""
    names = set()
    for t in tools or ():
        fn = t.get("function") if isinstance(t, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else t.get("name") if isinstance(t, dict) else None
        if isinstance(name, str):
            names.add(name)
    return frozenset(names)


def _declared(session: Session, default: Sequence[dict[str, Any]]) -> frozenset[str]:
    """Every tool the session's requests declared so far (the environment's, before the first request)."""
    tool_lists = session.declared_tools()
    if not tool_lists:
        return _tool_names(default)
    return frozenset().union(*(_tool_names(t) for t in tool_lists))


def _without_tools(messages: list[Message], env: Any, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The first messages with the tools' block taken out of the system message, where the environment
    wrote it (`tools_in_prompt`): a harness passes the tools as `tools`, and its session writes the same
    block back (`tools_prompt="system"`), so the model's prompt is the native one, token for token."""
    out = [dict(m) for m in messages]
    if not tools or not out or out[0].get("role") != "system" or not getattr(env, "tools_in_prompt", False):
        return out
    suffix = "\n\n" + env.parser.system_block(tools)
    content = out[0].get("content") or ""
    if content.endswith(suffix):
        out[0]["content"] = content[: -len(suffix)]
    return out


def _normal(message: Any) -> dict[str, Any] | None:
    data = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else message
    if not isinstance(data, dict):
        return None
    data = {k: v for k, v in data.items() if v is not None}
    try:
        return normal_message(ChatMessage.model_validate(data))
    except Exception:
        return None


def _call_ids(parser: Any, text: str, message: dict[str, Any] | None) -> dict[str, str]:
    """The environment's ids of the calls in `text` (its parser numbers them) to the ids the agent's
    message gave the same calls: tool results answer the ids the agent knows."""
    theirs = [c.get("id") for c in (message or {}).get("tool_calls", [])]
    if not any(theirs):
        return {}
    try:
        ours = [c.id for c in parser.parse(text).calls]
    except Exception:
        return {}
    if len(ours) != len(theirs):
        return {}
    return {a: b for a, b in zip(ours, theirs, strict=True) if a and b}


def _render(message: dict[str, Any], parser: Any) -> str:
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    parts = [message.get("content") or ""]
    if calls:
        parts.append(parser.render_calls(calls))
    return "\n".join(p for p in parts if p)


async def _run_blocking(agent: Callable[..., Any], task: HarnessTask, url: str, timeout_s: float) -> None:
    """A plain `def` agent, on a daemon thread of its own with a blocking `openai.OpenAI` client. Cancelling
    this (the episode ended first) stops the wait, not the thread (Python cannot kill one): the session
    is closed by then, so its next call fails with a 404 and it unwinds; one that never calls again
    (sleeps forever) is left behind, and its episode has ended `timeout` all the same."""
    from openai import DefaultHttpxClient, OpenAI

    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def run() -> None:
        error: BaseException | None = None
        try:
            with OpenAI(
                base_url=url,
                api_key="agentrl-session",
                max_retries=0,
                timeout=timeout_s,
                http_client=DefaultHttpxClient(verify=False),
            ) as client:
                returned = agent(client, task)
            if inspect.isawaitable(returned):
                close = getattr(returned, "close", None)
                if close is not None:
                    close()  # never awaited: no "coroutine was never awaited" warning on top
                raise TypeError(
                    "the agent is a plain function that returned an awaitable: declare it `async def` (it "
                    "then gets an openai.AsyncOpenAI client), or make it blocking (an openai.OpenAI client)"
                )
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the rollout's loop is gone: nobody waits
            loop.call_soon_threadsafe(_settle, done, error)

    threading.Thread(target=run, name="agentrl-blocking-agent", daemon=True).start()
    await done


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the episode ended first
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)


class HarnessEpisode:
    """One harness episode in a rollout, the rollout's `EpisodeDriver` (`agentrl.rollout.driver`): reset, the
    agent against a fresh session, the ending, the branches."""

    def __init__(self, env: HarnessEnv, gateway: Gateway, context: EpisodeContext):
        self.env, self.gateway, self.rollout = env, gateway, context.rollout
        self.episode_policy = context.episode_policy
        """(environment after reset, None) -> the policy that answers this episode's calls instead of the
        gateway's (`agentrl.kit.demonstrations`: the oracle, in the agent's own prompt)."""
        self.seed, self.index, self.group_id = context.seed, context.index, context.group_id
        self.env_call = context.env_call
        self.session: Session | None = None

    def sampled_versions(self) -> set[int]:
        """The weights versions of every id sampled for the session's calls."""
        session = self.session
        return {v for s in (session.samples if session is not None else []) for v in s.token_versions}

    async def play(self, *, seed: int | None, options: dict[str, Any]) -> None:
        """Play the episode to its end (see the module docstring); the environment's episode records how."""
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient

        env = self.env
        obs, _info = await self.env_call(env.reset, seed=seed, options=options)
        loop = asyncio.get_running_loop()
        over = asyncio.Event()

        def on_close(_session: Session) -> None:
            with contextlib.suppress(RuntimeError):  # the rollout's loop is gone: nobody waits
                loop.call_soon_threadsafe(over.set)

        self.gateway.aliases.update(env.model_aliases)
        policy = self.episode_policy(env, None) if self.episode_policy is not None else None
        self.session = session = self.gateway.session(
            policy=policy,
            rollout=self.rollout,
            seed=self.seed,
            index=self.index,
            max_calls=env.max_calls if env.max_calls is not None else env.max_turns,
            parser=env.parser,
            group_id=self.group_id,
            on_close=on_close,
            # The tools are shown where the native environment shows them: in its system prompt, written
            # by its tool-call format; an environment built without them there leaves them to the template.
            tools_prompt="system" if getattr(env.env, "tools_in_prompt", True) else "template",
        )
        task = HarnessTask(self, env.task, obs)
        client = AsyncOpenAI(
            base_url=session.url,
            api_key="agentrl-session",  # the session URL is the credential; the SDK wants a key
            max_retries=0,
            timeout=self.rollout.episode_timeout_s,
            # The session URL is plain HTTP on this machine: no certificate store to load (tens of
            # milliseconds of CPU per client, one client per episode).
            http_client=DefaultAsyncHttpxClient(verify=False),
        )
        if is_async_agent(env.agent):
            agent = asyncio.ensure_future(env.agent(client, task))
        else:  # a blocking agent on a thread: the episode's timeout holds whatever it does
            agent = asyncio.ensure_future(
                _run_blocking(env.agent, task, session.url, self.rollout.episode_timeout_s)
            )
        waiter = asyncio.ensure_future(over.wait())
        reason: FinishReason = "submitted"
        error: str | None = None
        try:
            await asyncio.wait({agent, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if agent.done() and not session.closed:
                exc = agent.exception() if not agent.cancelled() else asyncio.CancelledError()
                if exc is not None:
                    reason, error = "agent_error", f"the agent raised {type(exc).__name__}: {exc}"
                    log.info("harness agent of episode %s raised: %r", self.index, exc)
        except asyncio.CancelledError:
            reason, error = (
                "timeout",
                f"the episode ran past its {self.rollout.episode_timeout_s:g}s wall-clock limit",
            )
            raise
        finally:
            task.done = True
            for t in (agent, waiter):
                t.cancel()
            # An agent that swallows its cancellation is left behind after a grace period.
            await asyncio.wait({agent, waiter}, timeout=_CANCEL_GRACE_S)
            with contextlib.suppress(Exception):
                await client.close()
            session.close(reason, error)
        episode = env.episode
        if not episode.done:
            await self.env_call(env.end_episode, session.finish_reason or reason, session.error)

    def trajectories(self, base: Trajectory) -> list[Trajectory]:
        """`base` (the episode's trajectory as the native loop would make it, without tokens) once per
        branch, each with its branch's tokens (`agentrl.rollout.assemble`); `base` itself when the agent
        never called the model."""
        session = self.session
        branches = session.branches() if session is not None else []
        if session is None or not branches:
            return [base]
        if isinstance(self.env.agent, SandboxCommand):
            # The environment never stepped: its turns are the command's completions.
            base = dataclasses.replace(base, turns=session.calls)
        out = branch_trajectories(
            base,
            branches,
            rollout=self.rollout,
            drifted_calls=session.drifted_calls,
            timings=dataclasses.replace(base.timings, generate_s=session.generate_s),
        )
        # What the environment answered last, when the agent never sent it back, ends branch 0's messages.
        out[0].messages += self._last_observation(out[0].messages)
        return out

    def _last_observation(self, messages: list[Message]) -> list[Message]:
        """What the environment answered to the episode's last reply when the agent never sent it back (it
        stopped): its own record's messages after its last assistant message, as a native trajectory keeps
        them (they are not tokens of the trajectory)."""
        episode = getattr(self.env, "episode", None)
        record = list(getattr(episode, "messages", None) or [])
        if not messages or messages[-1].get("role") != "assistant" or not record:
            return []
        last = max((k for k, m in enumerate(record) if m.get("role") == "assistant"), default=-1)
        return [dict(m) for m in record[last + 1 :]] if last >= 0 else []
