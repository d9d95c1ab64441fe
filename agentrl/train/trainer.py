"""GRPO training of a tool-using agent, top to bottom: `setup`, the loop of `train`, `finish`.

    agentrl train examples/calc_grpo.yaml [key.sub=value ...]          # one process
    agentrl train examples/calc_grpo.yaml --nproc 2                     # torchrun, FSDP2 over 2 ranks

One step (`train` names each phase):
 1. `next_batch`: rank 0 builds a batch with the curriculum and DAPO dynamic sampling: it draws tasks in
    the learnability band, runs one group of episodes per task through the vLLM policy and the
    environments, drops zero-variance groups and refills (bounded); the batch goes to every rank;
 2. `update`: advantages are computed on the whole batch (one per trajectory, group-relative), then
    each rank takes its share; `optim.epochs` passes over the batch, each split into `optim.mini_batches`
    optimizer steps: each rank computes the clipped surrogate over its micro-batches (cut by a token
    budget, packed where the varlen kernel runs: `agentrl.train.packing`; log-probs from hidden
    states at the action tokens only: `agentrl.train.logprobs`; FSDP2 all-gathers the weights,
    reduce-scatters the gradients), the global gradient is clipped, AdamW steps. With more
    than one step per batch the ratio is taken against the log-probs from before the first
    one, computed up front (as are the reference's when `loss.kl_coef` > 0). A vLLM engine
    colocated on the trainer's GPU sleeps meanwhile (`agentrl.rollout.placement`);
 3. `push_weights`: the weights go to the vLLM policy (bf16 GPU to GPU on GPUs,
    `agentrl.rollout.weight_sync`), whose version increments;
 4. `report`: metrics to out/metrics.jsonl (and TensorBoard, W&B: `report_to`), held-out evaluation
    every `eval.every` steps; a Hugging Face-loadable, resumable `out/checkpoint-N` every
    `checkpoint_every` steps (`agentrl.train.checkpoint`); out/training.png at the end.

A run resumes from its newest checkpoint, exactly (the same metrics and weights as an
uninterrupted run, on CPU with the same seed; synchronous mode). Ctrl-C stops the episodes being
generated, or lets an update finish, saves a checkpoint and says how to continue. Several steps in
a row without an informative group (all-fail: warm-start first; all-pass: harder tasks) stop the
run with the reason (`stop_uninformative_after`; both in `agentrl.train.stopping`).

Step 1 is rank 0's `agentrl.train.producer.RolloutProducer`. Asynchronous mode overlaps 1 with 2-3:
the producer's background thread generates up to `max_staleness` batches ahead with the weights it has
while the trainer updates (with `overlap`, all of them at once), so no trajectory is more than that
many versions behind when trained on; the truncated importance-sampling correction weighs the stale
tokens, and a push reaches the episodes in flight between two decode steps.

Step 2 is `agentrl.train.update.grpo_step`; `agentrl.train.launch` checks a run and starts its ranks, which
run this module. Losses and advantages are the pure functions of `agentrl.train.grpo`; batching is `agentrl.train.batch`
and `agentrl.train.packing`; the curriculum is `agentrl.train.curriculum`; distribution is
`agentrl.train.distributed`; the engine is started by `agentrl.rollout.engine.make_policy`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from tqdm import tqdm

from agentrl.core.errors import UserError, one_line, visible_gpus
from agentrl.core.runlog import quiet_libraries
from agentrl.eval.failures import OUTSIDE_THE_POLICY, failures
from agentrl.rollout.engine import make_policy
from agentrl.rollout.placement import Placement, plan_placement
from agentrl.rollout.trajectory import Trajectory, load_trajectories, save_trajectories
from agentrl.rollout.weight_sync import WeightSync
from agentrl.train.checkpoint import (
    export_model,
    latest_resumable,
    save_weights,
    set_rng_state,
    truncate_jsonl,
)
from agentrl.train.checkpoint import load as load_checkpoint
from agentrl.train.checkpoint import save as save_checkpoint
from agentrl.train.compiled import resolve_compile
from agentrl.train.config import TrainConfig
from agentrl.train.curriculum import Curriculum, build_curriculum
from agentrl.train.distributed import (
    DistInfo,
    init_distributed,
    run_rank,
    shard_model,
    wait_for_main,
)
from agentrl.train.lora import (
    adapter_files,
    apply_lora,
    merge_adapter,
    merged_state_dict,
    trainable_parameters,
)
from agentrl.train.plot import plot_training
from agentrl.train.producer import RolloutProducer
from agentrl.train.selection import METRIC as SELECTION_METRIC
from agentrl.train.selection import Choice, best_of, eval_rows, evaluated, rule, write_best
from agentrl.train.stopping import (
    ENGINE_OUT_OF_DATE,
    INTERRUPTED,
    EngineLost,
    Sigint,
    StopUninformative,
    TrainingInterrupted,
    TrainingStopped,
    check_engine_versions,
    engine_dead,
    no_update_reason,
    stop_advice,
)
from agentrl.train.tracking import Tracker
from agentrl.train.update import grpo_step


def log(msg: str) -> None:
    # tqdm.write keeps the progress bar below the line instead of breaking it.
    tqdm.write(f"[train] {msg}", file=sys.stderr)


# --- what the loop works with ----------------------------------------------------------------------


@dataclass
class Progress:
    """The counters a checkpoint records beside the weights: a resumed run carries on from them."""

    updates: int
    """Optimizer steps so far (the learning-rate warm-up counts these, not training steps)."""
    rollout_calls: int
    """Rollout calls so far: each seeds its episodes differently."""
    streak: int
    """Steps in a row without an informative group."""
    policy_version: int
    """The engine's weight version when the run (re)started; it counts weight pushes."""
    curriculum: dict[str, Any] | None
    """The curriculum's state after the last batch trained on (a batch in flight, or one interrupted
    half-way, is generated again after a resume)."""

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> Progress:
        """From a checkpoint's state (`Run.checkpoint` writes it); `{}`: a new run."""
        return cls(
            updates=int(state.get("updates", 0)),
            rollout_calls=int(state.get("rollout_calls", 0)),
            streak=int(state.get("uninformative_streak", 0)),
            policy_version=int(state.get("policy_version", 0)),
            curriculum=state.get("curriculum"),
        )


