"""The one trajectory builder: a masked sequence and the policy versions that sampled it, with what its
episode recorded, become a `Trajectory`.

Every trajectory is made here: the native loop's (`agentrl.rollout.loop`: one per episode), a driven
episode's (`agentrl.rollout.driver`, such as a harness's gateway session: one per branch of its calls)
and the `agentrl gateway` server's unscored sessions alike, so the token fields, the policy versions and
the drift check are filled the same way wherever the tokens came from.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.masker import ChatMasker, MaskedSequence
from agentrl.rollout.trajectory import Trajectory


class SampledBranch(Protocol):
    """One chain of calls (`agentrl.gateway.session.Branch`): its tokens, versions and renderer."""

    seq: MaskedSequence
    versions: list[int]
    masker: ChatMasker


def sequence_fields(
    seq: MaskedSequence | None,
    versions: Sequence[int],
    *,
    masker: ChatMasker | None = None,
    rollout: RolloutConfig | None = None,
) -> dict[str, Any]:
    """The fields of a trajectory that its tokens give: ids, loss mask, behaviour log-probs, per-id versions,
    the prompt's length and messages, the oldest and newest policy version (of `versions`, not empty), and
    the drift report when `rollout` asks for the check (`drift_check`, made with `masker`)."""
    drift = None
    if seq is not None and masker is not None and rollout is not None and rollout.drift_check:
        drift = masker.check_drift(seq, warn=rollout.warn_on_drift) if len(seq) > seq.prompt_len else None
    return {
        "token_ids": list(seq.token_ids) if seq is not None else [],
        "loss_mask": list(seq.loss_mask) if seq is not None else [],
        "behavior_logprobs": list(seq.behavior_logprobs) if seq is not None else [],
        "token_versions": list(seq.token_versions) if seq is not None else [],
        "prompt_len": seq.prompt_len if seq is not None else 0,
        "messages": list(seq.messages) if seq is not None else [],
        "policy_version": min(versions),
        "policy_version_max": max(versions),
        "drift": drift,
    }


def build_trajectory(
    seq: MaskedSequence | None,
    versions: Sequence[int],
    *,
    masker: ChatMasker | None = None,
    rollout: RolloutConfig | None = None,
    **fields: Any,
) -> Trajectory:
    """A trajectory of `seq`'s tokens (none: an episode that ended before its first sample) with `fields`
    (task, group, reward, finish reason, ...) on top; `fields` may override a token field's default
    (`messages`: the environment's record of the conversation)."""
    return Trajectory(**{**sequence_fields(seq, versions, masker=masker, rollout=rollout), **fields})


def branch_trajectories(
    base: Trajectory,
    branches: Sequence[SampledBranch],
    *,
    rollout: RolloutConfig | None = None,
    **changes: Any,
) -> list[Trajectory]:
    """`base` (an episode's trajectory without tokens: its task, reward, finish reason) once per branch, each
    with its branch's tokens and numbered (`branch`, `branches`), and `changes` on top; drift is checked
    with each branch's own renderer when `rollout` asks for it. Each gets timings of its own (a copy)."""
    timings = changes.pop("timings", base.timings)
    return [
        dataclasses.replace(
            base,
            **sequence_fields(b.seq, b.versions, masker=b.masker, rollout=rollout),
            branch=i,
            branches=len(branches),
            timings=dataclasses.replace(timings),
            **changes,
        )
        for i, b in enumerate(branches)
    ]
