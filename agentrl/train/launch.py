"""Starting a GRPO run: `preflight` checks everything that can fail before a process starts, then `launch`
trains here or under `torchrun` (one node or several). The ranks run `agentrl.train.trainer` itself.
"""

from __future__ import annotations

import json
from pathlib import Path

from agentrl.core.errors import UserError, check_model_dir, check_nonempty_file
from agentrl.rollout.adapters import is_adapter_dir
from agentrl.rollout.trajectory import load_trajectories
from agentrl.train.checkpoint import latest_resumable, prepare_run_dir
from agentrl.train.config import TrainConfig
from agentrl.train.distributed import run_here_or_as_ranks, run_ranks
from agentrl.train.tracking import check_available
from agentrl.train.trainer import log, train, train_placement


def preflight(cfg: TrainConfig, nproc: int = 1, force: bool = False) -> str:
    """Every check that can fail before any process starts, each a one-line `UserError`: the process
    count, the starting model, the tracking packages, the replay file or the environment and its
    tasks; then the run directory (resume or not, config unchanged or `force`). Returns a note."""
    train_placement(cfg, nproc)  # the process count and the engine's GPUs fit this machine
    check_model_dir(cfg.model.path, what="model")
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
    from agentrl.env.registry import task_source

    source = task_source(cfg.env, **cfg.env_kwargs)
    source.get(0, "train")
    size = source.size("train")
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
    final = Path(cfg.out) / "final"
    if finished >= cfg.steps and ((final / "config.json").exists() or is_adapter_dir(final)):
        log(f"{cfg.out} already finished its {cfg.steps} steps ({newest}); raise steps= to train it further")
        return Path(cfg.out) / "final"
    if nnodes > 1:
        run_ranks("agentrl.train.trainer", cfg.model_dump_json(), nproc, nnodes=nnodes, node_rank=node_rank,
                  rdzv_endpoint=rdzv_endpoint)  # fmt: skip
        return Path(cfg.out) / "final"
    return run_here_or_as_ranks(
        lambda: train(cfg), "agentrl.train.trainer", cfg.model_dump_json(), nproc
    ) or (Path(cfg.out) / "final")
