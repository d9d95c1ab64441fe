"""The GRPO trainer under FSDP2 on replayed batches: 1 vs 2 processes, and resume."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.rollout.trajectory import Trajectory, save_trajectories
from agentrl.train.config import ConfigError, TrainConfig, load_config
from tests.fixtures_dist import assert_same_gradients, grpo_step_gradients, one_rank_group  # noqa: F401
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[2]


def grpo_batch(vocab: int, groups: int = 3, group_size: int = 4, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        for i in range(group_size):
            n = rng.randint(24, 48)
            mask = [0] * 10 + [1 if (j // 5) % 2 == 0 else 0 for j in range(n - 10)]
            out.append(
                Trajectory(
                    task_id=f"task{g}",
                    group_id=f"g{g}",
                    token_ids=[rng.randrange(vocab) for _ in range(n)],
                    loss_mask=mask,
                    # Behaviour log-probs near the random model's (about -ln V) so ratios are moderate.
                    behavior_logprobs=[-7.8 + rng.uniform(-0.3, 0.3) if m else 0.0 for m in mask],
                    prompt_len=10,
                    reward=float(i % 2),
                    passed=bool(i % 2),
                    finish_reason="submitted",
                    policy_version=0,
                )
            )
    return out


COIN = "tests.coin_env:test/Coin-v0"


def coin_config(
    model: Any, out: Any, *, steps: int, lr: float, env: str = COIN, **settings: Any
) -> TrainConfig:
    """A small GRPO run on the coin env (or a variant): groups of 4, 2 informative groups a step, 12-token turns."""
    return TrainConfig(
        env=env,
        model=model,
        out=str(out),
        steps=steps,
        rollout={"group_size": 4, "max_tokens_per_turn": 12, "max_total_tokens": 512, "concurrency": 8},
        curriculum={"batch_groups": 2, "max_gen_factor": 3.0},
        optim={"lr": lr, "micro_batch_size": 4},
        **settings,
    )


def run(cfg: TrainConfig, nproc: int, cpu: bool = True) -> list[dict]:
    """`python -m agentrl.train.trainer` under torchrun. `cpu`: gloo ranks on the CPU even where CUDA GPUs
    are visible (these are CPU tests: fp32 numbers compared across process counts; a one-GPU
    machine could not host two NCCL ranks anyway)."""
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [*launcher, "-m", "agentrl.train.trainer", cfg.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]


def test_config_from_yaml_with_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("model: m\nsteps: 3\nloss:\n  agg: seq-mean-token-mean\n")
    cfg = load_config(f, ["optim.lr=3e-5", "curriculum.batch_groups=2", "loss.tis_cap=null"])
    assert (cfg.steps, cfg.loss.agg, cfg.optim.lr, cfg.curriculum.batch_groups, cfg.loss.tis_cap) == (
        3,
        "seq-mean-token-mean",
        3e-5,
        2,
        None,
    )
    with pytest.raises(ValueError, match="must look like key.sub=value"):
        load_config(f, ["steps"])
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr'. Did you mean 'optim.lr'\?"):
        load_config(f, ["optim.lrr=1"])


@pytest.mark.slow
def test_two_processes_match_one_and_resume_reproduces_the_next_step(tiny_model_dir, tmp_path):  # noqa: F811
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    data = tmp_path / "batch.jsonl"
    save_trajectories(data, grpo_batch(vocab))
    base = dict(
        model=str(tiny_model_dir),
        replay=str(data),
        steps=2,
        checkpoint_every=1,
        optim={"lr": 1e-3, "micro_batch_size": 2},
    )
    one = run(TrainConfig(**base, out=str(tmp_path / "one")), 1)
    two = run(TrainConfig(**base, out=str(tmp_path / "two")), 2)
    # Stated tolerance: fp32 CPU, sums split across ranks in another order: 1e-5 relative on the loss.
    for a, b in zip(one, two, strict=True):
        assert b["losses/policy_loss"] == pytest.approx(a["losses/policy_loss"], rel=1e-5, abs=1e-7)
        assert b["losses/grad_norm"] == pytest.approx(a["losses/grad_norm"], rel=1e-4)
        assert b["batch/action_tokens"] == a["batch/action_tokens"]
    # The update moved the policy: the second step's loss differs from the first.
    assert one[1]["losses/policy_loss"] != one[0]["losses/policy_loss"]

    # Resume: stop after step 1, start again; step 2 must be what the uninterrupted run did.
    first = run(TrainConfig(**{**base, "steps": 1}, out=str(tmp_path / "resume")), 1)
    assert first[0]["losses/policy_loss"] == pytest.approx(one[0]["losses/policy_loss"], rel=1e-6)
    resumed = run(TrainConfig(**base, out=str(tmp_path / "resume")), 1)
    assert [r["step"] for r in resumed] == [1, 2]
    assert resumed[1]["losses/policy_loss"] == pytest.approx(one[1]["losses/policy_loss"], rel=1e-6, abs=1e-8)
    assert resumed[1]["losses/grad_norm"] == pytest.approx(one[1]["losses/grad_norm"], rel=1e-6)
    assert (tmp_path / "one" / "final" / "model.safetensors").exists()


def test_staleness_is_a_histogram_and_the_bound_drops_what_is_past_it():
    from agentrl.train.trainer import _apply_staleness

    trajs = grpo_batch(vocab=16, groups=3, group_size=2)
    for t, v in zip(trajs, [5, 5, 4, 3, 2, 4], strict=True):
        t.policy_version, t.policy_version_max = v, v if v < 4 else 5  # the last: one push mid-episode
    cfg = TrainConfig(model="m", asynchronous={"mode": "async", "max_staleness": 1, "stale": "drop"})
    metrics: dict[str, float] = {}
    kept = _apply_staleness(trajs, 5, cfg, metrics)  # ages 0, 0, 1, 2, 3, 1 (its oldest token's)
    assert [t.policy_version for t in kept] == [5, 5, 4, 4]
    assert metrics["async/staleness_max"] == 3.0 and metrics["async/staleness_mean"] == 7 / 6
    assert (
        metrics["async/staleness_0"],
        metrics["async/staleness_1"],
        metrics["async/staleness_over_bound"],
    ) == (
        2.0,
        2.0,
        2.0,
    )
    assert metrics["async/dropped_stale"] == 2.0
    assert "async/token_staleness_mean" not in metrics  # no per-token versions recorded


def test_token_staleness_counts_each_sampled_token_by_the_version_it_came_from():
    from agentrl.train.trainer import _apply_staleness

    trajs = grpo_batch(vocab=16, groups=1, group_size=2)
    for t, (start, switch) in zip(trajs, [(4, None), (3, 2)], strict=True):
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        t.token_versions = [-1] * len(t.token_ids)
        for k, i in enumerate(sampled):  # the second: pushed after its first two sampled ids
            t.token_versions[i] = start if switch is None or k < switch else start + 1
        t.policy_version, t.policy_version_max = start, max(t.token_versions)
    cfg = TrainConfig(model="m", asynchronous={"mode": "async", "max_staleness": 2})
    metrics: dict[str, float] = {}
    _apply_staleness(trajs, 5, cfg, metrics)
    ages = [5 - v for t in trajs for v, m in zip(t.token_versions, t.loss_mask, strict=True) if m]
    newer = sum(len([m for m in t.loss_mask if m]) - 2 for t in trajs[1:])
    assert metrics["async/token_staleness_mean"] == pytest.approx(sum(ages) / len(ages))
    assert metrics["async/tokens_after_push"] == pytest.approx(newer / len(ages))
    assert metrics["async/staleness_max"] == 2.0  # a trajectory's age is still its oldest token's


def test_learning_rate_warms_up_linearly_over_optimizer_steps():
    from agentrl.train.update import learning_rate

    cfg = TrainConfig(model="m", optim={"lr": 1e-4, "warmup_steps": 4})
    assert [learning_rate(cfg, u) for u in range(6)] == pytest.approx(
        [2.5e-5, 5e-5, 7.5e-5, 1e-4, 1e-4, 1e-4]
    )
    assert learning_rate(TrainConfig(model="m", optim={"lr": 1e-4}), 0) == 1e-4


@pytest.mark.slow
def test_ppo_epochs_mini_batches_and_kl_match_across_processes_and_resume(tiny_model_dir, tmp_path):  # noqa: F811
    """Two passes of two mini-batches per batch (4 optimizer steps), warm-up over 6 of them, a KL
    penalty to the frozen start: 2 processes take the steps of 1, and a resume continues the
    warm-up and the update count where they were."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    data = tmp_path / "batch.jsonl"
    save_trajectories(data, grpo_batch(vocab, groups=4))
    base = dict(
        model=str(tiny_model_dir),
        replay=str(data),
        steps=2,
        checkpoint_every=1,
        optim={"lr": 1e-3, "micro_batch_size": 2, "epochs": 2, "mini_batches": 2, "warmup_steps": 6},
        loss={"kl_coef": 0.1, "negative_weight": 0.5},
    )
    one = run(TrainConfig(**base, out=str(tmp_path / "one")), 1)
    two = run(TrainConfig(**base, out=str(tmp_path / "two")), 2)
    assert [r["optim/updates"] for r in one] == [4.0, 8.0]
    assert [r["optim/lr"] for r in one] == pytest.approx(
        [1e-3 * 4 / 6, 1e-3], abs=1e-6
    )  # JSONL rounds to 6 places
    # After the first of 4 updates the ratio leaves 1 and the policy leaves the reference.
    assert one[0]["losses/kl_ref"] > 0 and one[0]["losses/approx_kl"] > 0
    for a, b in zip(one, two, strict=True):
        # Later updates start from weights that already differ by float rounding: 1e-4 relative.
        assert b["losses/policy_loss"] == pytest.approx(a["losses/policy_loss"], rel=1e-4, abs=1e-7)
        assert b["losses/kl_ref"] == pytest.approx(a["losses/kl_ref"], rel=1e-3, abs=1e-9)
        assert b["losses/grad_norm"] == pytest.approx(a["losses/grad_norm"], rel=1e-3)
    run(TrainConfig(**{**base, "steps": 1}, out=str(tmp_path / "resume")), 1)
    resumed = run(TrainConfig(**base, out=str(tmp_path / "resume")), 1)
    assert resumed[1]["optim/updates"] == 8.0 and resumed[1]["optim/lr"] == pytest.approx(1e-3)
    assert resumed[1]["losses/policy_loss"] == pytest.approx(one[1]["losses/policy_loss"], rel=1e-5, abs=1e-8)


