"""The samplers behind `curriculum.sampler`: the registry (built-ins, entry points, module:attribute),
each built-in's draws, metrics and state, cheaper probes and probes chosen by a metadata prior."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from pydantic import ValidationError

from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.train.curriculum import (
    Curriculum,
    CurriculumConfig,
    DapoSampler,
    DifficultyPools,
    DynamicBatch,
    MgpoSampler,
    UniformSampler,
    available_samplers,
    build_curriculum,
    load_sampler,
    metrics_of,
)
from tests.train.test_curriculum import build_batch, group, make_task


def pool(n: int) -> list[Task]:
    return [make_task(i) for i in range(n)]


def config(**kw) -> CurriculumConfig:
    return CurriculumConfig(**kw)


# --- the registry ------------------------------------------------------------------------------


def test_builtin_names_build_their_classes() -> None:
    assert available_samplers()[:6] == ["band", "uniform", "dapo", "pools", "mgpo", "leveled"]
    for name, cls in [("band", Curriculum), ("uniform", UniformSampler), ("pools", DifficultyPools)]:
        assert type(build_curriculum(pool(5), config(sampler=name))) is cls


def test_an_unknown_sampler_is_one_line_naming_the_choices() -> None:
    with pytest.raises(UserError) as info:
        load_sampler("banana")
    message = str(info.value)
    assert "\n" not in message and "'banana' is not a sampler" in message and "dapo, pools" in message
    with pytest.raises(ValidationError, match="'banana' is not a sampler; available: band, uniform"):
        config(sampler="banana")  # the config says so before anything starts


def test_options_the_sampler_does_not_take_are_named() -> None:
    with pytest.raises(UserError, match=r"does not take curriculum.sampler_options \['wobble'\]"):
        build_curriculum(pool(5), config(sampler="uniform", sampler_options={"wobble": 1}))
    with pytest.raises(UserError, match="hard_threshold < easy_threshold"):
        build_curriculum(pool(5), config(sampler="pools", sampler_options={"easy_threshold": 0.0}))


def test_adaptive_difficulty_is_the_leveled_sampler_and_excludes_others() -> None:
    with pytest.raises(ValidationError, match="cannot be combined with sampler 'uniform'"):
        config(sampler="uniform", difficulty={"adaptive": True})


PLUGIN = '''
from agentrl.train.curriculum import Curriculum, TaskDraw


class Newest(Curriculum):
    """Always the newest tasks: a sampler as a third party writes one."""

    dynamic_sampling = False

    def __init__(self, task_factory, config=None, pool_size=None, *, tag="x"):
        super().__init__(task_factory, config, pool_size)
        self.tag = tag

    def sample(self, n, exclude=()):
        return [d for d in (self._probe() for _ in range(n)) if d is not None]

    def metrics(self):
        return {"newest_tracked": len(self.tasks), "tag_" + self.tag: 1}

    def group_weight(self, group):
        return 0.5
'''


def install_plugin(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package `newest_sampler` with an `agentrl.samplers` entry point, importable from `root`."""
    (root / "newest_sampler.py").write_text(textwrap.dedent(PLUGIN))
    info = root / "newest_sampler-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: newest-sampler\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[agentrl.samplers]\nnewest = newest_sampler:Newest\n")
    monkeypatch.syspath_prepend(str(root))
    # Entry points are listed once per process: this test's copy of the samplers lists them again.
    from agentrl.train.curriculum import names

    monkeypatch.setattr(names, "SAMPLERS", names.SAMPLERS.copy())
    names.SAMPLERS.rescan()
    # Processes it starts (the trainer's ranks) find it too.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))


def test_a_sampler_registered_by_entry_point_is_found_built_and_logged(tmp_path, monkeypatch) -> None:
    install_plugin(tmp_path, monkeypatch)
    assert "newest" in available_samplers()
    sampler = build_curriculum(pool(6), config(sampler="newest", sampler_options={"tag": "t"}))
    assert type(sampler).__name__ == "Newest" and sampler.tag == "t"
    result = build_batch(sampler, lambda draws: [group(d.task_id, [1.0, 1.0]) for d in draws])
    assert len(result.groups) == 6  # its own choice: zero-variance groups kept
    assert metrics_of(sampler) == {"curriculum/newest_tracked": 6, "curriculum/tag_t": 1}
    sys.modules.pop("newest_sampler", None)


def test_module_attribute_names_a_sampler_too(tmp_path, monkeypatch) -> None:
    install_plugin(tmp_path, monkeypatch)
    assert type(build_curriculum(pool(3), config(sampler="newest_sampler:Newest"))).__name__ == "Newest"
    with pytest.raises(UserError, match="cannot load 'newest_sampler:Oldest'"):
        load_sampler("newest_sampler:Oldest")
    sys.modules.pop("newest_sampler", None)


# --- uniform and dapo --------------------------------------------------------------------------


