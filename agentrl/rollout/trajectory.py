"""`Trajectory`: one finished episode as the trainer sees it. Token ids are the truth.

`token_ids` is the whole conversation exactly as the policy saw and produced it: the prompt,
then, turn by turn, the tokens the policy sampled (`loss_mask` 1) and the observation tokens
the environment appended (`loss_mask` 0). `behavior_logprobs[i]` is the log-probability the
rollout engine gave to sampled token i (0.0 where the mask is 0). Nothing is re-tokenized
from text after the fact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrl.core.types import FinishReason, Message

# Episodes that ended for a reason outside the policy's control are kept for inspection but
# excluded from the loss by default: their reward says nothing about the policy.
UNTRAINABLE_FINISH_REASONS: frozenset[FinishReason] = frozenset(
    {"env_error", "timeout", "engine_error", "agent_error"}
)


@dataclass
class Timings:
    generate_s: float = 0.0
    env_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0


@dataclass
class DriftReport:
    """Where the appended ids differ from a full re-render of the conversation with the chat template."""

    drifted: bool = False
    first_mismatch: int | None = None  # index into token_ids of the first differing id
    rendered_len: int = 0
    detail: str = ""
    # "tokenization" (same text, different ids) or "template" (the template rewrites the text); "" if none.
    kind: str = ""


@dataclass
class Trajectory:
    task_id: str
    group_id: str
    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    prompt_len: int
    reward: float
    passed: bool
    finish_reason: FinishReason
    policy_version: int
    env_id: str = ""
    split: str = "train"
    verdict_details: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    format_errors: int = 0
    # The policy versions that produced the oldest (`policy_version`) and newest sampled token (async
    # training can update weights mid-episode); staleness is measured from the oldest.
    policy_version_max: int | None = None
    timings: Timings = field(default_factory=Timings)
    drift: DriftReport | None = None
    messages: list[Message] = field(default_factory=list)
    error: str | None = None
    # A harness episode (`agentrl.gateway`) may give several trajectories: one per branch of its calls.
    branch: int = 0
    """This trajectory's branch of its episode: 0 ends at the episode's last call (the one evaluations
    score), the others are earlier leaves (history the harness rewrote, choices it did not continue)."""
    branches: int = 1
    """How many trajectories its episode gave."""
    drifted_calls: int = 0
    """Calls of its episode whose conversation did not extend the tokens already sampled (each began a branch)."""
    loss_weight: float = 1.0
    """A factor on its advantage, set by the curriculum's sampler for its group (`mgpo`); 1: GRPO's own."""
    restarts: int = 0
    """Times its episode was abandoned and started again because weights were pushed while it ran
    (`RolloutConfig.on_push: restart`)."""
    judged: bool = True
    """False when its verifier could not score it (`Verdict.judged`: a judge that failed): not trainable."""
    submission: str | None = None
    """What the agent submitted (`Episode.submission`); a group judge scores the group's submissions together."""
    token_versions: list[int] = field(default_factory=list)
    """Per id, the weights version that sampled it (a push mid-episode, even mid-turn, changes it); -1
    for ids not sampled (prompt, observations) and where the policy did not say. Empty: not recorded."""
    scored: bool = True
    """False when no verifier ran on it (the `agentrl gateway` server's sessions): its reward means nothing."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.behavior_logprobs) != n:
            raise ValueError(
                f"token_ids ({n}), loss_mask ({len(self.loss_mask)}) and behavior_logprobs "
                f"({len(self.behavior_logprobs)}) must have the same length"
            )
        if self.token_versions and len(self.token_versions) != n:
            raise ValueError(
                f"token_ids ({n}) and token_versions ({len(self.token_versions)}) differ in length"
            )
        if self.policy_version_max is None:
            self.policy_version_max = self.policy_version

    @property
    def trainable(self) -> bool:
        """Whether the loss may use it: it ended by the policy's doing and its verifier judged it."""
        return self.finish_reason not in UNTRAINABLE_FINISH_REASONS and self.judged

    @property
    def num_action_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["timings"] = Timings(**d.get("timings") or {})
        if d.get("drift") is not None:
            d["drift"] = DriftReport(**d["drift"])
        return cls(**d)


def save_trajectories(path: str | Path, trajectories: Iterable[Trajectory], *, append: bool = False) -> int:
    n = 0
    with open(path, "a" if append else "w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict(), separators=(",", ":")) + "\n")
            n += 1
    return n


def iter_trajectories(path: str | Path) -> Iterator[Trajectory]:
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield Trajectory.from_dict(json.loads(line))
                except Exception as exc:
                    raise ValueError(f"{path}:{lineno}: not a valid trajectory ({exc})") from exc


def load_trajectories(path: str | Path) -> list[Trajectory]:
    return list(iter_trajectories(path))
