import subprocess
import sys

import pytest

import agentrl
from agentrl.envs.calc import CalcTaskGenerator

from .conftest import floor_rewards, oracle_rewards


def test_generator_is_deterministic_and_splits_are_disjoint():
    g = CalcTaskGenerator(seed=0)
    assert g.generate(5, "train") == CalcTaskGenerator(seed=0).generate(5, "train")
    train = {g.generate(i, "train").prompt for i in range(300)}
    test = {g.generate(i, "test").prompt for i in range(300)}
    assert len(train) > 250
    assert len(train & test) <= 3  # independent streams; a rare identical small problem is possible
    assert CalcTaskGenerator(seed=1).generate(5, "train") != g.generate(5, "train")


def test_answers_are_the_expressions_value():
    g = CalcTaskGenerator(seed=3)
    for i in range(50):
        t = g.generate(i)
        assert str(eval(t.metadata["expression"])) == t.answer
        assert int(t.answer) >= 0 or t.metadata["kind"] == "arithmetic"


@pytest.mark.docker
@pytest.mark.slow
def test_oracle_solves_100_tasks_through_docker():
    rewards = oracle_rewards("agentrl/calc-v0", 100)
    assert rewards == [1.0] * 100


@pytest.mark.docker
def test_empty_and_random_agents_score_zero():
    assert set(floor_rewards("agentrl/calc-v0", 5)) == {0.0}


@pytest.mark.docker
@pytest.mark.parametrize("bad_call", [{"code": 123}, {"program": "print(1)"}, {}])
def test_python_gate_counts_only_python_calls_that_ran(bad_call):
    from agentrl.env.agents import tool_call

    env = agentrl.make("agentrl/calc-v0")
    try:
        task = env.tasks.get(0, env.split)
        # A python call refused for its arguments ran nothing: typing the answer in still scores 0.
        env.reset(options={"task": task})
        obs, *_ = env.step(tool_call("python", **bad_call))
        assert "bad arguments for tool 'python'" in obs[0]["content"]
        _, reward, terminated, _, info = env.step(tool_call("submit", answer=task.answer))
        assert terminated and reward == 0.0
        assert "python ran 0 time(s) (1 more attempted that did not run)" in info["verdict"].details
        # Control: a python call that ran, then the same answer, scores 1.
        env.reset(options={"task": task})
        env.step(tool_call("python", code="print(0)"))
        assert env.step(tool_call("submit", answer=task.answer))[1] == 1.0
    finally:
        env.close()


def test_in_llama3_json_the_prompt_and_the_oracle_use_that_format():
    env = agentrl.make("agentrl/calc-v0", parser="llama3-json", backend="local", use_pool=False)
    obs, _ = env.reset(seed=0)
    assert "<tool_call>" not in obs[0]["content"] and '"parameters"' in obs[0]["content"]
    first = env.oracle(env.task).act(obs)
    assert first.startswith('{"name": "python", "parameters": {"code": "print(')
    env.close()


@pytest.mark.docker
def test_env_check_passes_in_llama3_json_with_the_oracle():
    """`agentrl env check` of calc-v0 in Llama 3.1's JSON format: the contract checks (garbage in that
    format), then the oracle, its calls written in that format, solves every task."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentrl.cli",
            "env",
            "check",
            "agentrl/calc-v0",
            "--parser",
            "llama3-json",
            "--tasks",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (
        "[ok] agentrl/calc-v0: check_env passed" in out.stdout
        and "[ok] oracle solved 3/3 tasks" in out.stdout
    )
