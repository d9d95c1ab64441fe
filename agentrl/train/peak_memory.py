"""Peak memory of the tensors a block allocates, on any device (the CPU has no allocator statistics).

    with PeakMemory() as mem:
        loss = step(); loss.backward()
    mem.peak  # bytes

`PeakMemory` is a `TorchDispatchMode`: every tensor an op returns is charged to the block the
first time its storage is seen, and released when that storage is freed (storages keep their
Python object, so a `weakref.finalize` on it fires exactly then). Backward of CPU tensors runs
in the calling thread, so the ops of `loss.backward()` inside the block count too. Tensors that
existed before the block are not charged. Every op pays a Python call: measure memory and time
in separate runs. Storages resized in place (FSDP frees and re-allocates its unsharded
parameters that way) are counted at the size they were first seen with, as if resident
throughout: for FSDP models use `HeapPeak`, which samples the process heap instead. On CUDA,
`torch.cuda.max_memory_allocated` is the cheaper and exact measure.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakMemory(TorchDispatchMode):
    """Live and peak bytes of the storages created inside the `with` block."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            try:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a storage-less tensor (a DTensor wrapper, a functional placeholder)
                continue
            if nbytes == 0 or key in self._seen:
                continue
            self._seen.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._release, key, nbytes)
        return out


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2() -> Any:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        return libc.mallinfo2
    except (OSError, AttributeError):
        return None


def heap_in_use() -> int | None:
    """Bytes of the process heap in use (glibc's mallinfo2: small blocks plus mmapped ones); None off glibc."""
    info = _mallinfo2()
    if info is None:
        return None
    m = info()
    return int(m.uordblks + m.hblkhd)


class HeapPeak(TorchDispatchMode):
    """Peak of the process heap in use above its level at entry, sampled after every op of the block.

    Unlike `PeakMemory` it sees memory freed or resized outside the dispatcher (FSDP resizes its
    parameter storages in place), at the price of counting whatever else the process allocates
    meanwhile. CPU tensors only; on CUDA use `torch.cuda.max_memory_allocated`.
    """

    def __init__(self) -> None:
        super().__init__()
        base = heap_in_use()
        if base is None:
            raise RuntimeError("HeapPeak needs glibc (mallinfo2); use PeakMemory elsewhere")
        self.base = base
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, (heap_in_use() or 0) - self.base)
        return out
