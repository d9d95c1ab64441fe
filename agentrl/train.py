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
    budget, packed where the varlen kernel runs: `agentrl.packing`; log-probs from hidden
    states at the action tokens only: `agentrl.logprobs`; FSDP2 all-gathers the weights,
    reduce-scatters the gradients), the global gradient is clipped, AdamW steps. With more
    than one step per batch the ratio is taken against the log-probs from before the first
    one, computed up front (as are the reference's when `loss.kl_coef` > 0). A vLLM engine
    colocated on the trainer's GPU sleeps meanwhile (`agentrl.placement`);
 4. the weights go to the vLLM policy (bf16 GPU to GPU on GPUs, `agentrl.weight_sync`), whose
    version increments;
 5. metrics to out/metrics.jsonl (and TensorBoard), held-out evaluation every `eval.every`
    steps, a resumable checkpoint every `checkpoint_every` steps.

Asynchronous mode overlaps 1 with 3-4: a background thread generates the next batch with
the weights it has while the trainer updates; trajectories more than `max_staleness` versions
behind are dropped or kept with the truncated importance-sampling correction.

Losses and advantages are the pure functions of `agentrl.grpo`; batching is `agentrl.batch`
and `agentrl.packing`; the curriculum is `agentrl.curriculum`; distribution is
`agentrl.distributed`; GPU placement is `agentrl.placement` and `agentrl.weight_sync`.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.batch import collate
from agentrl.curriculum import Curriculum, DynamicBatchResult, TaskDraw, build_batch, group_by_id
from agentrl.distributed import (
    DistInfo,
    all_reduce_mean,
    export_hf,
    full_state_dict,
    global_token_scale,
    init_distributed,
    load_checkpoint,
    run_ranks,
    save_checkpoint,
    shard_model,
)
from agentrl.grpo import group_advantages, policy_loss, weight_negatives
from agentrl.logprobs import action_logprobs
from agentrl.packing import plan_micro_batches, resolve_packing
from agentrl.placement import Placement, plan_placement, visible_gpus
from agentrl.train_config import TrainConfig
from agentrl.trajectory import Trajectory, load_trajectories
from agentrl.weight_sync import WeightSync


def log(msg: str) -> None:
    print(f"[train] {msg}", file=sys.stderr, flush=True)


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


# --- rollouts (rank 0) --------------------------------------------------------------------------


@dataclass
class Generator:
    """Rank 0's side: the vLLM policy and the environments, turning task draws into groups."""

    cfg: TrainConfig
    policy: Any
    stats: dict[str, float] = field(default_factory=dict)
    calls: int = 0

    def groups(self, draws: list[TaskDraw]) -> list[list[Trajectory]]:
        from agentrl.rollout import RolloutConfig, collect_sync

        r = self.cfg.rollout
        # A new seed per call: the rollout derives episode k's sampling seed from (seed, k, turn),
        # so reusing one seed every step would replay the same random stream for every batch.
        self.calls += 1
        rc = RolloutConfig(
            group_size=r.group_size,
            max_tokens_per_turn=r.max_tokens_per_turn,
            max_total_tokens=r.max_total_tokens,
            episode_timeout_s=r.episode_timeout_s,
            concurrency=r.concurrency,
            temperature=r.temperature,
            top_p=r.top_p,
            seed=self.cfg.seed * 1_000_003 + self.calls,
        )
        t0 = time.perf_counter()
        trajs = collect_sync(
            self.cfg.env, [d.task for d in draws], self.policy, rc, env_kwargs=self.cfg.env_kwargs
        )
        self.stats["time/rollout_s"] = self.stats.get("time/rollout_s", 0.0) + time.perf_counter() - t0
        self.stats["rollout/drifted"] = self.stats.get("rollout/drifted", 0.0) + sum(
            1 for t in trajs if t.drift is not None and t.drift.drifted
        )
        return group_by_id(trajs)

    def batch(self, curriculum: Curriculum) -> tuple[DynamicBatchResult, dict[str, float], dict[str, Any]]:
        """One dynamic-sampling batch, its metrics, and the curriculum state right after it.

        Metrics and state are taken here, in the thread that changed the curriculum, so the
        async producer and the trainer never touch the curriculum at the same time.
        """
        self.stats = {}
        result = build_batch(curriculum, self.groups)
        metrics = {**_batch_metrics(result, curriculum), **self.stats}
        return result, metrics, curriculum.state_dict()


def _batch_metrics(result: DynamicBatchResult, curriculum: Curriculum) -> dict[str, float]:
    # Rewards over every generated group (dropped zero-variance ones too): what the policy scored.
    trajs = [t for g in (*result.groups, *result.dropped, *result.surplus) for t in g]
    m: dict[str, float] = {
        k: float(v) for k, v in curriculum.metrics(result).as_dict().items() if isinstance(v, int | float)
    }
    if trajs:
        m["charts/reward_mean"] = sum(t.reward for t in trajs) / len(trajs)
        m["charts/episode_turns"] = sum(t.turns for t in trajs) / len(trajs)
        m["charts/episode_tokens"] = sum(len(t.token_ids) for t in trajs) / len(trajs)
    m["batch/groups"] = float(len(result.groups))
    return m


# --- the loop -----------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = init_distributed()
    placement = train_placement(cfg, info.world_size)
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    ckpt_dir = out / "checkpoints" / "latest"
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
    if info.is_main and cfg.replay is None:
        import agentrl

        env = agentrl.make(cfg.env, backend="local", use_pool=False)
        curriculum = Curriculum.from_generator(env.task_source, config=cfg.curriculum)
        env.close()
    start = 0
    updates = 0  # optimizer steps so far (the warm-up counts these, not training steps)
    if cfg.resume and (ckpt_dir / "weights.pt").exists():
        state = load_checkpoint(ckpt_dir, model, opt)
        if curriculum is not None and state.get("curriculum") is not None:
            curriculum.load_state_dict(state["curriculum"])
        start = int(state["step"])
        updates = int(state.get("updates", 0))
        log(f"resumed from {ckpt_dir} at step {start}")
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    writer = _tensorboard(cfg, out) if info.is_main else None

    replay = load_trajectories(cfg.replay) if cfg.replay else None
    gen: Generator | None = None
    policy_dir = out / "policy"
    if info.is_main and replay is None:
        from agentrl.policy import VLLMPolicy

        # vLLM loads from a directory; after a resume that is the checkpoint's weights.
        start_dir = cfg.model
        if start:
            start_dir = str(
                export_hf(
                    torch.load(ckpt_dir / "weights.pt", weights_only=False)["model"], cfg.model, policy_dir
                )
            )
        # An in-process engine (no second process, no weight serialisation) only works while our
        # process group has one rank: vLLM joins an existing default group and would wait for the
        # other ranks to create its subgroups. With more ranks, or on GPUs, the engine core runs in
        # its own process, spawned without torchrun's rendezvous variables.
        in_process = info.world_size == 1 and not torch.cuda.is_available()
        with _without_torchrun_env():
            policy = VLLMPolicy(
                start_dir,
                seed=cfg.seed,
                in_process=in_process,
                # fp32 on CPU, as the trainer computes: behaviour log-probs then match to ~1e-6;
                # on GPUs vLLM's choice (bf16), with the TIS correction covering the mismatch.
                dtype="auto" if torch.cuda.is_available() else "float32",
                max_model_len=cfg.rollout.max_total_tokens + cfg.rollout.max_tokens_per_turn,
                **engine_placement_kwargs(placement),
            )
        gen = Generator(cfg, policy)
    sync = WeightSync(placement, gen.policy if gen else None, model, info, active=cfg.replay is None)
    prefetch: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    worker: threading.Thread | None = None
    curriculum_state = curriculum.state_dict() if curriculum is not None else None

    # One batch ahead at most: the producer may start the next batch only once the trainer has
    # taken the last one, so a trajectory is at most one policy version behind when it is trained
    # on (episodes that straddle a weight push are younger still).
    slot = threading.Semaphore(1)

    def produce() -> None:
        assert gen is not None and curriculum is not None
        while not stop.is_set():
            if not slot.acquire(timeout=0.5):
                continue
            if stop.is_set():
                break
            prefetch.put(gen.batch(curriculum))

    for step in range(start, cfg.steps):
        t_step = time.perf_counter()
        metrics: dict[str, float] = {}
        if info.is_main:
            if replay is not None:
                trajs = replay
                metrics["charts/reward_mean"] = sum(t.reward for t in trajs) / len(trajs)
            else:
                assert gen is not None
                t0 = time.perf_counter()
                if cfg.asynchronous.mode == "async":
                    if worker is None:
                        worker = threading.Thread(target=produce, daemon=True, name="rollout")
                        worker.start()
                    result, batch_metrics, curriculum_state = prefetch.get()
                    slot.release()  # the producer starts the next batch, with the weights of this update
                else:
                    assert curriculum is not None
                    result, batch_metrics, curriculum_state = gen.batch(curriculum)
                metrics["time/wait_for_batch_s"] = time.perf_counter() - t0
                metrics.update(batch_metrics)
                trajs = _apply_staleness(result.trajectories, gen.policy.version, cfg, metrics)
            payload = [trajs]
        else:
            payload = [None]
        dist.broadcast_object_list(payload, src=0)
        trajs = payload[0]
        if not trajs:
            if info.is_main:
                log(
                    f"step {step + 1}: no informative groups (all groups had equal rewards); skipping the update"
                )
        else:
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
        t0 = time.perf_counter()
        version = sync.after_update()  # wake weights, push them (a collective), wake the KV cache
        if version is not None:
            metrics["policy/version"] = float(version)
        metrics["time/weight_sync_s"] = time.perf_counter() - t0
        metrics["time/step_s"] = time.perf_counter() - t_step
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(
                ckpt_dir, model, opt, {"step": step + 1, "updates": updates, "curriculum": curriculum_state}
            )
        if info.is_main:
            row = {"step": step + 1, **{k: round(v, 6) for k, v in metrics.items()}}
            with (out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")
            if writer is not None:
                for k, v in metrics.items():
                    writer.add_scalar(k, v, step + 1)
            log(
                f"step {step + 1}/{cfg.steps} reward {metrics.get('charts/reward_mean', float('nan')):.3f} "
                f"loss {metrics.get('losses/policy_loss', float('nan')):.4f} "
                f"band {metrics.get('curriculum/band_occupancy', float('nan')):.2f} {metrics['time/step_s']:.1f}s"
            )
            if gen is not None and cfg.eval.every and (step + 1) % cfg.eval.every == 0:
                _evaluate_in_training(cfg, gen.policy, step + 1, out)
    stop.set()
    if worker is not None:
        worker.join()  # the batch in flight finishes; its groups were generated but are not trained on
    save_checkpoint(
        ckpt_dir, model, opt, {"step": cfg.steps, "updates": updates, "curriculum": curriculum_state}
    )
    sd = full_state_dict(model)
    if info.is_main:
        export_hf(sd, cfg.model, out / "final")
        if writer is not None:
            writer.close()
    sync.close()
    if gen is not None:
        gen.policy.close()
    dist.barrier()
    return out / "final"


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
    from agentrl.evaluate import evaluate_policy

    summary = evaluate_policy(
        policy,
        cfg.env,
        split=cfg.eval.split,
        num_tasks=cfg.eval.tasks,
        samples=cfg.eval.samples,
        temperature=cfg.eval.temperature,
        rollout=cfg.rollout,
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


def _tensorboard(cfg: TrainConfig, out: Path) -> Any:
    if not cfg.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            "tensorboard=true needs the tensorboard package: pip install 'agentrl[tensorboard]'"
        ) from exc
    return SummaryWriter(str(out / "tb"))


def train_placement(cfg: TrainConfig, nproc: int) -> Placement:
    """Trainer and engine GPUs for this config on this machine (`agentrl.placement`); PlacementError if impossible."""
    return plan_placement(
        gpus=visible_gpus(),
        nproc=nproc,
        devices=cfg.rollout.devices,
        asynchronous=cfg.asynchronous.mode == "async",
        sleep=cfg.rollout.sleep,
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
    )


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


def launch(cfg: TrainConfig, nproc: int = 1) -> Path:
    """Train here (nproc=1) or under `torchrun` with `nproc` processes.

    Raises PlacementError (before starting anything) when `nproc` or `rollout.devices` do not fit
    the visible GPUs."""
    train_placement(cfg, nproc)
    if nproc <= 1:
        path = train(cfg)
        dist.destroy_process_group()
        return path
    run_ranks("agentrl.train", cfg.model_dump_json(), nproc)
    return Path(cfg.out) / "final"


if __name__ == "__main__":
    train(TrainConfig.model_validate_json(sys.argv[1]))
    dist.destroy_process_group()
