"""Stitching a session's calls into trajectories: extension reuses the sampled ids exactly, anything else
branches, and the drift is counted. Calls go through the real server with the `openai` SDK.

The model writes tool calls here (`ToolCallPolicy`: fixed Hermes calls; the tiny model writes none):
what is under test is what the gateway does with the calls and the history a harness sends back.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from agentrl.gateway.server import Gateway
from agentrl.gateway.session import GATEWAY_METRICS, tools_in_system
from agentrl.rollout.config import RolloutConfig
from tests import fixtures_model
from tests.gateway.scripted import (
    RecordingPolicy,
    ToolCallPolicy,
    as_trajectory,
    assert_all_sampled,
    guess_call,
)
from tests.gateway.test_server import MESSAGES, TOOLS

tiny_model_dir = fixtures_model.tiny_model_dir
ROLLOUT = RolloutConfig(max_tokens_per_turn=64, max_total_tokens=2048)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def served(tokenizer):
    """A gateway over a recorded tool-calling policy: guesses 50, 51, 52, ... with a sentence first."""
    record = RecordingPolicy(ToolCallPolicy(tokenizer, lambda _prompt, n: guess_call(50 + n, "Let me try. ")))
    with Gateway(record, tokenizer=tokenizer) as gw:
        yield gw, record


def tool_result(call, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call.id, "content": content}


async def play(session, model: str, rewrite=None, turns: int = 3, n: int = 1) -> list:
    """A harness: call, append the reply, answer its tool call, `turns` times; `rewrite(messages)` edits the
    history before each call."""
    replies = []
    messages = copy.deepcopy(MESSAGES)
    async with openai.AsyncOpenAI(base_url=session.url, api_key="unused", max_retries=0) as c:
        for _ in range(turns):
            sent = rewrite(copy.deepcopy(messages)) if rewrite else messages
            r = await c.chat.completions.create(model=model, messages=sent, tools=TOOLS, n=n)
            replies.append(r)
            msg = r.choices[-1].message
            answer = (
                tool_result(msg.tool_calls[0], "higher")
                if msg.tool_calls
                else {"role": "user", "content": "?"}
            )
            messages = [*sent, msg.model_dump(exclude_none=True), answer]
    return replies


def test_extension_reuses_sampled_ids_and_masks_observations(served):
    gw, record = served
    session = gw.session(rollout=ROLLOUT, seed=0)
    asyncio.run(play(session, gw.model_name))
    session.close("submitted")
    (branch,) = session.branches()
    assert session.drifted_calls == 0 and not branch.drifted
    # What the native loop builds from the same conversation: one prompt, the sampled ids appended as
    # sampled (mask 1), each observation as a template delta tokenized once (mask 0).
    # The tools written into the system message by the session's tool-call format, as a native env writes them.
    masker = gw.masker_for(None)
    seq = masker.start(tools_in_system(copy.deepcopy(MESSAGES), session.parser.system_block(TOOLS)))
    for i, (prompt, _sampling, gen) in enumerate(record.calls):
        assert prompt == seq.token_ids, f"call {i} was not given the extended context"
        masker.add_turn(seq, gen.token_ids, gen.logprobs, gen.stop_reason)
        if i < 2:
            obs = [{"role": "tool", "tool_call_id": "call_0", "content": "higher"}]
            masker.add_observation(seq, obs, masker.observation_ids(seq, obs))
    assert branch.seq.token_ids == seq.token_ids
    assert branch.seq.loss_mask == seq.loss_mask
    assert branch.seq.behavior_logprobs == seq.behavior_logprobs
    assert sum(branch.seq.loss_mask) == sum(len(g.token_ids) for _p, _s, g in record.calls)
    # The drift check of the native loop agrees: the ids are the template's rendering.
    assert not masker.check_drift(branch.seq, warn=False).drifted


def test_reserialized_arguments_still_extend(served):
    """Same call, other JSON (spacing, key order, a new id): the sampled tokens already say it; no drift."""
    gw, _record = served
    session = gw.session(rollout=ROLLOUT)

    def reserialize(messages):
        for m in messages:
            for k, call in enumerate(m.get("tool_calls", [])):
                args = json.loads(call["function"]["arguments"])
                call["function"]["arguments"] = json.dumps(args, indent=2, sort_keys=True)
                call["id"] = f"renumbered-{k}"
        for m in messages:
            if m["role"] == "tool":
                m["tool_call_id"] = "renumbered-0"
        return messages

    asyncio.run(play(session, gw.model_name, rewrite=reserialize))
    session.close("submitted")
    assert session.drifted_calls == 0 and len(session.branches()) == 1


@pytest.mark.parametrize("edit", ["changed call", "dropped text", "truncated history"])
def test_rewritten_history_branches_on_sampled_tokens_only(served, edit):
    gw, record = served
    session = gw.session(rollout=ROLLOUT)
    before = GATEWAY_METRICS["gateway/drifted_calls"]

    def rewrite(messages):
        assistants = [m for m in messages if m["role"] == "assistant"]
        if not assistants:
            return messages
        last = assistants[-1]
        if edit == "changed call":  # the harness "fixes" the model's call
            last["tool_calls"][0]["function"]["arguments"] = json.dumps({"number": 7})
        elif edit == "dropped text":  # reasoning dropped from history
            last.pop("content", None)
        else:  # only the last exchange kept
            return [messages[0], messages[1], *messages[-2:]]
        return messages

    asyncio.run(play(session, gw.model_name, rewrite=rewrite, turns=3))
    session.close("submitted")
    branches = session.branches()
    expected_drift = 2 if edit != "truncated history" else 1  # keeping the last two is a no-op at call 2
    assert session.drifted_calls == expected_drift
    assert len(branches) == expected_drift + 1
    assert GATEWAY_METRICS["gateway/drifted_calls"] - before == expected_drift
    assert branches[0].samples[-1].call == 2  # branch 0 ends at the last call
    for b in branches:
        assert assert_all_sampled(as_trajectory(b), record) >= 1
    # Every sample lies in exactly one branch's trained tokens.
    trained = sum(sum(b.seq.loss_mask) for b in branches)
    assert trained == sum(len(g.token_ids) for _p, _s, g in record.calls)


def test_n_choices_are_branches(served):
    gw, record = served
    session = gw.session(rollout=ROLLOUT)
    replies = asyncio.run(play(session, gw.model_name, turns=2, n=2))
    session.close("submitted")
    assert len(replies[0].choices) == 2
    branches = session.branches()
    # Call 1's unchosen choice, call 2's two choices: three leaves, none of them drift.
    assert len(branches) == 3 and session.drifted_calls == 0
    for b in branches:
        assert_all_sampled(as_trajectory(b), record)


def test_call_limit_ends_the_session_max_turns(served):
    gw, _record = served
    session = gw.session(rollout=ROLLOUT, max_calls=2)
    with pytest.raises(openai.NotFoundError):
        asyncio.run(play(session, gw.model_name, turns=3))
    assert session.finish_reason == "max_turns" and len(session.samples) == 2


def test_context_budget_ends_the_session_max_tokens(served):
    gw, _record = served
    session = gw.session(rollout=RolloutConfig(max_tokens_per_turn=64, max_total_tokens=300))
    with pytest.raises(openai.APIStatusError) as info:
        asyncio.run(play(session, gw.model_name, turns=10))
    # Either a prompt past the budget (400), or a call after the turn that ran into it (the session is over).
    assert (info.value.status_code, info.value.code) in {
        (400, "context_length_exceeded"),
        (404, "session_not_found"),
    }
    assert session.finish_reason == "max_tokens"
    assert all(len(b.seq) <= 300 for b in session.branches())
