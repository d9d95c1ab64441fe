"""Demonstrations: an environment's oracle played through the rollout engine, saved as Trajectory JSONL.

    agentrl demos agentrl/calc-v0 --n 800 --out demos.jsonl --model runs/tiny

The oracle (`env.oracle(task)`, an `agentrl.env.agents.Agent`) is wrapped in a `ScriptedPolicy`: a
`Policy` whose "sampled" ids are the oracle's next message, tokenized, plus the template's
end-of-turn token. The rollout engine (`agentrl.rollout.loop.collect`) runs it exactly like a sampling
policy: the same `ChatMasker` appends those ids with mask 1 and the observations as template deltas
with mask 0, the same drift check re-renders the conversation. So SFT on demonstrations trains on the
token ids and loss mask the RL trainer would see for the same conversation; there is no second
masker to drift from the first. Behaviour log-probs are 0 (log 1: the script is deterministic).

The oracle text is tokenized once, by the tokenizer's canonical encoding: what a model trained on
demonstrations learns to sample. A tokenizer that cannot round-trip the text (decode(encode(t)) != t)
is an error here, not a silent difference between what the environment saw and what is trained.

**Through a harness.** For a harness environment (`agentrl.gateway.HarnessEnv`: the user's own agent,
its own system prompt and tool schemas), the agent itself plays each demonstration: its requests go to
its gateway session as in training, and the session's completions come from the oracle (the
environment's next action, read from the environment's own record of the episode) instead of the
engine. The trajectory is what the gateway records, token for token: the agent's prompt as its chat
template renders it, the oracle's message as the ids the model should sample, the tool results in the
agent's own rendering. SFT on it teaches the model the agent's format, not the environment's.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrl.core.types import Split
from agentrl.env.agents import Agent
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.masker import ChatMasker, MaskedSequence
from agentrl.rollout.policy import Generation, SamplingConfig
from agentrl.rollout.trajectory import Trajectory, save_trajectories


class ScriptedPolicy:
    """A `Policy` that plays one episode with a scripted agent (an oracle); made per episode.

    The rollout engine creates one per episode through `collect(..., episode_policy=...)` and hands
    it the episode's `MaskedSequence`: the agent reads the newest observation from `seq.messages`
    (the conversation as the policy has seen it), so nothing is decoded back from ids.
    """

    version = 0
    """A script has no weights to update."""

    def __init__(
        self,
        agent: Agent,
        seq: MaskedSequence | None,
        masker: ChatMasker,
        conversation: Callable[[], list[dict[str, Any]]] | None = None,
    ):
        if seq is None and conversation is None:
            raise ValueError("ScriptedPolicy needs the episode's sequence or a conversation to read")
        self.agent, self.seq, self.masker = agent, seq, masker
        self.conversation = conversation if conversation is not None else lambda: seq.messages
        """The episode as the agent sees it: `seq.messages`, or (through a harness) the environment's record."""

    def newest_observation(self) -> list[dict[str, Any]]:
        """The messages after the last assistant turn (the first messages, on the first turn)."""
        messages = self.conversation()
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        return [dict(m) for m in messages[last + 1 :]]

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        # Through a harness the prompt is the agent's rendering, which the gateway checks and records.
        if self.seq is not None and list(prompt_ids) != self.seq.token_ids:
            raise RuntimeError(
                "ScriptedPolicy was asked to continue ids that are not its episode's sequence; build one "
                "ScriptedPolicy per episode through collect(..., episode_policy=...)"
            )
        text = self.agent.act(self.newest_observation())
        ids = self.masker.encode(text)
        if self.masker.decode(ids) != text:
            raise ValueError(
                f"the tokenizer does not round-trip the agent's message {text[:80]!r} (decodes to "
                f"{self.masker.decode(ids)[:80]!r}); demonstrations would train on text the environment never saw. "
                "Use a tokenizer that covers every byte (byte-level BPE)"
            )
        ids.append(self.masker.end_of_turn_id)
        finish = "stop"
        if len(ids) > sampling.max_tokens:  # the same cut a sampling policy gets from max_tokens
            ids, finish = ids[: sampling.max_tokens], "length"
        return Generation(
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            stop_reason=finish,
            policy_version=self.version,
            policy_version_end=self.version,
        )


def oracle_policy(masker: ChatMasker):
    """The `episode_policy` factory for `collect`: the environment's oracle for the task it just reset to."""

    def make(env: Any, seq: MaskedSequence | None) -> ScriptedPolicy:
        oracle = getattr(env, "oracle", None)
        if oracle is None:
            raise TypeError(
                f"environment {getattr(env, 'env_id', type(env).__name__)} has no oracle(task); demonstrations "
                "need one (see agentrl.env.tool_env.ToolEnv subclasses in agentrl.envs)"
            )
        if seq is None:  # a harness episode: the oracle reads the environment's own record of it
            return ScriptedPolicy(oracle(env.task), None, masker, conversation=lambda: env.episode.messages)
        return ScriptedPolicy(oracle(env.task), seq, masker)

    return make