@dataclass
class Run:
    """Everything `setup` builds for one run, on every rank; rank 0 alone holds the rollout side
    (`producer`, `curriculum`, `tracker`, `bar`), which is None elsewhere and in replayed runs."""

    cfg: TrainConfig
    info: DistInfo
    out: Path
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    ref_model: torch.nn.Module | None
    pad_id: int
    sync: WeightSync
    progress: Progress
    start: int
    """Steps finished before this process started (a resume's checkpoint step)."""
    resumed_from: Path | None
    replay: list[Trajectory] | None
    curriculum: Curriculum | None
    producer: RolloutProducer | None
    tracker: Tracker | None
    bar: Any
    sigint: Sigint
    step: int = 0
    """The step in progress (0-based), which is also the number of steps finished."""
    saved_at: int = -1
    """The step of the newest checkpoint written (or resumed from); -1: none yet."""
    step_times: list[float] = field(default_factory=list)
    t_start: float = field(default_factory=time.perf_counter)
    pushed_version: int = -1
    """Rank 0: the weight (or adapter) version the trainer last pushed, counted here and not read from the
    engine, so an engine that missed a push is caught (`check_engine_versions`); -1: not counted yet."""
    engine_error: str | None = None
    """Rank 0: why the engine is not running the newest push, found after it; the next batch stops the run."""
    best: Choice | None = None
    """Rank 0, with `eval.keep_best`: the best step by validation pass@1 so far (`agentrl.train.selection`)."""
    failures_said: set[str] = field(default_factory=set)
    """Rank 0: the failure reasons (and "pool", the exhausted pool) a warning was printed for, once each."""

    def policy_version(self) -> int:
        return self.producer.policy.version if self.producer is not None else self.progress.policy_version

    def checkpoint(self, step: int) -> Path:
        """Save `out/checkpoint-<step>` (every rank: a collective)."""
        p = self.progress
        state = {
            "updates": p.updates,
            "curriculum": p.curriculum,
            "rollout_calls": p.rollout_calls,
            "uninformative_streak": p.streak,
            "policy_version": self.policy_version(),
        }
        path = save_checkpoint(
            self.out, step, self.model, self.opt, state, self.cfg.model.path, self.cfg.keep_last,
            protect=self.best.step if self.best is not None else None,
        )  # fmt: skip
        self.saved_at = step
        return path


# --- the recipe ----------------------------------------------------------------------------------------


def train(cfg: TrainConfig) -> Path:
    """Run GRPO in this process (a `torchrun` rank, or a one-rank group); see the module docstring.

    Resumes from the newest `out/checkpoint-N` when `cfg.resume` (the launcher has checked that the
    config matches). Returns out/final. Ctrl-C saves a checkpoint and raises `TrainingInterrupted`;
    a run that cannot learn stops with `TrainingStopped`.
    """
    run = setup(cfg)
    try:
        with run.sigint:
            for step in range(run.start, cfg.steps):
                run.step = step
                t_step = time.perf_counter()
                metrics: dict[str, float] = {}
                trajs, generated = next_batch(run, step, metrics)
                if trajs:
                    update(run, trajs, step, metrics)
                run.progress.streak = 0 if trajs else run.progress.streak + 1  # steps with nothing to learn
                push_weights(run, metrics)
                metrics["time/step_s"] = time.perf_counter() - t_step
                if checkpoint_due(cfg, step + 1) and step + 1 < cfg.steps:
                    run.checkpoint(step + 1)
                report(run, step + 1, metrics, updated=bool(trajs))
                stop_if_uninformative(run, step, metrics, generated)
            run.step = cfg.steps
    except BaseException as exc:
        if not stopped_early(run, exc):
            raise
    return finish(run)


