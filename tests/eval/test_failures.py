"""Episodes that ended outside the policy's control, said on the console where they happen: the
evaluation warns with the first error's text and `agentrl eval` exits 1 when every episode of a model
failed so; training names agent errors apart from environment errors and keeps a sample of them."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

import tests.coin_env  # noqa: F401  (registers test/Pick-v0)
from agentrl.cli import app
from agentrl.eval.failures import failures
from agentrl.rollout.trajectory import Trajectory
from agentrl.train.stopping import no_update_reason, stop_advice
from tests import fixtures_model
from tests.gateway.scripted import ToolCallPolicy

tiny_model_dir = fixtures_model.tiny_model_dir


def _t(reason: str, error: str | None = None, branch: int = 0) -> Trajectory:
    return Trajectory("t", "g", [1], [0], [0.0], 1, 0.0, False, reason, 0, error=error, branch=branch)  # type: ignore[arg-type]


def test_failures_count_episodes_once_and_quote_the_first_error_of_the_commonest_reason():
    trajs = [
        _t("max_turns"),
        _t("timeout", "the episode ran past its 5s wall-clock limit"),
        _t("agent_error", "the agent raised NotFoundError: Error code: 404 - the model `gpt-4o` ..."),
        _t("agent_error", "the agent raised NotFoundError: second"),
        _t("agent_error", "a branch of the same episode", branch=1),  # not counted again
    ]
    f = failures(trajs)
    assert f is not None
    assert (f.episodes, f.failed, f.counts, f.first_reason) == (
        4,
        3,
        {"agent_error": 2, "timeout": 1},
        "agent_error",
    )
    assert f.most and not f.every
    line = f.line("mylab/X-v0")
    assert line.startswith("3 of 4 episodes ended outside the policy's control (agent_error 2, timeout 1)")
    assert (
        "the first agent_error: the agent raised NotFoundError: Error code: 404 - the model `gpt-4o`" in line
    )
    assert "your agent raised it, not the environment" in line and "\n" not in line
    assert failures([_t("submitted"), _t("max_turns")]) is None
    long = failures([_t("env_error", "x" * 5000)])
    assert long is not None and long.every and len(long.first_error) < 500


def test_a_train_stop_names_agent_errors_apart_from_environment_errors():
    assert (
        no_update_reason({"batch/untrainable_trajectories": 8, "rollout/agent_errors": 8})[0] == "agent-error"
    )
    assert no_update_reason({"batch/untrainable_trajectories": 8, "rollout/timeouts": 6})[0] == "timeout"
    assert no_update_reason({"batch/untrainable_trajectories": 8, "rollout/env_errors": 8})[0] == "env-error"
    crashed = [_t("agent_error", "the agent raised ValueError: my bug")] * 3
    advice = stop_advice("agent-error", "mylab/X-v0", crashed)
    assert "an error of the agent (agent_error), not of the environment" in advice
    assert advice.endswith("the first agent_error: the agent raised ValueError: my bug")
    advice = stop_advice(
        "timeout", "mylab/X-v0", [_t("timeout", "the episode ran past its 5s wall-clock limit")]
    )
    assert "rollout.episode_timeout_s" in advice and "5s wall-clock limit" in advice


async def wrong_model_agent(client, task) -> None:
    await client.chat.completions.create(model="gpt-4o", messages=task.messages, tools=task.tools)


async def good_agent(client, task) -> None:
    reply = await client.chat.completions.create(model=task.model, messages=task.messages, tools=task.tools)
    await task.step(reply.choices[0].message)


def _submit(prompt: str, _n: int) -> str:
    word = re.findall(r"Submit the word (\w+)", prompt)[-1]
    return "<tool_call>\n" + json.dumps({"name": "submit", "arguments": {"answer": word}}) + "\n</tool_call>"


@pytest.fixture
def scripted_engines(monkeypatch, tiny_model_dir):
    """`agentrl eval`'s engines replaced by the scripted Hermes policy (no vLLM)."""
    from transformers import AutoTokenizer

    import agentrl.eval.evaluate as evaluate

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    class Engines:
        def __init__(self, *args, **kwargs):
            pass

        def __call__(self, path):
            return ToolCallPolicy(tok, _submit)

        def close(self):
            pass

    monkeypatch.setattr(evaluate, "_Engines", Engines)
    return tiny_model_dir


def test_eval_of_an_agent_that_always_fails_warns_with_the_error_and_exits_1(
    scripted_engines, tmp_path, monkeypatch
):
    import agentrl
    from agentrl.env.registry import registry

    for env_id, agent in (("test/PickWrongModel-v0", wrong_model_agent), ("test/PickGood-v0", good_agent)):
        agentrl.register(env_id, "agentrl.gateway:HarnessEnv", env="test/Pick-v0", agent=agent)
        monkeypatch.setitem(registry, env_id, registry[env_id])  # removed again after the test
    args = ["--model", str(scripted_engines), "--tasks", "2", "--n", "2", "--k", "1", "--no-progress"]
    res = CliRunner().invoke(
        app, ["eval", "--env", "test/PickWrongModel-v0", "--out", str(tmp_path / "a"), *args]
    )
    assert res.exit_code == 1, res.output
    assert "pass@1 0.000" in res.stdout
    assert (
        "warning: tiny-qwen2: 4 of 4 episodes ended outside the policy's control (agent_error 4)"
        in res.stderr
    )
    assert "The model `gpt-4o` does not exist" in res.stderr and "--alias gpt-4o" in res.stderr
    assert "error: every episode of tiny-qwen2 ended outside the policy's control" in res.stderr
    episodes = (tmp_path / "a" / "tiny-qwen2" / "episodes.jsonl").read_text().splitlines()
    assert all(json.loads(x)["trajectory"]["error"] for x in episodes)

    res = CliRunner().invoke(app, ["eval", "--env", "test/PickGood-v0", "--out", str(tmp_path / "b"), *args])
    assert res.exit_code == 0 and "pass@1 1.000" in res.stdout and "warning" not in res.stderr, res.output


def test_training_keeps_a_sample_of_failed_episodes_and_warns_once_per_reason(tmp_path, capsys):
    from types import SimpleNamespace

    from agentrl.rollout.trajectory import load_trajectories
    from agentrl.train.trainer import FAILED_FILE, _note_failures

    run = SimpleNamespace(out=tmp_path, cfg=SimpleNamespace(env="mylab/X-v0"), failures_said=set())
    step = [_t("agent_error", f"the agent raised ValueError: bug {i}") for i in range(20)] + [_t("max_turns")]
    _note_failures(run, step)
    _note_failures(run, step)  # the same reason again: kept up to the cap, said once
    kept = load_trajectories(tmp_path / FAILED_FILE)
    assert len(kept) == 32 and all(t.finish_reason == "agent_error" and t.error for t in kept)
    err = capsys.readouterr().err
    assert err.count("warning: 20 of 21 episodes ended outside the policy's control (agent_error 20)") == 1
    assert "the agent raised ValueError: bug 0" in err and str(tmp_path / FAILED_FILE) in err
    _note_failures(run, [_t("max_turns")])  # nothing failed: nothing written, nothing said
    assert len(load_trajectories(tmp_path / FAILED_FILE)) == 32 and capsys.readouterr().err == ""
