"""The gateway with agent frameworks as they are, from the package index: the OpenAI Agents SDK runs a
multi-turn tool agent to its end, every call stitched into one token-exact trajectory.

The policy writes scripted Hermes tool calls (`ToolCallPolicy`): what the frameworks do with the replies
(call ids, tool results, repeats, the final answer) is under test, not the sampling.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from transformers import AutoTokenizer

from agentrl.gateway.server import Gateway
from agentrl.rollout.config import RolloutConfig
from tests import fixtures_model
from tests.gateway.scripted import ToolCallPolicy, guess_call

tiny_model_dir = fixtures_model.tiny_model_dir

ROLLOUT = RolloutConfig(max_tokens_per_turn=64, max_total_tokens=4096)
SECRET = 62


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def bisect_then_answer(prompt: str, _n: int) -> str:
    """Guesses 50 twice (the same invocation again: a framework must not take it for the first one), then
    bisects on the tool results in the prompt, then answers in text."""
    answers = re.findall(r"<tool_response>\n(higher|lower|correct)", prompt)
    guesses = [int(g) for g in re.findall(r'"number": (\d+)', prompt.split("<|im_start|>user", 1)[-1])]
    if "correct" in answers:
        return f"The number is {guesses[answers.index('correct')]}."
    if len(answers) < 2:
        return guess_call(50, "Let me guess. ")
    lo, hi = 1, 100
    for g, a in zip(guesses, answers, strict=False):
        lo, hi = (g + 1, hi) if a == "higher" else (lo, g - 1)
    return guess_call((lo + hi) // 2)


def answer(number: int) -> str:
    return "correct" if number == SECRET else "higher" if number < SECRET else "lower"


def test_agents_sdk_runs_a_tool_agent_to_its_end(tokenizer):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    seen: list[int] = []

    @agents.function_tool
    def guess(number: int) -> str:
        """Guess the secret number (1..100); says higher, lower or correct."""
        seen.append(number)
        return answer(number)

    policy = ToolCallPolicy(tokenizer, bisect_then_answer)
    with Gateway(policy, tokenizer=tokenizer) as gw:
        session = gw.session(rollout=ROLLOUT)

        async def go():
            client = AsyncOpenAI(base_url=session.url, api_key="unused", max_retries=0)
            agent = agents.Agent(
                name="guesser",
                instructions="Find the secret number with the guess tool.",
                tools=[guess],
                model=agents.OpenAIChatCompletionsModel(model=gw.model_name, openai_client=client),
            )
            result = await agents.Runner.run(agent, "It is between 1 and 100.", max_turns=12)
            await client.close()
            return result

        result = asyncio.run(go())
        session.close("submitted")
        branches = session.branches()
    assert result.final_output == f"The number is {SECRET}."
    assert seen[:2] == [50, 50] and seen[-1] == SECRET  # the repeat ran: its call id was a new one
    ids = [c["id"] for s in session.samples for c in s.reply.get("tool_calls", [])]
    assert len(ids) == len(seen) == len(set(ids))
    # Every call extended the one before: one branch, nothing drifted, each sample trained on once.
    assert session.drifted_calls == 0 and len(branches) == 1
    assert len(session.samples) == len(seen) + 1
    assert sum(branches[0].seq.loss_mask) == sum(len(s.sampled_ids) for s in session.samples)


def _gateway(tokenizer):
    return Gateway(ToolCallPolicy(tokenizer, bisect_then_answer), tokenizer=tokenizer)


def _one_branch(session) -> None:
    session.close("submitted")
    branches = session.branches()
    assert session.drifted_calls == 0 and len(branches) == 1
    assert sum(branches[0].seq.loss_mask) == sum(len(s.sampled_ids) for s in session.samples)


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "guess",
        "description": "Guess the secret number (1..100).",
        "parameters": {
            "type": "object",
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
        },
    }
]


def test_openai_responses_client_plays_to_its_end(tokenizer):
    """Input items sent back whole, and `previous_response_id`: both extend the sampled ids; streamed
    events add up to the same output."""
    from openai import OpenAI

    with _gateway(tokenizer) as gw:
        for chained in (False, True):
            session = gw.session(rollout=ROLLOUT)
            with OpenAI(base_url=session.url, api_key="unused", max_retries=0) as c:
                items: list = [{"role": "user", "content": "It is between 1 and 100."}]
                previous, answered = None, []
                for _ in range(12):
                    ask = dict(model=gw.model_name, instructions="Find it.", tools=RESPONSES_TOOLS)
                    if chained and previous is not None:
                        r = c.responses.create(**ask, input=items, previous_response_id=previous)
                    else:
                        r = c.responses.create(**ask, input=items)
                    calls = [o for o in r.output if o.type == "function_call"]
                    if not calls:
                        break
                    outputs = [
                        {
                            "type": "function_call_output",
                            "call_id": o.call_id,
                            "output": answer(json.loads(o.arguments)["number"]),
                        }
                        for o in calls
                    ]
                    answered += [json.loads(o.arguments)["number"] for o in calls]
                    items = (
                        outputs
                        if chained
                        else [*items, *[o.model_dump(exclude_none=True) for o in r.output], *outputs]
                    )
                    previous = r.id
            assert r.status == "completed" and r.output_text == f"The number is {SECRET}."
            assert answered[:2] == [50, 50] and answered[-1] == SECRET
            assert r.usage.output_tokens == len(session.samples[-1].sampled_ids)
            lps = [t.logprob for t in r.output[0].content[0].logprobs]
            assert lps == session.samples[-1].logprobs[: len(lps)] and lps
            _one_branch(session)
        # Streaming: the events of one call, and a response id of another session is a 404.
        session = gw.session(rollout=ROLLOUT)
        with OpenAI(base_url=session.url, api_key="unused", max_retries=0) as c:
            events = list(
                c.responses.create(
                    model=gw.model_name, input="Between 1 and 100.", tools=RESPONSES_TOOLS, stream=True
                )
            )
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
            assert done.name == "guess" and json.loads(done.arguments) == {"number": 50}
            final = events[-1].response
            assert [o.type for o in final.output] == ["message", "function_call"]
            import openai

            with pytest.raises(openai.NotFoundError):
                c.responses.create(model=gw.model_name, input="x", previous_response_id="resp_" + "0" * 48)


def test_agents_sdk_default_responses_model(tokenizer):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    seen: list[int] = []

    @agents.function_tool
    def guess(number: int) -> str:
        """Guess the secret number (1..100); says higher, lower or correct."""
        seen.append(number)
        return answer(number)

    with _gateway(tokenizer) as gw:
        session = gw.session(rollout=ROLLOUT)

        async def go():
            client = AsyncOpenAI(base_url=session.url, api_key="unused", max_retries=0)
            # The SDK's default model for a name: the Responses API.
            provider = agents.OpenAIProvider(openai_client=client)
            agent = agents.Agent(name="guesser", instructions="Find the secret number.", tools=[guess])
            config = agents.RunConfig(model=gw.model_name, model_provider=provider)
            model = provider.get_model(gw.model_name)
            result = await agents.Runner.run(agent, "Between 1 and 100.", max_turns=12, run_config=config)
            await client.close()
            return result, model

        result, model = asyncio.run(go())
        assert type(model).__name__ == "OpenAIResponsesModel"
        assert result.final_output == f"The number is {SECRET}."
        assert seen[:2] == [50, 50] and seen[-1] == SECRET
        _one_branch(session)


ANTHROPIC_TOOLS = [
    {
        "name": "guess",
        "description": "Guess the secret number (1..100).",
        "input_schema": {
            "type": "object",
            "properties": {"number": {"type": "integer"}},
            "required": ["number"],
        },
    }
]


def test_anthropic_client_plays_to_its_end(tokenizer):
    anthropic = pytest.importorskip("anthropic")

    with _gateway(tokenizer) as gw:
        session = gw.session(rollout=ROLLOUT)
        with anthropic.Anthropic(base_url=session.anthropic_url, api_key="unused", max_retries=0) as c:
            messages: list = [{"role": "user", "content": "It is between 1 and 100."}]
            answered = []
            for _ in range(12):
                r = c.messages.create(
                    model=gw.model_name,
                    max_tokens=4096,
                    system="Find it.",
                    messages=messages,
                    tools=ANTHROPIC_TOOLS,
                )
                uses = [b for b in r.content if b.type == "tool_use"]
                if not uses:
                    break
                assert r.stop_reason == "tool_use"
                messages.append(
                    {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]}
                )
                messages.append(
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": b.id, "content": answer(b.input["number"])}
                            for b in uses
                        ],
                    }
                )
                answered += [b.input["number"] for b in uses]
            assert r.stop_reason == "end_turn" and r.content[0].text == f"The number is {SECRET}."
            assert answered[:2] == [50, 50] and answered[-1] == SECRET
            # Streaming: the same events Anthropic's SDK assembles into one message.
            with c.messages.stream(
                model=gw.model_name, max_tokens=64, messages=messages[:1], tools=ANTHROPIC_TOOLS
            ) as stream:
                final = stream.get_final_message()
            assert [b.type for b in final.content] == ["text", "tool_use"] and final.content[1].input == {
                "number": 50
            }
            with pytest.raises(anthropic.BadRequestError) as info:
                c.messages.create(
                    model=gw.model_name,
                    max_tokens=16,
                    messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}],
                )
            assert "text only" in str(info.value)
        session.close("submitted")
        # The streamed call started from the first message again: a branch of its own, as drift.
        assert len(session.branches()) == 2 and session.drifted_calls == 1
