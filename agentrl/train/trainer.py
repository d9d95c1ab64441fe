"""GRPO training of a tool-using agent, top to bottom.

    agentrl train examples/calc_grpo.yaml [key.sub=value ...]          # one process
    agentrl train examples/calc_grpo.yaml --nproc 2                     # torchrun, FSDP2 over 2 ranks

One step:
 1. rank 0 builds a batch with the curriculum and DAPO dynamic sampling: it draws tasks in
    the learnability band, runs one group of episodes per task through the vLLM policy and
    the environments, drops zero-variance groups and refills (bounded);
 2. the batch goes to every rank; advantages are computed on the whole batch (one per
    trajectory, group-relative), then each rank takes its share;
 3. `optim.epochs` passes over the batch, each split into `optim.mini_batches` optimizer
    steps: each rank computes the clipped surrogate over its micro-batches (cut by a token
    budget, packed where the varlen kernel runs: `agentrl.train.packing`; log-probs from hidden
    states at the action tokens only: `agentrl.train.logprobs`; FSDP2 all-gathers the weights,
    reduce-scatters the gradients), the global gradient is clipped, AdamW steps. With more
    than one step per batch the ratio is taken against the log-probs from before the first
    one, computed up front (as are the reference's when `loss.kl_coef` > 0). A vLLM engine
    colocated on the trainer's GPU sleeps meanwhile (`agentrl.train.placement`);
 4. the weights go to the vLLM policy (bf16 GPU to GPU on GPUs, `agentrl.train.weight_sync`), whose
    version increments;
 5. metrics to out/metrics.jsonl (and TensorBoard, W&B: `report_to`), held-out evaluation every
    `eval.every` steps, a Hugging Face-loadable, resumable `out/checkpoint-N` every
    `checkpoint_every` steps (`agentrl.train.checkpoint`); out/training.png at the end.

A run resumes from its newest checkpoint, exactly (the same metrics and weights as an
uninterrupted run, on CPU with the same seed; synchronous mode). Ctrl-C stops the episodes being
generated, or lets an update finish, saves a checkpoint and says how to continue. Several steps in
a row without an informative group (all-fail: warm-start first; all-pass: harder tasks) stop the
run with the reason (`stop_uninformative_after`).

Step 1 is rank 0's `agentrl.train.producer.RolloutProducer`. Asynchronous mode overlaps 1 with 3-4:
the producer's background thread generates the next batch with the weights it has while the trainer
updates; trajectories more than `max_staleness` versions
behind are dropped or kept with the truncated importance-sampling correction.

Losses and advantages are the pure functions of `agentrl.train.grpo`; batching is `agentrl.train.batch`
and `agentrl.train.packing`; the curriculum is `agentrl.train.curriculum`; distribution is
`agentrl.train.distributed`; GPU placement is `agentrl.train.placement` and `agentrl.train.weight_sync`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from agentrl.errors import UserError, check_model_dir, check_nonempty_file, one_line, visible_gpus
from agentrl.eval.report import plot_training
from agentrl.rollout.trajectory import Trajectory, load_trajectories
from agentrl.runlog import quiet_libraries
from agentrl.train.batch import collate
from agentrl.train.checkpoint import latest_resumable, prepare_run_dir, set_rng_state, truncate_jsonl
from agentrl.train.checkpoint import load as load_checkpoint
from agentrl.train.checkpoint import save as save_checkpoint
from agentrl.train.config import TrainConfig
from agentrl.train.curriculum import Curriculum
from agentrl.train.distributed import (
    DistInfo,
    all_reduce_mean,
    export_hf,
    full_state_dict,
    global_token_scale,
    init_distributed,
    run_rank,
    run_ranks,
    shard_model,
    wait_for_main,
)
from agentrl.train.grpo import group_advantages, policy_loss, weight_negatives
from agentrl.train.logprobs import action_logprobs
from agentrl.train.packing import plan_micro_batches, resolve_packing
from agentrl.train.placement import Placement, plan_placement
from agentrl.train.producer import RolloutProducer
from agentrl.train.tracking import Tracker, check_available
from agentrl.train.weight_sync import WeightSync
from agentrl.verifiers.base import verifier_failed


def log(msg: str) -> None:
    # tqdm.write keeps the progress bar below the line instead of breaking it.
    tqdm.write(f"[train] {msg}", file=sys.stderr)


# --- one optimisation step (every rank) -------------------------------------------------------


def grpo_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    trajectories: list[Trajectory],
    cfg: TrainConfig,
    info: DistInfo,
    pad_id: int,
    *,
    ref_model: torch.nn.Module | None = None,
    updates_done: int = 0,
    seed: int = 0,
) -> dict[str, float]:
    """GRPO updates on `trajectories` (the same list on every rank): `optim.epochs` passes, each
    split into `optim.mini_batches` optimizer steps. Returns metrics averaged over ranks and updates.

    `updates_done` (optimizer steps taken before this batch) drives the learning-rate warm-up;
    `seed` fixes the mini-batch shuffle, identically on every rank.
    """
    rewards = torch.tensor([t.reward for t in trajectories])  # [N]
    advantages = group_advantages(
        rewards, [t.group_id for t in trajectories], scale=cfg.loss.adv_scale
    )  # [N]
    advantages = weight_negatives(advantages, cfg.loss.negative_weight)  # [N]
    # Keyed by object: the plans below hand out these same objects (plus zero-mask fillers).
    advantage_of = {id(t): a for t, a in zip(trajectories, advantages.tolist(), strict=True)}
    n_updates = cfg.optim.epochs * cfg.optim.mini_batches
    packed = trainer_packs(cfg, info)
    # The trust region is anchored at the trainer's own log-probs of the batch before its first
    # update ("decoupled" PPO: the rollout engine's log-probs only enter through the capped TIS
    # weight). With one update those are the live log-probs detached; with more, the ratio must
    # move away from 1 between updates, so they are computed once up front, as is the reference.
    anchored = cfg.loss.tis_cap is not None or n_updates > 1
    before: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    if n_updates > 1 or ref_model is not None:
        before = _logprobs_before_update(
            model if n_updates > 1 else None, ref_model, trajectories, cfg, info, pad_id
        )
    order = list(range(len(trajectories)))
    shuffle = torch.Generator().manual_seed(seed)
    totals: dict[str, float] = {}
    loss_total = grad_norm_total = 0.0
    tokens_total = 0.0
    for epoch in range(cfg.optim.epochs):
        if epoch > 0:  # the first pass keeps the batch's order: one update reproduces the plain step
            order = torch.randperm(len(trajectories), generator=shuffle).tolist()
        for part in range(cfg.optim.mini_batches):
            mini = [trajectories[i] for i in order[part :: cfg.optim.mini_batches]]
            for group in opt.param_groups:
                group["lr"] = learning_rate(cfg, updates_done)
            updates_done += 1
            micro = trainer_micro_batches(mini, cfg, info, packed)
            # Denominators over the whole optimizer step, all ranks: the plan is the same everywhere,
            # so each rank counts its own share and one all-reduce gives the global count.
            local_tokens = sum(sum(t.loss_mask) for mb in micro for t in mb)
            _, global_tokens = global_token_scale(local_tokens, info.device)
            local_seqs = sum(1 for mb in micro for t in mb if any(t.loss_mask))
            _, global_seqs = global_token_scale(local_seqs, info.device)
            # FSDP2 averages gradients over ranks, so each rank divides its sum by global count / world.
            denom = (global_tokens if cfg.loss.agg == "token-mean" else global_seqs) / info.world_size
            tokens_total += global_tokens
            for i, mb in enumerate(micro):
                model.set_requires_gradient_sync(i == len(micro) - 1)
                batch = collate(mb, pad_id).to(info.device)
                live = action_logprobs(
                    model, batch, temperature=cfg.rollout.temperature, with_entropy=True, packed=packed
                )
                logp = live.logprobs  # [B, T], 0 off the loss mask
                adv = torch.tensor([advantage_of.get(id(t), 0.0) for t in mb], device=info.device)  # [B]
                width = logp.shape[1]
                old = ref = None
                if anchored:
                    old = (
                        logp.detach()
                        if n_updates == 1
                        else _rows([before.get(id(t), (None, None))[0] for t in mb], width, logp)
                    )  # [B, T]
                if ref_model is not None:
                    ref = _rows([before.get(id(t), (None, None))[1] for t in mb], width, logp)  # [B, T]
                loss, metrics = policy_loss(
                    logp,
                    batch.behavior_logprobs,
                    adv,
                    batch.loss_mask,
                    cfg.loss.clip_low,
                    cfg.loss.clip_high,
                    cfg.loss.agg,
                    cfg.loss.ratio,
                    old_logprobs=old,
                    tis_cap=cfg.loss.tis_cap,
                    ref_logprobs=ref,
                    kl_coef=cfg.loss.kl_coef,
                    entropy=live.entropy,
                    denominator=max(denom, 1e-9),
                )
                loss.backward()
                loss_total += float(loss.item())
                w = float(batch.loss_mask.sum().item())
                for k, v in metrics.as_dict().items():
                    if isinstance(v, int | float) and v is not None:
                        totals[k] = totals.get(k, 0.0) + float(v) * w
                totals["_w"] = totals.get("_w", 0.0) + w
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            grad_norm_total += float(
                grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            )
            opt.step()
            opt.zero_grad(set_to_none=True)
    # Token-weighted over all ranks: the mean over ranks of the weighted sums, over that of the weights.
    totals["losses/policy_loss"] = loss_total / n_updates
    # Each rank's loss is world · (its sum) / (global count), so the mean over ranks is the global loss.
    out = all_reduce_mean(totals, info.device)
    w = max(out.pop("_w", 0.0), 1e-9)
    out = {k: v if k == "losses/policy_loss" else v / w for k, v in out.items()}
    out["losses/grad_norm"] = grad_norm_total / n_updates
    out["batch/action_tokens"] = tokens_total / n_updates
    out["batch/sequences"] = float(len(trajectories))
    out["optim/lr"] = learning_rate(cfg, updates_done - 1)
    out["optim/updates"] = float(updates_done)
    return out


def trainer_packs(cfg: TrainConfig, info: DistInfo) -> bool:
    """Whether this trainer packs its micro-batches (`optim.packing`, resolved for its device and dtype)."""
    bf16 = cfg.optim.bf16 if cfg.optim.bf16 is not None else info.device.type == "cuda"
    return resolve_packing(cfg.optim.packing, info.device, bf16)


def trainer_micro_batches(
    trajectories: list[Trajectory], cfg: TrainConfig, info: DistInfo, packed: bool
) -> list[list[Trajectory]]:
    """This rank's micro-batches of `trajectories` under the token budget (same count on every rank)."""
    plan = plan_micro_batches(
        trajectories,
        info.world_size,
        max_tokens=cfg.optim.max_tokens_per_micro_batch,
        max_sequences=cfg.optim.micro_batch_size,
        packed=packed,
    )
    return plan.for_rank(info.rank)


