"""Policies for the gateway's tests that are not the engine under test.

- `ToolCallPolicy`: writes fixed Hermes tool calls (the tiny model is a random initialisation and never
  writes one), as canonical ids with made-up log-probs: what the gateway does with tool calls (parse,
  return, step, stitch) is under test, not the sampling.
- `RecordingPolicy`: wraps a real policy and records every (prompt ids, generation) it returned: the
  engine's record, against which every trained token of a trajectory is checked.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from agentrl.rollout.masker import ChatMasker
from agentrl.rollout.policy import Generation, SamplingConfig
from agentrl.rollout.trajectory import Trajectory


class ToolCallPolicy:
    """Writes `write(prompt text, call number)` (a Hermes message) as canonical ids, end-of-turn appended."""

    def __init__(self, tokenizer, write: Callable[[str, int], str]):
        self.masker = ChatMasker(tokenizer)
        self.tokenizer = tokenizer
        self.write = write
        self.version = 0
        self.calls = 0

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        await asyncio.sleep(0)
        text = self.write(self.masker.decode(prompt_ids), self.calls)
        self.calls += 1
        ids = [*self.masker.encode(text), self.masker.end_of_turn_id][: sampling.max_tokens]
        reason = "stop" if ids[-1] == self.masker.end_of_turn_id else "length"
        return Generation(
            ids, [-0.25 - 0.001 * i for i in range(len(ids))], reason, self.version, self.version
        )


def guess_call(number: int, text: str = "") -> str:
    call = json.dumps({"name": "guess", "arguments": {"number": number}})
    return f"{text}<tool_call>\n{call}\n</tool_call>"


class RecordingPolicy:
    """Wraps a real policy; records every (prompt ids, generation) it returned."""

    def __init__(self, inner):
        self.inner = inner
        self.tokenizer = getattr(inner, "tokenizer", None)
        self.calls: list[tuple[list[int], SamplingConfig, Generation]] = []

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        gen = await self.inner.generate(prompt_ids, sampling)
        self.calls.append((list(prompt_ids), sampling, gen))
        return gen


def sampled_runs(t: Trajectory) -> list[tuple[int, list[int], list[float]]]:
    """(start, ids, behaviour log-probs) of each maximal run of mask-1 ids."""
    runs: list[tuple[int, list[int], list[float]]] = []
    for i, (tok, m, lp) in enumerate(zip(t.token_ids, t.loss_mask, t.behavior_logprobs, strict=True)):
        if m == 1:
            if i == 0 or t.loss_mask[i - 1] != 1:
                runs.append((i, [], []))
            runs[-1][1].append(tok)
            runs[-1][2].append(lp)
    return runs


def assert_all_sampled(t: Trajectory, record: RecordingPolicy) -> int:
    """Every trained token of `t` was sampled by the engine, in the context the trajectory shows, with the
    engine's log-prob; returns how many sampled runs were checked."""
    assert all(lp == 0.0 for lp, m in zip(t.behavior_logprobs, t.loss_mask, strict=True) if m == 0)
    runs = sampled_runs(t)
    for start, ids, lps in runs:
        context = t.token_ids[:start]
        gens = [g for prompt, _s, g in record.calls if prompt == context]
        assert gens, f"the trajectory trains on ids at {start} after a context the engine was never given"
        # A run is one generation, or its head when a stop string cut it.
        match = [g for g in gens if g.token_ids[: len(ids)] == ids]
        assert match, (
            f"the trajectory trains on ids at {start} that the engine did not sample in that context"
        )
        # Two requests (say, under different constraints) can sample the same ids with other log-probs.
        assert any(g.logprobs[: len(ids)] == lps for g in match), "behaviour log-probs differ from the engine's"
    return len(runs)


def as_trajectory(branch) -> Trajectory:
    """A session's branch (`agentrl.gateway.session.Branch`) as an unscored trajectory."""
    s = branch.seq
    return Trajectory(
        task_id="t",
        group_id="g",
        token_ids=list(s.token_ids),
        loss_mask=list(s.loss_mask),
        behavior_logprobs=list(s.behavior_logprobs),
        prompt_len=s.prompt_len,
        reward=0.0,
        passed=False,
        finish_reason="submitted",
        policy_version=0,
    )
