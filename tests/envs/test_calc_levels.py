"""`agentrl/calc-levels-v0`: levels as a pure function of the index, a ladder that lengthens, the oracle solves it."""

from __future__ import annotations

import re
from collections import Counter

import pytest

import agentrl
from agentrl.envs.calc_levels import LADDER, LeveledCalcTasks

from .conftest import oracle_rewards


def operations(expression: str) -> int:
    return len(re.findall(r" [-+*] ", expression))


def test_a_task_is_a_pure_function_of_seed_split_index_and_level():
    g = LeveledCalcTasks(seed=0)
    assert g.generate_at(7, "train", 3) == LeveledCalcTasks(seed=0).generate_at(7, "train", 3)
    assert g.generate_at(7, "train", 3) != LeveledCalcTasks(seed=1).generate_at(7, "train", 3)
    assert g.generate_at(7, "train", 3).prompt != g.generate_at(7, "test", 3).prompt


def test_the_mixed_pool_is_the_leveled_tasks_at_each_index_s_own_level():
    g = LeveledCalcTasks(seed=0)
    for i in range(40):
        task = g.generate(i, "train")
        assert task == g.generate_at(i, "train", g.level_of(i, "train"))
        assert task.id == f"calc-levels/train/L{task.metadata['level']}/{i}"
    counts = Counter(g.level_of(i) for i in range(3000))
    assert set(counts) == set(range(len(LADDER)))
    assert min(counts.values()) > 3000 / len(LADDER) * 0.85  # about uniform over the levels


def test_each_level_has_its_number_of_operations_and_the_answer_is_the_value():
    g = LeveledCalcTasks(seed=2)
    for level, (ops, (low, high)) in enumerate(LADDER):
        for i in range(30):
            task = g.generate_at(i, "train", level)
            expression = task.metadata["expression"]
            assert operations(expression) == ops and task.metadata["level"] == level
            assert str(eval(expression)) == task.answer
            first = int(re.match(r"\(*(\d+)", expression).group(1))
            assert low <= first <= high


def test_a_fixed_level_and_bad_levels():
    g = LeveledCalcTasks(seed=0, level=2)
    assert {g.generate(i).metadata["level"] for i in range(20)} == {2}
    with pytest.raises(ValueError, match="level must be in 0..5"):
        LeveledCalcTasks(level=6)
    with pytest.raises(ValueError, match="levels must be in 1..6"):
        LeveledCalcTasks(levels=0)
    with pytest.raises(ValueError, match="level must be in 0..2"):
        LeveledCalcTasks(levels=3).generate_at(0, "train", 3)


@pytest.mark.docker
def test_the_oracle_solves_every_level_through_docker():
    rewards = oracle_rewards("agentrl/calc-levels-v0", 12)
    assert rewards == [1.0] * 12


def test_the_task_source_poses_the_leveled_pool_without_building_the_env():
    """`agentrl.task_source` (evaluation, the curriculum) reads the same leveled tasks an env poses."""
    source = agentrl.task_source("agentrl/calc-levels-v0", split="test", level=3)
    env = agentrl.make("agentrl/calc-levels-v0", split="test", level=3, backend="local", use_pool=False)
    try:
        for i in range(4):
            task = source.get(i, "test")
            assert task.metadata["level"] == 3
            assert task == env.tasks.get(i, "test")
    finally:
        env.close()


def test_mix_weights_the_levels_of_the_mixed_pool() -> None:

    from agentrl.envs.calc_levels import SWE_LIKE_MIX

    levels = Counter(LeveledCalcTasks(seed=0, mix="swe-like").level_of(i, "test") for i in range(3000))
    for level, weight in enumerate(SWE_LIKE_MIX):
        assert abs(levels[level] / 3000 - weight) < 0.03, (level, levels)
    only_two = LeveledCalcTasks(seed=0, mix=[0, 0, 1, 0, 0, 0])
    assert {only_two.generate(i).metadata["level"] for i in range(50)} == {2}
    assert LeveledCalcTasks(seed=0).generate(5) == LeveledCalcTasks(seed=0, mix=None).generate(5)
    with pytest.raises(ValueError, match="mix needs 6 non-negative weights"):
        LeveledCalcTasks(mix=[1, 2])
    with pytest.raises(ValueError, match="mix must be 'swe-like' or a weight per level"):
        LeveledCalcTasks(mix="hard")
