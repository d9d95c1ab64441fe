"""An agent as a service: the rollout hands episodes to an agent process it did not start (a separate
process here), which plays them against their gateway sessions and the environment's step endpoint; the
environment's verifier scores them. `agentrl gateway` answers to aliases and marks its trajectories not
scored, and training refuses those."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

import tests.coin_env  # noqa: F401  (registers test/Pick-v0)
from agentrl.core.errors import UserError
from agentrl.gateway.harness import HarnessEnv
from agentrl.gateway.service import TOKEN_ENV
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync
from agentrl.rollout.trajectory import load_trajectories
from tests import fixtures_model
from tests.gateway.scripted import RecordingPolicy, ToolCallPolicy, assert_all_sampled

tiny_model_dir = fixtures_model.tiny_model_dir
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _submit(prompt: str, _n: int) -> str:
    word = re.findall(r"Submit the word (\w+)", prompt)[-1]
    return "<tool_call>\n" + json.dumps({"name": "submit", "arguments": {"answer": word}}) + "\n</tool_call>"


def test_episodes_handed_to_an_agent_process_are_played_and_scored_by_the_verifier(tokenizer, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "a-shared-secret")
    address = f"127.0.0.1:{_free_port()}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.gateway.service_agent", f"http://{address}", "8"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        record = RecordingPolicy(ToolCallPolicy(tokenizer, _submit))
        cfg = RolloutConfig(group_size=1, concurrency=3, max_tokens_per_turn=64, episode_timeout_s=120)
        trajs = collect_sync(
            lambda: HarnessEnv("test/Pick-v0", service=address), [0, 1, 2], record, cfg, seed=0
        )
        out, _ = agent.communicate(timeout=60)
    finally:
        agent.kill()
    by_task = {t.task_id: t for t in trajs}
    ok = [by_task["pick/train/0"], by_task["pick/train/2"]]
    for t in ok:  # scored by the environment's verifier, every trained token one the engine sampled
        assert t.finish_reason == "submitted" and t.passed and t.reward == 1.0
        assert assert_all_sampled(t, record) == 1
    failed = by_task["pick/train/1"]
    assert failed.finish_reason == "agent_error" and not failed.trainable
    assert "the agent process reported: my service lost its database" in failed.error
    played = {row[0]: row[1:] for row in json.loads(out)}
    assert played["pick/train/1"] == ["agent_error"]
    # The submit call ended the episode inside `step`: `end` finds it over; the agent saw the tool result.
    assert played["pick/train/0"] == played["pick/train/2"] == ["ended", True, "Submitted."]


def test_an_episode_no_agent_takes_ends_saying_so_and_a_wrong_token_is_refused(tokenizer, monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "another-secret")
    address = f"127.0.0.1:{_free_port()}"
    policy = ToolCallPolicy(tokenizer, _submit)
    cfg = RolloutConfig(group_size=1, max_tokens_per_turn=64)
    (t,) = collect_sync(
        lambda: HarnessEnv("test/Pick-v0", service=address, pickup_timeout_s=1.0), [0], policy, cfg, seed=0
    )
    assert (
        t.finish_reason == "agent_error"
        and f"no agent took this episode from the service at http://{address}" in t.error
    )
    r = httpx.post(f"http://{address}/v1/episodes/next", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and TOKEN_ENV in r.json()["error"]["message"]
    r = httpx.post(f"http://{address}/v1/episodes/nosuch/step", json={"message": {}})
    assert r.status_code == 404
    with pytest.raises(ValueError, match="one of agent="):
        HarnessEnv("test/Pick-v0", agent="agentrl.gateway:tool_loop_agent", service=address)
    with pytest.raises(ValueError, match="must look like 'host:port'"):
        HarnessEnv("test/Pick-v0", service="nowhere")


def test_the_gateway_server_answers_to_aliases_and_its_calls_are_not_scored(
    tiny_model_dir, tokenizer, tmp_path
):
    from agentrl.gateway.serve import serve
    from agentrl.rollout.policy import HFPolicy
    from agentrl.train.trainer import load_replay

    policy = HFPolicy(tiny_model_dir)
    policy.tokenizer = tokenizer
    lines: list[str] = []
    stop = threading.Event()
    out = tmp_path / "calls.jsonl"
    errors: list[str] = []

    def agent() -> None:
        while not lines:
            stop.wait(0.05)
        line = json.loads(lines[0])
        assert line["aliases"] == ["gpt-4o"]
        with openai.OpenAI(base_url=line["url"], api_key="unused", max_retries=0) as c:
            c.chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            try:
                c.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
            except openai.NotFoundError as exc:
                errors.append(str(exc))
        stop.set()

    worker = threading.Thread(target=agent)
    worker.start()
    serve(policy, rollout=RolloutConfig(), port=0, out=out, echo=lines.append, stop=stop, aliases=["gpt-4o"])
    worker.join()
    (t,) = load_trajectories(out)
    assert not t.scored and t.verdict_details.startswith("not scored") and t.num_action_tokens > 0
    assert "serves `agentrl-policy`" in errors[0] and "--alias gpt-5" in errors[0]
    with pytest.raises(UserError, match="1 of the 1 trajectories .* are not scored"):
        load_replay(str(out))
