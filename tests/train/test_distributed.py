"""The process group: what each rank knows about its node, waits on rank 0 that no collective timeout
cuts short, and a one-rank group whose port is never free for another process to take."""

from __future__ import annotations

import errno
import os
import socket

import pytest
import torch.distributed as dist

from tests.train.rank_cases import launch, launch_nodes


@pytest.mark.slow
def test_every_rank_knows_its_node_and_the_ranks_beside_it(tmp_path) -> None:
    """Two nodes of two ranks: the local world size (what GPUs are counted against) is 2, not 4."""
    res = launch_nodes("dist_info", tmp_path)
    assert res[-1]["returncode"] == 0, res[-1]["stderr"]
    seen = sorted((r["rank"], r["node_rank"], r["local_rank"], r["local_world_size"], r["world_size"])
                  for k, r in res.items() if k >= 0)  # fmt: skip
    assert seen == [(0, 0, 0, 2, 4), (1, 0, 1, 2, 4), (2, 1, 0, 2, 4), (3, 1, 1, 2, 4)]


@pytest.mark.slow
def test_ranks_wait_for_rank_0_longer_than_the_collective_timeout(tmp_path) -> None:
    """Rank 0 works alone for three times the collective timeout (2 s) before it broadcasts: waiting on the
    store, rank 1 gets the payload; sitting in the broadcast itself (what the trainer did), it times out."""
    res = launch("wait_for_main", tmp_path / "wait", "wait")
    assert res[-1]["returncode"] == 0, (res.get(1), res[-1]["stderr"])
    assert res[1]["got"] == {"batch": 42} and res[1]["waited_s"] > 4.0
    bare = launch("wait_for_main", tmp_path / "bare", "bare")
    assert bare[-1]["returncode"] != 0
    assert "error" in bare[1] and "imed out" in bare[1]["error"], bare[1]


def test_a_one_rank_group_holds_its_port_from_the_start(monkeypatch) -> None:
    """A plain `python` run makes its own rendezvous: the store binds the port and keeps it, so no other
    process can take it between choosing and binding (the port is never released in between)."""
    from agentrl.train.distributed import init_distributed

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # restored (or removed) after the test
    if dist.is_initialized():
        pytest.fail(
            "a process group is already initialised in this process; a test leaked one", pytrace=False
        )
    info = init_distributed()
    try:
        assert (info.rank, info.world_size, info.local_world_size, info.node_rank) == (0, 1, 1, 0)
        port = int(os.environ["MASTER_PORT"])
        with socket.socket() as s, pytest.raises(OSError) as err:
            s.bind(("127.0.0.1", port))
        assert err.value.errno == errno.EADDRINUSE
    finally:
        dist.destroy_process_group()


def test_one_process_runs_here_and_leaves_no_process_group_behind(monkeypatch) -> None:
    """A recipe launched with one process runs in this one, and its one-rank group is torn down after,
    when it returns and when it fails (a later run in the same process must be able to start its own)."""
    from pathlib import Path

    from agentrl.train.distributed import init_distributed, run_here_or_as_ranks

    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for key in keys:  # set, then removed: the test's end removes what the one-rank group sets as well
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    assert not dist.is_initialized()

    def run() -> Path:
        assert init_distributed().world_size == 1
        return Path("ran-here")

    def fail() -> Path:
        for key in keys:  # a plain `python` run again, not a rank of the group just torn down
            os.environ.pop(key, None)
        init_distributed()
        raise RuntimeError("the recipe failed")

    assert run_here_or_as_ranks(run, "agentrl.no_such_module", "{}", 1) == Path("ran-here")
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="the recipe failed"):
        run_here_or_as_ranks(fail, "agentrl.no_such_module", "{}", 1)
    assert not dist.is_initialized()
