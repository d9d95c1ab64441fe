"""`agentrl gateway`: a checkpoint served through the gateway by itself, for pointing an agent at it by hand.

    agentrl gateway --model runs/warm-calc --sessions 2 --out calls.jsonl
    {"session": 0, "url": "http://127.0.0.1:8000/s/4bq.../v1", "model": "agentrl-policy"}
    ...

Each session URL is one episode's: point an OpenAI client at it (`OPENAI_BASE_URL`). The model answers to
its name (`agentrl-policy`) and to every `--alias` (the name an agent hard-codes). The server runs until
interrupted (Ctrl-C, SIGTERM); then every session's calls are written to `--out` as trajectories (one
per branch, `agentrl.gateway.session`), marked not scored (`scored: false`, reward 0.0): no environment
ran a verifier on them, and training refuses them. To train an agent that runs as its own process, use
the agent service (`agentrl.gateway.service`): the trainer hands it episodes and scores them.
Unlike a rollout's sessions, these honour a request's temperature, top-p and seed.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentrl.gateway.server import Gateway
from agentrl.rollout.assemble import branch_trajectories, build_trajectory
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.trajectory import Trajectory, save_trajectories


def serve(
    policy: Any,
    *,
    rollout: RolloutConfig,
    sessions: int = 1,
    host: str = "127.0.0.1",
    port: int = 8000,
    uds: str | None = None,
    parser: str = "hermes",
    model_name: str = "agentrl-policy",
    aliases: Sequence[str] = (),
    tools_prompt: str = "system",
    out: str | Path | None = None,
    echo: Callable[[str], None] = print,
    stop: threading.Event | None = None,
    note: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> int:
    """Serve until `stop` is set (by default: until SIGINT or SIGTERM); write the sessions' trajectories to
    `out` (saying so on stderr at once, before the slow shutdown); return how many were written."""
    stop = stop or _stop_on_signals()
    gateway = Gateway(
        policy,
        host=host,
        port=port,
        uds=uds,
        parser=parser,
        model_name=model_name,
        aliases=aliases,
        tools_prompt=tools_prompt,  # type: ignore[arg-type]
    )
    with gateway:
        opened = [gateway.session(rollout=rollout, lock_sampling=False) for _ in range(sessions)]
        for i, s in enumerate(opened):
            line = {"session": i, "url": s.url, "anthropic_url": s.anthropic_url, "model": gateway.model_name}
            echo(json.dumps({**line, "aliases": sorted(gateway.aliases)} if gateway.aliases else line))
        stop.wait()
        # Written before the server and the engine shut down (seconds): what was asked for comes first.
        calls = sum(len(s.samples) for s in opened)
        where = f" to {out}" if out is not None else " (no --out: not kept)"
        note(f"stopping: writing the calls of {len(opened)} sessions ({calls} completions){where}")
        trajectories = []
        for i, s in enumerate(opened):
            s.close("submitted")
            trajectories += session_trajectories(s, task_id=f"session-{i}")
        if out is not None:
            save_trajectories(out, trajectories)
            note(f"wrote {len(trajectories)} trajectories to {out}; shutting the server and the engine down")
    return len(trajectories)


def session_trajectories(session: Any, *, task_id: str) -> list[Trajectory]:
    """A session's branches as trajectories marked not scored (no environment, no verifier, no reward)."""
    # Without tokens, then once per branch with that branch's tokens and versions.
    unscored = build_trajectory(
        None,
        [0],
        task_id=task_id,
        group_id=task_id,
        reward=0.0,
        passed=False,
        scored=False,
        verdict_details="not scored: no verifier ran on this session (agentrl gateway)",
        finish_reason=session.finish_reason or "submitted",
    )
    return branch_trajectories(unscored, session.branches(), drifted_calls=session.drifted_calls)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(_signum: int, _frame: Any) -> None:
        stop.set()
        # A second Ctrl-C while shutting down interrupts at once.
        signal.signal(signal.SIGINT, signal.default_int_handler)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop
