"""pass@1 of one checkpoint natively and through the gateway as a harness, on the same tasks and seeds.

    .venv/bin/python benchmarks/harness_pass1.py --model runs/demo/warm-start --tasks 100 --samples 2

Prints ONE JSON object on stdout (progress and vLLM's logs on stderr). The same episodes (test-split
tasks of `--env`, per-episode seeds) are played twice: by the native rollout loop, and by
`HarnessEnv(env, tool_loop_agent)`, the native loop written against the `openai` SDK, every call
through a gateway session. The harness's first request is the native prompt token for token (the
tools written into the system message by the environment's own tool-call format), so the two should
agree episode for episode; `paired` is the paired comparison (McNemar's exact p, a paired bootstrap
interval of the difference), `identical_episodes` the share whose token ids are the same.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="Checkpoint directory (a warm start).")
    parser.add_argument("--env", default="agentrl/calc-v0")
    parser.add_argument("--backend", default="bwrap", help="Sandbox backend of the env's tools.")
    parser.add_argument("--tasks", type=int, default=100, help="Test-split tasks.")
    parser.add_argument("--samples", type=int, default=2, help="Episodes per task.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-tokens-per-turn", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import agentrl
    from agentrl.eval.paired import compare_trajectories
    from agentrl.gateway.harness import HarnessEnv, tool_loop_agent
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.loop import collect_sync
    from agentrl.rollout.masker import ChatMasker
    from agentrl.rollout.policy import VLLMPolicy

    policy = VLLMPolicy(args.model, in_process=True, dtype="float32", max_model_len=2048)
    masker = ChatMasker(policy.tokenizer)
    source = agentrl.task_source(args.env)
    tasks = [source.get(i, "test") for i in range(args.tasks)]
    cfg = RolloutConfig(
        group_size=args.samples,
        temperature=1.0,
        max_tokens_per_turn=args.max_tokens_per_turn,
        max_total_tokens=1024,
        concurrency=args.concurrency,
        episode_timeout_s=300,
    )
    kwargs = {"backend": args.backend}

    def run(name: str, envs: Any) -> tuple[dict[tuple[str, int], Any], float]:
        policy.reset_prefix_cache()  # the second run must not find the first's conversations cached
        t = time.perf_counter()
        trajs = collect_sync(envs, tasks, policy, cfg, seed=args.seed, masker=masker)
        wall = time.perf_counter() - t
        first = [t for t in trajs if t.branch == 0]
        print(f"{name}: {len(first)} episodes in {wall:.1f}s", file=sys.stderr)
        return {(t.task_id, i % args.samples): t for i, t in enumerate(first)}, wall

    native, native_s = run("native", lambda: agentrl.make(args.env, **kwargs))
    harness, harness_s = run("harness", lambda: HarnessEnv(args.env, tool_loop_agent, **kwargs))
    policy.close()
    paired = compare_trajectories("native", native, "harness", harness)
    same = sum(native[k].token_ids == harness[k].token_ids for k in native) / len(native)
    result = {
        "benchmark": "harness_vs_native_pass_at_1",
        "model": args.model,
        "env": args.env,
        "tasks": args.tasks,
        "samples": args.samples,
        "seed": args.seed,
        "native_pass_at_1": paired.baseline_pass_at_1,
        "harness_pass_at_1": paired.model_pass_at_1,
        "difference": paired.difference,
        "ci": [paired.ci_low, paired.ci_high],
        "mcnemar_p": paired.p_value,
        "harness_only": paired.b_only,
        "native_only": paired.a_only,
        "identical_episodes": round(same, 3),
        "harness_branches": sum(t.branches > 1 for t in harness.values()),
        "native_s": round(native_s, 1),
        "harness_s": round(harness_s, 1),
        "load_average_1m": os.getloadavg()[0],
    }
    print(json.dumps(result, indent=2), file=result_out, flush=True)


if __name__ == "__main__":
    main()