def learning_rate(cfg: TrainConfig, update: int) -> float:
    """Learning rate of optimizer step `update` (0-based): linear warm-up, then constant."""
    if cfg.optim.warmup_steps and update < cfg.optim.warmup_steps:
        return cfg.optim.lr * (update + 1) / cfg.optim.warmup_steps
    return cfg.optim.lr


def _logprobs_before_update(
    model: torch.nn.Module | None,
    ref_model: torch.nn.Module | None,
    trajectories: list[Trajectory],
    cfg: TrainConfig,
    info: DistInfo,
    pad_id: int,
) -> dict[int, tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per trajectory (keyed by id): the policy's and the reference's log-probs before any update,
    each [len(token_ids)]. Every rank computes its own share (the shards are what it trains on)
    plus the zero-mask fillers, so the FSDP collectives of the forward passes match."""
    out: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
    packed = trainer_packs(cfg, info)
    micro = trainer_micro_batches(trajectories, cfg, info, packed)
    mine = [t for mb in micro for t in mb]
    # The mini-batches reshuffle trajectories across ranks, so every rank needs every row: run
    # this rank's share, then gather the rows of the others.
    with torch.no_grad():
        for mb in micro:
            batch = collate(mb, pad_id).to(info.device)
            rows = []
            for m in (model, ref_model):
                if m is None:
                    rows.append(None)
                    continue
                rows.append(
                    action_logprobs(m, batch, temperature=cfg.rollout.temperature, packed=packed).logprobs
                )  # [B, T], 0 off the loss mask (the only positions the loss reads)
            for b, t in enumerate(mb):
                n = len(t.token_ids)
                out[id(t)] = tuple(None if r is None else r[b, :n].cpu() for r in rows)  # type: ignore[assignment]
    if info.world_size > 1:
        index = {id(t): i for i, t in enumerate(trajectories)}
        local = {index[id(t)]: out[id(t)] for t in mine if id(t) in index and any(t.loss_mask)}
        gathered: list[Any] = [None] * info.world_size
        dist.all_gather_object(gathered, local)
        for part in gathered:
            for i, rows in part.items():
                out[id(trajectories[i])] = rows
    return out


def _rows(rows: list[torch.Tensor | None], width: int, like: torch.Tensor) -> torch.Tensor:
    """Stack per-trajectory [n] rows into [B, width], zero-padded; a missing row (a zero-mask
    filler) is all zeros, which its mask ignores."""
    out = torch.zeros((len(rows), width), dtype=like.dtype, device=like.device)  # [B, T]
    for b, r in enumerate(rows):
        if r is not None:
            out[b, : r.shape[0]] = r.to(like.device)
    return out


def _no_update_reason(metrics: dict[str, float]) -> tuple[str, str]:
    """(kind, words) for a step without an informative group: all-fail, all-pass, env-error or mixed."""
    fail = int(metrics.get("batch/all_fail_groups", 0))
    ok = int(metrics.get("batch/all_pass_groups", 0))
    broken = int(metrics.get("batch/untrainable_trajectories", 0))
    if fail and not ok:
        return "all-fail", f"all {fail} groups failed (reward 0 everywhere)"
    if ok and not fail:
        return "all-pass", f"all {ok} groups passed"
    if not ok and not fail:
        return "env-error", f"no usable episode ({broken} ended in environment errors or timeouts)"
    return "mixed", f"every group was all-pass ({ok}) or all-fail ({fail})"


_STOP_ADVICE = {
    "all-fail": "every episode failed: the policy cannot solve these tasks yet. Warm-start it first (SFT on "
    "demonstrations: `agentrl demos {env} --n 256 --out demos.jsonl`, then `agentrl sft`), or use easier tasks",
    "all-pass": "every episode passed: the policy already solves these tasks; train on harder ones",
    "env-error": "every episode ended in an environment error or timeout; run `agentrl env check {env}` "
    "and look at the trajectories' `error` field",
    "mixed": "every task was either always solved or never: none is in the learnability band. Use tasks of "
    "graded difficulty, or warm-start the policy first",
}


def _stop_advice(kind: str, env: str, trajectories: Sequence[Trajectory]) -> str:
    """What to do after steps of `kind` (`_STOP_ADVICE`), unless the verdicts of the last batch's
    episodes say the verifier itself failed (crashed, overran its deadline): then the rewards said
    nothing about the policy, and the failure (its exception and file:line) is what to fix."""
    advice = _STOP_ADVICE[kind].format(env=env)
    broken = [t for t in trajectories if verifier_failed(t.verdict_details)]
    if not broken:
        return advice
    reason, count = Counter(t.verdict_details for t in broken).most_common(1)[0]
    reason = one_line(reason)
    if len(reason) > 500:  # an exception's message can be a page long; the file:line is at its end
        reason = f"{reason[:300]} ... {reason[-150:]}"
    said = f"{'most often: ' if count < len(broken) else ''}{reason}"
    if len(broken) == len(trajectories):
        return (
            f"the verifier failed on every episode ({len(broken)} of the last batch), so no reward said anything "
            f"about the policy: {said}. Fix that first (`agentrl verifier check {env}` runs the verifier on the "
            "oracle's solution)"
        )
    return f"{advice} (the verifier failed on {len(broken)} of the last batch's {len(trajectories)} episodes: {said})"


class _Sigint:
    """Ctrl-C during training. While episodes are being generated it stops them at once (the batch in
    flight is discarded); during an update, a weight push or a save it only asks to stop after it, so
    a checkpoint is always taken at a step boundary. Only rank 0 listens; the other ranks follow its
    decision (an `_INTERRUPTED` payload), since Ctrl-C reaches every process of the terminal."""

    def __init__(self, listen: bool):
        self.requested = 0
        self.interruptible = False
        self.previous: Any = None
        self.listen = listen

    def __enter__(self) -> _Sigint:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGINT)
            # A process started with Ctrl-C ignored (nohup, a background job) keeps ignoring it.
            listen = self.listen and self.previous is not signal.SIG_IGN
            signal.signal(signal.SIGINT, self._handle if listen else signal.SIG_IGN)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested += 1
        if self.interruptible or self.requested >= 3:  # a third Ctrl-C gives up on saving
            raise KeyboardInterrupt
        if self.requested == 1:
            log(
                "Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C twice more to quit without saving)"
            )

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[None]:
        self.interruptible = True
        try:
            if self.requested:  # asked during the previous update: stop before generating more
                raise KeyboardInterrupt
            yield
        finally:
            self.interruptible = False


_INTERRUPTED = "__agentrl_interrupted__"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after a checkpoint was saved; the message says how to continue."""


class TrainingStopped(UserError):
    """Training stopped because nothing could be learned (no informative group for several steps)."""

    collective = True  # every rank raises it together (see agentrl.train.distributed.run_rank)


# --- the loop -----------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> Path:
    """Run GRPO in this process (a `torchrun` rank, or a one-rank group); see the module docstring.

    Resumes from the newest `out/checkpoint-N` when `cfg.resume` (the launcher has checked that the
    config matches). Returns out/final. Ctrl-C saves a checkpoint and raises `TrainingInterrupted`;
    a run that cannot learn stops with `TrainingStopped`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = init_distributed(timeout_s=cfg.collective_timeout_s)
    # Per node: GPUs are counted on this node, for this node's ranks (not the world size of all nodes).
    placement = train_placement(cfg, info.local_world_size)
    out = Path(cfg.out)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    quiet_libraries(out / "engine.log" if info.is_main and cfg.replay is None else None)
    _register_rank_pid(info.rank)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(cfg.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(info.device)
    model.train()
    shard_model(model, activation_checkpointing=cfg.optim.activation_checkpointing, bf16=cfg.optim.bf16)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    ref_model: torch.nn.Module | None = None
    if cfg.loss.kl_coef > 0:
        # The starting checkpoint, frozen: the KL penalty keeps the policy near it.
        ref_model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(info.device)
        ref_model.eval().requires_grad_(False)
        shard_model(ref_model, activation_checkpointing=False, bf16=cfg.optim.bf16)

    # Only rank 0 draws tasks and generates: the other ranks (and replayed runs) never build the
    # environment, whose task supply may be costly to load (python-repair synthesizes on first use).
    curriculum: Curriculum | None = None
    pool = "generator"
    if info.is_main and cfg.replay is None:
        from agentrl.registry import task_source

        curriculum = Curriculum.from_source(task_source(cfg.env, **cfg.env_kwargs), config=cfg.curriculum)
        if curriculum.pool_size is not None:
            pool = f"a pool of {curriculum.pool_size} train tasks"
    # updates: optimizer steps so far (the warm-up counts these, not training steps)
    start = updates = rollout_calls = streak = policy_version = 0
    rng: Any = None
    resumed_from = latest_resumable(out) if cfg.resume else None
    if resumed_from is not None:
        state = load_checkpoint(resumed_from, model, opt)
        if curriculum is not None and state.get("curriculum") is not None:
            curriculum.load_state_dict(state["curriculum"])
        start, updates = int(state["step"]), int(state.get("updates", 0))
        rollout_calls, streak = int(state.get("rollout_calls", 0)), int(state.get("uninformative_streak", 0))
        policy_version = int(state.get("policy_version", 0))
        rng = state.get("rng")
    tracker: Tracker | None = None
    if info.is_main:
        if not (out / "config.json").exists():
            (out / "config.json").write_text(cfg.model_dump_json(indent=2))
        for name in ("metrics.jsonl", "eval.jsonl"):  # rows a killed run wrote after its last checkpoint
            truncate_jsonl(out / name, start)
        tracker = Tracker(cfg, out, resumed_at=start)

    replay = load_trajectories(cfg.replay) if cfg.replay else None
    producer: RolloutProducer | None = None
    bar: Any = None
    if info.is_main:
        bar = tqdm(
            total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0
        )
    if info.is_main and replay is None and cfg.sandbox.docker_hosts:
        from agentrl.sandbox.hosts import configure

        configure(cfg.sandbox.docker_hosts)  # the rollout's environments place on these engines
    if info.is_main and replay is None:
        from agentrl.rollout.policy import VLLMPolicy

        # vLLM loads from a directory: after a resume, the checkpoint itself (Hugging Face layout).
        start_dir = str(resumed_from) if resumed_from is not None else cfg.model
        # An in-process engine (no second process, no weight serialisation) only works while our
        # process group has one rank: vLLM joins an existing default group and would wait for the
        # other ranks to create its subgroups. With more ranks, or on GPUs, the engine core runs in
        # its own process, spawned without torchrun's rendezvous variables.
        in_process = info.world_size == 1 and not torch.cuda.is_available()
        with _without_torchrun_env():
            policy = _ray_policy(cfg, start_dir) if cfg.cluster.ray_address is not None else None
        with _without_torchrun_env():
            policy = policy or VLLMPolicy(
                start_dir,
                seed=cfg.seed,
                in_process=in_process,
                # fp32 on CPU, as the trainer computes: behaviour log-probs then match to ~1e-6;
                # on GPUs vLLM's choice (bf16), with the TIS correction covering the mismatch.
                dtype="auto" if torch.cuda.is_available() else "float32",
                max_model_len=cfg.rollout.max_total_tokens + cfg.rollout.max_tokens_per_turn,
                weight_bucket_bytes=weight_chunk_bytes(cfg),
                **engine_placement_kwargs(placement),
                engine_kwargs={"use_tqdm_on_load": False},
            )
        # The engine counts weight pushes from 0; a resumed run continues the count (trajectories
        # record it, and async staleness is measured with it).
        policy._version = policy_version
        producer = RolloutProducer(cfg, policy, calls=rollout_calls, on_trajectory=_episode_counter(bar))
    if cfg.cluster.ray_address is not None:
        # The engines are Ray actors on their own GPUs: no sleep, weights through the object store.
        placement = dataclasses.replace(placement, colocated=False, sleep=False, transport="rpc")
    sync = WeightSync(
        placement,
        producer.policy if producer else None,
        model,
        info,
        active=cfg.replay is None,
        chunk_bytes=weight_chunk_bytes(cfg),
        sleep_wait_s=cfg.engine.sleep_wait_s,
    )
    if rng is not None:  # after the engine's start-up, which seeds the global RNGs
        set_rng_state(rng)
    if info.is_main:
        what = f"replaying {cfg.replay}" if replay is not None else f"{cfg.env} ({pool})"
        resumed = f", resuming {resumed_from.name}" if resumed_from is not None else ""
        log(
            f"{cfg.steps} steps on {what}, {info.world_size} process(es){resumed}; run directory {out}"
            + (f" (engine log: {out / 'engine.log'})" if replay is None else "")
        )
        for note in tracker.notes if tracker is not None else []:
            log(note)

    # What a checkpoint records: the state after the last batch trained on (a batch in flight, or
    # one interrupted half-way, is generated again after a resume).
    curriculum_state = curriculum.state_dict() if curriculum is not None else None

    def checkpoint(step: int) -> Path:
        return save_checkpoint(
            out,
            step,
            model,
            opt,
            {
                "updates": updates,
                "curriculum": curriculum_state,
                "rollout_calls": rollout_calls,
                "uninformative_streak": streak,
                "policy_version": producer.policy.version if producer is not None else policy_version,
            },
            cfg.model,
            cfg.keep_last,
        )

    sigint = _Sigint(listen=info.is_main)
    step = start
    t_run = time.perf_counter()
    step_times: list[float] = []
    saved_at = start if resumed_from is not None else -1
    try:
        with sigint:
            for step in range(start, cfg.steps):
                t_step = time.perf_counter()
                metrics: dict[str, float] = {}
                generated: list[Trajectory] = []  # every episode of this step's batch, for a stop's reason
                payload: list[Any] = [None]
                if info.is_main:
                    try:
                        with sigint.rollout_phase():
                            if replay is not None:
                                trajs = generated = replay
                                metrics["charts/reward_mean"] = sum(t.reward for t in trajs) / len(trajs)
                            else:
                                assert producer is not None
                                t0 = time.perf_counter()
                                if bar is not None:
                                    bar.set_postfix_str("generating")
                                assert curriculum is not None
                                batch = producer.next_batch(curriculum)
                                metrics["time/wait_for_batch_s"] = time.perf_counter() - t0
                                metrics.update(batch.metrics)
                                curriculum_state, rollout_calls = batch.curriculum_state, batch.rollout_calls
                                made = batch.result
                                generated = [
                                    t for g in (*made.groups, *made.dropped, *made.surplus) for t in g
                                ]
                                trajs = _apply_staleness(
                                    batch.result.trajectories, producer.policy.version, cfg, metrics
                                )
                        payload = [trajs]
                    except KeyboardInterrupt:
                        payload = [_INTERRUPTED]
                # The other ranks waited through the rollout (or the engine's start-up) on the store, not
                # in this collective, whose timeout is meant for the update.
                wait_for_main(f"batch-{step}")
                dist.broadcast_object_list(payload, src=0)
                if isinstance(payload[0], str) and payload[0] == _INTERRUPTED:
                    raise KeyboardInterrupt
                trajs = payload[0]
                if bar is not None:
                    bar.set_postfix_str("updating")
                if trajs:
                    t0 = time.perf_counter()
                    sync.before_update()  # a colocated engine sleeps: the update gets its memory
                    metrics.update(
                        grpo_step(
                            model,
                            opt,
                            trajs,
                            cfg,
                            info,
                            pad_id,
                            ref_model=ref_model,
                            updates_done=updates,
                            seed=cfg.seed + step,
                        )
                    )
                    updates += cfg.optim.epochs * cfg.optim.mini_batches
                    metrics["time/train_s"] = time.perf_counter() - t0
                    streak = 0
                else:
                    streak += 1
                t0 = time.perf_counter()
                version = sync.after_update()  # wake weights, push them (a collective), wake the KV cache
                if version is not None:
                    metrics["policy/version"] = float(version)
                    if producer is not None and hasattr(
                        producer.policy, "versions"
                    ):  # each engine's own report
                        metrics["policy/engine_version_min"] = float(min(producer.policy.versions()))
                metrics["time/weight_sync_s"] = time.perf_counter() - t0
                metrics["time/step_s"] = time.perf_counter() - t_step
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    checkpoint(step + 1)
                    saved_at = step + 1
                if info.is_main:
                    assert tracker is not None
                    tracker.log(step + 1, metrics)
                    step_times.append(metrics["time/step_s"])
                    log(_step_line(step + 1, cfg.steps, metrics, bool(trajs), step_times))
                    if bar is not None:
                        bar.update(1)
                    if producer is not None and cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                        _evaluate_in_training(cfg, producer.policy, step + 1, out)
                # Nothing to learn from for several steps in a row: say why and stop, rather than
                # run on with an unchanged policy (rank 0 decides; every rank leaves the loop).
                limit = cfg.stop_uninformative_after
                kind = _no_update_reason(metrics)[0] if info.is_main and limit and streak >= limit else ""
                verdict = [(kind, _stop_advice(kind, cfg.env, generated)) if kind else None]
                wait_for_main(f"verdict-{step}")  # rank 0 may have evaluated meanwhile
                dist.broadcast_object_list(verdict, src=0)
                if verdict[0]:
                    raise _StopUninformative(*verdict[0], step + 1)
            step = cfg.steps
    except KeyboardInterrupt:
        if producer is not None:
            producer.stop()
        if sigint.requested >= 3:  # quit without saving: an update may be half done
            _finish(info, producer, sync, tracker, bar, out, ok=False)
            newest = latest_resumable(out)
            message = f"quit at step {step + 1}/{cfg.steps} without saving; " + (
                f"a resume starts from {newest}" if newest else "no checkpoint was saved"
            )
        else:
            where = checkpoint(step) if saved_at != step else out / f"checkpoint-{step}"
            _finish(info, producer, sync, tracker, bar, out)
            done = f"step{'s 1-' if step > 1 else ' '}{step} done" if step else "no step finished yet"
            message = (
                f"interrupted at step {step + 1}/{cfg.steps}: saved {where} ({done}; the step in progress "
                f"is redone on resume). Continue with the same command: {_command()}"
            )
        if info.is_main:
            log(message)
        raise TrainingInterrupted(message) from None
    except _StopUninformative as stopped:
        if producer is not None:
            producer.stop()
        if stopped.kind != "all-pass":
            where = checkpoint(stopped.step)
            _finish(info, producer, sync, tracker, bar, out)
            raise TrainingStopped(
                f"no informative group in the last {cfg.stop_uninformative_after} steps (step {stopped.step}/"
                f"{cfg.steps}): {stopped.advice}. Saved {where}; stop_uninformative_after=0 "
                "keeps going regardless"
            ) from None
        if info.is_main:
            log(f"stopping early at step {stopped.step}: {stopped.advice}")
        step = stopped.step
    except BaseException:
        if producer is not None:
            producer.stop()
        _finish(info, producer, sync, tracker, bar, out, ok=False)
        raise
    if producer is not None:
        producer.stop(
            wait=True
        )  # the batch in flight finishes; its groups were generated but are not trained on
    wait_for_main("final")
    if saved_at != step:
        checkpoint(step)
    sd = full_state_dict(model)
    if info.is_main:
        export_hf(sd, cfg.model, out / "final")
    wait_for_main("exported")  # writing a large model can outlast a collective's timeout
    _finish(info, producer, sync, tracker, bar, out)
    if info.is_main:
        minutes, seconds = divmod(int(time.perf_counter() - t_run), 60)
        log(
            f"done: {step - start} step(s) in {minutes}m{seconds:02d}s; model {out / 'final'}; "
            f"plot {out / 'training.png'}; metrics {out / 'metrics.jsonl'}"
        )
    return out / "final"


class _StopUninformative(Exception):
    def __init__(self, kind: str, advice: str, step: int):
        super().__init__(kind)
        self.kind, self.advice, self.step = kind, advice, step


def _finish(
    info: DistInfo, producer: Any, sync: WeightSync, tracker: Any, bar: Any, out: Path, ok: bool = True
) -> None:
    """Close what the run opened, in an order that keeps the process group alive for its users."""
    if ok and dist.is_initialized():
        dist.barrier()  # every rank is done with collectives before the engine may take the group down
    if bar is not None:
        bar.close()
    if tracker is not None:
        tracker.close()
    if info.is_main and (out / "metrics.jsonl").exists():
        try:
            plot_training(out / "metrics.jsonl", out / "training.png")
        except Exception as exc:  # a plot must never cost the run
            log(f"could not write {out / 'training.png'}: {exc}")
    sync.close()
    if producer is not None:
        # An in-process vLLM engine shuts down the default process group it joined: last.
        producer.policy.close()


def _step_line(step: int, steps: int, metrics: dict[str, float], updated: bool, times: list[float]) -> str:
    reward = metrics.get("charts/reward_mean")
    head = f"step {step}/{steps}" + (f" reward {reward:.3f}" if reward is not None else "")
    if updated:
        body = f" loss {metrics.get('losses/policy_loss', 0.0):.4g}"
    else:
        body = f" no update: {_no_update_reason(metrics)[1]}"
    band = metrics.get("curriculum/band_occupancy")
    if band is not None:
        body += f" band {band:.2f}"
    remaining = steps - step
    eta = f", eta {_duration(sum(times) / len(times) * remaining)}" if remaining and times else ""
    return f"{head}{body} ({metrics.get('time/step_s', 0.0):.1f}s{eta})"


def _duration(seconds: float) -> str:
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s" if minutes else f"{sec}s"


def _episode_counter(bar: Any) -> Any:
    """on_trajectory callback: the episodes of the batch being generated, on the progress bar."""
    if bar is None:
        return None
    count = {"n": 0, "passed": 0}

    def on_trajectory(t: Trajectory) -> None:
        count["n"] += 1
        count["passed"] += t.passed
        bar.set_postfix_str(f"generating: {count['n']} episodes, {count['passed']} passed", refresh=False)

    return on_trajectory


def _command() -> str:
    return os.environ.get("AGENTRL_COMMAND") or "rerun the same `agentrl train` command"


def _register_rank_pid(rank: int) -> None:
    """Tell `run_ranks` this rank's pid, so it can forward Ctrl-C to the ranks (not to torchrun)."""
    pid_dir = os.environ.get("AGENTRL_RANK_PIDS")
    if pid_dir:
        Path(pid_dir, f"rank-{rank}.pid").write_text(str(os.getpid()))


@contextlib.contextmanager
def _without_torchrun_env() -> Iterator[None]:
    """Hide torchrun's rendezvous variables from processes spawned inside (the vLLM engine core)."""
    keys = [k for k in os.environ if k in _TORCHRUN_VARS or k.startswith("TORCHELASTIC_")]
    saved = {k: os.environ.pop(k) for k in keys}
    try:
        yield
    finally:
        os.environ.update(saved)


_TORCHRUN_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
}


