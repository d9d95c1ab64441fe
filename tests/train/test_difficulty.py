"""Difficulty that rises with the policy: the level moves with what the probes find, by hand."""

from __future__ import annotations

import json

import pytest

import agentrl
from agentrl.core.errors import UserError
from agentrl.envs.calc import CalcTaskGenerator
from agentrl.envs.calc_levels import LeveledCalcTasks
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.curriculum import (
    Curriculum,
    CurriculumConfig,
    DynamicBatch,
    LeveledCurriculum,
    LeveledTaskGenerator,
    build_curriculum,
)
from tests.train.test_curriculum import traj


def group(task_id: str, successes: int, n: int = 8) -> list[Trajectory]:
    return [traj(task_id, f"{task_id}#g", float(i < successes)) for i in range(n)]


def adaptive(**difficulty) -> LeveledCurriculum:
    # Probes only: every draw is a new task at the current level, so each test drives the level alone.
    cfg = CurriculumConfig(probe_prob=1.0, reprobe_prob=0.0, difficulty={"adaptive": True, **difficulty})
    return LeveledCurriculum(LeveledCalcTasks(seed=0), cfg)


def probe_round(cur: LeveledCurriculum, successes: list[int]) -> list[int]:
    """Probe len(successes) tasks, hand back one group each with those successes of 8; the probes' levels."""
    draws = cur.sample(len(successes))
    assert all(d.kind == "probe" for d in draws)
    for d, s in zip(draws, successes, strict=True):
        cur.update(group(d.task_id, s))
    return [d.task.metadata["level"] for d in draws]


def test_probes_come_from_the_current_level():
    cur = adaptive(start_level=2)
    draws = cur.sample(5)
    assert {d.task.metadata["level"] for d in draws} == {2}
    assert len({d.task_id for d in draws}) == 5


def test_probes_that_pass_too_often_move_the_level_up_once_the_window_is_full():
    # target 0.5, tolerance 0.15: up above a mean pass rate of 0.65, down below 0.35.
    cur = adaptive(min_probes=4)
    probe_round(cur, [8, 8, 8])
    assert cur.level == 0  # 3 probes judged: the window of 4 is not full yet
    probe_round(cur, [0])
    assert cur.level == 1  # mean (1 + 1 + 1 + 0) / 4 = 0.75 > 0.65
    assert cur.moves == [{"probes": 4, "level": 1}] and len(cur.window) == 0  # the window starts over
    assert probe_round(cur, [4]) == [1]  # the next probes are at the new level


def test_tasks_mostly_passed_but_rarely_all_passed_still_move_the_level_up():
    # 7 of 8 everywhere: every probe is in the 0.2-0.8 band by its posterior mean (0.8), yet the level
    # is too easy (mean pass rate 0.875): the rule reads pass rates, not band membership.
    cur = adaptive(min_probes=6)
    probe_round(cur, [7] * 6)
    assert cur.level == 1


def test_a_level_near_the_target_holds():
    cur = adaptive(start_level=2, min_probes=6)
    probe_round(cur, [8, 0, 4, 4, 8, 0, 4, 4])  # window means 0.5, ~0.42, 0.5
    assert cur.level == 2 and cur.moves == []


def test_the_tolerance_edges_are_exclusive():
    cur = adaptive(min_probes=4, tolerance=0.25)  # up only above 0.75
    probe_round(cur, [8, 8, 8, 0])  # mean exactly 0.75
    assert cur.level == 0


def test_probes_that_pass_too_rarely_move_the_level_down_but_not_below_zero():
    cur = adaptive(start_level=3, min_probes=3)
    probe_round(cur, [0, 1, 2])  # mean 0.125 < 0.35
    assert cur.level == 2
    probe_round(cur, [0, 0, 0])
    assert cur.level == 1
    floor = adaptive(start_level=0, min_probes=2)
    probe_round(floor, [0, 0, 0, 0])
    assert floor.level == 0 and floor.moves == []


def test_the_top_level_is_a_ceiling():
    cur = adaptive(start_level=5, min_probes=2)
    probe_round(cur, [8, 8, 8])
    assert cur.level == 5 and cur.moves == []


def test_probes_drawn_before_a_move_do_not_count_at_the_new_level():
    cur = adaptive(min_probes=2)
    draws = cur.sample(4)  # all at level 0
    cur.update(group(draws[0].task_id, 8))
    cur.update(group(draws[1].task_id, 8))
    assert cur.level == 1
    cur.update(group(draws[2].task_id, 0))  # level-0 probes answering late: judged, not in the window
    cur.update(group(draws[3].task_id, 0))
    assert cur.level == 1 and len(cur.window) == 0 and cur.judged == 4


