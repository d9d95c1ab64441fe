"""Trajectories to tensors, and the one alignment rule the trainer must not get wrong.

Every `[B, T]` tensor here is indexed by *token position*, exactly like `Trajectory.token_ids`:
`loss_mask[b, t] == 1` means token t of sequence b was sampled by the policy, and
`behavior_logprobs[b, t]` is the log-probability the rollout engine gave to token t. A causal
LM's logits at position t predict token t + 1, so the log-prob of token t comes from the logits
at position t - 1. `sequence_logprobs` and `token_entropy` do that shift once, and return
tensors in the same token-position layout (position 0, which no prefix predicts, is 0). So
`collate(...).loss_mask`, `behavior_logprobs` and `sequence_logprobs(model(input_ids).logits,
input_ids)` line up element for element, with no slicing at the call site.

Padding is on the right: `attention_mask` is 1 on real tokens, and padded positions carry
`pad_id`, a 0 loss mask and 0 behaviour log-probs. Right padding keeps `position_ids` the
default `arange(T)`, which HF models use when none are passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from agentrl.rollout.trajectory import Trajectory


@dataclass
class Batch:
    """A padded batch of trajectories; every `[B, T]` tensor is in token-position layout."""

    input_ids: Tensor  # [B, T] int64, right-padded with pad_id
    attention_mask: Tensor  # [B, T] int64, 1 on real tokens
    loss_mask: Tensor  # [B, T] float32, 1 on sampled (action) tokens
    behavior_logprobs: Tensor  # [B, T] float32, rollout engine's log-prob of token t; 0 off the mask
    rewards: Tensor  # [B] float32
    lengths: Tensor  # [B] int64, real (unpadded) length of each sequence
    policy_versions: Tensor  # [B] int64, policy version that produced each trajectory
    group_ids: list[str]
    task_ids: list[str]

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """A copy with every tensor moved to `device` (ids and lists are shared). `non_blocking` from the
        host: the copies do not wait for the kernels already queued on the device."""
        moved = {
            f.name: (v.to(device, non_blocking=non_blocking) if isinstance(v, Tensor) else v)
            for f in fields(self)
            for v in [getattr(self, f.name)]
        }
        return Batch(**moved)


def collate(trajectories: Sequence[Trajectory], pad_id: int) -> Batch:
    """Pad `trajectories` on the right into a `Batch` (token-position layout, see the module doc).

    Raises ValueError if the list is empty or a trajectory marks its first token as an action:
    token 0 has no prefix, so no logits predict it and it can carry no loss.
    """
    if not trajectories:
        raise ValueError("collate() got no trajectories; pass at least one")
    for traj in trajectories:
        if traj.loss_mask and traj.loss_mask[0]:
            raise ValueError(
                f"trajectory of task {traj.task_id!r} (group {traj.group_id!r}) has loss_mask[0] == 1: "
                "the first token has no prefix to be predicted from; a trajectory must start with prompt tokens"
            )
        if any(m not in (0, 1) for m in traj.loss_mask):
            raise ValueError(f"trajectory of task {traj.task_id!r} has a loss_mask value other than 0 or 1")
    batch_size = len(trajectories)
    max_len = max(len(t.token_ids) for t in trajectories)
    input_ids = torch.full((batch_size, max_len), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((batch_size, max_len), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((batch_size, max_len), dtype=torch.float32)  # [B, T]
    behavior_logprobs = torch.zeros((batch_size, max_len), dtype=torch.float32)  # [B, T]
    for b, traj in enumerate(trajectories):
        n = len(traj.token_ids)
        input_ids[b, :n] = torch.tensor(traj.token_ids, dtype=torch.long)
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(traj.loss_mask, dtype=torch.float32)
        # Observation tokens carry 0.0 already; zero them again so a sloppy producer cannot leak a value.
        behavior_logprobs[b, :n] = (
            torch.tensor(traj.behavior_logprobs, dtype=torch.float32) * loss_mask[b, :n]
        )
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        behavior_logprobs=behavior_logprobs,
        rewards=torch.tensor([t.reward for t in trajectories], dtype=torch.float32),  # [B]
        lengths=torch.tensor([len(t.token_ids) for t in trajectories], dtype=torch.long),  # [B]
        policy_versions=torch.tensor([t.policy_version for t in trajectories], dtype=torch.long),  # [B]
        group_ids=[t.group_id for t in trajectories],
        task_ids=[t.task_id for t in trajectories],
    )


def sequence_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log π(token t | tokens < t) for every position, in token-position layout.

    out[:, t] = log_softmax(logits[:, t - 1] / temperature)[input_ids[:, t]] for t >= 1, and
    out[:, 0] = 0 (nothing predicts the first token). Computed in float32 as
    `gather(z) - logsumexp(z)`, which never materialises a second [B, T, V] log-softmax tensor.

    `temperature` must match the one the rollout engine sampled with when its log-probs are of
    the tempered distribution (vLLM's default `logprobs_mode` reports the raw distribution;
    check the engine before comparing).
    """
    if logits.shape[:2] != input_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and input_ids {tuple(input_ids.shape)} disagree on [B, T]"
        )
    z = logits[:, :-1].float()  # [B, T-1, V] logits at t-1 predict token t
    if temperature != 1.0:
        z = z / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)  # [B, T-1, 1]
    picked = z.gather(-1, targets).squeeze(-1)  # [B, T-1]
    logp = picked - torch.logsumexp(z, dim=-1)  # [B, T-1]
    return torch.nn.functional.pad(logp, (1, 0))  # [B, T] position 0 gets 0


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the distribution each token was drawn from, in token-position layout.

    out[:, t] = H(softmax(logits[:, t - 1] / temperature)) for t >= 1 and out[:, 0] = 0, so
    `(token_entropy(logits) * loss_mask).sum() / loss_mask.sum()` is the mean entropy over the
    action tokens. H(p) = logsumexp(z) - Σ_v softmax(z)_v z_v.
    """
    z = logits[:, :-1].float()  # [B, T-1, V]
    if temperature != 1.0:
        z = z / temperature
    probs = torch.softmax(z, dim=-1)  # [B, T-1, V]
    entropy = torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)  # [B, T-1]
    return torch.nn.functional.pad(entropy, (1, 0))  # [B, T]