def test_uniform_draws_distinct_tasks_per_call_with_replacement_across_calls() -> None:
    sampler = build_curriculum(pool(10), config(sampler="uniform", seed=3))
    seen: Counter[str] = Counter()
    for _ in range(50):
        draws = sampler.sample(4)
        assert len({d.task_id for d in draws}) == 4
        seen.update(d.task_id for d in draws)
        sampler.update([t for d in draws for t in group(d.task_id, [0.0, 0.0])])
    assert len(seen) == 10 and min(seen.values()) >= 10  # every task, about 20 times each
    kinds = Counter(d.kind for d in sampler.sample(10))
    assert kinds == {"revisit": 10}  # known tasks are drawn again, whatever their estimate (all 0 here)
    assert [d.task_id for d in sampler.sample(10, exclude=["sim/0", "sim/1"])].count("sim/0") == 0
    assert len(sampler.sample(20)) == 10  # a pool of 10 has 10 distinct tasks


def test_uniform_keeps_zero_variance_groups_and_dapo_drops_them() -> None:
    def all_fail(draws):
        return [group(d.task_id, [0.0, 0.0]) for d in draws]

    uniform = build_batch(build_curriculum(pool(20), config(sampler="uniform", batch_groups=4)), all_fail)
    dapo = build_batch(build_curriculum(pool(20), config(sampler="dapo", batch_groups=4)), all_fail)
    assert (len(uniform.groups), uniform.generated_groups) == (4, 4)
    assert (len(dapo.groups), dapo.generated_groups) == (0, 12)  # refilled up to max_gen_factor x 4
    forced = build_curriculum(pool(20), config(sampler="dapo", batch_groups=4, dynamic_sampling=False))
    assert len(build_batch(forced, all_fail).groups) == 4  # the config's explicit choice wins
    assert isinstance(build_curriculum(pool(3), config(sampler="dapo")), DapoSampler)


def test_uniform_over_a_generator_probes_new_tasks() -> None:
    from agentrl.envs.calc import CalcTaskGenerator

    sampler = build_curriculum(CalcTaskGenerator(seed=0), config(sampler="uniform"))
    draws = sampler.sample(5)
    assert [d.kind for d in draws] == ["probe"] * 5 and len({d.task_id for d in draws}) == 5


# --- difficulty pools -------------------------------------------------------------------------


def pools_sampler(**options) -> DifficultyPools:
    sampler = build_curriculum(pool(12), config(sampler="pools", sampler_options=options, seed=1))
    first = sampler.sample(12)  # every task tracked
    assert len(first) == 12
    for d in first:
        i = d.index
        rewards = [1.0, 1.0] if i < 4 else [0.0, 0.0] if i < 8 else [1.0, 0.0]
        sampler.update(group(d.task_id, rewards))
    return sampler


def test_pools_sort_tasks_by_their_last_group_and_draw_by_the_shares() -> None:
    sampler = pools_sampler(easy_fraction=0.0, hard_fraction=0.0)
    assert {sampler.pool_of(f"sim/{i}") for i in range(4)} == {"easy"}
    assert {sampler.pool_of(f"sim/{i}") for i in range(4, 8)} == {"hard"}
    m = metrics_of(sampler)
    assert (m["curriculum/easy_tasks"], m["curriculum/hard_tasks"], m["curriculum/normal_tasks"]) == (4, 4, 4)
    for _ in range(20):  # no share for easy or hard: only the four normal tasks come back
        assert {d.index for d in sampler.sample(3)} <= {8, 9, 10, 11}
    easy = pools_sampler(easy_fraction=1.0, hard_fraction=0.0)
    assert {d.index for d in easy.sample(4)} == {0, 1, 2, 3}
    # The easy pool exhausted within the call: the rest of the draws are normal tasks, never hard ones.
    drawn = {d.index for d in easy.sample(6)}
    assert len(drawn) == 6 and {0, 1, 2, 3} <= drawn and len(drawn & {8, 9, 10, 11}) == 2
    mixed = pools_sampler(easy_fraction=0.3, hard_fraction=0.3)
    drawn = Counter(mixed.pool_of(d.task_id) for _ in range(300) for d in mixed.sample(1))
    assert 60 <= drawn["easy"] <= 120 and 60 <= drawn["hard"] <= 120 and 90 <= drawn["normal"] <= 150


def test_pools_state_round_trips_and_a_task_moves_pool_with_its_last_group() -> None:
    sampler = pools_sampler()
    twin = build_curriculum(
        pool(12),
        config(sampler="pools", sampler_options={"easy_fraction": 0.1, "hard_fraction": 0.1}, seed=1),
    )
    twin.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert [d.task_id for d in twin.sample(5)] == [d.task_id for d in sampler.sample(5)]
    sampler.update(group("sim/0", [0.0, 1.0]))  # was easy; its last group split
    assert sampler.pool_of("sim/0") == "normal"
    with pytest.raises(ValueError, match="state is of the sampler DifficultyPools, this run's is Curriculum"):
        build_curriculum(pool(12)).load_state_dict(sampler.state_dict())


# --- mgpo ---------------------------------------------------------------------------------------