def setup(cfg: TrainConfig) -> Run:
    """This rank's process group, model, optimizer and run directory; on rank 0 the engine, the
    environments and the curriculum; the state of the newest checkpoint when resuming."""
    info = init_distributed(timeout_s=cfg.collective_timeout_s)
    # Per node: GPUs are counted on this node, for this node's ranks (not the world size of all nodes).
    placement = train_placement(cfg, info.local_world_size)
    out = Path(cfg.out)
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
    quiet_libraries(out / "engine.log" if info.is_main and cfg.replay is None else None)
    _register_rank_pid(info.rank)
    torch.manual_seed(cfg.seed)
    model, opt, ref_model, pad_id = _load_models(cfg, info)
    resumed_from = latest_resumable(out) if cfg.resume else None
    start, progress, rng = 0, Progress.from_checkpoint({}), None
    if resumed_from is not None:
        state = load_checkpoint(resumed_from, model, opt)
        start, progress, rng = int(state["step"]), Progress.from_checkpoint(state), state.get("rng")
    tracker = bar = None
    if info.is_main:
        tracker = _open_tracker(cfg, out, start)
        bar = tqdm(
            total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, mininterval=1.0
        )
    replay = load_replay(cfg.replay) if cfg.replay else None
    curriculum, producer = _start_rollouts(cfg, info, placement, progress, resumed_from, bar)
    if cfg.cluster.ray_address is not None:
        # The engines are Ray actors on their own GPUs: no sleep, weights through the object store.
        placement = replace(placement, colocated=False, sleep=False, transport="rpc")
    sync = WeightSync(
        placement,
        producer.policy if producer else None,
        model,
        info,
        active=cfg.replay is None,
        chunk_bytes=weight_chunk_bytes(cfg),
        sleep_wait_s=cfg.engine.sleep_wait_s,
        **_lora_push(cfg, model),
    )
    if rng is not None:  # after the engine's start-up, which seeds the global RNGs
        set_rng_state(rng)
    run = Run(
        cfg=cfg, info=info, out=out, model=model, opt=opt, ref_model=ref_model, pad_id=pad_id, sync=sync,
        progress=progress, start=start, resumed_from=resumed_from, replay=replay, curriculum=curriculum,
        producer=producer, tracker=tracker, bar=bar, sigint=Sigint(listen=info.is_main), step=start,
        saved_at=start if resumed_from is not None else -1, pushed_version=progress.policy_version,
    )  # fmt: skip
    if info.is_main:
        _say_start(run)
        _evaluate_at_start(run)
    if start_is_candidate(cfg) and resumed_from is None:
        # The starting model's weights, for out/best should no trained step beat it on validation.
        wait_for_main("start-evaluated")
        save_weights(out, 0, model, cfg.model.path)
    return run


def load_replay(path: str) -> list[Trajectory]:
    """The trajectories of a `replay` file; one that holds trajectories no verifier scored is refused."""
    replay = load_trajectories(path)
    unscored = sum(not t.scored for t in replay)
    if unscored:  # rewards of 0.0 that no verifier gave would train the policy away from what it did
        raise UserError(
            f"{unscored} of the {len(replay)} trajectories of {path} are not scored (no verifier ran: `agentrl "
            "gateway` wrote them). Train an agent that runs as its own process with the agent service instead "
            "(HarnessEnv(service=...), docs/AGENTS.md): the environment's verifier scores each episode"
        )
    return replay


def next_batch(run: Run, step: int, metrics: dict[str, float]) -> tuple[list[Trajectory], list[Trajectory]]:
    """Rank 0 generates the step's batch (or takes the replayed one) and every rank receives it. Returns
    the trajectories to train on and, on rank 0, every episode generated for them (a stop's reasons)."""
    payload: list[Any] = [None]
    trajs: list[Trajectory] = []
    generated: list[Trajectory] = []
    if run.info.is_main:
        try:
            if run.engine_error is None:  # an engine that missed the last push is not asked for samples
                with run.sigint.rollout_phase():
                    trajs, generated = _generate(run, metrics)
                if run.producer is not None:  # not for replayed trajectories: no engine sampled them here
                    run.engine_error = check_engine_versions(
                        trajs, run.pushed_version, run.cfg.asynchronous.mode
                    )
            payload = [trajs if run.engine_error is None else (ENGINE_OUT_OF_DATE, run.engine_error)]
        except KeyboardInterrupt:
            payload = [INTERRUPTED]
    # The other ranks waited through the rollout (or the engine's start-up) on the store, not
    # in this collective, whose timeout is meant for the update.
    wait_for_main(f"batch-{step}")
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], str) and payload[0] == INTERRUPTED:
        raise KeyboardInterrupt
    if isinstance(payload[0], tuple) and payload[0][0] == ENGINE_OUT_OF_DATE:
        raise TrainingStopped(payload[0][1])
    if run.bar is not None:
        run.bar.set_postfix_str("updating")
    return payload[0], generated


