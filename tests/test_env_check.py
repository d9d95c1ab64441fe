import pytest

import agentrl
from agentrl.env import ToolEnv
from agentrl.env_check import check_env
from agentrl.registry import all_specs
from agentrl.task import Task


@pytest.mark.docker
@pytest.mark.parametrize("env_id", [s.id for s in all_specs() if s.id.startswith("agentrl/")])
def test_check_env_on_every_registered_id(env_id):
    env = agentrl.make(env_id)
    check_env(env)


class NonDeterministic(ToolEnv):
    """Ignores the seed: picks a task from a counter."""

    counter = 0

    def _pick_task(self, options):
        NonDeterministic.counter += 1
        return Task(id=f"t{self.counter}", prompt=f"task {self.counter}", answer="1")


def test_check_env_catches_a_non_deterministic_reset():
    env = NonDeterministic(tasks=[], tools=["submit"], backend="local", use_pool=False)
    with pytest.raises(AssertionError, match="not deterministic"):
        check_env(env)


def test_check_env_rejects_non_envs():
    with pytest.raises(AssertionError, match="not a gymnasium.Env"):
        check_env(object())