@pytest.mark.slow
def test_activation_checkpointing_packing_and_token_budget_match_the_plain_run_on_two_processes(
    tiny_model_dir,  # noqa: F811
    tmp_path,
):
    """FSDP2 on 2 gloo ranks with activation checkpointing, packed micro-batches under a token budget
    and per-sequence loss aggregation takes the steps of 1 process with none of them."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    data = tmp_path / "batch.jsonl"
    save_trajectories(data, grpo_batch(vocab))
    base = dict(model=str(tiny_model_dir), replay=str(data), steps=2, loss={"agg": "seq-mean-token-mean"})
    plain = run(
        TrainConfig(
            **base,
            out=str(tmp_path / "plain"),
            optim={"lr": 1e-3, "max_tokens_per_micro_batch": None, "packing": "off"},
        ),
        1,
    )
    lean = run(
        TrainConfig(
            **base,
            out=str(tmp_path / "lean"),
            optim={
                "lr": 1e-3,
                "max_tokens_per_micro_batch": 100,
                "packing": "on",
                "activation_checkpointing": True,
            },
        ),
        2,
    )
    for a, b in zip(plain, lean, strict=True):
        assert b["losses/policy_loss"] == pytest.approx(a["losses/policy_loss"], rel=1e-5, abs=1e-7)
        assert b["losses/grad_norm"] == pytest.approx(a["losses/grad_norm"], rel=1e-4)
        assert b["losses/entropy"] == pytest.approx(a["losses/entropy"], rel=1e-5)


@pytest.mark.parametrize("packing", ["off", "on"])
def test_activation_checkpointing_on_and_off_give_equal_gradients(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    packing: str,
):
    """The trainer's step under FSDP2 (gloo) with decoder layers recomputed in backward: the same
    gradients, to fp32 rounding. (The training forward keeps no KV cache: a recomputed layer that
    appended to one would see its keys twice.)"""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    trajs = grpo_batch(vocab, groups=2, group_size=3)
    base = {"model": str(tiny_model_dir), "loss": {"kl_coef": 0.1}}

    def cfg(checkpointing: bool) -> TrainConfig:
        optim = {"grad_clip": 1e9, "packing": packing, "activation_checkpointing": checkpointing, "epochs": 2}
        return TrainConfig(**base, optim=optim)

    off, m_off = grpo_step_gradients(tiny_model_dir, one_rank_group, cfg(False), trajs)
    on, m_on = grpo_step_gradients(tiny_model_dir, one_rank_group, cfg(True), trajs)
    assert m_on["losses/policy_loss"] == pytest.approx(m_off["losses/policy_loss"], rel=1e-6, abs=1e-9)
    assert_same_gradients(off, on, rel=1e-6)


def _half_passed_batch(model_dir) -> list[Trajectory]:
    """Rewards 0, 1, 0, 1 in each of three groups; versions per token, as a real rollout records them."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return [
        replace(t, token_versions=[0 if m else -1 for m in t.loss_mask]) for t in grpo_batch(vocab, groups=3)
    ]


