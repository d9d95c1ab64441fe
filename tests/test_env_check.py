import pytest

import agentrl
from agentrl.env import ToolEnv
from agentrl.env_check import check_env, garbage_actions
from agentrl.parsers import get_parser
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


@pytest.mark.parametrize("parser", ["hermes", "llama3-json"])
def test_every_garbage_action_is_a_mistake_in_the_envs_own_format(parser):
    """None of them is read as a well-formed call: each parses to an error, or to no call at all."""
    fmt = get_parser(parser)
    actions = garbage_actions(fmt)
    assert {"broken json", "unknown tool", "arguments not an object", "cut short"} <= set(actions)
    for label, text in actions.items():
        parsed = fmt.parse(text)
        known = [c for c in parsed.calls if c.name != "definitely_not_a_tool"]
        assert parsed.errors or not known, (label, text, parsed)


def test_check_env_passes_a_pure_env_in_llama3_json():
    env = ToolEnv(
        tasks=[Task(id="t", prompt="Say 1.", answer="1")],
        tools=["submit"],
        parser="llama3-json",
        backend="local",
        use_pool=False,
    )
    check_env(env)
