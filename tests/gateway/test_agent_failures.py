"""A user's own agent failing, and each failure named where it happens: a blocking agent whose timeout
holds, a model name the gateway does not serve, an engine request cut by the episode timeout, a tool the
agent never declared. The policy is `ToolCallPolicy` (scripted Hermes calls through the real gateway):
what is under test is the harness around it, not the sampling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

import tests.coin_env  # noqa: F401  (registers test/Pick-v0)
from agentrl.gateway.harness import HarnessEnv, HarnessTask, is_async_agent
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync
from agentrl.rollout.policy import Generation, SamplingConfig
from tests import fixtures_model
from tests.gateway.scripted import ToolCallPolicy

tiny_model_dir = fixtures_model.tiny_model_dir

PICK = "test/Pick-v0"
CFG = RolloutConfig(group_size=1, max_tokens_per_turn=64, max_total_tokens=2048)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def submit_the_word(prompt: str, _n: int) -> str:
    word = re.findall(r"Submit the word (\w+)", prompt)[-1]
    return "<tool_call>\n" + json.dumps({"name": "submit", "arguments": {"answer": word}}) + "\n</tool_call>"


def blocking_agent(client, task: HarnessTask) -> None:
    """A plain `def` agent with the blocking client: one call, stepped, then done."""
    reply = client.chat.completions.create(model=task.model, messages=task.messages, tools=task.tools)
    task.step(reply.choices[0].message)


def sleeping_agent(client, task: HarnessTask) -> None:
    client.chat.completions.create(model=task.model, messages=task.messages, tools=task.tools)
    time.sleep(3600)  # blocks its thread, not the rollout


def test_a_blocking_agent_runs_on_a_thread_and_its_timeout_holds(tokenizer):
    assert not is_async_agent(blocking_agent) and is_async_agent(asking_agent)
    policy = ToolCallPolicy(tokenizer, submit_the_word)
    done = collect_sync(lambda: HarnessEnv(PICK, blocking_agent), [0, 1], policy, CFG, seed=0)
    assert [(t.finish_reason, t.passed) for t in done] == [("submitted", True)] * 2
    assert all(t.num_action_tokens > 0 and t.branches == 1 for t in done)

    t0 = time.perf_counter()
    cfg = CFG.model_copy(update={"episode_timeout_s": 2.0})
    hung = collect_sync(lambda: HarnessEnv(PICK, sleeping_agent), [0], policy, cfg, seed=0)
    assert time.perf_counter() - t0 < 30  # the sleep did not hold the rollout
    assert hung[0].finish_reason == "timeout" and "2s wall-clock limit" in hung[0].error


class _Stuck:
    """A policy whose every request waits forever (an engine that never answers)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.version = tokenizer, 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


async def asking_agent(client, task: HarnessTask) -> None:
    await client.chat.completions.create(model=task.model, messages=task.messages, tools=task.tools)


def test_a_request_cut_by_the_episode_timeout_is_a_timeout_not_an_engine_failure(tokenizer, caplog):
    cfg = CFG.model_copy(update={"episode_timeout_s": 1.5})
    with caplog.at_level(logging.WARNING):
        trajs = collect_sync(lambda: HarnessEnv(PICK, asking_agent), [0], _Stuck(tokenizer), cfg, seed=0)
    assert trajs[0].finish_reason == "timeout" and "1.5s wall-clock limit" in trajs[0].error
    assert "policy engine failed" not in caplog.text and "CancelledError" not in caplog.text


async def production_agent(client, task: HarnessTask) -> None:
    """Asks for the model its production code hard-codes."""
    reply = await client.chat.completions.create(model="gpt-4o", messages=task.messages, tools=task.tools)
    await task.step(reply.choices[0].message)


def test_a_model_name_the_gateway_does_not_serve_is_named_and_an_alias_serves_it(tokenizer):
    policy = ToolCallPolicy(tokenizer, submit_the_word)
    trajs = collect_sync(lambda: HarnessEnv(PICK, production_agent), [0], policy, CFG, seed=0)
    t = trajs[0]
    assert t.finish_reason == "agent_error" and "NotFoundError" in t.error
    assert "The model `gpt-4o` does not exist" in t.error
    assert "serves `agentrl-policy`" in t.error and "--alias gpt-4o" in t.error
    aliased = collect_sync(
        lambda: HarnessEnv(PICK, production_agent, model_aliases=["gpt-4o"]), [0], policy, CFG, seed=0
    )
    assert aliased[0].finish_reason == "submitted" and aliased[0].passed


async def own_tools_agent(client, task: HarnessTask) -> None:
    """Declares a tool of its own (`answer`), not the environment's `submit`."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "answer",
                "description": "Say the word.",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
            },
        }
    ]
    reply = await client.chat.completions.create(model=task.model, messages=task.messages, tools=tools)
    message = reply.choices[0].message
    task.replies.append(message)  # type: ignore[attr-defined]
    task.observations = await task.step(message)  # type: ignore[attr-defined]


def test_a_tool_the_agent_did_not_declare_is_refused_not_run(tokenizer):
    """The model writes `submit`, which the agent's request does not declare: the gateway returns no tool
    call (OpenAI's API never calls an undeclared function) and the environment refuses to run it."""
    seen: list[HarnessTask] = []

    async def agent(client, task: HarnessTask) -> None:
        task.replies = []  # type: ignore[attr-defined]
        seen.append(task)
        await own_tools_agent(client, task)

    policy = ToolCallPolicy(tokenizer, submit_the_word)
    trajs = collect_sync(lambda: HarnessEnv(PICK, agent), [0], policy, CFG, seed=0)
    t = trajs[0]
    (reply,) = seen[0].replies  # type: ignore[attr-defined]
    assert reply.tool_calls is None and "<tool_call>" in reply.content
    (obs,) = seen[0].observations  # type: ignore[attr-defined]
    assert "tool 'submit' was not offered to you (the tools you have: answer)" in obs["content"]
    assert t.finish_reason != "submitted" and not t.passed and t.tool_errors == 1
    # Declared by the environment instead: it runs.
    trajs = collect_sync(lambda: HarnessEnv(PICK, agent, env_tools=["submit"]), [0], policy, CFG, seed=0)
    assert trajs[0].finish_reason == "submitted" and trajs[0].passed
    with pytest.raises(ValueError, match=r"env_tools \['nope'\] are not tools of test/Pick-v0"):
        HarnessEnv(PICK, agent, env_tools=["nope"])