def _count_runs(patch) -> list[int]:
    """Through `patch` (a monkeypatch), count the trajectories each micro-batch of the update runs."""
    from agentrl.train import update

    ran: list[int] = []
    real = update._micro_batch_backward

    def counting(model, mb, *args, **kwargs):
        ran.append(sum(1 for t in mb if any(t.loss_mask)))
        return real(model, mb, *args, **kwargs)

    patch.setattr(update, "_micro_batch_backward", counting)
    return ran


def test_trajectories_with_zero_advantage_are_not_run_and_the_step_is_unchanged(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    monkeypatch,
):
    """Positives only (`loss.negative_weight: 0`): a negative trajectory adds exactly nothing to the
    gradient, so the optimizer steps do not run it. Every step's gradients, the loss and the mismatch
    metrics (still over every trajectory) are those of running the whole batch; a mini-batch with no
    positive at all still steps, with zero gradients."""
    from agentrl.train import update

    trajs = _half_passed_batch(tiny_model_dir)
    cfg = TrainConfig(
        model=str(tiny_model_dir),
        loss={"negative_weight": 0.0},
        # The first pass's first mini-batch is every other trajectory: the negatives only.
        optim={"grad_clip": 1e9, "epochs": 2, "mini_batches": 2, "micro_batch_size": 2},
    )
    everything = lambda self, t: True  # noqa: E731  (the step before the skip: every trajectory runs)
    with monkeypatch.context() as m:
        ran = _count_runs(m)
        lean_steps: list[dict] = []
        _, lean = grpo_step_gradients(tiny_model_dir, one_rank_group, cfg, trajs, lean_steps)
        lean_rows, ran[:] = sum(ran), []
        m.setattr(update._BatchContext, "trains", everything)
        full_steps: list[dict] = []
        _, full = grpo_step_gradients(tiny_model_dir, one_rank_group, cfg, trajs, full_steps)
    assert (lean_rows, sum(ran)) == (2 * 6, 2 * 12)  # 2 passes over 6 positives, against 12 trajectories
    assert len(lean_steps) == len(full_steps) == 4
    assert all(not g.any() for g in lean_steps[0].values())  # the negatives-only mini-batch
    for a, b in zip(full_steps[1:], lean_steps[1:], strict=True):
        assert_same_gradients(a, b, rel=1e-5)
    for key in ("losses/policy_loss", "mismatch/logprob_abs_diff", "mismatch/kl", "mismatch/is_ratio_p50"):
        assert lean[key] == pytest.approx(full[key], rel=1e-5, abs=1e-9), key
    assert lean["batch/action_tokens"] == full["batch/action_tokens"]
    # One update per batch (no pass before it): the skipped trajectories still get a forward pass for
    # the mismatch metrics, even when no trajectory trains at all.
    one = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"epochs": 1, "mini_batches": 1})})
    negatives = [t for t in trajs if t.reward == 0]
    for batch in (trajs, negatives + trajs[1:2], negatives):  # one positive in all; then none
        _, lean = grpo_step_gradients(tiny_model_dir, one_rank_group, one, batch)
        with monkeypatch.context() as m:
            m.setattr(update._BatchContext, "trains", everything)
            _, full = grpo_step_gradients(tiny_model_dir, one_rank_group, one, batch)
        for key in ("losses/policy_loss", "mismatch/logprob_abs_diff", "mismatch/is_ratio_p50"):
            assert lean[key] == pytest.approx(full[key], rel=1e-5, abs=1e-9), key


