import agentrl
from agentrl.env.agents import tool_call
from agentrl.envs.guess_number import GuessNumberTaskGenerator

from .conftest import floor_rewards, oracle_rewards


def test_oracle_binary_search_solves_100_tasks():
    assert oracle_rewards("agentrl/guess-number-v0", 100, workers=1) == [1.0] * 100


def test_empty_and_random_agents_score_zero():
    assert set(floor_rewards("agentrl/guess-number-v0", 10)) == {0.0}


def test_feedback_depends_on_history_and_range_is_enforced():
    env = agentrl.make("agentrl/guess-number-v0")
    task = GuessNumberTaskGenerator(seed=0).generate(0)
    secret, high = int(task.answer), task.metadata["high"]
    env.reset(options={"task": task})
    obs, *_ = env.step(tool_call("guess", number=high + 1))
    assert "outside the range" in obs[0]["content"]
    if secret > 1:
        obs, *_ = env.step(tool_call("guess", number=secret - 1))
        assert obs[0]["content"] == "higher"
    obs, reward, terminated, truncated, info = env.step(tool_call("guess", number=secret))
    assert terminated and reward == 1.0 and info["finish_reason"] == "submitted"


def test_needs_no_sandbox():
    env = agentrl.make("agentrl/guess-number-v0")
    env.reset(seed=0)
    assert env.sandbox is None and not env.needs_sandbox


def test_one_guess_per_turn_parallel_guesses_do_not_win():
    env = agentrl.make("agentrl/guess-number-v0")
    assert env.max_tool_calls_per_step == 1 and env.spec.max_tool_calls_per_step == 1
    gen = GuessNumberTaskGenerator(seed=0)
    task = next(t for t in map(gen.generate, range(100)) if t.metadata["high"] == 100)
    env.reset(options={"task": task})
    high = task.metadata["high"]
    # Every number of the range in one message (100 parallel guesses): only the first is played.
    every = "".join(tool_call("guess", number=n) for n in range(1, high + 1))
    obs, reward, terminated, truncated, info = env.step(every)
    assert info["step_tool_calls"] == 1 and info["step_tool_calls_not_run"] == high - 1
    assert obs[0]["content"] in ("higher", "correct: the secret number is 1.")
    assert f"{high - 1} tool call(s) of your message were not run" in obs[-1]["content"]
    assert reward == (1.0 if task.answer == "1" else 0.0)