def _apply_staleness(
    trajs: list[Trajectory], version: int, cfg: TrainConfig, metrics: dict[str, float]
) -> list[Trajectory]:
    """Async: drop trajectories too many versions behind, or keep them (the TIS weight corrects them)."""
    ages = [
        version - (t.policy_version_max if t.policy_version_max is not None else t.policy_version)
        for t in trajs
    ]
    metrics["async/staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
    if cfg.asynchronous.mode != "async" or cfg.asynchronous.stale == "importance-weight":
        return trajs
    kept = [t for t, a in zip(trajs, ages, strict=True) if a <= cfg.asynchronous.max_staleness]
    metrics["async/dropped_stale"] = float(len(trajs) - len(kept))
    return kept


def _evaluate_in_training(cfg: TrainConfig, policy: Any, step: int, out: Path) -> None:
    from agentrl.eval.evaluate import evaluate_policy

    # The training's rollout settings, at the evaluation's own temperature when it has one.
    eval_rollout = (
        cfg.rollout
        if cfg.eval.temperature is None
        else cfg.rollout.model_copy(update={"temperature": cfg.eval.temperature})
    )
    summary = evaluate_policy(
        policy,
        cfg.env,
        split=cfg.eval.split,
        num_tasks=cfg.eval.tasks,
        samples=cfg.eval.samples,
        rollout=eval_rollout,
        env_kwargs=cfg.env_kwargs,
        model_name=f"step-{step}",
    )
    row = {
        "step": step,
        **{f"eval/{k}": v for k, v in summary.pass_at_dict().items()},
        "eval/mean_reward": summary.mean_reward,
    }
    with (out / "eval.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    log(f"eval at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "step"))