def test_an_entropy_bonus_trains_every_trajectory_the_negatives_included(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    monkeypatch,
):
    """With `loss.entropy_coef` a zero-advantage trajectory adds its entropy to the gradient: every
    trajectory runs, the negatives-only mini-batch moves the weights, and the bonus lowers the loss."""
    cfg = TrainConfig(
        model=str(tiny_model_dir),
        loss={"negative_weight": 0.0, "entropy_coef": 0.01},
        optim={"grad_clip": 1e9, "epochs": 2, "mini_batches": 2, "micro_batch_size": 2},
    )
    ran = _count_runs(monkeypatch)
    steps: list[dict] = []
    _, metrics = grpo_step_gradients(
        tiny_model_dir, one_rank_group, cfg, _half_passed_batch(tiny_model_dir), steps
    )
    assert sum(ran) == 2 * 12
    assert any(g.any() for g in steps[0].values())  # the negatives alone: the bonus's gradient
    assert metrics["losses/entropy"] > 0
    assert metrics["losses/loss"] < metrics["losses/pg_loss"]  # the bonus is subtracted


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async", "overlap"])
def test_grpo_loop_with_vllm_rollouts_under_two_processes(tiny_model_dir, tmp_path, mode):  # noqa: F811
    """The real loop: curriculum draws, vLLM rollouts on rank 0, FSDP2 update on 2 ranks, weight push.
    `overlap`: two batches built at once, their episodes in one engine from two threads.

    On a GPU machine it runs there (vLLM needs its GPU build): 2 ranks with 2 GPUs or more, one
    (the engine colocated with it) on a single GPU."""
    overlap = mode == "overlap"
    cfg = coin_config(
        str(tiny_model_dir),
        tmp_path / mode,
        steps=3,
        lr=1e-4,
        asynchronous={
            "mode": "sync" if mode == "sync" else "async",
            "max_staleness": 2 if overlap else 1,
            "overlap": overlap,
        },
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows = run(cfg, 1 if gpus == 1 else 2, cpu=False)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Weights reached vLLM after every update.
    assert [r["policy/version"] for r in rows] == [1.0, 2.0, 3.0]
    trained = [r for r in rows if "losses/policy_loss" in r]
    assert trained, (
        "a random policy on the coin env gives informative groups; at least one update must happen"
    )
    for r in trained:
        assert r["batch/action_tokens"] > 0 and r["losses/grad_norm"] > 0
    for r in rows:
        assert 0.0 <= r["curriculum/band_occupancy"] <= 1.0 and r["curriculum/refill_cost"] >= 1.0
    if mode == "sync" and gpus == 0:
        # An fp32 engine on the trainer's own weights, pushed after every step: the engine samples from the
        # policy the trainer holds, to float rounding (a missed push would show as ~1e-2 and grow).
        for r in trained:
            assert r["mismatch/logprob_abs_diff"] < 1e-4 and r["mismatch/kl"] < 1e-6, r
    if mode != "sync":
        # k batches ahead at most: never more than k versions behind, so nothing is dropped.
        assert all(r["async/staleness_max"] <= cfg.asynchronous.max_staleness for r in rows)
        assert all(r.get("async/dropped_stale", 0.0) == 0.0 for r in rows)
    if overlap:  # batch 2 started with batch 1, both under the first weights: one version behind, at least
        assert rows[1]["async/staleness_max"] >= 1.0 and rows[0]["async/batches_building"] >= 1.0, rows
    assert (tmp_path / mode / "final" / "model.safetensors").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_trains_an_openai_harness_and_eval_reports_its_pass_at_k(tiny_model_dir, tmp_path):  # noqa: F811
    """`agentrl train` on a harness env: an `openai`-SDK agent plays every episode through its gateway
    session on rank 0, FSDP2 updates on 2 ranks, checkpoints as for any env; then `agentrl eval`
    scores the harness's pass@k with the trained model."""
    env = "tests.coin_env:test/CoinHarness-v0"
    cfg = coin_config(str(tiny_model_dir), tmp_path / "run", steps=2, lr=1e-4, env=env, checkpoint_every=1)
    rows = run(cfg, 2)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["policy/version"] for r in rows] == [1.0, 2.0]
    trained = [r for r in rows if "losses/policy_loss" in r]
    assert trained and all(r["batch/action_tokens"] > 0 for r in trained)
    for r in rows:  # one call per episode, nothing rewritten: no branch, no drift, no crashed agent
        assert r["rollout/branches"] == r["rollout/drifted_calls"] == r["rollout/agent_errors"] == 0, r
    for r in trained:  # the gateway's captured samples are the engine's: the trainer recomputes them
        assert r["mismatch/logprob_abs_diff"] < 1e-4, r
    assert (tmp_path / "run" / "checkpoint-2").is_dir()
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()

    out = tmp_path / "eval"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--env",
            env,
            "--model",
            str(tmp_path / "run" / "final"),
            "--tasks",
            "4",
            "--samples",
            "2",
            "--k",
            "1,2",
            "--out",
            str(out),
            "--max-tokens-per-turn",
            "12",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    (model,) = json.loads(next(out.rglob("summary.json")).read_text())["models"]
    assert [p["k"] for p in model["pass_at"]] == [1, 2] and model["samples_per_task"] == 2
    assert sum(model["finish_reasons"].values()) == 8  # 4 tasks x 2 episodes, each ended with its reason


