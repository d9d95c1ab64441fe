"""No compute on padding: micro-batches by a token budget, and packed rows for the varlen attention.

Trajectories of a GRPO batch range from a few hundred to many thousand tokens. Padding them in
micro-batches of a fixed count pays for the longest one in every row; here a micro-batch is
whatever fits a token budget instead:

- `plan_micro_batches` shares a batch among the ranks (longest first, each to the rank with
  the fewest tokens so far) and cuts each rank's share into micro-batches of at most
  `max_tokens` tokens and `max_sequences` sequences. Padded, a micro-batch costs its length
  bucket (count x longest; sequences of similar length go together); packed, it costs the sum
  of its lengths. A sequence longer than the budget gets a micro-batch of its own. Every rank
  gets the same number of micro-batches (FSDP's collectives must pair up): a rank with fewer
  runs zero-loss fillers, two tokens long.
- `packed_inputs` lays a micro-batch out as one row with position ids restarting per sequence
  and the cumulative lengths that `agentrl.train.varlen`'s attention reads: no padding at all.
- `shared_prefix_inputs` lays it out with the tokens every sequence starts with (an agent's system
  prompt and tool schemas, a GRPO group's prompt) once, then each sequence's remainder, which
  attends to that prefix and to itself: the prefix's forward and backward run once, not once a sequence.
  So that a micro-batch's sequences have a long start in common, the plan with `share_prefix` first
  puts together sequences that share at least `MIN_SHARED_PREFIX` leading tokens (a GRPO group's
  episodes, with their prompt), counting a micro-batch as the prefix once plus every remainder
  (`shared_cost`); the sequences that share nothing are planned as before.

The plan is a pure function of the batch, so every rank computes the same one with no
communication, and the loss denominators (tokens or sequences of the whole step) are the same
whatever the split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from agentrl.rollout.trajectory import Trajectory
from agentrl.train.batch import Batch

if TYPE_CHECKING:
    from agentrl.train.config import PackingMode


@dataclass(frozen=True)
class MicroBatchPlan:
    """Every rank's micro-batches for one optimizer step (the same on every rank)."""

    per_rank: list[list[list[Trajectory]]]  # [rank][micro-batch] -> trajectories (fillers included)

    def for_rank(self, rank: int) -> list[list[Trajectory]]:
        return self.per_rank[rank]

    @property
    def num_micro_batches(self) -> int:
        return len(self.per_rank[0]) if self.per_rank else 0


