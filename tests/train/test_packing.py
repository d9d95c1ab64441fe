"""Micro-batches by token budget: the plan (hand-computed), and the padded batch's loss and gradients
through the real `grpo_step`, padded by length bucket or packed, for every loss aggregation."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.batch import collate
from agentrl.train.config import TrainConfig
from agentrl.train.packing import (
    MIN_SHARED_PREFIX,
    common_prefix,
    filler,
    micro_batch_cost,
    packed_inputs,
    plan_micro_batches,
    resolve_packing,
    resolve_share_prefix,
    shared_cost,
    shared_prefix_inputs,
    shared_prefix_length,
)
from tests.fixtures_dist import assert_same_gradients, grpo_step_gradients, one_rank_group  # noqa: F401
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)


def traj(n: int, tag: str = "", vocab: int = 50, reward: float = 0.0, group: str = "g") -> Trajectory:
    rng = random.Random(n * 7919 + len(tag))
    mask = [0] * min(4, n - 1) + [1 if (j // 3) % 2 == 0 else 0 for j in range(n - min(4, n - 1))]
    return Trajectory(
        task_id=f"{tag}{n}",
        group_id=group,
        token_ids=[rng.randrange(vocab) for _ in range(n)],
        loss_mask=mask,
        behavior_logprobs=[-7.8 if m else 0.0 for m in mask],
        prompt_len=4,
        reward=reward,
        passed=reward > 0,
        finish_reason="submitted",
        policy_version=0,
    )


def lengths(plan_rank: list[list[Trajectory]]) -> list[list[int]]:
    return [[len(t.token_ids) for t in mb] for mb in plan_rank]


def test_cost_is_count_times_longest_padded_and_the_sum_packed() -> None:
    assert micro_batch_cost([10, 6, 6], packed=False) == 30
    assert micro_batch_cost([10, 6, 6], packed=True) == 22
    assert micro_batch_cost([], packed=True) == 0


def test_padded_plan_buckets_by_length_under_the_budget() -> None:
    batch = [traj(n) for n in (6, 10, 6, 6)]
    plan = plan_micro_batches(batch, 1, max_tokens=24, packed=False)
    # Longest first: [10, 6] costs 2 x 10 = 20; a third would cost 30 > 24; the other two 6s go together.
    assert lengths(plan.for_rank(0)) == [[10, 6], [6, 6]]


def test_packed_plan_fills_the_budget_with_the_sum_of_lengths() -> None:
    batch = [traj(n) for n in (6, 10, 6, 6)]
    plan = plan_micro_batches(batch, 1, max_tokens=24, packed=True)
    assert lengths(plan.for_rank(0)) == [[10, 6, 6], [6]]  # 22 <= 24, then 28 > 24


def test_a_sequence_longer_than_the_budget_runs_alone_and_the_count_cap_holds() -> None:
    batch = [traj(n) for n in (40, 5, 5, 5)]
    assert lengths(plan_micro_batches(batch, 1, max_tokens=16, packed=True).for_rank(0)) == [[40], [5, 5, 5]]
    assert lengths(plan_micro_batches(batch, 1, max_sequences=2).for_rank(0)) == [[40, 5], [5, 5]]
    assert lengths(plan_micro_batches(batch, 1).for_rank(0)) == [[40, 5, 5, 5]]


def test_ranks_get_balanced_shares_and_the_same_number_of_micro_batches() -> None:
    batch = [traj(n, tag=str(i)) for i, n in enumerate((30, 28, 9, 8, 7))]
    plan = plan_micro_batches(batch, 2, max_tokens=32, packed=True)
    # Longest first, each to the rank with fewer tokens: r0 30, r1 28, r1 9 (37), r0 8 (38), r1 7 (44).
    assert lengths(plan.for_rank(0)) == [[30], [8]]
    assert lengths(plan.for_rank(1)) == [[28], [9, 7]]  # 28 + 9 > 32


def test_a_rank_with_fewer_micro_batches_runs_a_two_token_zero_loss_filler() -> None:
    batch = [traj(n, tag=str(i)) for i, n in enumerate((30, 29, 5))]
    plan = plan_micro_batches(batch, 2, max_tokens=32, packed=True)
    assert lengths(plan.for_rank(1)) == [[29], [5]]  # 29 + 5 > 32
    assert lengths(plan.for_rank(0)) == [[30], [2]]
    (fill,) = plan.for_rank(0)[1]
    assert fill.loss_mask == [0, 0] and fill.behavior_logprobs == [0.0, 0.0]


def test_the_filler_of_a_trajectory_with_per_token_versions_is_a_valid_trajectory() -> None:
    like = replace(traj(30), token_versions=[3] * 30)  # what every trajectory of a real rollout carries
    fill = filler(like)
    assert (fill.token_versions, filler(traj(30)).token_versions) == ([-1, -1], [])
    assert Trajectory.from_dict(fill.to_dict()) == fill


def test_every_trajectory_is_trained_exactly_once_and_fillers_carry_no_loss() -> None:
    rng = random.Random(3)
    batch = [traj(rng.randint(5, 80), tag=str(i)) for i in range(13)]
    for world in (1, 2, 3):
        for packed in (False, True):
            plan = plan_micro_batches(batch, world, max_tokens=100, max_sequences=4, packed=packed)
            assert len({len(plan.for_rank(r)) for r in range(world)}) == 1
            real = [t for r in range(world) for mb in plan.for_rank(r) for t in mb if any(t.loss_mask)]
            assert sorted(id(t) for t in real) == sorted(id(t) for t in batch)
            for r in range(world):
                for mb in plan.for_rank(r):
                    assert len(mb) <= 4
                    assert len(mb) == 1 or micro_batch_cost([len(t.token_ids) for t in mb], packed) <= 100
                    for t in mb:
                        if not any(t.loss_mask):
                            assert len(t.token_ids) == 2 and t.task_id.endswith("#filler")


def groups(prompts: list[int], per_group: int = 4, seed: int = 0, vocab: int = 50) -> list[Trajectory]:
    """GRPO groups: each group's episodes share its prompt (`prompts[g]` tokens), then differ; interleaved in
    the batch (group 0's first, group 1's first, ...), as a sampler hands in nothing sorted."""
    rng = random.Random(seed)
    starts = [rng.choices(range(vocab), k=p) for p in prompts]
    batch = []
    for i in range(per_group):
        for g, start in enumerate(starts):
            rest = rng.randint(3, 20)
            batch.append(
                replace(
                    traj(len(start) + rest, tag=f"{g}.{i}.", vocab=vocab, group=f"g{g}"),
                    token_ids=start + rng.choices(range(vocab), k=rest),
                )
            )
    return batch


def common(mb: list[Trajectory]) -> int:
    ids = sorted(t.token_ids for t in mb)
    return common_prefix(ids[0], ids[-1])


def test_with_shared_prefixes_a_groups_episodes_are_planned_together_and_cost_the_prompt_once() -> None:
    batch = groups([40, 50, 60])
    plan = plan_micro_batches(batch, 1, max_tokens=150, packed=True, share_prefix=True)
    micro = plan.for_rank(0)
    assert sorted(id(t) for mb in micro for t in mb) == sorted(id(t) for t in batch)
    for mb in micro:
        assert len({t.group_id for t in mb}) == 1  # never two prompts in one micro-batch
        assert common(mb) >= MIN_SHARED_PREFIX
        assert shared_cost([len(t.token_ids) for t in mb], common(mb)) <= 150
    computed = sum(shared_cost([len(t.token_ids) for t in mb], common(mb)) for mb in micro)
    assert computed < sum(len(t.token_ids) for t in batch) * 0.6  # each prompt once or twice, not 4 times
    # Without sharing, the same budget mixes the groups by length and computes every prompt 4 times.
    unshared = plan_micro_batches(batch, 1, max_tokens=150, packed=True).for_rank(0)
    assert any(len({t.group_id for t in mb}) > 1 for mb in unshared)


def test_with_nothing_worth_sharing_the_plan_is_the_unshared_one() -> None:
    rng = random.Random(3)
    short = groups([MIN_SHARED_PREFIX - 1, 10], seed=1)  # prompts too short to plan around
    unrelated = [replace(t, token_ids=rng.choices(range(50), k=len(t.token_ids)))
                 for t in (traj(rng.randint(5, 80), tag=str(i)) for i in range(13))]  # fmt: skip
    for batch in (unrelated, short):
        for world in (1, 2):
            a = plan_micro_batches(batch, world, max_tokens=100, packed=True, share_prefix=True)
            b = plan_micro_batches(batch, world, max_tokens=100, packed=True)
            for r in range(world):
                assert [[id(t) for t in mb] for mb in a.for_rank(r)] == [
                    [id(t) for t in mb] for mb in b.for_rank(r)
                ]
    with pytest.raises(ValueError, match="share_prefix needs packed"):
        plan_micro_batches(short, 1, share_prefix=True)


def test_shared_prefix_plans_share_the_ranks_and_keep_every_bound() -> None:
    batch = groups([40, 45, 50, 55, 60], seed=2) + [traj(n, tag=f"x{n}") for n in (70, 12, 33)]
    for world in (1, 2, 3):
        for max_sequences in (None, 3):
            plan = plan_micro_batches(
                batch, world, max_tokens=160, max_sequences=max_sequences, packed=True, share_prefix=True
            )
            assert len({len(plan.for_rank(r)) for r in range(world)}) == 1
            real = [t for r in range(world) for mb in plan.for_rank(r) for t in mb if any(t.loss_mask)]
            assert sorted(id(t) for t in real) == sorted(id(t) for t in batch)
            loads = []
            for r in range(world):
                load = 0
                for mb in plan.for_rank(r):
                    cost = shared_cost([len(t.token_ids) for t in mb], common(mb) if len(mb) > 1 else 0)
                    assert len(mb) == 1 or cost <= 160
                    assert max_sequences is None or len(mb) <= max_sequences
                    load += cost
                loads.append(load)
            assert max(loads) - min(loads) <= 160  # within a micro-batch of each other


def test_common_prefix_of_token_lists() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([5], [6]) == 0
    assert common_prefix(list(range(1000)), [*range(777), -1]) == 777
    assert shared_cost([10, 12, 14], 8) == 10 + 4 + 6


def test_the_plan_rejects_bad_budgets() -> None:
    with pytest.raises(ValueError, match="no trajectories"):
        plan_micro_batches([], 1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        plan_micro_batches([traj(5)], 1, max_tokens=0)


def test_packed_inputs_restart_positions_and_cumulate_lengths() -> None:
    batch = collate([traj(3), traj(5), traj(2)], pad_id=0)
    inputs, offsets = packed_inputs(batch)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 8, 10] and inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == 5 and offsets.tolist() == [0, 3, 8]
    assert inputs["input_ids"][0, 3:8].tolist() == batch.input_ids[1, :5].tolist()


def test_a_shared_prefix_is_held_once_and_the_rest_continues_its_positions() -> None:
    start = [7, 8, 9]
    trajs = [replace(t, token_ids=start + t.token_ids[3:]) for t in (traj(5), traj(6), traj(3))]
    batch = collate(trajs, pad_id=0)
    assert shared_prefix_length(batch) == 3
    inputs, offsets = shared_prefix_inputs(batch, 3)
    assert inputs["input_ids"][0].tolist() == start + trajs[0].token_ids[3:] + trajs[1].token_ids[3:]
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    # segments: the prefix, then each remainder (the third sequence is the prefix alone: an empty one)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 8] and inputs["shared_prefix_len"] == 3
    assert inputs["max_length_q"] == 3
    assert offsets.tolist() == [0, 2, 5]  # token t >= 3 of sequence b at row offsets[b] + t
    assert inputs["input_ids"][0, offsets[1] + 4].item() == trajs[1].token_ids[4]
    assert shared_prefix_length(collate([traj(4), traj(9)], pad_id=0)) < 4  # random starts differ at once


def test_share_prefix_auto_is_on_where_packed_attention_runs_its_reference() -> None:
    cpu = torch.device("cpu")
    assert resolve_share_prefix("auto", True, cpu, bf16=False) is True
    assert resolve_share_prefix("auto", False, cpu, bf16=False) is False  # nothing packed, nothing shared
    assert resolve_share_prefix("off", True, cpu, bf16=False) is False
    with pytest.raises(ValueError, match="needs packed micro-batches"):
        resolve_share_prefix("on", False, cpu, bf16=False)
    with pytest.raises(ValueError, match="share_prefix: on needs packing"):
        TrainConfig(model="m", optim={"share_prefix": "on", "packing": "off"})


def test_packing_auto_packs_except_on_a_gpu_without_the_varlen_kernel() -> None:
    cpu = torch.device("cpu")
    assert resolve_packing("auto", cpu, bf16=False) is True
    # fp32 on a GPU: no flash kernel for it, so length-bucketed padding (whatever this machine has).
    assert resolve_packing("auto", torch.device("cuda"), bf16=False) is False
    assert resolve_packing("on", cpu, bf16=False) is True and resolve_packing("off", cpu, bf16=True) is False
    with pytest.raises(ValueError, match="auto, on or off"):
        resolve_packing("yes", cpu, bf16=False)


# --- the trainer's step: equal losses and gradients -----------------------------------------------


def grpo_batch(vocab: int) -> list[Trajectory]:
    rng = random.Random(5)
    out = []
    for g in range(2):
        for i in range(4):
            t = traj(rng.randint(12, 40), tag=f"{g}.{i}.", vocab=vocab, reward=float(i % 2), group=f"g{g}")
            out.append(t)
    return out


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_token_budget_and_packed_micro_batches_give_the_padded_loss_and_gradients(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
    agg: str,
) -> None:
    vocab = 2543
    # A common start (a system prompt), which the share_prefix variant holds once per micro-batch.
    start = random.Random(9).choices(range(vocab), k=10)
    trajs = [
        replace(t, token_ids=start + t.token_ids, loss_mask=[0] * 10 + t.loss_mask,
                            behavior_logprobs=[0.0] * 10 + t.behavior_logprobs, prompt_len=14)
        for t in grpo_batch(vocab)
    ]  # fmt: skip
    base = dict(model=str(tiny_model_dir), loss={"agg": agg}, optim={"grad_clip": 1e9})

    def cfg(**optim) -> TrainConfig:
        return TrainConfig(**{**base, "optim": {**base["optim"], **optim}})

    ref, ref_m = grpo_step_gradients(
        tiny_model_dir, one_rank_group, cfg(max_tokens_per_micro_batch=None, packing="off"), trajs
    )
    for variant in (
        {"max_tokens_per_micro_batch": 60, "packing": "off"},  # several length buckets, padded
        {"max_tokens_per_micro_batch": 80, "packing": "on"},  # packed rows through the varlen attention
        {"max_tokens_per_micro_batch": None, "micro_batch_size": 3, "packing": "on"},
        {"max_tokens_per_micro_batch": 80, "packing": "on", "share_prefix": "on"},
    ):
        grads, m = grpo_step_gradients(tiny_model_dir, one_rank_group, cfg(**variant), trajs)
        assert m["losses/policy_loss"] == pytest.approx(ref_m["losses/policy_loss"], rel=1e-5, abs=1e-8)
        assert m["batch/action_tokens"] == ref_m["batch/action_tokens"]
        assert m["losses/entropy"] == pytest.approx(ref_m["losses/entropy"], rel=1e-5)
        assert_same_gradients(ref, grads)


def test_groups_planned_around_their_prompts_give_the_padded_loss_and_gradients(
    tiny_model_dir,  # noqa: F811
    one_rank_group,  # noqa: F811
) -> None:
    """Two GRPO groups, each with its own prompt: the shared-prefix plan puts each group's episodes together
    and computes its prompt once per micro-batch; the loss and the gradients are those of one padded batch."""
    vocab = 2543
    trajs = [
        replace(t, reward=float(i % 3 == 0)) for i, t in enumerate(groups([40, 48], vocab=vocab, seed=4))
    ]
    base = dict(model=str(tiny_model_dir), optim={"grad_clip": 1e9})
    ref, ref_m = grpo_step_gradients(
        tiny_model_dir,
        one_rank_group,
        TrainConfig(
            **{**base, "optim": {**base["optim"], "max_tokens_per_micro_batch": None, "packing": "off"}}
        ),
        trajs,
    )
    shared = TrainConfig(
        **{**base, "optim": {**base["optim"], "max_tokens_per_micro_batch": 150, "share_prefix": "on"}}
    )
    grads, m = grpo_step_gradients(tiny_model_dir, one_rank_group, shared, trajs)
    assert m["losses/policy_loss"] == pytest.approx(ref_m["losses/policy_loss"], rel=1e-5, abs=1e-8)
    assert m["losses/entropy"] == pytest.approx(ref_m["losses/entropy"], rel=1e-5)
    assert m["mismatch/logprob_abs_diff"] == pytest.approx(ref_m["mismatch/logprob_abs_diff"], rel=1e-5)
    assert_same_gradients(ref, grads)
    tokens = sum(len(t.token_ids) for t in trajs)
    assert ref_m["batch/tokens_computed"] >= tokens  # padded: every row to its longest
    assert m["batch/tokens_computed"] < 0.75 * tokens  # each prompt once per micro-batch, not once a sequence