def test_mgpo_weights_a_group_by_how_close_its_pass_rate_is_to_one_half() -> None:
    sampler = build_curriculum(pool(4), config(sampler="mgpo", sampler_options={"strength": 2.0}))
    assert isinstance(sampler, MgpoSampler)
    assert sampler.group_weight(group("sim/0", [1.0, 0.0])) == pytest.approx(1.0)
    assert sampler.group_weight(group("sim/0", [0.0, 0.0, 0.0, 0.0])) == pytest.approx(0.25)  # 2^-2
    kl = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert sampler.group_weight(group("sim/0", [1.0, 0.0, 0.0, 0.0])) == pytest.approx(math.exp(-2 * kl))
    assert Curriculum(make_task).group_weight(group("sim/0", [1.0, 1.0])) == 1.0


def test_the_producer_puts_the_samplers_weight_on_every_trajectory_of_a_trained_group() -> None:
    from agentrl.train.config import TrainConfig
    from agentrl.train.producer import RolloutProducer

    class Scripted(RolloutProducer):
        def groups(self, draws):  # type: ignore[override]
            return [group(d.task_id, [1.0, 0.0, 0.0, 0.0] if d.index % 2 else [1.0, 0.0]) for d in draws]

    cfg = TrainConfig(model="m", curriculum={"sampler": "mgpo", "batch_groups": 4})
    sampler = build_curriculum(pool(8), cfg.curriculum)
    batch = Scripted(cfg, policy=None).batch(sampler)
    quarter = sampler.group_weight(group("x", [1.0, 0.0, 0.0, 0.0]))
    assert quarter < 1.0 and len(batch.result.groups) == 4
    assert sorted({t.loss_weight for g in batch.result.groups for t in g}) == [quarter, 1.0]
    for g in batch.result.groups:
        assert {t.loss_weight for t in g} == {sampler.group_weight(g)}
    assert 0.0 < batch.metrics["curriculum/loss_weight_mean"] <= 1.0


# --- cheaper probes and priors ------------------------------------------------------------------


def test_probes_run_a_smaller_group_and_a_split_probe_group_trains() -> None:
    cfg = config(probe_group_size=2, batch_groups=2, min_band_tasks=1)
    sampler = build_curriculum(pool(20), cfg)
    sizes: list[int | None] = []

    def play(draws):
        sizes.extend(d.group_size for d in draws)
        return [group(d.task_id, [1.0, 0.0][: d.group_size or 8]) for d in draws]

    result = build_batch(sampler, play)
    assert set(sizes) == {2} and len(result.groups) == 2 and all(len(g) == 2 for g in result.groups)
    band = [d for d in sampler.sample(6) if d.kind == "band"]
    assert band and all(d.group_size is None for d in band)  # known tasks get the full group


def leveled_pool() -> list[Task]:
    """30 tasks, levels 0, 1, 2 in turn: 0 always solved, 1 half the time, 2 never (in `solve`)."""
    return [Task(id=f"lv/{i}", prompt=str(i), metadata={"level": i % 3}) for i in range(30)]


def solve(task_id: str) -> list[float]:
    level = int(task_id.split("/")[1]) % 3
    return [[1.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 4][level]


def test_a_metadata_prior_steers_probes_to_the_level_in_the_band() -> None:
    cfg = config(prior_key="level", probe_candidates=6, probe_prob=1.0, reprobe_prob=0.0, seed=0)
    sampler = build_curriculum(leveled_pool(), cfg)
    levels = []
    for _ in range(8):
        draws = sampler.sample(1)
        levels += [d.task.metadata["level"] for d in draws]
        for d in draws:
            sampler.update(group(d.task_id, solve(d.task_id)))
    # Each level is tried once while unknown; after that the probes stay at level 1.
    assert sorted(levels[:3]) == [0, 1, 2] and set(levels[3:]) == {1}
    assert sampler.prior(Task(id="new", prompt="", metadata={"level": 2})) < 0.2
    # The candidates a probe looked at and left are kept (and checkpointed) for later probes.
    twin = build_curriculum(leveled_pool(), cfg)
    twin.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
    assert [d.task_id for d in twin.sample(3)] == [d.task_id for d in sampler.sample(3)]


def test_without_a_prior_key_probes_take_the_next_task_in_order() -> None:
    a = build_curriculum(leveled_pool(), config(probe_prob=1.0, reprobe_prob=0.0))
    b = build_curriculum(leveled_pool(), config(probe_prob=1.0, reprobe_prob=0.0, probe_candidates=6))
    assert [d.task_id for d in a.sample(10)] == [d.task_id for d in b.sample(10)]


def test_a_finite_pool_is_probed_to_the_end_with_candidates_pending() -> None:
    sampler = build_curriculum(
        pool(7), config(prior_key="level", probe_candidates=4, probe_prob=1.0, reprobe_prob=0.0)
    )
    ids = [d.task_id for _ in range(7) for d in sampler.sample(1)]
    assert sorted(ids) == sorted(f"sim/{i}" for i in range(7)) and sampler.exhausted
    batch = DynamicBatch(sampler, batch_groups=2)
    assert len(batch.request()) == 2  # then the tracked tasks are drawn again
