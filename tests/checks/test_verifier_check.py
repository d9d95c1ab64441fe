"""`check_verifier` / `filter_tasks`: a verifier is trusted on a task only if the reference passes and the untouched start fails."""

from __future__ import annotations

import logging

import pytest

import agentrl
from agentrl.checks.verifier_check import DroppedTask, VerifierCheck, check_verifier, filter_tasks
from agentrl.core.task import Task
from agentrl.env.tool_env import ToolEnv


@pytest.fixture(scope="module")
def calc():
    with agentrl.make("agentrl/calc-v0", use_pool=False) as env:
        yield env


@pytest.fixture(scope="module")
def sqlite():
    with agentrl.make("agentrl/sqlite-v0", use_pool=False) as env:
        yield env


def _first(env, kind_test, n: int = 50) -> Task:
    for i in range(n):
        task = env.tasks.get(i)
        if kind_test(task):
            return task
    raise AssertionError("no such task in the first 50")


@pytest.mark.docker
def test_calc_task_is_trusted(calc):
    check = check_verifier(calc, calc.tasks.get(0))
    assert isinstance(check, VerifierCheck) and check.ok, check.reason
    assert check.reference.reward == 1.0 and check.untouched.reward == 0.0


@pytest.mark.docker
def test_sqlite_query_and_change_tasks_are_trusted(sqlite):
    query = _first(sqlite, lambda t: not t.metadata["mutates"])
    change = _first(sqlite, lambda t: t.metadata["mutates"])
    for task in (query, change):
        check = check_verifier(sqlite, task)
        assert check.ok, (task.id, check.reason)


@pytest.mark.docker
def test_wrong_reference_answer_is_dropped_with_reason(calc, caplog):
    good = calc.tasks.get(1)
    broken = good.model_copy(update={"id": "calc/broken", "answer": str(int(good.answer) + 1)})
    with caplog.at_level(logging.WARNING, logger="agentrl.checks.verifier_check"):
        kept, dropped = filter_tasks(calc, [good, broken])
    assert kept == [good]
    assert [d.task.id for d in dropped] == ["calc/broken"] and isinstance(dropped[0], DroppedTask)
    assert "reference solution is not accepted" in dropped[0].reason
    assert "dropped 1 of 2 tasks" in caplog.text


@pytest.mark.docker
def test_verifier_that_ignores_the_state_is_dropped(sqlite):
    change = _first(sqlite, lambda t: t.metadata["mutates"])
    # The check command never looks at the database: the untouched start passes too.
    blind = change.model_copy(update={"id": "sqlite/blind", "check_command": "echo ok", "answer": "ok"})
    check = check_verifier(sqlite, blind)
    assert not check.ok and check.reference.passed
    assert "untouched starting state already passes" in check.reason


def test_env_without_oracle_is_not_trusted():
    task = Task(id="t", prompt="Say hi.", answer="hi")
    with ToolEnv(tasks=[task], tools=["submit"]) as env:
        check = check_verifier(env, task)
    assert not check.ok and "has no oracle(task)" in check.reason


def test_exported_lazily_from_agentrl():
    assert agentrl.check_verifier is check_verifier and agentrl.filter_tasks is filter_tasks
