"""collate / sequence_logprobs / token_entropy: the next-token alignment, checked on hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.batch import Batch, collate, sequence_logprobs, token_entropy


def traj(token_ids, loss_mask, behavior_logprobs, reward=0.0, group_id="g", task_id="t", policy_version=0):
    return Trajectory(
        task_id=task_id,
        group_id=group_id,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behavior_logprobs=behavior_logprobs,
        prompt_len=2,
        reward=reward,
        passed=reward >= 1.0,
        finish_reason="submitted",
        policy_version=policy_version,
    )


def two_trajectories() -> list[Trajectory]:
    # A: prompt (1, 2), sampled 3 and 4.  B: prompt (2,), sampled 3, observation token 1.
    a = traj([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.5, -0.7], reward=1.0, group_id="g0", task_id="ta")
    b = traj(
        [2, 3, 1], [0, 1, 0], [0.0, -0.2, 0.0], reward=0.0, group_id="g0", task_id="ta", policy_version=3
    )
    return [a, b]


def test_collate_pads_right_in_token_position_layout() -> None:
    batch = collate(two_trajectories(), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4], [2, 3, 1, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert torch.allclose(batch.behavior_logprobs, torch.tensor([[0, 0, -0.5, -0.7], [0, -0.2, 0, 0]]))
    assert batch.rewards.tolist() == [1.0, 0.0]
    assert batch.lengths.tolist() == [4, 3]
    assert batch.policy_versions.tolist() == [0, 3]
    assert batch.group_ids == ["g0", "g0"] and batch.task_ids == ["ta", "ta"]
    assert batch.num_action_tokens == 3 and batch.num_sequences == 2
    assert batch.loss_mask.dtype == torch.float32 and batch.input_ids.dtype == torch.long


def test_collate_zeroes_behaviour_logprobs_off_the_mask() -> None:
    # A producer that left a value on an observation token must not leak it into the batch.
    batch = collate([traj([5, 6, 7], [0, 1, 0], [-9.0, -0.1, -9.0])], pad_id=0)
    assert torch.allclose(batch.behavior_logprobs, torch.tensor([[0.0, -0.1, 0.0]]))


def test_collate_rejects_an_action_first_token_and_an_empty_list() -> None:
    with pytest.raises(ValueError, match="first token has no prefix"):
        collate([traj([5, 6], [1, 1], [-0.1, -0.1])], pad_id=0)
    with pytest.raises(ValueError, match="no trajectories"):
        collate([], pad_id=0)


def test_sequence_logprobs_take_token_t_from_the_logits_at_t_minus_1() -> None:
    # V = 3. The logits at each position are the logs of a distinct distribution:
    #   position 0 predicts (0.5, 0.25, 0.25), position 1 (0.1, 0.2, 0.7), position 2 (0.6, 0.3, 0.1)
    # input_ids (0, 2, 1): out[0] = 0 (no prefix), out[1] = log p_0[2] = log 0.25,
    #   out[2] = log p_1[1] = log 0.2. (The logits at the last position predict nothing here.)
    probs = torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.2, 0.7], [0.6, 0.3, 0.1]]])
    logits = probs.log() + 3.0  # a constant shift per row does not change log_softmax
    out = sequence_logprobs(logits, torch.tensor([[0, 2, 1]]))
    assert out.shape == (1, 3)
    assert out[0].tolist() == pytest.approx([0.0, math.log(0.25), math.log(0.2)])


def test_sequence_logprobs_are_log_probs_given_the_prefix_of_a_causal_model() -> None:
    # Reference: for every t, run the model on the prefix ids[:t] and read its last position.
    torch.manual_seed(0)
    vocab, dim = 11, 8
    embed, mix, head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, dim), torch.nn.Linear(dim, vocab)

    def model(ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, V], causal (prefix means)
        h = embed(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1).view(1, -1, 1)
        return head(torch.tanh(mix(h)))

    batch = collate(two_trajectories(), pad_id=0)
    with torch.no_grad():
        out = sequence_logprobs(model(batch.input_ids), batch.input_ids)  # [B, T]
        for b in range(2):
            for t in range(1, int(batch.lengths[b])):
                ids = batch.input_ids[b : b + 1, :t]
                expected = torch.log_softmax(model(ids)[0, -1], -1)[batch.input_ids[b, t]]
                assert out[b, t].item() == pytest.approx(expected.item(), abs=1e-5)
        assert torch.all(out[:, 0] == 0)
    # The masked positions of `out` are the sampled tokens' log-probs, the same layout as behaviour's.
    assert out.shape == batch.loss_mask.shape == batch.behavior_logprobs.shape


def test_sequence_logprobs_temperature_and_gradient() -> None:
    # Temperature 2 on logits (0, log 4): softmax of (0, log 2) = (1/3, 2/3); token 1 -> log(2/3)
    logits = torch.tensor([[[0.0, math.log(4)], [0.0, 0.0]]], requires_grad=True)
    out = sequence_logprobs(logits, torch.tensor([[0, 1]]), temperature=2.0)
    assert out[0, 1].item() == pytest.approx(math.log(2 / 3))
    out[0, 1].backward()
    # d log softmax(z/τ)_1 / d z = (onehot - softmax) / τ = ((0 - 1/3) / 2, (1 - 2/3) / 2)
    assert logits.grad[0, 0].tolist() == pytest.approx([-1 / 6, 1 / 6])
    assert logits.grad[0, 1].tolist() == [0.0, 0.0]


def test_token_entropy_is_aligned_like_the_logprobs() -> None:
    # Position 0 logits uniform over 4 (H = log 4), position 1 nearly one-hot (H ≈ 0).
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]])
    h = token_entropy(logits)
    assert h.shape == (1, 3)
    assert h[0].tolist() == pytest.approx([0.0, math.log(4), 0.0], abs=1e-6)


def test_batch_to_moves_tensors_and_keeps_lists() -> None:
    batch = collate(two_trajectories(), pad_id=0)
    moved = batch.to("cpu")
    assert isinstance(moved, Batch) and moved.group_ids == batch.group_ids
    assert torch.equal(moved.input_ids, batch.input_ids)