@dataclass(frozen=True)
class DemoStats:
    """What `generate_demos` wrote."""

    episodes: int
    passed: int
    drifted: int
    mean_tokens: float
    mean_action_tokens: float
    seconds: float
    kinds: dict[str, int]
    """Episodes per task kind (`task.metadata["kind"]`), where the environment sets one."""
    first_failure: str = ""
    """Why the first episode that did not pass failed (its error, else its verdict), "" when all passed."""
    trajectories: int = 0
    """Trajectories written: one per episode, or one per branch of a harness episode's calls."""


def generate_demos(
    env_id: str,
    n: int,
    out: str | Path,
    tokenizer: Any,
    *,
    split: Split = "train",
    start: int = 0,
    kinds: list[str] | None = None,
    backend: str = "local",
    rollout: RolloutConfig | None = None,
    env_kwargs: dict[str, Any] | None = None,
) -> tuple[list[Trajectory], DemoStats]:
    """Play the oracle on `n` tasks of `split` (generator indices from `start`) and save the trajectories.

    `kinds` keeps only tasks whose `metadata["kind"]` is listed (indices are skipped until `n` are found).
    `tokenizer` is a Hugging Face tokenizer (the model's: the ids are that model's ids) or a `ChatMasker`.
    `rollout` bounds the episodes (context budget, timeouts) and sets how many run at once; one
    demonstration per task whatever its `group_size`, and its sampling settings do not apply to a script.
    """
    from agentrl.env.registry import task_source
    from agentrl.rollout.loop import collect

    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    masker = tokenizer if isinstance(tokenizer, ChatMasker) else ChatMasker(tokenizer)
    kwargs = {"backend": backend, **(env_kwargs or {})}
    source = task_source(env_id, split=split, **kwargs)
    tasks = []
    index = start
    # Bounded scan: a `kinds` filter that matches nothing must fail, not loop forever.
    while len(tasks) < n and index < start + 100 * n:
        task = source.get(index, split)
        index += 1
        if kinds is None or task.metadata.get("kind") in kinds:
            tasks.append(task)
    if len(tasks) < n:
        raise ValueError(
            f"only {len(tasks)} of the first {index - start} {split} tasks of {env_id} have a kind in {kinds}; "
            "check the kinds against the tasks' metadata['kind']"
        )
    cfg = (rollout or RolloutConfig()).model_copy(update={"group_size": 1})
    t0 = time.perf_counter()
    trajectories = asyncio.run(
        collect(
            env_id,
            tasks,
            _NoPolicy(masker.tokenizer),
            cfg,
            seed=0,
            masker=masker,
            env_kwargs=kwargs,
            episode_policy=oracle_policy(masker),
        )
    )
    seconds = time.perf_counter() - t0
    save_trajectories(out, trajectories)
    episodes = [t for t in trajectories if t.branch == 0]  # a harness episode's other branches: not again
    count = len(episodes)
    failed = next((t for t in episodes if not t.passed), None)
    stats = DemoStats(
        episodes=count,
        passed=sum(t.passed for t in episodes),
        drifted=sum(bool(t.drift and t.drift.drifted) for t in trajectories),
        mean_tokens=sum(len(t.token_ids) for t in trajectories) / len(trajectories),
        mean_action_tokens=sum(t.num_action_tokens for t in trajectories) / len(trajectories),
        seconds=seconds,
        kinds=dict(Counter(str(t.metadata.get("kind", "")) for t in tasks)),
        first_failure=_why(failed) if failed is not None else "",
        trajectories=len(trajectories),
    )
    return trajectories, stats


def _why(t: Trajectory) -> str:
    """Why an episode did not pass, in one line: its ending, its error, the verdict, the last thing it was told."""
    from agentrl.core.errors import one_line

    said = [f"task {t.task_id} ended {t.finish_reason}"]
    if t.error:
        said.append(t.error)
    if t.verdict_details:
        said.append(f"verdict: {t.verdict_details}")
    told = [m for m in t.messages if m.get("role") in ("tool", "user")]
    if told and len(t.messages) > 2:
        said.append(f"last observation: {str(told[-1].get('content', ''))[:300]}")
    return one_line("; ".join(said))


class _NoPolicy:
    """The shared policy `collect` requires; every episode plays its own ScriptedPolicy instead."""

    version = 0

    def __init__(self, tokenizer: Any = None):
        self.tokenizer = tokenizer  # a harness episode's gateway renders with it

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        raise RuntimeError("demonstrations are played by per-episode ScriptedPolicy objects, not this one")
