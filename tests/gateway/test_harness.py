"""Harness environments through the rollout with the real vLLM engine: an `openai`-SDK agent plays
through its session URL, and what the trainer gets is what the native loop gives.

- The same agent written twice, as the native loop and as an OpenAI harness, with the same seeds:
  identical token ids, loss masks and behaviour log-probs, episode for episode.
- A harness that rewrites history: branches whose every trained token the engine sampled, counted as
  drift.
- Tool calls executed by the environment, the verifier's reward in the trajectory.
- Crash, hang, returning early, asking past the turn limit: the episode ends with its reason, the
  rollout goes on; `evaluate_policy` reports pass@k of a harness.

The tiny model is a random initialisation: it writes no tool calls, so a native guess-number episode
is three error observations to its turn limit. That is still a real multi-turn trajectory of the
engine's samples, which is what the comparison is about. The tool-call episode uses `ToolCallPolicy`.

vLLM runs with prefix caching off and one episode at a time: the two runs then hand the engine the same
requests in the same order, and its float32 CPU arithmetic gives the same bits.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

import agentrl
from agentrl.gateway.harness import HarnessEnv, HarnessTask, messages_loop_agent, responses_loop_agent
from agentrl.gateway.harness import tool_loop_agent as openai_agent  # the native loop's agent, as a harness
from agentrl.gateway.session import GATEWAY_METRICS
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.loop import collect_sync
from agentrl.rollout.masker import ChatMasker
from agentrl.rollout.policy import VLLMPolicy
from tests import fixtures_model
from tests.gateway.scripted import RecordingPolicy, ToolCallPolicy, assert_all_sampled, guess_call

tiny_model_dir = fixtures_model.tiny_model_dir

GUESS = "agentrl/guess-number-v0"
CFG = RolloutConfig(group_size=2, concurrency=1, max_tokens_per_turn=24, max_total_tokens=2048)


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path):
    p = VLLMPolicy(
        tiny_model_dir,
        in_process=True,
        dtype="float32",
        max_model_len=2048,
        cpu_threads=1,
        engine_kwargs={"enable_prefix_caching": False},
    )
    yield p
    p.close()


def native_env():
    return agentrl.make(GUESS, max_turns=3)


@pytest.mark.parametrize("env_id", [GUESS, "agentrl/calc-v0"])
@pytest.mark.parametrize("tools_in_prompt", [True, False])
def test_harness_prompt_is_the_native_prompt(tiny_model_dir, env_id, tools_in_prompt):
    """The first request of a harness episode is the native loop's prompt, id for id, for the same task:
    the tools written where the environment writes them, by the same renderer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    record = RecordingPolicy(ToolCallPolicy(tok, lambda _p, _n: "I give up."))
    kwargs = {"max_turns": 1, "backend": "local"} if env_id != GUESS else {"max_turns": 1}
    cfg = RolloutConfig(group_size=1, max_tokens_per_turn=16)
    schemas = agentrl.make(env_id, **kwargs).toolbox.schemas
    # Natively without the tools in the prompt, the template is what shows them (as the harness's session does).
    masker = ChatMasker(tok, tools=None if tools_in_prompt else schemas)
    native = collect_sync(
        lambda: agentrl.make(env_id, tools_in_prompt=tools_in_prompt, **kwargs),
        [0, 1],
        record,
        cfg,
        seed=3,
        masker=masker,
    )
    harness = collect_sync(
        lambda: HarnessEnv(env_id, openai_agent, tools_in_prompt=tools_in_prompt, **kwargs),
        [0, 1],
        record,
        cfg,
        seed=3,
        masker=ChatMasker(tok),
    )
    prompts = [p for p, _s, _g in record.calls]
    assert len(prompts) == 4 and sorted(prompts[:2]) == sorted(prompts[2:])
    for a, b in zip(native, harness, strict=True):
        assert a.token_ids[: a.prompt_len] == b.token_ids[: b.prompt_len]
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask
    text = tok.decode(prompts[0])
    assert text.count("<tools>\n") == 1 and "You may call one or more functions" in text
    assert ("like this:" in text) == tools_in_prompt  # the env's own wording, else the template's