def _ray_policy(cfg: TrainConfig, start_dir: str) -> Any:
    """`engine.count` engines on the Ray cluster of `cluster.ray_address` (agentrl.rollout.ray_policy)."""
    from agentrl.rollout.ray_policy import RayPolicy

    return RayPolicy(
        start_dir,
        engines=cfg.engine.count,
        address=cfg.cluster.ray_address,
        resources=cfg.engine.resources,
        seed=cfg.seed,
        dtype="auto" if torch.cuda.is_available() else "float32",
        max_model_len=cfg.rollout.max_total_tokens + cfg.rollout.max_tokens_per_turn,
        engine_kwargs={"use_tqdm_on_load": False},
    )


def train_placement(cfg: TrainConfig, nproc: int) -> Placement:
    """Trainer and engine GPUs for this config on this node, `nproc` being the node's trainer processes (`--nproc`,
    torchrun's local world size; `agentrl.train.placement`); PlacementError if impossible."""
    return plan_placement(
        gpus=visible_gpus(),
        nproc=nproc,
        devices=cfg.engine.devices,
        asynchronous=cfg.asynchronous.mode == "async",
        sleep=cfg.engine.sleep,
        gpu_memory_utilization=cfg.engine.gpu_memory_utilization,
    )


def weight_chunk_bytes(cfg: TrainConfig) -> int:
    """`engine.weight_chunk_mib` in bytes: one chunk of a weight push."""
    return max(1, int(cfg.engine.weight_chunk_mib * (1 << 20)))


