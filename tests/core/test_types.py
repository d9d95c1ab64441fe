"""The shared types and the environment contract: what `make` returns, the typed step record."""

from __future__ import annotations

import agentrl
from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.core.types import StepInfo
from agentrl.env.agents import AnswerOracle, run_episode, tool_call
from agentrl.env.protocols import AgentEnv, OracleEnv, has_oracle
from agentrl.env.tool_env import ToolEnv
from agentrl.verifiers import Verdict

TASK = Task(id="t/0", prompt="Say 7.", answer="7")


def pure_env(**kw) -> ToolEnv:
    """An env of pure tools (submit only): no sandbox, so these checks need no engine."""
    return ToolEnv(tasks=[TASK], tools=["submit"], verifier="exact-match", max_turns=2, **kw)


def test_make_returns_an_agent_env_and_the_builtins_have_oracles():
    env = agentrl.make("agentrl/guess-number-v0")
    try:
        assert isinstance(env, AgentEnv) and isinstance(env, OracleEnv) and has_oracle(env)
    finally:
        env.close()


def test_the_oracle_is_optional():
    env = pure_env()
    assert isinstance(env, AgentEnv) and not has_oracle(env)
    assert has_oracle(pure_env(oracle=AnswerOracle))


def test_step_info_is_gymnasiums_dict_with_the_declared_keys():
    env = pure_env()
    env.reset(seed=0)
    _, _, _, _, info = env.step("no call here")
    assert set(info) == set(StepInfo.__dataclass_fields__) - {"verdict", "error"}
    assert info["format_errors"] == 1 and info["finish_reason"] is None
    _, reward, terminated, _, info = env.step(tool_call("submit", answer="7"))
    assert terminated and reward == 1.0
    assert set(info) == set(StepInfo.__dataclass_fields__) - {"error"}
    assert info["verdict"].passed and info["tools_used"] == {"submit": 1} and info["turns"] == 2


def test_step_info_as_dict_leaves_out_what_is_not_set():
    verdict = Verdict(1.0, True, "ok")
    assert "verdict" not in StepInfo().as_dict() and "error" not in StepInfo().as_dict()
    done = StepInfo(finish_reason="env_error", verdict=verdict, error="the sandbox died")
    assert done.as_dict()["verdict"] is verdict and done.as_dict()["error"] == "the sandbox died"


def test_the_episode_record_carries_the_verdict_once_the_episode_is_over():
    env = pure_env()
    env.reset(seed=0)
    assert isinstance(env.episode, Episode) and env.episode.verdict is None
    result = run_episode(env, AnswerOracle(TASK), options={"task": TASK})
    assert result.verdict is env.episode.verdict and result.verdict.passed
    assert env.episode.finish_reason == "submitted"


def test_an_episode_ended_from_outside_records_its_verdict():
    env = pure_env()
    env.reset(seed=0)
    verdict = env.end_episode("max_tokens", "the context budget is used up")
    assert env.episode.verdict is verdict and env.episode.finish_reason == "max_tokens"
    assert not verdict.passed


def test_an_oracle_factory_that_takes_a_parser_writes_in_the_envs_format():
    env = pure_env(oracle=AnswerOracle, parser="llama3-json")
    env.reset(seed=0)
    assert env.oracle(TASK).act([]) == '{"name": "submit", "parameters": {"answer": "7"}}'
    assert run_episode(env, env.oracle(TASK), options={"task": TASK}).verdict.passed