@pytest.mark.vllm
def test_harness_equals_native_loop(policy):
    tok = policy.tokenizer
    native = collect_sync(native_env, [0, 1], policy, CFG, seed=7, masker=ChatMasker(tok))
    harness = collect_sync(
        lambda: HarnessEnv(GUESS, openai_agent, max_turns=3),
        [0, 1],
        policy,
        CFG,
        seed=7,
        masker=ChatMasker(tok),
    )
    assert len(native) == len(harness) == 4
    for a, b in zip(native, harness, strict=True):
        assert b.branches == 1 and b.drifted_calls == 0
        assert a.token_ids == b.token_ids
        assert a.loss_mask == b.loss_mask
        assert a.behavior_logprobs == b.behavior_logprobs
        assert a.prompt_len == b.prompt_len
        assert (a.task_id, a.group_id.split("@")[0]) == (b.task_id, b.group_id.split("@")[0])
        assert (a.finish_reason, a.reward, a.turns, a.format_errors) == (
            b.finish_reason,
            b.reward,
            b.turns,
            b.format_errors,
        )
        assert a.finish_reason == "max_turns" and a.turns == 3
        assert bool(a.drift and a.drift.drifted) == bool(b.drift and b.drift.drifted)
    # The episodes differ from each other (the seeds reach the engine), so the equality says something.
    assert len({tuple(t.token_ids) for t in harness}) == 4