@pytest.mark.vllm
def test_a_sampler_registered_by_a_package_runs_in_agentrl_train(tiny_model_dir, tmp_path, monkeypatch):  # noqa: F811
    """A third party's sampler (entry-point group `agentrl.samplers`) picks every batch of `agentrl train`:
    its probes run groups of `probe_group_size`, its group weight reaches the loss, its metrics the log."""
    from tests.train.test_samplers import install_plugin

    install_plugin(tmp_path, monkeypatch)
    cfg = coin_config(str(tiny_model_dir), tmp_path / "run", steps=2, lr=1e-4)
    config = cfg.model_dump(mode="json")
    config["curriculum"] |= {"sampler": "newest", "sampler_options": {"tag": "cli"}, "probe_group_size": 2}
    (tmp_path / "run.yaml").write_text(json.dumps(config))  # JSON is YAML
    # The command in a process of its own: one process trains where it runs, and this one must not
    # become a rank of a process group (its environment would leak into later tests' ranks).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])  # the plugin's folder, then ours
    proc = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "train", str(tmp_path / "run.yaml")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # 2 groups of 2 a step, every group kept (the plugin's own choice), each weighing 0.5
        assert r["curriculum/tag_cli"] == 1 and r["curriculum/newest_tracked"] == 2 * r["step"], r
        assert r["batch/groups"] == r["batch/generated_groups"] == 2 and r["batch/sequences"] == 4, r
        parts = ("all_pass_groups", "all_fail_groups", "mixed_groups", "empty_groups")
        assert sum(r[f"batch/{k}"] for k in parts) == r["batch/generated_groups"], r
        assert r["curriculum/loss_weight_mean"] == 0.5, r
        # The engine samples from the trainer's policy (fp32 both): every quantile of the ratio is 1.
        assert (
            r["mismatch/is_ratio_p01"] == r["mismatch/is_ratio_p50"] == r["mismatch/is_ratio_p99"] == 1.0
        ), r