def _generate(run: Run, metrics: dict[str, float]) -> tuple[list[Trajectory], list[Trajectory]]:
    """Rank 0: the batch to train on and every episode generated for it (the replay file, replayed)."""
    if run.replay is not None:
        metrics["charts/reward_mean"] = sum(t.reward for t in run.replay) / len(run.replay)
        return run.replay, run.replay
    assert run.producer is not None and run.curriculum is not None
    t0 = time.perf_counter()
    if run.bar is not None:
        run.bar.set_postfix_str("generating")
    batch = run.producer.next_batch(run.curriculum)
    metrics["time/wait_for_batch_s"] = time.perf_counter() - t0
    metrics.update(batch.metrics)
    run.progress.curriculum, run.progress.rollout_calls = batch.curriculum_state, batch.rollout_calls
    made = batch.result
    generated = [t for g in (*made.groups, *made.dropped, *made.surplus) for t in g] + made.untrainable
    _note_failures(run, generated)
    _note_exhausted_pool(run, metrics)
    return _apply_staleness(made.trajectories, run.producer.policy.version, run.cfg, metrics), generated


FAILED_FILE = "failed_episodes.jsonl"
"""In the run directory: a sample of the episodes that ended outside the policy's control, each with its error."""
_KEEP_FAILED = 32
"""The most failed episodes a run keeps in `FAILED_FILE`."""


def _note_failures(run: Run, generated: list[Trajectory]) -> None:
    """Rank 0: keep the first failed episodes (agent errors, timeouts, environment errors) with their
    errors in the run directory, and say on the console, once per reason, when most of a step's episodes
    failed so: the stop that follows a few steps later must not be the first word of it."""
    failed = failures(generated)
    if failed is None:
        return
    path = run.out / FAILED_FILE
    kept = sum(1 for _ in path.open()) if path.exists() else 0
    if kept < _KEEP_FAILED:
        sample = [t for t in generated if t.finish_reason in OUTSIDE_THE_POLICY][: _KEEP_FAILED - kept]
        save_trajectories(path, sample, append=True)
    if failed.most and failed.first_reason not in run.failures_said:
        run.failures_said.add(failed.first_reason)
        log(f"warning: {failed.line(run.cfg.env)} (kept in {path})")


def _note_exhausted_pool(run: Run, metrics: dict[str, float]) -> None:
    """Rank 0: say once when a finite pool of tasks has nothing left in the learnability band (every task
    tried, each solved always or never): the steps after it learn from stray mixed groups only."""
    if "pool" in run.failures_said or not metrics.get("curriculum/pool_exhausted"):
        return
    if metrics.get("curriculum/num_in_band", 0) > 0:
        return
    above = int(metrics.get("curriculum/tasks_above_band", 0))
    below = int(metrics.get("curriculum/tasks_below_band", 0))
    if not above + below:
        return
    run.failures_said.add("pool")
    log(
        f"warning: the curriculum's pool is exhausted: every task of {run.cfg.env} has been tried and none is in the "
        f"learnability band ({above} solved always, {below} never), so the steps from here learn from stray "
        "mixed groups only. Add tasks (a larger dataset or generator), make them harder (a harder level in "
        "env_kwargs, or curriculum.difficulty.adaptive), or stop here and keep the last checkpoint"
    )


def update(run: Run, trajs: list[Trajectory], step: int, metrics: dict[str, float]) -> None:
    """Every rank: GRPO on the batch, a colocated engine asleep meanwhile (the update gets its memory)."""
    cfg = run.cfg
    t0 = time.perf_counter()
    run.sync.before_update()
    metrics.update(
        grpo_step(
            run.model,
            run.opt,
            trajs,
            cfg,
            run.info,
            run.pad_id,
            ref_model=run.ref_model,
            updates_done=run.progress.updates,
            seed=cfg.seed + step,
        )
    )
    run.progress.updates += cfg.optim.epochs * cfg.optim.mini_batches
    metrics["time/train_s"] = time.perf_counter() - t0


