"""Placement of trainer ranks and the vLLM engine on GPUs: decisions and the errors that say what to change."""

from __future__ import annotations

import pytest

from agentrl.core.errors import UserError, check_nproc
from agentrl.rollout.placement import Placement, PlacementError, physical_devices, plan_placement


def test_cpu_machine_uses_the_rpc_path_and_never_sleeps() -> None:
    p = plan_placement(gpus=0, nproc=2)
    assert p == Placement((), (), colocated=False, sleep=False, transport="rpc", gpu_memory_utilization=None)
    assert not p.on_gpu


def test_default_on_one_gpu_is_colocated_with_sleep_and_ipc() -> None:
    p = plan_placement(gpus=1, nproc=1)
    assert (p.trainer_gpus, p.engine_gpus, p.colocated, p.sleep, p.transport) == (
        (0,),
        (0,),
        True,
        True,
        "ipc",
    )
    assert p.gpu_memory_utilization == 0.4


def test_free_gpus_make_a_dedicated_engine_over_nccl() -> None:
    p = plan_placement(gpus=4, nproc=2, devices=[2, 3])
    assert (p.trainer_gpus, p.engine_gpus, p.colocated, p.sleep, p.transport) == (
        (0, 1),
        (2, 3),
        False,
        False,
        "nccl",
    )
    assert p.gpu_memory_utilization == 0.9


def test_asynchronous_mode_keeps_a_colocated_engine_awake() -> None:
    # The engine generates the next batch during the update, so it cannot sleep through it.
    assert plan_placement(gpus=1, nproc=1, asynchronous=True).sleep is False
    assert plan_placement(gpus=1, nproc=1, sleep=False).sleep is False


def test_the_users_memory_share_is_kept() -> None:
    assert (
        plan_placement(gpus=2, nproc=1, devices=[1], gpu_memory_utilization=0.7).gpu_memory_utilization == 0.7
    )


def test_nproc_beyond_the_visible_gpus_is_one_clear_line() -> None:
    with pytest.raises(UserError) as err:
        check_nproc(2, gpus=1)
    message = str(err.value)
    assert "\n" not in message
    assert (
        "--nproc 2 needs 2 GPUs" in message
        and "use --nproc 1" in message
        and "CUDA_VISIBLE_DEVICES=" in message
    )
    check_nproc(2, gpus=0)  # CPU: any number of gloo ranks
    check_nproc(2, gpus=2)


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        ([], "empty"),
        ([2], r"\[2\] not among the 2 visible"),
        ([1, 1], "repeats a GPU"),
        ([0, 1], "mixes trainer GPUs"),
    ],
)
def test_bad_engine_devices_are_refused(devices: list[int], match: str) -> None:
    with pytest.raises(PlacementError, match=match):
        plan_placement(gpus=2, nproc=1, devices=devices)


def test_engine_devices_on_a_cpu_machine_are_refused() -> None:
    with pytest.raises(PlacementError, match="no.*visible|none is visible"):
        plan_placement(gpus=0, nproc=1, devices=[0])


def test_engine_devices_map_through_the_parents_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert physical_devices((1, 2)) == "1,2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert physical_devices((1, 2)) == "6,7"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    assert physical_devices((1,)) == "GPU-bbb"


def test_placement_is_per_node_data() -> None:
    """The same plan on every node of 8 GPUs, whatever the number of nodes; a dedicated engine on GPUs 6-7 of
    node 0 shares no trainer GPU, on any node."""
    for node in range(2):
        colocated = plan_placement(gpus=8, nproc=8)
        assert colocated.trainer_gpus == tuple(range(8))
        assert [colocated.shares_engine_gpu(node_rank=node, local_rank=r) for r in range(8)] == [
            node == 0 and r == 0 for r in range(8)
        ]
        dedicated = plan_placement(gpus=8, nproc=6, devices=[6, 7])
        assert dedicated.trainer_gpus == tuple(range(6)) and dedicated.transport == "nccl"
        assert not any(dedicated.shares_engine_gpu(node_rank=node, local_rank=r) for r in range(6))
    tensor_parallel = plan_placement(gpus=8, nproc=8, devices=[0, 1])
    assert [tensor_parallel.shares_engine_gpu(node_rank=0, local_rank=r) for r in range(3)] == [
        True,
        True,
        False,
    ]
    with pytest.raises(UserError, match="--nproc 16 needs 16 GPUs"):
        plan_placement(gpus=8, nproc=16)  # what every rank asked for when it counted all nodes' ranks
