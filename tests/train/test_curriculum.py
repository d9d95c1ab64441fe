"""Learnability curriculum and DAPO dynamic sampling: arithmetic by hand, statistics with fixed seeds."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
from pydantic import ValidationError

from agentrl.core.task import Task
from agentrl.envs.calc import CalcTaskGenerator
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.curriculum import (
    Curriculum,
    CurriculumConfig,
    DynamicBatch,
    DynamicBatchResult,
    TaskDraw,
    build_curriculum,
    filter_groups,
    group_by_id,
)


def make_task(index: int) -> Task:
    return Task(id=f"sim/{index}", prompt=f"task {index}")


def traj(task_id: str, group_id: str, reward: float, finish_reason: str = "submitted") -> Trajectory:
    return Trajectory(
        task_id=task_id,
        group_id=group_id,
        token_ids=[1, 2],
        loss_mask=[0, 1],
        behavior_logprobs=[0.0, -0.1],
        prompt_len=1,
        reward=reward,
        passed=reward >= 1.0,
        finish_reason=finish_reason,
        policy_version=0,
    )


def group(task_id: str, rewards: list[float], group_id: str | None = None) -> list[Trajectory]:
    gid = group_id or f"{task_id}#{len(rewards)}#{sum(rewards)}"
    return [traj(task_id, gid, r) for r in rewards]


def build_batch(
    cur: Curriculum, generate: Callable[[list[TaskDraw]], list[list[Trajectory]]]
) -> DynamicBatchResult:
    """Drive `DynamicBatch` to the end as the rollout producer does, with a synchronous `generate`."""
    builder = DynamicBatch(cur)
    while not builder.done:
        builder.add(generate(builder.request()))
    return builder.result()


def tracked(cur: Curriculum, n: int) -> list[str]:
    """Probe n fresh tasks (sample() probes while the band is empty) and return their ids."""
    draws = cur.sample(n)
    assert all(d.kind == "probe" for d in draws)
    return [d.task_id for d in draws]


# --- posterior arithmetic -------------------------------------------------------------------


def test_beta_update_arithmetic() -> None:
    cur = Curriculum(make_task, CurriculumConfig(prior_alpha=1.0, prior_beta=1.0))
    (tid,) = tracked(cur, 1)
    assert cur.p_hat(tid) == 0.5  # prior Beta(1, 1)
    # 3 successes, 5 failures: Beta(1 + 3, 1 + 5) = Beta(4, 6), mean 4 / 10 = 0.4
    cur.observe(tid, [1, 1, 0, 0, 0, 1, 0, 0])
    assert cur.posterior(tid) == (4.0, 6.0)
    assert cur.p_hat(tid) == pytest.approx(0.4)
    # 2 more of 2: Beta(6, 6), mean 0.5; counts add up across groups
    cur.observe(tid, [1.0, 1.0])
    assert cur.posterior(tid) == (6.0, 6.0)
    stats = cur.tasks[tid]
    assert (stats.groups, stats.samples) == (2, 10)


def test_prior_and_threshold() -> None:
    # Prior Beta(2, 3); rewards (0.99, 0.5, 1.0) with threshold 1.0 -> 1 success, 2 failures
    # -> Beta(3, 5), mean 3 / 8 = 0.375. With threshold 0.5 -> 3 successes -> Beta(5, 3), mean 0.625.
    for threshold, expected in ((1.0, 3 / 8), (0.5, 5 / 8)):
        cur = Curriculum(
            make_task, CurriculumConfig(prior_alpha=2, prior_beta=3, success_threshold=threshold)
        )
        (tid,) = tracked(cur, 1)
        cur.observe(tid, [0.99, 0.5, 1.0])
        assert cur.p_hat(tid) == pytest.approx(expected)


def test_decay_forgets_old_evidence() -> None:
    # γ = 0.5: after (3 of 8): s = 3, f = 5. After (4 of 4): s = 0.5·3 + 4 = 5.5, f = 0.5·5 + 0 = 2.5
    # posterior Beta(6.5, 3.5), mean 0.65 (without decay: Beta(8, 6), mean 0.5714)
    cur = Curriculum(make_task, CurriculumConfig(decay=0.5))
    (tid,) = tracked(cur, 1)
    cur.observe(tid, [1, 1, 1, 0, 0, 0, 0, 0])
    cur.observe(tid, [1, 1, 1, 1])
    assert cur.posterior(tid) == pytest.approx((6.5, 3.5))
    assert cur.p_hat(tid) == pytest.approx(0.65)


def test_band_membership_is_inclusive_on_the_posterior_mean() -> None:
    cur = Curriculum(make_task, CurriculumConfig())
    assert cur.in_band(0.2) and cur.in_band(0.8) and cur.in_band(0.5)
    assert not cur.in_band(0.19) and not cur.in_band(0.81)
    a, b, c = tracked(cur, 3)
    cur.observe(a, [1] + [0] * 7)  # Beta(2, 8): 0.2 -> in band (edge)
    cur.observe(b, [0] * 8)  # Beta(1, 9): 0.1 -> out
    cur.observe(c, [1] * 8)  # Beta(9, 1): 0.9 -> out
    m = cur.metrics()
    assert (m.num_tracked, m.num_in_band) == (3, 1)
    assert m.band_occupancy == pytest.approx(1 / 3)
    # histogram over 10 bins: 0.1 -> bin 1, 0.2 -> bin 2, 0.9 -> bin 9
    assert m.p_hat_histogram == [0, 1, 1, 0, 0, 0, 0, 0, 0, 1]
    assert m.p_hat_mean == pytest.approx((0.2 + 0.1 + 0.9) / 3)


def test_observe_an_unknown_task_says_what_to_do() -> None:
    cur = Curriculum(make_task)
    with pytest.raises(KeyError, match="only tasks it handed out"):
        cur.observe("nope", [1.0])


def test_update_groups_by_group_id_and_skips_untrainable() -> None:
    cur = Curriculum(make_task)
    a, b = tracked(cur, 2)
    trajs = [traj(a, "g1", 1.0), traj(b, "g2", 0.0), traj(a, "g1", 0.0), traj(a, "g1", 1.0, "env_error")]
    cur.update(trajs)
    # a: rewards (1, 0) -- the env_error one is not evidence -> Beta(2, 2); b: (0) -> Beta(1, 2)
    assert cur.posterior(a) == (2.0, 2.0) and cur.posterior(b) == (1.0, 2.0)
    with pytest.raises(ValueError, match="mixes tasks"):
        cur.update([traj(a, "g9", 1.0), traj(b, "g9", 0.0)])


def test_a_harness_episode_with_several_branches_counts_once() -> None:
    """Branches of one episode (a harness that rewrote its history) repeat its reward: one observation."""
    import dataclasses

    cur = Curriculum(make_task)
    (a,) = tracked(cur, 1)
    passed = traj(a, "g1", 1.0)
    branches = [dataclasses.replace(passed, branch=i, branches=3) for i in range(3)]
    cur.update([*branches, traj(a, "g1", 0.0)])
    # one pass, one fail -> Beta(2, 2); counting every branch would give Beta(4, 2)
    assert cur.posterior(a) == (2.0, 2.0)


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="band_low"):
        CurriculumConfig(band_low=0.9, band_high=0.1)
    with pytest.raises(ValidationError, match="shares of the draws"):
        CurriculumConfig(probe_prob=0.7, reprobe_prob=0.5)
    with pytest.raises(ValidationError):
        CurriculumConfig(bogus=1)
    # every field carries a description (surfaced as CLI help)
    assert all(f.description for f in CurriculumConfig.model_fields.values())


# --- sampling -------------------------------------------------------------------------------


def band_curriculum(**overrides) -> tuple[Curriculum, list[str]]:
    """Three in-band tasks with p̂ = 0.2, 0.5, 0.7 and one out-of-band task (p̂ = 0.1)."""
    cfg = CurriculumConfig(**{"probe_prob": 0.0, "reprobe_prob": 0.0, "min_band_tasks": 1, **overrides})
    cur = Curriculum(make_task, cfg)
    ids = tracked(cur, 4)
    for tid, successes in zip(ids, (1, 4, 6, 0), strict=True):
        cur.observe(tid, [1] * successes + [0] * (8 - successes))  # Beta(1+s, 1+8-s): mean (1+s)/10
    return cur, ids


def test_band_weights_are_proportional_to_p_one_minus_p() -> None:
    # p̂ = (0.2, 0.5, 0.7): p(1-p) = (0.16, 0.25, 0.21), sum 0.62 -> (0.2581, 0.4032, 0.3387).
    # The out-of-band task (p̂ = 0.1) is never drawn with reprobe_prob = 0.
    cur, ids = band_curriculum()
    n = 20_000
    counts = Counter(cur.sample(1)[0].task_id for _ in range(n))
    assert set(counts) == set(ids[:3])
    expected = np.array([0.16, 0.25, 0.21]) / 0.62
    observed = np.array([counts[t] for t in ids[:3]])
    # chi-square goodness of fit, 2 degrees of freedom: 99.9% quantile 13.8
    chi2 = float((((observed - n * expected) ** 2) / (n * expected)).sum())
    assert chi2 < 13.8, (observed / n, expected)


def test_band_draws_within_one_call_are_distinct_and_respect_exclude() -> None:
    cur, ids = band_curriculum()
    draws = cur.sample(3)
    assert sorted(d.task_id for d in draws) == sorted(ids[:3])
    assert all(d.kind == "band" for d in draws)
    # A fourth draw in the same call finds the band empty and probes a new task.
    assert [d.kind for d in cur.sample(4)].count("probe") == 1
    assert all(d.task_id != ids[1] for d in cur.sample(2, exclude=[ids[1]]))


def test_reprobe_rate() -> None:
    # probe 0.2, reprobe 0.3: over many single draws ~20% probes, ~30% re-probes of the out-of-band
    # task, ~50% band. Binomial std at n = 5000 is <= 0.0071; allow 4 std.
    cur, ids = band_curriculum(probe_prob=0.2, reprobe_prob=0.3)
    n = 5000
    draws = [cur.sample(1)[0] for _ in range(n)]
    kinds = Counter(d.kind for d in draws)
    assert kinds["probe"] / n == pytest.approx(0.2, abs=0.03)
    assert kinds["reprobe"] / n == pytest.approx(0.3, abs=0.03)
    assert kinds["band"] / n == pytest.approx(0.5, abs=0.03)
    assert {d.task_id for d in draws if d.kind == "reprobe"} == {ids[3]}
    assert all(d.p_hat == pytest.approx(0.1) for d in draws if d.kind == "reprobe")


def test_too_few_band_tasks_means_probing() -> None:
    # min_band_tasks = 5 but only 3 tasks are in band: every non-reprobe draw is a probe.
    cur, _ = band_curriculum(min_band_tasks=5)
    assert {d.kind for d in cur.sample(20)} == {"probe"}


def test_thompson_sampling_is_deterministic_and_uses_posterior_draws() -> None:
    def run(seed: int) -> list[tuple[str, float | None]]:
        cur, _ = band_curriculum(sampling="thompson", seed=seed)
        return [(d.task_id, d.p_hat) for _ in range(50) for d in cur.sample(2)]

    first = run(3)
    assert first == run(3)
    assert first != run(4)
    # The p̂ a Thompson draw reports is a posterior sample, not the mean (0.2, 0.5 or 0.7).
    assert any(p not in (None, 0.2, 0.5, 0.7) for _, p in first)


def test_build_curriculum_over_the_environment_generator() -> None:
    gen = CalcTaskGenerator(seed=1)
    cur = build_curriculum(gen, CurriculumConfig(first_index=5), split="train")
    draw = cur.sample(1)[0]
    assert isinstance(draw, TaskDraw) and draw.index == 5
    assert draw.task == gen.generate(5, "train")


# --- dynamic sampling -----------------------------------------------------------------------


def test_filter_groups_drops_zero_variance_groups() -> None:
    groups = [
        group("a", [1, 1, 1]),
        group("b", [0, 0]),
        group("c", [0, 1]),
        group("d", [0.5]),
        group("e", [0.3, 0.3]),
    ]
    kept, dropped = filter_groups(groups)
    assert [g[0].task_id for g in kept] == ["c"]
    assert [g[0].task_id for g in dropped] == ["a", "b", "d", "e"]


def test_group_by_id_keeps_first_appearance_order() -> None:
    trajs = [traj("a", "g2", 1), traj("b", "g1", 0), traj("a", "g2", 0)]
    assert [[t.reward for t in g] for g in group_by_id(trajs)] == [[1, 0], [0]]


def test_refill_is_bounded_by_max_gen_factor() -> None:
    # Every group is all-fail: nothing is ever kept. batch_groups 4 × factor 2.5 = 10 groups at most.
    cur = Curriculum(make_task, CurriculumConfig(batch_groups=4, max_gen_factor=2.5))
    calls: list[int] = []

    def generate(draws: list[TaskDraw]) -> list[list[Trajectory]]:
        calls.append(len(draws))
        return [group(d.task_id, [0.0] * 4) for d in draws]

    result = build_batch(cur, generate)
    # round 1 asks for 4; nothing kept (keep rate 0) -> round 2 asks for the whole remaining budget 6
    assert calls == [4, 6]
    assert (result.requested_groups, result.generated_groups, len(result.groups)) == (10, 10, 0)
    assert not result.full and result.refill_cost == 10.0
    m = result.metrics()
    assert (m.all_fail_fraction, m.all_pass_fraction, m.dropped_groups) == (1.0, 0.0, 10)


def test_refill_requests_the_shortfall_scaled_by_the_keep_rate() -> None:
    # Alternate informative / all-pass groups: keep rate 1/2.
    # round 1: 4 requested, 2 kept -> need 2, keep rate 0.5 -> ask ceil(2 / 0.5) = 4 (budget 12 - 4 = 8)
    # round 2: 2 more kept -> full with 8 generated: refill cost 8 / 4 = 2
    cur = Curriculum(make_task, CurriculumConfig(batch_groups=4, max_gen_factor=3.0))
    builder = DynamicBatch(cur)
    sizes = []
    while not builder.done:
        draws = builder.request()
        sizes.append(len(draws))
        builder.add(group(d.task_id, [0.0, 1.0] if i % 2 == 0 else [1.0, 1.0]) for i, d in enumerate(draws))
    result = builder.result()
    assert sizes == [4, 4]
    assert result.full and len(result.groups) == 4 and result.refill_cost == 2.0
    assert result.all_pass_groups == 4 and len(result.dropped) == 4
    assert builder.request() == []
    # The step's metrics: all-pass groups are counted among the generated ones, not the trained ones.
    from agentrl.train.producer import batch_metrics

    m = batch_metrics(result, cur)
    assert m["batch/groups"] == 4 and m["batch/generated_groups"] == 8 and m["batch/all_pass_groups"] == 4
    assert m["batch/mixed_groups"] == 4 and m["batch/all_fail_groups"] == m["batch/empty_groups"] == 0
    parts = ("all_pass_groups", "all_fail_groups", "mixed_groups", "empty_groups")
    assert sum(m[f"batch/{k}"] for k in parts) == m["batch/generated_groups"]
    # every group, dropped ones included, updated the curriculum
    assert sum(s.groups for s in cur.tasks.values()) == 8


def test_without_dynamic_sampling_every_group_is_kept_and_nothing_refilled() -> None:
    # Uniform GRPO: the batch is the first batch_groups groups, zero-variance ones included.
    cur = Curriculum(make_task, CurriculumConfig(batch_groups=4, dynamic_sampling=False))
    calls: list[int] = []

    def generate(draws: list[TaskDraw]) -> list[list[Trajectory]]:
        calls.append(len(draws))
        return [group(d.task_id, [1.0, 1.0] if i % 2 else [0.0, 1.0]) for i, d in enumerate(draws)]

    result = build_batch(cur, generate)
    assert calls == [4] and result.full and result.refill_cost == 1.0
    assert len(result.groups) == 4 and result.dropped == [] and result.all_pass_groups == 2


def test_surplus_informative_groups_are_cut_to_batch_groups_and_untrainable_removed() -> None:
    cur = Curriculum(make_task, CurriculumConfig(batch_groups=2))
    builder = DynamicBatch(cur)
    draws = builder.request()
    groups = [group(d.task_id, [0.0, 1.0]) for d in draws] + [group(draws[0].task_id, [1.0, 0.0], "extra")]
    groups[0].append(traj(draws[0].task_id, groups[0][0].group_id, 1.0, "timeout"))
    builder.add(groups)
    result = builder.result()
    assert len(result.groups) == 2 and len(result.surplus) == 1
    assert result.untrainable_trajectories == 1
    assert all(t.trainable for t in result.trajectories)


# --- state ----------------------------------------------------------------------------------


class Simulator:
    """Tasks with known true pass rates; each group is 8 Bernoulli(p) rewards from a seeded rng."""

    LEVELS = (0.0, 0.0, 0.02, 0.3, 0.5, 0.7, 0.98, 1.0, 1.0)  # 3 of 9 in the band [0.2, 0.8]

    def __init__(self, seed: int, group_size: int = 8) -> None:
        self.rng = np.random.default_rng(seed)
        self.group_size = group_size
        self.counter = 0

    @classmethod
    def true_p(cls, task_id: str) -> float:
        index = int(task_id.split("/")[1])
        return cls.LEVELS[(index * 7919) % len(cls.LEVELS)]

    def generate(self, draws: list[TaskDraw]) -> list[list[Trajectory]]:
        out = []
        for d in draws:
            self.counter += 1
            rewards = (self.rng.random(self.group_size) < self.true_p(d.task_id)).astype(float)
            out.append(group(d.task_id, list(rewards), f"grp{self.counter}"))
        return out


def test_state_dict_round_trip_gives_identical_subsequent_sampling() -> None:
    cfg = CurriculumConfig(batch_groups=6, seed=11)
    cur, sim = Curriculum(make_task, cfg), Simulator(seed=5)
    for _ in range(5):
        build_batch(cur, sim.generate)
    state = json.loads(json.dumps(cur.state_dict()))  # plain JSON
    sim_state = sim.rng.bit_generator.state

    restored = Curriculum(make_task, cfg)
    restored.load_state_dict(state)
    sim2 = Simulator(seed=0)
    sim2.rng.bit_generator.state = sim_state
    sim2.counter = sim.counter

    def trace(c: Curriculum, s: Simulator) -> list[tuple[str, str]]:
        out = []
        for _ in range(5):
            r = build_batch(c, s.generate)
            out += [(g[0].task_id, g[0].group_id) for g in r.groups]
            out += [(k, str(v)) for k, v in sorted(r.draw_counts.items())]
        return out

    assert trace(cur, sim) == trace(restored, sim2)
    assert cur.state_dict() == restored.state_dict()


def test_load_state_dict_rejects_an_unknown_version() -> None:
    cur = Curriculum(make_task)
    with pytest.raises(ValueError, match="version"):
        cur.load_state_dict({"version": 99})


def test_simulation_concentrates_on_band_tasks() -> None:
    # A third of the generator's tasks have a true p in the band. After a warm-up the curriculum's
    # draws should go to band tasks far more often than a third of the time, the kept groups come
    # cheaply, and the tasks it believes in band are mostly truly in band.
    cfg = CurriculumConfig(batch_groups=8, max_gen_factor=3.0, probe_prob=0.15, reprobe_prob=0.05, seed=0)
    cur, sim = Curriculum(make_task, cfg), Simulator(seed=1)
    late_draws: list[float] = []
    costs = []
    for step in range(40):
        builder = DynamicBatch(cur)
        while not builder.done:
            draws = builder.request()
            if step >= 20:
                late_draws += [Simulator.true_p(d.task_id) for d in draws]
            builder.add(sim.generate(draws))
        result = builder.result()
        if step >= 20:
            costs.append(result.refill_cost)
    in_band_share = float(np.mean([0.2 <= p <= 0.8 for p in late_draws]))
    assert in_band_share > 0.7, in_band_share  # uniform sampling would give 1/3
    assert float(np.mean(costs)) < 1.6  # uniform sampling wastes ~2/3 of groups: cost ~2.6 (capped at 3)
    believed = [s.task_id for s in cur.tasks.values() if s.observed and cur.in_band(cur.p_hat(s.task_id))]
    truly = np.mean([0.2 <= Simulator.true_p(t) <= 0.8 for t in believed])
    assert truly > 0.9, truly
    m = cur.metrics()
    assert 0 < m.band_occupancy < 1 and sum(m.p_hat_histogram) == m.num_tracked
    b = result.metrics()
    assert b.kept_groups == 8 and math.isclose(b.refill_cost, result.refill_cost)


def test_reprobing_finds_tasks_that_became_learnable() -> None:
    # A task that was all-fail becomes p = 0.5 (the policy learned). Only re-probes can notice:
    # with reprobe_prob > 0 the task comes back into the band; with 0 it never does.
    def run(reprobe_prob: float) -> bool:
        cfg = CurriculumConfig(probe_prob=0.0, reprobe_prob=reprobe_prob, min_band_tasks=1, decay=0.5, seed=2)
        cur = Curriculum(make_task, cfg)
        hard, mid = tracked(cur, 2)
        cur.observe(hard, [0] * 8)
        cur.observe(mid, [0, 1] * 4)
        rng = np.random.default_rng(0)
        for _ in range(100):
            for d in cur.sample(1):
                cur.observe(d.task_id, list((rng.random(8) < 0.5).astype(float)))
        return cur.in_band(cur.p_hat(hard))

    assert run(0.3) is True
    assert run(0.0) is False


def test_min_band_tasks_gate_holds_through_reprobes_in_one_call() -> None:
    # 3 band tasks < min_band_tasks 5, one out-of-band task, reprobe_prob 0.5: after the single
    # re-probe is used up, the remaining draws must still be probes, never band draws.
    cur, ids = band_curriculum(min_band_tasks=5, reprobe_prob=0.5)
    kinds = Counter(d.kind for d in cur.sample(40))
    assert kinds["band"] == 0 and kinds["reprobe"] == 1 and kinds["probe"] == 39


def test_an_exhausted_pool_is_said_once_with_what_to_do(capsys):
    """A finite pool every task of which is solved always or never: nothing left in the band. The batch's
    metrics say so, and the trainer warns once (a run that trains on with no warning wastes its steps)."""
    from types import SimpleNamespace

    from agentrl.train.producer import batch_metrics
    from agentrl.train.trainer import _note_exhausted_pool

    cur = Curriculum(make_task, CurriculumConfig(seed=0, probe_prob=1.0, reprobe_prob=0.0), pool_size=3)
    draws = cur.sample(3)
    assert cur.exhausted and cur.pool_state()["curriculum/tasks_above_band"] == 0
    for i, d in enumerate(draws):
        cur.update(group(d.task_id, [1.0] * 8 if i < 2 else [0.0] * 8))
    state = cur.pool_state()
    assert state == {
        "curriculum/pool_exhausted": 1.0,
        "curriculum/tasks_above_band": 2.0,
        "curriculum/tasks_below_band": 1.0,
    }
    solved = {d.task_id: float(i < 2) for i, d in enumerate(draws)}
    batch = build_batch(cur, lambda ds: [group(d.task_id, [solved[d.task_id]] * 4) for d in ds])
    metrics = batch_metrics(batch, cur)
    assert metrics["curriculum/pool_exhausted"] == 1.0 and metrics["curriculum/num_in_band"] == 0
    run = SimpleNamespace(cfg=SimpleNamespace(env="mylab/Units-v0"), failures_said=set())
    _note_exhausted_pool(run, metrics)
    _note_exhausted_pool(run, metrics)
    err = capsys.readouterr().err
    assert err.count("warning: the curriculum's pool is exhausted") == 1
    assert "(2 solved always, 1 never)" in err and "Add tasks" in err and "harder" in err
    # A generator never runs out; a pool with a task in the band is not exhausted of learning.
    assert Curriculum(make_task, CurriculumConfig(seed=0)).pool_state()["curriculum/pool_exhausted"] == 0.0
    _note_exhausted_pool(
        run := SimpleNamespace(cfg=run.cfg, failures_said=set()), {**metrics, "curriculum/num_in_band": 1}
    )
    assert capsys.readouterr().err == ""