def push_weights(run: Run, metrics: dict[str, float]) -> None:
    """Every rank: wake the engine's weights, push the new ones (a collective), wake its KV cache. An
    engine found dead stops every rank together (`EngineLost`): the step just trained is saved."""
    t0 = time.perf_counter()
    lost: list[str | None] = [None]
    try:
        version = run.sync.after_update()
    except Exception as exc:
        if not engine_dead(exc):
            raise
        version, lost[0] = None, one_line(f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(lost, src=0)  # only rank 0 holds the engine
    if lost[0] is not None:
        raise EngineLost(lost[0], run.step + 1)
    if version is not None:
        run.pushed_version += 1
        metrics["policy/version"] = float(version)
        reported = [version]
        if run.producer is not None and hasattr(run.producer.policy, "versions"):  # each engine's own report
            reported = list(run.producer.policy.versions())
            metrics["policy/engine_version_min"] = float(min(reported))
        if any(v != run.pushed_version for v in reported) and run.engine_error is None:
            run.engine_error = (
                f"the engine reports weight version(s) {sorted(set(reported))} after push {run.pushed_version}: "
                "the push did not reach every engine, so it would keep sampling from an older policy"
            )
    metrics["time/weight_sync_s"] = time.perf_counter() - t0


def report(run: Run, step: int, metrics: dict[str, float], *, updated: bool) -> None:
    """Rank 0, after step `step` (1-based): metrics, the step's line, the bar, the held-out evaluation."""
    if not run.info.is_main:
        return
    cfg = run.cfg
    assert run.tracker is not None
    run.tracker.log(step, metrics)
    run.step_times.append(metrics["time/step_s"])
    log(_step_line(step, cfg.steps, metrics, updated, run.step_times))
    if run.bar is not None:
        run.bar.update(1)
    if run.producer is not None and eval_due(cfg, step):
        _evaluate_in_training(cfg, run.producer.policy, step, run.out)
        _choose(run)


def stop_if_uninformative(
    run: Run, step: int, metrics: dict[str, float], generated: list[Trajectory]
) -> None:
    """Nothing to learn from for several steps in a row: say why and stop, rather than run on with an
    unchanged policy (rank 0 decides; every rank raises `StopUninformative` and leaves the loop)."""
    limit = run.cfg.stop_uninformative_after
    kind = no_update_reason(metrics)[0] if run.info.is_main and limit and run.progress.streak >= limit else ""
    verdict = [(kind, stop_advice(kind, run.cfg.env, generated)) if kind else None]
    wait_for_main(f"verdict-{step}")  # rank 0 may have evaluated meanwhile
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise StopUninformative(*verdict[0], step + 1)


def stopped_early(run: Run, exc: BaseException) -> bool:
    """The one place a run ends before its last step. Ctrl-C saves a checkpoint (not on the third one),
    closes the run and raises `TrainingInterrupted`; a stop for want of informative groups saves and
    raises `TrainingStopped`, except when every group passed: that run ends as a finished one (True).
    Anything else closes the run and is raised again (False)."""
    cfg = run.cfg
    if run.producer is not None:
        run.producer.stop()
    if isinstance(exc, KeyboardInterrupt):
        _interrupted(run)
    if isinstance(exc, StopUninformative) and exc.kind == "all-pass":
        if run.info.is_main:
            log(f"stopping early at step {exc.step}: {exc.advice}")
        run.step = exc.step
        return True
    if isinstance(exc, EngineLost):
        # The update of that step is done: it is kept.
        where = run.checkpoint(exc.step) if run.saved_at != exc.step else run.out / f"checkpoint-{exc.step}"
        close(run, ok=False)
        log_file = run.out / "engine.log"
        raise TrainingStopped(
            f"the rollout engine died (found by the weight push after step {exc.step}/{cfg.steps}: {exc.why}); "
            f"its log: {log_file}. Saved {where}; once the engine can start again, the same command resumes "
            f"from there: {_command()}"
        ) from None
    if isinstance(exc, StopUninformative):
        where = run.checkpoint(exc.step)
        close(run)
        raise TrainingStopped(
            f"no informative group in the last {cfg.stop_uninformative_after} steps (step {exc.step}/"
            f"{cfg.steps}): {exc.advice}. Saved {where}; stop_uninformative_after=0 keeps going regardless"
        ) from None
    close(run, ok=False)
    return False


def _interrupted(run: Run) -> NoReturn:
    """After Ctrl-C: save (unless asked three times), close, say how to continue."""
    cfg, step = run.cfg, run.step
    if run.sigint.requested >= 3:  # quit without saving: an update may be half done
        close(run, ok=False)
        newest = latest_resumable(run.out)
        message = f"quit at step {step + 1}/{cfg.steps} without saving; " + (
            f"a resume starts from {newest}" if newest else "no checkpoint was saved"
        )
    else:
        where = run.checkpoint(step) if run.saved_at != step else run.out / f"checkpoint-{step}"
        close(run)
        done = f"step{'s 1-' if step > 1 else ' '}{step} done" if step else "no step finished yet"
        message = (
            f"interrupted at step {step + 1}/{cfg.steps}: saved {where} ({done}; the step in progress "
            f"is redone on resume). Continue with the same command: {_command()}"
        )
    if run.info.is_main:
        log(message)
    raise TrainingInterrupted(message) from None


def finish(run: Run) -> Path:
    """After the last step: a checkpoint, the model in Hugging Face layout (out/final; a LoRA run's adapter
    directory), the run closed."""
    cfg, info, out = run.cfg, run.info, run.out
    if run.producer is not None:
        # The batch in flight finishes; its groups were generated but are not trained on.
        run.producer.stop(wait=True)
    wait_for_main("final")
    if run.saved_at != run.step:
        run.checkpoint(run.step)
    export_model(run.model, cfg.model.path, out / "final")  # every rank gathers; rank 0 writes
    kept = _keep_best(run) if info.is_main and cfg.eval.keep_best else None
    wait_for_main("exported")  # writing a large model can outlast a collective's timeout
    close(run)
    if info.is_main:
        minutes, seconds = divmod(int(time.perf_counter() - run.t_start), 60)
        log(
            f"done: {run.step - run.start} step(s) in {minutes}m{seconds:02d}s; model {out / 'final'}; "
            f"plot {out / 'training.png'}; metrics {out / 'metrics.jsonl'}"
        )
        if kept is not None:
            log(kept)
    return out / "final"


def _keep_best(run: Run) -> str:
    """Rank 0, after the final checkpoint: out/best from the best step by validation pass@1 (the starting
    model among the candidates with `eval.at_start`)."""
    rows = eval_rows(run.out)
    start = start_is_candidate(run.cfg)
    choice = best_of(rows, start=start)
    if choice is None:
        return f"eval.keep_best: no trained step was evaluated, so {run.out / 'best'} was not written"
    best = write_best(run.out, choice, rows, start=start)
    scores = ", ".join(f"{int(r['step'])}: {r.get(SELECTION_METRIC, float('nan')):.3f}" for r in rows)
    if choice.step == 0:
        return (
            f"kept the starting model in {best}: no trained step of {run.step} beat its validation pass@1 "
            f"{choice.score:.3f} (rule: {rule(start)}; by step: {scores})"
        )
    return (
        f"kept step {choice.step} of {run.step} in {best} (validation pass@1 {choice.score:.3f}; rule: "
        f"{rule(start)}; by step: {scores})"
    )


def start_is_candidate(cfg: TrainConfig) -> bool:
    """Whether `eval.keep_best` may keep the starting model: its validation score is known (`eval.at_start`),
    and its weights are saved as checkpoint-0 before the first step."""
    return cfg.eval.keep_best and cfg.eval.at_start


def _choose(run: Run) -> None:
    """Rank 0, after an evaluation: the best step so far (its checkpoint is protected from pruning)."""
    if run.cfg.eval.keep_best:
        run.best = best_of(eval_rows(run.out), start=start_is_candidate(run.cfg))


def _evaluate_at_start(run: Run) -> None:
    """Rank 0, before the first step: the starting model's evaluation (`eval.at_start`), and, on a resume
    whose checkpoint was due an evaluation that the interrupted run did not finish, that one."""
    cfg = run.cfg
    if run.producer is None:
        return
    rows = eval_rows(run.out)
    if run.start == 0 and cfg.eval.at_start and not evaluated(rows, 0):
        _evaluate_in_training(cfg, run.producer.policy, 0, run.out)
    elif run.start > 0 and eval_due(cfg, run.start) and not evaluated(rows, run.start):
        _evaluate_in_training(cfg, run.producer.policy, run.start, run.out)
    _choose(run)


def eval_due(cfg: TrainConfig, step: int) -> bool:
    """Whether the policy after step `step` (1-based) is evaluated: every `eval.every` steps, and after the
    last step when `eval.keep_best` chooses among them."""
    every = cfg.eval.every
    return bool(every) and (step % every == 0 or (cfg.eval.keep_best and step == cfg.steps))


def checkpoint_due(cfg: TrainConfig, step: int) -> bool:
    """Whether a checkpoint is written after step `step`: every `checkpoint_every` steps, and at every
    evaluation when `eval.keep_best` may keep it (the last step's is written by `finish`)."""
    every = cfg.checkpoint_every
    return bool(every and step % every == 0) or (cfg.eval.keep_best and eval_due(cfg, step))


def close(run: Run, ok: bool = True) -> None:
    """Close what the run opened, in an order that keeps the process group alive for its users."""
    try:
        if ok and dist.is_initialized():
            dist.barrier()  # every rank is done with collectives before the engine may take the group down
        if run.bar is not None:
            run.bar.close()
        if run.tracker is not None:
            run.tracker.close()
        if run.info.is_main and (run.out / "metrics.jsonl").exists():
            try:
                plot_training(run.out / "metrics.jsonl", run.out / "training.png")
            except Exception as exc:  # a plot must never cost the run
                log(f"could not write {run.out / 'training.png'}: {exc}")
        run.sync.close()
    finally:
        if run.producer is not None:
            # An in-process vLLM engine shuts down the default process group it joined: last, and
            # whatever failed before it (the engine's processes and folders must not outlive the run).
            run.producer.policy.close()


# --- set-up, piece by piece ------------------------------------------------------------------------------


def _load_models(
    cfg: TrainConfig, info: DistInfo
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module | None, int]:
    """The policy (sharded, training; with `model.lora`, LoRA adapters on the frozen checkpoint), its optimizer
    (over what trains), the frozen reference when `loss.kl_coef` > 0, the pad id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = cfg.model.path
    tok = AutoTokenizer.from_pretrained(base)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(info.device)
    if cfg.model.lora is not None:
        # Before sharding, after setup's torch.manual_seed: every rank starts from the same A matrices.
        apply_lora(model, cfg.model.lora, base)
    model.train()
    compiled = resolve_compile(cfg.optim.compile, info.device)
    shard_model(
        model,
        activation_checkpointing=cfg.optim.activation_checkpointing,
        bf16=cfg.optim.bf16,
        compiled=compiled,
    )
    opt = torch.optim.AdamW(
        trainable_parameters(model),
        lr=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        betas=cfg.optim.betas,
        eps=cfg.optim.eps,
    )
    ref_model: torch.nn.Module | None = None
    if cfg.loss.kl_coef > 0:
        # The starting checkpoint, frozen: the KL penalty keeps the policy near it (with LoRA that is the base,
        # which is the policy at its start: the adapters' B matrices start at zero).
        ref_model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(info.device)
        ref_model.eval().requires_grad_(False)
        shard_model(ref_model, activation_checkpointing=False, bf16=cfg.optim.bf16, compiled=compiled)
    return model, opt, ref_model, pad_id


def _open_tracker(cfg: TrainConfig, out: Path, start: int) -> Tracker:
    """Rank 0: the run's config.json, metrics cut back to `start`, the metrics sinks."""
    if not (out / "config.json").exists():
        (out / "config.json").write_text(cfg.model_dump_json(indent=2))
    for name in ("metrics.jsonl", "eval.jsonl"):  # rows a killed run wrote after its last checkpoint
        truncate_jsonl(out / name, start)
    return Tracker(cfg, out, resumed_at=start)


def _start_rollouts(
    cfg: TrainConfig,
    info: DistInfo,
    placement: Placement,
    progress: Progress,
    resumed_from: Path | None,
    bar: Any,
) -> tuple[Curriculum | None, RolloutProducer | None]:
    """Rank 0, unless replaying: the curriculum over the env's tasks and the producer of batches, with its
    engine. The other ranks never build the environment, whose task supply may be costly to load
    (python-repair synthesizes on first use)."""
    if not info.is_main or cfg.replay is not None:
        progress.curriculum = None
        return None, None
    from agentrl.env.registry import task_source

    curriculum = build_curriculum(task_source(cfg.env, **cfg.env_kwargs), cfg.curriculum)
    if progress.curriculum is not None:
        curriculum.load_state_dict(progress.curriculum)
    progress.curriculum = curriculum.state_dict()
    from agentrl.sandbox.settings import configure

    configure(cfg.sandbox)  # the rollout's sandboxes: their engines, warm pool and Docker limits
    lora = cfg.model.lora if cfg.model.lora is not None and cfg.model.lora.push == "adapter" else None
    start = str(resumed_from) if resumed_from is not None else cfg.model.path
    if resumed_from is not None and cfg.model.lora is not None and lora is None:
        # A LoRA run that pushes merged weights: its engine starts from the checkpoint's adapter merged in.
        merged_dir = Path(cfg.out) / "engine-start"
        # An earlier resume's merge: this checkpoint's replaces it.
        shutil.rmtree(merged_dir, ignore_errors=True)
        start = str(merge_adapter(resumed_from, merged_dir))
    policy = make_policy(
        # vLLM loads from a directory: after a resume, the checkpoint itself (Hugging Face layout); with LoRA
        # adapters pushed, the base and the checkpoint's adapter on it.
        start if lora is None else cfg.model.path,
        cfg.rollout,
        seed=cfg.seed,
        # fp32 on CPU, as the trainer computes: behaviour log-probs then match to ~1e-6;
        # on GPUs vLLM's choice (bf16), with the TIS correction covering the mismatch.
        dtype="auto" if torch.cuda.is_available() else "float32",
        # An in-process engine (no second process, no weight serialisation) only works while our
        # process group has one rank: vLLM joins an existing default group and would wait for the
        # other ranks to create its subgroups. With more ranks the engine core runs in its own process.
        in_process=None if info.world_size == 1 else False,
        placement=placement,
        weight_chunk_bytes=weight_chunk_bytes(cfg),
        # The engine counts weight pushes; a resumed run continues the count (trajectories record it,
        # and async staleness is measured with it).
        version=progress.policy_version,
        ray_address=cfg.cluster.ray_address,
        engines=cfg.engine.count,
        resources=cfg.engine.resources,
        lora_rank=lora.rank if lora is not None else None,
        adapter=str(resumed_from) if resumed_from is not None and lora is not None else None,
    )
    producer = RolloutProducer(cfg, policy, calls=progress.rollout_calls, on_trajectory=_episode_counter(bar))
    return curriculum, producer


def _lora_push(cfg: TrainConfig, model: torch.nn.Module) -> dict[str, Any]:
    """What a LoRA run pushes after each step (`model.lora.push`): its adapter, or merged full weights."""
    if cfg.model.lora is None:
        return {}
    if cfg.model.lora.push == "merged":
        return {"merged": lambda: merged_state_dict(model)}
    return {"adapter": lambda: adapter_files(model)}


def _say_start(run: Run) -> None:
    cfg = run.cfg
    if run.replay is not None:
        what = f"replaying {cfg.replay}"
    else:
        size = run.curriculum.pool_size if run.curriculum is not None else None
        what = f"{cfg.env} ({'generator' if size is None else f'a pool of {size} train tasks'})"
    resumed = f", resuming {run.resumed_from.name}" if run.resumed_from is not None else ""
    log(
        f"{cfg.steps} steps on {what}, {run.info.world_size} process(es){resumed}; run directory {run.out}"
        + (f" (engine log: {run.out / 'engine.log'})" if run.replay is None else "")
    )
    for note in run.tracker.notes if run.tracker is not None else []:
        log(note)


# --- the loop's helpers ----------------------------------------------------------------------------------


def _step_line(step: int, steps: int, metrics: dict[str, float], updated: bool, times: list[float]) -> str:
    reward = metrics.get("charts/reward_mean")
    head = f"step {step}/{steps}" + (f" reward {reward:.3f}" if reward is not None else "")
    if updated:
        body = f" loss {metrics.get('losses/policy_loss', 0.0):.4g}"
    else:
        body = f" no update: {no_update_reason(metrics)[1]}"
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


def _apply_staleness(
    trajs: list[Trajectory], version: int, cfg: TrainConfig, metrics: dict[str, float]
) -> list[Trajectory]:
    """Async: drop trajectories too many versions behind, or keep them (the TIS weight corrects them).
    A trajectory's age is that of its oldest token: the bound the producer's admission guarantees."""
    ages = [version - t.policy_version for t in trajs]
    metrics["async/staleness_mean"] = sum(ages) / len(ages) if ages else 0.0
    metrics["async/staleness_max"] = float(max(ages, default=0))
    # The histogram: trajectories 0, 1, ..., k versions behind, and past the bound k.
    bound = cfg.asynchronous.max_staleness
    for age in range(bound + 1):
        metrics[f"async/staleness_{age}"] = float(sum(a == age for a in ages))
    metrics["async/staleness_over_bound"] = float(sum(a > bound for a in ages))
    # Per sampled token (the version each was sampled with): pushes mid-episode make tokens of one
    # trajectory younger than its oldest.
    token_ages = [
        version - v
        for t in trajs
        for v, m in zip(t.token_versions, t.loss_mask, strict=False)
        if m and v >= 0
    ]
    if token_ages:
        metrics["async/token_staleness_mean"] = sum(token_ages) / len(token_ages)
        newer = sum(v > t.policy_version for t in trajs for v in t.token_versions)
        metrics["async/tokens_after_push"] = newer / len(token_ages)
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


def train_placement(cfg: TrainConfig, nproc: int) -> Placement:
    """Trainer and engine GPUs for this config on this node, `nproc` being the node's trainer processes (`--nproc`,
    torchrun's local world size; `agentrl.rollout.placement`); PlacementError if impossible."""
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


if __name__ == "__main__":
    sys.exit(run_rank(lambda: train(TrainConfig.model_validate_json(sys.argv[1]))))
