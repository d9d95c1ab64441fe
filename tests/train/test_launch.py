"""`agentrl train` places itself before anything starts: the process count against the GPUs, per node."""

from __future__ import annotations

import pytest

from agentrl.core.errors import UserError
from agentrl.rollout.placement import Placement


def test_launch_refuses_nproc_before_starting_anything(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`agentrl train --nproc 2` on a one-GPU machine: the placement error, not a torchrun crash."""
    import agentrl.train.launch as launch_mod
    import agentrl.train.trainer as train_mod
    from agentrl.train.config import TrainConfig

    monkeypatch.setattr(train_mod, "visible_gpus", lambda: 1)
    started = []
    monkeypatch.setattr(launch_mod, "run_ranks", lambda *a, **k: started.append(a))
    with pytest.raises(UserError, match="--nproc 2 needs 2 GPUs"):
        launch_mod.launch(TrainConfig(model=str(tmp_path), out=str(tmp_path / "run")), nproc=2)
    assert started == []


def test_cli_train_says_what_to_change_in_one_usage_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from typer.testing import CliRunner

    import agentrl.train.trainer as train_mod
    from agentrl.cli import app

    monkeypatch.setattr(train_mod, "visible_gpus", lambda: 1)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tmp_path}\nout: {tmp_path / 'run'}\n")
    result = CliRunner().invoke(app, ["train", str(config), "--nproc", "2"])
    assert result.exit_code == 2  # a usage error, not a traceback from inside torchrun
    assert "--nproc 2 needs 2 GPUs" in result.output and "Traceback" not in result.output


# --- several nodes: everything is counted per node ---------------------------------------------------------


def test_two_nodes_of_eight_gpus_place_each_nodes_ranks_on_its_own_eight(monkeypatch, tmp_path) -> None:
    """`--nnodes 2 --nproc 8` on two 8-GPU nodes: each of the 16 ranks starts, plans GPUs 0..7 of its node
    (not 16 of them) and the engine beside rank 0; only node 0's rank on the engine's GPU shares it."""
    import types

    import torch

    import agentrl.train.trainer as train_mod
    from agentrl.train.config import TrainConfig

    class Reached(Exception):
        pass

    monkeypatch.setattr(train_mod, "visible_gpus", lambda: 8)
    planned: dict[int, Placement] = {}
    real_plan = train_mod.plan_placement

    def spy(**kwargs):
        planned[current["rank"]] = real_plan(**kwargs)
        return planned[current["rank"]]

    def stop(*args, **kwargs):  # the first thing train() does after placing itself
        raise Reached

    monkeypatch.setattr(train_mod, "plan_placement", spy)
    monkeypatch.setattr(train_mod, "quiet_libraries", stop)
    cfg = TrainConfig(model=str(tmp_path), out=str(tmp_path / "run"))
    current: dict[str, int] = {}
    for node in (0, 1):
        for local in range(8):
            rank = 8 * node + local
            current["rank"] = rank
            # What init_distributed reports on that rank under `torchrun --nnodes 2 --nproc-per-node 8`.
            info = types.SimpleNamespace(rank=rank, world_size=16, local_rank=local, local_world_size=8,
                                         node_rank=node, device=torch.device("cpu"), backend="nccl",
                                         is_main=rank == 0)  # fmt: skip
            monkeypatch.setattr(train_mod, "init_distributed", lambda info=info, **kw: info)
            with pytest.raises(Reached):
                train_mod.train(cfg)
    assert sorted(planned) == list(range(16))
    for rank, p in planned.items():
        assert p.trainer_gpus == tuple(range(8)), rank
        assert (p.engine_gpus, p.colocated, p.sleep, p.transport) == ((0,), True, True, "ipc")
        node, local = divmod(rank, 8)
        assert p.shares_engine_gpu(node_rank=node, local_rank=local) == (rank == 0)