def engine_placement_kwargs(placement: Placement) -> dict[str, Any]:
    """`VLLMPolicy` arguments that put the engine where `placement` says (nothing on CPU)."""
    if not placement.on_gpu:
        return {}
    return {
        "devices": list(placement.engine_gpus),
        "gpu_memory_utilization": placement.gpu_memory_utilization,
        "sleep_mode": placement.sleep,
        "weight_transfer": placement.transport,
    }


def preflight(cfg: TrainConfig, nproc: int = 1, force: bool = False) -> str:
    """Every check that can fail before any process starts, each a one-line `UserError`: the process
    count, the starting model, the tracking packages, the replay file or the environment and its
    tasks; then the run directory (resume or not, config unchanged or `force`). Returns a note."""
    train_placement(cfg, nproc)  # the process count and the engine's GPUs fit this machine
    check_model_dir(cfg.model, what="model")
    check_available(cfg.report_to)
    if cfg.replay is not None:
        check_nonempty_file(cfg.replay, "replay file")
        try:
            load_trajectories(cfg.replay)
        except Exception as exc:
            raise UserError(f"replay file {cfg.replay} is not trajectory JSONL: {exc}") from None
    else:
        _check_tasks(cfg)
    return prepare_run_dir(cfg, force)


def _check_tasks(cfg: TrainConfig) -> None:
    """A generator returning garbage, an empty dataset: said here, once. The tasks are read with the
    run's own overrides (`env_kwargs` may name another dataset: `tasks: data.jsonl`)."""
    from agentrl.registry import task_source

    train = task_source(cfg.env, **cfg.env_kwargs)
    train.get(0, "train")
    size = train.size("train")
    if size is not None and size < cfg.curriculum.batch_groups:
        log(
            f"note: {cfg.env} has {size} train tasks, fewer than curriculum.batch_groups "
            f"({cfg.curriculum.batch_groups}): a batch holds at most {size} groups"
        )
    if cfg.eval.every:
        task_source(cfg.env, split=cfg.eval.split, **cfg.env_kwargs).get(0, cfg.eval.split)


