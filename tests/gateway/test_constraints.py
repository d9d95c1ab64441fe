"""`tool_choice` honoured at sampling time with vLLM's structured outputs: "required" and a named function
give calls in the session's own tool-call format whatever the (random) model would have written, and the
constrained ids are recorded as the engine sampled them, with their log-probs; an engine that cannot
constrain answers 400.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from agentrl.gateway.server import Gateway
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy import HFPolicy, VLLMPolicy
from tests import fixtures_model
from tests.gateway.scripted import RecordingPolicy, as_trajectory, assert_all_sampled
from tests.gateway.test_server import MESSAGES

tiny_model_dir = fixtures_model.tiny_model_dir

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "parameters": {
                "type": "object",
                "properties": {"number": {"type": "integer"}},
                "required": ["number"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "maxLength": 8}},
                "required": ["answer"],
                "additionalProperties": False,
            },
        },
    },
]
ROLLOUT = RolloutConfig(max_tokens_per_turn=96, max_total_tokens=2048)


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path):
    policy = VLLMPolicy(tiny_model_dir, in_process=True, dtype="float32", max_model_len=2048, cpu_threads=1)
    record = RecordingPolicy(policy)
    record.supports_constraints = True
    try:
        with Gateway(record, tokenizer=policy.tokenizer) as gw:
            yield gw, record
    finally:
        policy.close()


@pytest.mark.vllm
def test_tool_choice_is_honoured_at_sampling_time(served):
    gw, record = served
    session = gw.session(rollout=ROLLOUT, lock_sampling=False)

    async def go():
        async with openai.AsyncOpenAI(base_url=session.url, api_key="unused", max_retries=0) as c:
            ask = dict(model=gw.model_name, messages=MESSAGES, tools=TOOLS, logprobs=True, seed=4)
            free = await c.chat.completions.create(**ask)
            # One call each: past a finished call a random model would as soon write another as end the
            # turn, and many calls can run into max_tokens.
            required = await c.chat.completions.create(
                **ask, tool_choice="required", parallel_tool_calls=False, n=3
            )
            named = await c.chat.completions.create(
                **ask, tool_choice={"type": "function", "function": {"name": "submit"}}
            )
            stream = await c.chat.completions.create(
                **ask, tool_choice="required", parallel_tool_calls=False, stream=True
            )
            chunks = [chunk async for chunk in stream]
            return free, required, named, chunks

    free, required, named, chunks = asyncio.run(go())
    # The random model writes no call by itself; constrained, every choice is calls and nothing else.
    assert free.choices[0].message.tool_calls is None
    for choice in [*required.choices, *named.choices]:
        calls = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and calls and not choice.message.content
        for call in calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in {"guess", "submit"}
            assert set(args) == ({"number"} if call.function.name == "guess" else {"answer"})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "submit" and isinstance(json.loads(call.function.arguments)["answer"], str)
    # Log-probs: on every sampled token, streamed or not, and each recorded id is one the engine sampled.
    streamed = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    streamed_calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    stream_sample = session.samples[-1]
    assert streamed_calls and [t.logprob for t in streamed] == stream_sample.logprobs[: len(streamed)]
    assert len(streamed) == len(stream_sample.sampled_ids) - 1  # all but the end-of-turn token
    for choice in [*required.choices, *named.choices]:
        assert choice.logprobs is not None and len(choice.logprobs.content) >= 1
    session.close("submitted")
    for branch in session.branches():
        assert_all_sampled(as_trajectory(branch), record)
    structured = [s for _p, s, _g in record.calls if s.structural_tag is not None]
    assert len(structured) == 3 + 1 + 1


def test_an_engine_without_constraints_refuses_tool_choice(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    with Gateway(HFPolicy(tiny_model_dir), tokenizer=tok) as gw:
        session = gw.session(rollout=ROLLOUT)
        url = f"{session.url}/chat/completions"
        for extra in (
            {"tool_choice": "required"},
            {"tool_choice": {"type": "function", "function": {"name": "guess"}}},
            {"parallel_tool_calls": False},
        ):
            body = {"model": gw.model_name, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
            r = httpx.post(url, json=body, timeout=60)
            assert r.status_code == 400 and "cannot be honoured" in r.json()["error"]["message"], extra
            assert r.json()["error"]["param"] == "tool_choice"
        assert not session.samples and session.calls == 0 and not session.closed
