"""The gateway with agent frameworks as they are, from the package index: the OpenAI Agents SDK runs a
multi-turn tool agent to its end, every call stitched into one token-exact trajectory.

The policy writes scripted Hermes tool calls (`ToolCallPolicy`): what the frameworks do with the replies
(call ids, tool results, repeats, the final answer) is under test, not the sampling.
"""

from __future__ import annotations

import asyncio
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