def micro_batch_cost(lengths: list[int], packed: bool) -> int:
    """Tokens a micro-batch of these lengths runs through the model: the sum packed, count x longest padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


MIN_SHARED_PREFIX = 32
"""Leading tokens sequences must have in common for the plan to put them together for it: a shorter
common start (a chat template's first tokens) saves less than first-fit packing of unrelated sequences
does."""


def shared_cost(lengths: list[int], prefix: int) -> int:
    """Tokens a packed micro-batch of these lengths runs with its first `prefix` tokens held once."""
    return sum(lengths) - max(0, len(lengths) - 1) * prefix


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (list slices compare in C: O(n log n))."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def filler(like: Trajectory) -> Trajectory:
    """A two-token trajectory with an all-zero loss mask: it runs the forward and backward (so FSDP's
    collectives pair up across ranks) and adds nothing to the loss or the gradient."""
    ids = (like.token_ids * 2)[:2]
    return replace(
        like,
        token_ids=ids,
        loss_mask=[0, 0],
        behavior_logprobs=[0.0, 0.0],
        token_versions=[-1, -1] if like.token_versions else [],
        prompt_len=min(like.prompt_len, 2),
        task_id=f"{like.task_id}#filler",
        messages=[],
    )


def plan_micro_batches(
    trajectories: list[Trajectory],
    world_size: int,
    *,
    max_tokens: int | None = None,
    max_sequences: int | None = None,
    packed: bool = False,
    share_prefix: bool = False,
) -> MicroBatchPlan:
    """Share `trajectories` among `world_size` ranks and cut each share into micro-batches.

    `max_tokens` bounds a micro-batch's cost (`micro_batch_cost`; with `share_prefix`, `shared_cost` for
    the micro-batches of sequences with a common start); `max_sequences` its number of sequences; None
    leaves that bound off (both None: one micro-batch per rank, and one per group of sequences with a
    common start).
    """
    if not trajectories:
        raise ValueError("plan_micro_batches got no trajectories")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
    if share_prefix and not packed:
        raise ValueError("share_prefix needs packed micro-batches")
    together: list[list[Trajectory]] = []
    rest = trajectories
    if share_prefix and len(trajectories) > 1:
        together, rest = _prefix_families(trajectories, max_tokens, max_sequences)
    # The micro-batches of sequences with a common start go first, biggest first, each to the rank with the
    # least work so far; then the other sequences, longest first, ties by position in the batch (deterministic
    # on every rank), each to the rank with the least work; each rank's share of those is cut as it fits.
    fixed: list[list[list[Trajectory]]] = [[] for _ in range(world_size)]
    shares: list[list[Trajectory]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for mb in sorted(together, key=_shared_cost_of, reverse=True):
        rank = min(range(world_size), key=lambda r: (loads[r], len(fixed[r]), r))
        fixed[rank].append(mb)
        loads[rank] += _shared_cost_of(mb)
    index = {id(t): i for i, t in enumerate(rest)}
    for t in sorted(rest, key=lambda t: (-len(t.token_ids), index[id(t)])):
        rank = min(range(world_size), key=lambda r: (loads[r], len(shares[r]), r))
        shares[rank].append(t)
        loads[rank] += len(t.token_ids)
    per_rank = [fixed[r] + _cut(shares[r], max_tokens, max_sequences, packed) for r in range(world_size)]
    n = max(len(m) for m in per_rank)
    shortest = min(trajectories, key=lambda t: len(t.token_ids))
    for micro in per_rank:
        micro.extend([[filler(shortest)] for _ in range(n - len(micro))])
    return MicroBatchPlan(per_rank)


def _shared_cost_of(mb: list[Trajectory]) -> int:
    ids = sorted(t.token_ids for t in mb)
    return shared_cost([len(i) for i in ids], common_prefix(ids[0], ids[-1]))


def _prefix_families(
    trajectories: list[Trajectory], max_tokens: int | None, max_sequences: int | None
) -> tuple[list[list[Trajectory]], list[Trajectory]]:
    """(micro-batches of sequences that start with at least `MIN_SHARED_PREFIX` tokens in common, the rest).

    In lexicographic order, sequences with a common start are neighbours, and the common start of a run
    of neighbours is that of its first and last. The runs are chosen to minimise the tokens computed
    (`shared_cost` per run, under the budget), then the number of runs: a dynamic programme over the
    order, each run extending back from its end until the budget stops it (a run's cost only grows).
    """
    n = len(trajectories)
    order = sorted(range(n), key=lambda i: (trajectories[i].token_ids, i))
    seqs = [trajectories[i] for i in order]
    lengths = [len(t.token_ids) for t in seqs]
    adjacent = [common_prefix(seqs[i].token_ids, seqs[i + 1].token_ids) for i in range(n - 1)]
    best: list[tuple[float, int]] = [(0, 0)] + [(math.inf, 0)] * n  # (cost, runs) of the first i
    start = [0] * (n + 1)  # where the last run of the best split of the first i begins
    for end in range(1, n + 1):
        total, lcp = 0, math.inf
        for begin in range(end - 1, -1, -1):
            count = end - begin
            total += lengths[begin]
            if count > 1:
                lcp = min(lcp, adjacent[begin])
            prefix = int(lcp) if count > 1 and lcp >= MIN_SHARED_PREFIX else 0
            cost = total - (count - 1) * prefix
            if count > 1 and (
                (max_tokens is not None and cost > max_tokens)
                or (max_sequences is not None and count > max_sequences)
            ):
                break
            candidate = (best[begin][0] + cost, best[begin][1] + 1)
            if candidate < best[end]:
                best[end], start[end] = candidate, begin
    together: list[list[Trajectory]] = []
    rest: list[Trajectory] = []
    end = n
    while end > 0:
        begin = start[end]
        run = seqs[begin:end]
        if len(run) > 1 and common_prefix(run[0].token_ids, run[-1].token_ids) >= MIN_SHARED_PREFIX:
            together.append(run)
        else:
            rest.extend(run)
        end = begin
    together.reverse()
    # `rest` back in batch order, so that with nothing shared the plan is exactly the unshared one.
    position = {id(t): i for i, t in enumerate(trajectories)}
    rest.sort(key=lambda t: position[id(t)])
    return together, rest


def _cut(
    share: list[Trajectory], max_tokens: int | None, max_sequences: int | None, packed: bool
) -> list[list[Trajectory]]:
    """First-fit over the share in decreasing length: each sequence joins the first micro-batch it fits."""
    bins: list[list[Trajectory]] = []
    lengths: list[list[int]] = []
    for t in share:  # already longest first
        n = len(t.token_ids)
        for b, lens in enumerate(lengths):
            if max_sequences is not None and len(lens) >= max_sequences:
                continue
            if max_tokens is not None and micro_batch_cost([*lens, n], packed) > max_tokens:
                continue
            bins[b].append(t)
            lens.append(n)
            break
        else:
            bins.append([t])
            lengths.append([n])
    return bins


def packed_inputs(batch: Batch) -> tuple[dict[str, Any], Tensor]:
    """The sequences of `batch` as one row: (model inputs, offset of each sequence in the row [B]).

    The inputs are `input_ids` [1, N] and `position_ids` [1, N] (restarting at 0 per sequence, so
    RoPE sees each sequence as it would alone), plus `cu_seq_lens_q/k` [B + 1] int32 and
    `max_length_q/k`, the keyword arguments transformers passes to the attention function
    (`agentrl.train.varlen` reads them; flash-attention implementations read the same names).
    """
    lengths = batch.lengths.to(batch.input_ids.device)  # [B]
    keep = batch.attention_mask.bool()  # [B, T] real tokens (right padding)
    input_ids = batch.input_ids[keep].unsqueeze(0)  # [1, N]
    t = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)  # [T]
    position_ids = t.expand_as(batch.input_ids)[keep].unsqueeze(0)  # [1, N]
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)  # [B + 1]
    return _row_inputs(input_ids, position_ids, lengths), cu[:-1].long()


def _row_inputs(input_ids: Tensor, position_ids: Tensor, segments: Tensor) -> dict[str, Any]:
    """The keyword arguments of one packed row whose segments have these lengths ([S]) in order."""
    cu = torch.nn.functional.pad(segments.cumsum(0), (1, 0)).to(torch.int32)  # [S + 1]
    longest = int(segments.max())
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
    }


def shared_prefix_length(batch: Batch) -> int:
    """How many leading tokens every sequence of `batch` has in common (at most the shortest length)."""
    ids = batch.input_ids  # [B, T]
    shortest = int(batch.lengths.min())
    same = (ids[:, :shortest] == ids[:1, :shortest]).all(0)  # [shortest]
    differs = (~same).nonzero()
    return int(differs[0]) if differs.numel() else shortest


def shared_prefix_inputs(batch: Batch, prefix: int) -> tuple[dict[str, Any], Tensor]:
    """The sequences of `batch` as one row that holds their first `prefix` tokens (the same in every
    sequence: `shared_prefix_length`) once: (model inputs, offset [B] such that sequence b's token at
    position t >= prefix sits at row index offset[b] + t).

    The row is the prefix, then each sequence's tokens from `prefix` on, with position ids that go on
    from the prefix's. The inputs are those of `packed_inputs` with the prefix as the first of the
    cumulative lengths' segments, plus `shared_prefix_len`: the attention (`agentrl.train.varlen`) lets
    every later segment see the whole prefix. A token before `prefix` sits at row index t for every b.
    """
    lengths = batch.lengths.to(batch.input_ids.device)  # [B]
    width = batch.input_ids.shape[1]
    t = torch.arange(width, device=batch.input_ids.device)  # [T]
    keep = batch.attention_mask.bool() & (t >= prefix)  # [B, T] the remainders
    input_ids = torch.cat([batch.input_ids[0, :prefix], batch.input_ids[keep]]).unsqueeze(0)  # [1, N]
    position_ids = torch.cat([t[:prefix], t.expand_as(batch.input_ids)[keep]]).unsqueeze(0)  # [1, N]
    rest = (lengths - prefix).clamp(min=0)  # [B] tokens after the prefix
    segments = torch.cat([lengths.new_tensor([prefix]), rest])  # [B + 1] the prefix, then each remainder
    inputs = {**_row_inputs(input_ids, position_ids, segments), "shared_prefix_len": prefix}
    return inputs, inputs["cu_seq_lens_q"][1:-1].long() - prefix


def resolve_share_prefix(setting: PackingMode, packed: bool, device: torch.device, bf16: bool) -> bool:
    """`share_prefix: auto|on|off` for a trainer that packs (`packed`) on `device`, in bf16 or not.

    auto shares wherever micro-batches are packed: the reference attention (CPU, fp32) takes the prefix
    as keys of every later segment at no extra cost, and the varlen flash kernel does the same in one
    call with each segment's keys gathered behind the prefix's (`agentrl.train.varlen`) — on a GPU whose
    kernel aligns causal attention to the bottom right, as flash attention does (probed once; where it
    does not, auto leaves sharing off there).
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"share_prefix must be auto, on or off; got {setting!r}")
    if setting == "on" and not packed:
        raise ValueError(
            "share_prefix: on needs packed micro-batches; set packing: on (or share_prefix: off)"
        )
    if setting != "auto" or not packed:
        return setting == "on"
    from agentrl.train.varlen import bottom_right_causal, kernel_available

    if kernel_available(device, torch.bfloat16 if bf16 else torch.float32):
        return bottom_right_causal(torch.device(device))
    return True


def resolve_packing(setting: PackingMode, device: torch.device, bf16: bool) -> bool:
    """`packing: auto|on|off` for a trainer on `device` computing in bf16 (or not).

    auto packs, except on a GPU where the varlen flash kernel cannot run (fp32 compute, a torch
    without `torch.nn.attention.varlen`): there the reference attention (one `sdpa` per sequence)
    would lose to the batched kernels, and length-bucketed padding is the faster choice. On the
    CPU the reference is the faster one (measured in benchmarks/RESULTS.md).
    """
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"packing must be auto, on or off; got {setting!r}")
    if setting != "auto":
        return setting == "on"
    if device.type != "cuda":
        return True
    from agentrl.train.varlen import kernel_available

    return kernel_available(device, torch.bfloat16 if bf16 else torch.float32)