def launch(
    cfg: TrainConfig,
    nproc: int = 1,
    force: bool = False,
    *,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
) -> Path:
    """Train here (nproc=1) or under `torchrun` with `nproc` processes, after `preflight`.

    Several nodes (`nnodes` > 1): `nproc` processes on this node, node `node_rank`, all nodes meeting
    at `rdzv_endpoint`; node 0 checks and prepares the run directory (shared by all nodes), the
    others only join.

    Returns out/final. Raises `TrainingInterrupted` (a KeyboardInterrupt) after Ctrl-C saved a
    checkpoint, `TrainingStopped` (a UserError) when nothing could be learned.
    """
    if nnodes > 1 and node_rank != 0:
        run_ranks("agentrl.train.trainer", cfg.model_dump_json(), nproc, nnodes=nnodes, node_rank=node_rank,
                  rdzv_endpoint=rdzv_endpoint)  # fmt: skip
        return Path(cfg.out) / "final"
    note = preflight(cfg, nproc, force)
    if "changed config" in note:
        log(note)
    newest = latest_resumable(cfg.out) if cfg.resume else None
    finished = json.loads((newest / "trainer_state" / "state.json").read_text())["step"] if newest else 0
    if finished >= cfg.steps and (Path(cfg.out) / "final" / "config.json").exists():
        log(f"{cfg.out} already finished its {cfg.steps} steps ({newest}); raise steps= to train it further")
        return Path(cfg.out) / "final"
    if nnodes > 1:
        run_ranks("agentrl.train.trainer", cfg.model_dump_json(), nproc, nnodes=nnodes, node_rank=node_rank,
                  rdzv_endpoint=rdzv_endpoint)  # fmt: skip
        return Path(cfg.out) / "final"
    if nproc == 1:
        try:
            return train(cfg)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    run_ranks("agentrl.train.trainer", cfg.model_dump_json(), nproc)
    return Path(cfg.out) / "final"


if __name__ == "__main__":
    sys.exit(run_rank(lambda: train(TrainConfig.model_validate_json(sys.argv[1]))))