def test_a_probe_counts_once_from_its_first_group():
    cur = adaptive(min_probes=2)
    (draw,) = cur.sample(1)
    cur.update(group(draw.task_id, 8))
    cur.update(group(draw.task_id, 8))  # a second group of the same task is band evidence, not a probe
    assert cur.judged == 1 and cur.level == 0


def test_tracked_tasks_of_every_level_stay_in_the_band_draws():
    cfg = CurriculumConfig(probe_prob=0.0, reprobe_prob=0.0, min_band_tasks=1, difficulty={"adaptive": True})
    cur = LeveledCurriculum(LeveledCalcTasks(seed=0), cfg)
    first = cur.sample(2)  # band empty: probes at level 0
    for d in first:
        cur.update(group(d.task_id, 4))
    cur.level = 3
    again = cur.sample(2)
    assert {d.kind for d in again} == {"band"} and {d.task_id for d in again} == {d.task_id for d in first}
    assert {d.task.metadata["level"] for d in again} == {0}  # regenerated from their tracked index


def test_metrics_carry_the_level():
    cur = adaptive(start_level=1)
    m = cur.metrics().as_dict()
    assert m["curriculum/level"] == 1 and m["curriculum/level_moves"] == 0


def test_state_dict_round_trip_continues_identically():
    cur = adaptive(min_probes=3)
    probe_round(cur, [8, 8, 8, 4, 0])
    state = json.loads(json.dumps(cur.state_dict()))  # plain JSON
    twin = adaptive(min_probes=3)
    twin.load_state_dict(state)
    assert (twin.level, list(twin.window), twin.moves, twin.judged) == (
        cur.level,
        list(cur.window),
        cur.moves,
        cur.judged,
    )
    assert [d.task_id for d in twin.sample(4)] == [d.task_id for d in cur.sample(4)]
    plain = Curriculum(lambda i: LeveledCalcTasks().generate(i), CurriculumConfig())
    with pytest.raises(
        ValueError, match="state is of the sampler Curriculum, this run's is LeveledCurriculum"
    ):
        twin.load_state_dict(plain.state_dict())


def test_the_config_switch_builds_a_leveled_curriculum_from_an_environment():
    env = agentrl.make("agentrl/calc-levels-v0", backend="local", use_pool=False)
    try:
        cur = build_curriculum(env.tasks, CurriculumConfig(difficulty={"adaptive": True, "start_level": 2}))
        plain = build_curriculum(env.tasks, CurriculumConfig())
    finally:
        env.close()
    assert isinstance(cur, LeveledCurriculum) and cur.level == 2
    assert type(plain) is Curriculum
    assert isinstance(LeveledCalcTasks(), LeveledTaskGenerator)
    assert not isinstance(CalcTaskGenerator(), LeveledTaskGenerator)


def test_a_generator_without_levels_is_one_clear_error():
    cfg = CurriculumConfig(difficulty={"adaptive": True})
    with pytest.raises(UserError, match="needs a task generator with difficulty levels.*calc-levels-v0"):
        build_curriculum(CalcTaskGenerator(), cfg)
    with pytest.raises(UserError, match="start_level is 9, but the task generator has 6 levels"):
        build_curriculum(
            LeveledCalcTasks(), CurriculumConfig(difficulty={"adaptive": True, "start_level": 9})
        )


def test_dynamic_batches_drive_it_like_any_curriculum():
    cur = adaptive(min_probes=4)
    builder = DynamicBatch(cur, batch_groups=4, max_gen_factor=1.0)
    while not builder.done:
        builder.add([group(d.task_id, 8) for d in builder.request()])
    result = builder.result()
    assert result.generated_groups == 4 and result.groups == []  # all-pass groups are dropped
    assert cur.level == 1  # and every one of them was a too-easy probe


def test_the_trainers_task_source_for_calc_levels_steers_levels():
    """`train` builds its curriculum from `agentrl.task_source(cfg.env)`: for calc-levels-v0 that must be
    the leveled generator (not calc-v0's, which the env class inherits), or adaptive difficulty fails."""
    source = agentrl.task_source("agentrl/calc-levels-v0")
    curriculum = build_curriculum(source, CurriculumConfig(difficulty={"adaptive": True}))
    assert isinstance(curriculum, LeveledCurriculum) and curriculum.num_levels == 6