def train_with_a_push_that_never_lands(
    model: Any, out: Path, patch: str, **settings: Any
) -> subprocess.CompletedProcess:
    """3 steps on the coin env in a process where `patch` (a line of Python) makes the engine drop pushes."""
    cfg = coin_config(model, out, steps=3, lr=1e-3, **settings)
    code = (
        "import sys\n"
        "from agentrl.rollout.policy import VLLMPolicy\n"
        f"{patch}\n"
        "from agentrl.train.config import TrainConfig\n"
        "from agentrl.train.distributed import run_rank\n"
        "from agentrl.train.trainer import train\n"
        "sys.exit(run_rank(lambda: train(TrainConfig.model_validate_json(sys.argv[1]))))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, cfg.model_dump_json()],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_a_policy_that_fails_every_task_stops_and_says_warm_start_first(tiny_model_dir, tmp_path):  # noqa: F811
    """A random policy never finds the secret number: no group is informative, so after
    `stop_uninformative_after` steps the run stops with the reason, instead of logging `loss nan`."""
    cfg = tmp_path / "guess.yaml"
    cfg.write_text(
        f"env: agentrl/guess-number-v0\nenv_kwargs: {{max_turns: 1}}\nmodel: {tiny_model_dir}\nout: {tmp_path / 'run'}\n"
        "steps: 5\nstop_uninformative_after: 2\n"
        "rollout: {group_size: 2, max_tokens_per_turn: 8, max_total_tokens: 1024}\n"
        "curriculum: {batch_groups: 2, max_gen_factor: 1.0}\n"
    )
    res = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "train", str(cfg)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [x for x in res.stderr.replace("\r", "\n").splitlines() if x.startswith(("[train]", "error:"))]
    assert res.returncode == 2, res.stderr[-3000:]
    assert "no update: all 2 groups failed (reward 0 everywhere)" in lines[1] and "nan" not in res.stderr
    assert lines[-1].startswith(
        "error: no informative group in the last 2 steps (step 2/5): every episode failed"
    )
    assert "Warm-start it first" in lines[-1] and "agentrl demos agentrl/guess-number-v0" in lines[-1]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and not any("losses/policy_loss" in r for r in rows)
    assert not (tmp_path / "run" / "final").exists()  # nothing was trained: no "final" model


class _CrashingVerifier:
    name = "crashing"

    def verify(self, sandbox, task, episode):
        return {"reward": 1.0}["score"]  # a verifier bug: KeyError on every episode


def _played(verifier: object, answers: list[str]) -> list[Trajectory]:
    """One group of real episodes (ToolEnv, its verifier) as the rollout records them: the verdict's
    reward and details on the trajectory."""
    from agentrl.core.task import Task
    from agentrl.env.agents import run_episode
    from agentrl.env.parsers import get_parser
    from agentrl.env.tool_env import ToolEnv

    env = ToolEnv(tasks=[Task(id="t", prompt="Say 1.", answer="1")], tools=["submit"], verifier=verifier,
                  backend="local", use_pool=False)  # fmt: skip
    hermes = get_parser("hermes")
    out = []
    for answer in answers:
        ep = run_episode(env, _Say(hermes.render_call("submit", answer=answer))).episode
        out.append(
            Trajectory(
                task_id=ep.task_id, group_id="g", token_ids=[], loss_mask=[], behavior_logprobs=[], prompt_len=0,
                reward=ep.verdict.reward, passed=ep.verdict.passed, finish_reason=ep.finish_reason,
                policy_version=0, verdict_details=ep.verdict.details,
            )
        )  # fmt: skip
    return out


class _Say:
    def __init__(self, text: str):
        self.text = text

    def act(self, observation):
        return self.text


def test_all_fail_because_the_verifier_crashed_says_so_with_the_crash_and_where():
    """A verifier that raises on every episode used to stop the run with "warm-start first": the
    stop names the crash instead, its exception and file:line."""
    import inspect

    from agentrl.train.stopping import stop_advice

    crashed = _played(_CrashingVerifier(), ["1", "2"])
    assert all(t.reward == 0.0 and t.trainable for t in crashed)  # an all-fail group to the curriculum
    lines, start = inspect.getsourcelines(_CrashingVerifier.verify)
    where = f"{__file__}:{start + next(i for i, text in enumerate(lines) if 'return ' in text)}"
    advice = stop_advice("all-fail", "agentrl/x-v0", crashed)
    assert advice.startswith("the verifier failed on every episode (2 of the last batch)"), advice
    assert f"verifier 'crashing' crashed: KeyError: 'score' (at {where})" in advice
    assert "`agentrl verifier check agentrl/x-v0`" in advice and "Warm-start" not in advice
    assert "\n" not in advice

    # Some episodes judged, some not: the ordinary advice, and how many the verifier failed on.
    judged = _played("exact-match", ["2"])
    advice = stop_advice("all-fail", "agentrl/x-v0", [*judged, *crashed])
    assert (
        "Warm-start it first" in advice
        and "the verifier failed on 2 of the last batch's 3 episodes" in advice
    )
    # A verifier that judged every episode: the advice as it always was.
    assert stop_advice("all-fail", "agentrl/x-v0", judged).startswith(
        "every episode failed: the policy cannot"
    )


def test_tracking_to_jsonl_tensorboard_and_wandb_offline_without_an_account(tiny_model_dir, tmp_path):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    save_trajectories(tmp_path / "batch.jsonl", grpo_batch(vocab))
    out = tmp_path / "run"
    cfg = TrainConfig(
        model=str(tiny_model_dir), replay=str(tmp_path / "batch.jsonl"), out=str(out), steps=2,
        report_to=["jsonl", "tensorboard", "wandb"], wandb={"project": "agentrl-test"},
        optim={"lr": 1e-3, "micro_batch_size": 4},
    )  # fmt: skip
    home = tmp_path / "home"  # no ~/.netrc, no W&B login
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.train.trainer", cfg.model_dump_json()],
        capture_output=True, text=True, timeout=600, env={**env, "HOME": str(home), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"W&B: offline in {out / 'wandb'}" in proc.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    logged = events.Scalars("losses/policy_loss")
    assert [e.step for e in logged] == [1, 2]
    assert [e.value for e in logged] == pytest.approx([r["losses/policy_loss"] for r in rows], abs=1e-6)
    run_id = (out / "wandb-run-id").read_text()
    (offline,) = (out / "wandb").glob(f"offline-run-*-{run_id}")
    assert (offline / f"run-{run_id}.wandb").stat().st_size > 0
    # The training plot is written by `train` itself.
    assert (out / "training.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_grpo_pushes_adapters_the_engine_samples_from_and_evaluates_like_its_merge(
    tiny_model_dir,  # noqa: F811
    tmp_path,
):
    """A LoRA run: each step's adapter reaches vLLM (versions 1..3, the engine's log-probs equal to the
    trainer's), the checkpoints are peft adapters, and the adapter evaluated in a multi-LoRA engine gives
    the same pass@1 as its merged full model on the same episodes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    cfg = coin_config(
        {"path": str(tiny_model_dir), "lora": {"rank": 8, "alpha": 16}},
        out,
        steps=3,
        lr=1e-3,
        checkpoint_every=2,
    )
    rows = run(cfg, 1)
    assert [r["policy/version"] for r in rows] == [1.0, 2.0, 3.0]
    trained = [r for r in rows if "losses/policy_loss" in r]
    assert trained
    for r in trained:  # fp32 engine with the pushed fp32 adapter against the trainer's fp32 LoRA model
        assert r["mismatch/logprob_abs_diff"] < 1e-3 and r["mismatch/kl"] < 1e-5, r
    for d in (out / "checkpoint-2", out / "final"):
        assert (d / "adapter_model.safetensors").is_file() and not (d / "model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, out / "final")  # peft's own loader takes it
    agentrl = str(ROOT / ".venv/bin/agentrl")
    # The test env (tests.coin_env) imports from the checkout.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    merged = tmp_path / "merged"
    subprocess.run([agentrl, "model", "merge", str(out / "final"), "--out", str(merged)], check=True, env=env)
    res = subprocess.run(
        [agentrl, "eval", "--env", "tests.coin_env:test/Coin-v0", "--model", str(tiny_model_dir),
         "--model", str(out / "checkpoint-2"), "--model", str(out / "final"), "--model", str(merged),
         "--name", "base", "--name", "ckpt2", "--name", "adapter", "--name", "merged",
         "--tasks", "6", "--samples", "2", "--k", "1", "--max-tokens-per-turn", "12",
         "--max-total-tokens", "512", "--out", str(tmp_path / "eval")],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    pass1 = {m["model"]: next(p["pass_at_k"] for p in m["pass_at"] if p["k"] == 1) for m in summary["models"]}
    episodes = {
        name: [json.loads(x) for x in (tmp_path / "eval" / name / "episodes.jsonl").read_text().splitlines()]
        for name in ("adapter", "merged")
    }
    same = sum(
        a["trajectory"]["token_ids"] == b["trajectory"]["token_ids"]
        for a, b in zip(
            sorted(episodes["adapter"], key=lambda e: (e["task_index"], e["sample"])),
            sorted(episodes["merged"], key=lambda e: (e["task_index"], e["sample"])),
            strict=True,
        )
    )
    assert same >= len(episodes["merged"]) - 1, (same, pass1)  # float rounding may flip one sample at most
    assert pass1["adapter"] == pass1["merged"], pass1


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_engine_that_keeps_an_old_adapter_stops_the_lora_run(tiny_model_dir, tmp_path, mode):  # noqa: F811
    """The adapter push is dropped on the engine's side (it keeps serving the adapter of version 0): the
    trainer counts its own pushes, sees the engine still at version 0 after push 1, and stops with the
    reason before a batch from the stale adapter is trained on. In async mode too, where the producer is
    already generating the next batch when the push goes out (the mode in which an adapter that never
    reaches the engine goes unnoticed longest). Full weights take the same check (`push_weights`; its
    batch-side half: tests/train/test_stopping.py)."""
    proc = train_with_a_push_that_never_lands(
        {"path": str(tiny_model_dir), "lora": {"rank": 8}},
        tmp_path / "stale",
        "VLLMPolicy.load_adapter = lambda self, files, *, version=None: self.version",
        asynchronous={"mode": mode, "max_staleness": 1},
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: the engine reports weight version(s) [0] after push 1" in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "stale" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_with_merged_pushes_keeps_the_engine_on_the_trainer_s_policy(tiny_model_dir, tmp_path):  # noqa: F811
    """`model.lora.push: merged`: the engine takes base + adapter as full weights each step, and samples from
    exactly the trainer's LoRA policy (the mismatch stays at float rounding, the versions count the pushes)."""
    cfg = coin_config(
        {"path": str(tiny_model_dir), "lora": {"rank": 8, "alpha": 16, "push": "merged"}},
        tmp_path / "merged",
        steps=2,
        lr=1e-2,
    )
    rows = run(cfg, 1)
    assert [r["policy/version"] for r in rows] == [1.0, 2.0]
    trained = [r for r in rows if "losses/policy_loss" in r]
    assert trained and all(r["mismatch/logprob_abs_diff"] < 1e-3 for r in trained), rows
    assert (tmp_path / "merged" / "final" / "adapter_model.safetensors").is_file()


def test_adamw_takes_betas_and_eps_from_the_config(tiny_model_dir, one_rank_group, tmp_path) -> None:  # noqa: F811
    from agentrl.train.trainer import _load_models

    cfg = coin_config(tiny_model_dir, tmp_path, steps=1, lr=3e-5)
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"betas": (0.8, 0.99), "eps": 1e-5})})
    _, opt, _, _ = _load_models(cfg, one_rank_group)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"]) == (3e-5, (0.8, 0.99), 1e-5)
    for bad, said in (("optim.eps=0", "eps"), ("optim.betas=[0.9,1.0]", "betas must be in")):
        with pytest.raises(ConfigError, match=said):
            load_config(ROOT / "examples" / "calc_grpo.yaml", [bad])