async def forgetful_agent(client, task: HarnessTask) -> None:
    """Rewrites history before every call: earlier replies lose their text (as a harness that drops reasoning)."""
    messages = list(task.messages)
    while not task.done:
        sent = [{**m, "content": ""} if m["role"] == "assistant" else m for m in messages]
        reply = await client.chat.completions.create(model=task.model, messages=sent, tools=task.tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        messages += await task.step(message)


@pytest.mark.vllm
def test_rewritten_history_trains_only_sampled_tokens(policy):
    record = RecordingPolicy(policy)
    before = GATEWAY_METRICS["gateway/drifted_calls"]
    trajs = collect_sync(
        lambda: HarnessEnv(GUESS, forgetful_agent, max_turns=3),
        [0],
        record,
        CFG.model_copy(update={"group_size": 1}),
        seed=1,
    )
    # Calls 2 and 3 do not extend what was sampled: three branches, two drifted calls.
    assert [t.branch for t in trajs] == [0, 1, 2]
    assert all(t.branches == 3 and t.drifted_calls == 2 for t in trajs)
    assert GATEWAY_METRICS["gateway/drifted_calls"] - before == 2
    assert len(record.calls) == 3
    for t in trajs:
        assert assert_all_sampled(t, record) == 1
        assert t.finish_reason == "max_turns" and t.group_id == trajs[0].group_id
    # Each sample is trained on exactly once, in the context it was sampled in.
    assert sum(t.num_action_tokens for t in trajs) == sum(len(g.token_ids) for _p, _s, g in record.calls)


def _bisect(prompt: str, _n: int) -> str:
    """A binary search over the range the task states, from the answers so far in the prompt."""
    lo, hi = map(int, re.search(r"between (\d+) and (\d+)", prompt).groups())
    guesses = [int(g) for g in re.findall(r'"number": (\d+)', prompt)]
    answers = re.findall(r"<tool_response>\n(higher|lower)", prompt)
    for g, a in zip(guesses, answers, strict=False):
        lo, hi = (g + 1, hi) if a == "higher" else (lo, g - 1)
    return guess_call((lo + hi) // 2)


async def id_checking_agent(client, task: HarnessTask) -> None:
    """The tool loop, checking that each tool result answers the id of its call (unique ids, as OpenAI's)."""
    messages, ids = list(task.messages), []
    while not task.done:
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        obs = await task.step(message)
        calls = [c.id for c in message.tool_calls or []]
        assert [m["tool_call_id"] for m in obs if m["role"] == "tool"] == calls
        ids += calls
        messages += obs
    assert len(ids) == len(set(ids)) >= 1


def test_tool_calls_run_in_the_env_and_the_reward_lands(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    record = RecordingPolicy(ToolCallPolicy(tok, _bisect))
    trajs = collect_sync(
        lambda: HarnessEnv(GUESS, id_checking_agent, max_turns=12),
        [0, 1, 2],
        record,
        RolloutConfig(group_size=1, max_tokens_per_turn=64),
        seed=0,
    )
    assert len(trajs) == 3
    for t in trajs:
        assert t.finish_reason == "submitted" and t.passed and t.reward == 1.0
        assert t.branches == 1 and t.drifted_calls == 0 and t.tool_calls == t.turns >= 1
        assert assert_all_sampled(t, record) == t.turns
        assert not (t.drift and t.drift.drifted)


@pytest.mark.parametrize("agent", [openai_agent, responses_loop_agent, messages_loop_agent])
def test_every_dialect_gives_the_native_trajectory(tiny_model_dir, agent):
    """The native loop written against chat completions, the Responses API and Anthropic's Messages API:
    the same episodes give the native loop's trajectories, id for id (one session logic behind each)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = RolloutConfig(group_size=1, max_tokens_per_turn=64)
    native = collect_sync(
        lambda: agentrl.make(GUESS, max_turns=12),
        [0, 1],
        ToolCallPolicy(tok, _bisect),
        cfg,
        seed=0,
        masker=ChatMasker(tok),
    )
    record = RecordingPolicy(ToolCallPolicy(tok, _bisect))
    harness = collect_sync(lambda: HarnessEnv(GUESS, agent, max_turns=12), [0, 1], record, cfg, seed=0)
    for a, b in zip(native, harness, strict=True):
        assert a.passed and b.passed and b.branches == 1 and b.drifted_calls == 0
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.turns == b.turns >= 2
        assert assert_all_sampled(b, record) == b.turns


async def crashing_agent(client, task: HarnessTask) -> None:
    await client.chat.completions.create(model=task.model, messages=task.messages, tools=task.tools)
    raise ValueError("the harness has a bug")


async def hanging_agent(client, task: HarnessTask) -> None:
    await asyncio.sleep(3600)


async def quitting_agent(client, task: HarnessTask) -> None:
    await client.chat.completions.create(model=task.model, messages=task.messages, tools=task.tools)


async def chatty_agent(client, task: HarnessTask) -> None:
    """Asks again and again without ever stepping the environment."""
    messages = list(task.messages)
    for _ in range(10):
        reply = await client.chat.completions.create(model=task.model, messages=messages, tools=task.tools)
        messages += [
            reply.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "more"},
        ]


@pytest.mark.vllm
def test_every_ending_is_recorded_and_the_run_goes_on(policy):
    agents = [crashing_agent, quitting_agent, chatty_agent, openai_agent]
    tasks = agentrl.task_source(GUESS)
    by_task = {tasks.get(i, "train").id: agent for i, agent in enumerate(agents)}

    async def agent(client, task: HarnessTask) -> None:
        await by_task[task.task.id](client, task)

    cfg = CFG.model_copy(update={"group_size": 1, "concurrency": 4})
    trajs = collect_sync(lambda: HarnessEnv(GUESS, agent, max_turns=3), list(range(4)), policy, cfg, seed=0)
    ending = {t.task_id: t for t in trajs}
    crashed, quit_, chatty, normal = (ending[tasks.get(i, "train").id] for i in range(4))
    assert crashed.finish_reason == "agent_error" and "ValueError: the harness has a bug" in crashed.error
    assert not crashed.trainable and crashed.num_action_tokens > 0
    assert quit_.finish_reason == "submitted" and quit_.reward == 0.0 and quit_.trainable
    assert chatty.finish_reason == "max_turns" and chatty.num_action_tokens > 0
    assert normal.finish_reason == "max_turns" and normal.turns == 3
    assert all(t.verdict_details for t in trajs), "every episode is scored"


@pytest.mark.vllm
def test_a_hanging_agent_times_out(policy):
    cfg = CFG.model_copy(update={"group_size": 2, "episode_timeout_s": 3.0})
    gw_before = GATEWAY_METRICS["gateway/sessions"]
    trajs = collect_sync(lambda: HarnessEnv(GUESS, hanging_agent, max_turns=3), [0], policy, cfg, seed=0)
    assert [t.finish_reason for t in trajs] == ["timeout", "timeout"]
    assert all(not t.trainable and "wall-clock" in t.error for t in trajs)
    assert GATEWAY_METRICS["gateway/sessions"] - gw_before == 2


@pytest.mark.vllm
def test_eval_reports_pass_at_k_of_a_harness(policy):
    from agentrl.env.registry import registry
    from agentrl.eval.evaluate import evaluate_policy

    agentrl.register(
        "tests/guess-harness-v0",
        entry_point="agentrl.gateway:HarnessEnv",
        env=GUESS,
        agent=openai_agent,
        max_turns=2,
    )
    try:
        summary = evaluate_policy(
            policy,
            "tests/guess-harness-v0",
            split="test",
            num_tasks=2,
            samples=2,
            rollout=CFG.model_copy(update={"concurrency": 2}),
        )
    finally:
        registry.pop("tests/guess-harness-v0")
    assert summary.num_tasks == 2 and summary.samples_per_task == 2
    assert set(summary.pass_at_dict()) == {"pass@1", "pass@2"}
    assert summary.finish_reasons == {"max_turns": 4} and summary.mean_turns == 2
