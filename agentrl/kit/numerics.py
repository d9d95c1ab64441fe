"""CPU kernel paths pinned so that a seed builds the same model on any x86-64 box.

A tiny model's SFT runs hundreds of steps; one differently rounded sum early on makes it another model
by the end, and GRPO from another warm start gives another verdict. What decides the rounding on a CPU:

- MKL's GEMM code path. MKL picks its kernels by CPU vendor and instruction set (AVX-512 kernels on
  Intel boxes that have it, a generic path on AMD ones), so the same matmul sums in another order on
  another box. `MKL_CBWR=COMPATIBLE` selects the code path MKL documents as the same on Intel and
  compatible processors (conditional numerical reproducibility).
- ATen's vectorized kernels (elementwise, reductions, softmax): compiled for AVX2 and AVX-512 and
  chosen at run time by what the CPU has. `ATEN_CPU_CAPABILITY=avx2` takes the path every x86-64 box
  of the last decade has.
- oneDNN's kernels, capped the same way (`ONEDNN_MAX_CPU_ISA=AVX2`).
- The number of OpenMP threads (how a reduction is split): fixed by the caller (`threads`).

Measured on a 2-core AMD EPYC box: each of the first two moves the weights of a 30-step tiny-model
training run (`MKL_CBWR=AVX2` and `=SSE4_2` do not: MKL already runs its generic path on AMD), and
the pinned run costs about the same time. The vLLM engine's own CPU kernels (attention, sampling) are
not governed by these settings: rollouts may still round differently on another box (docs/DEMO.md).

The variables must be in the environment before torch is imported (ATen reads its capability once),
so `pin` sets them for this process's children and `pinned_env` builds a child's environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

Numerics = Literal["pinned", "native"]

PINNED: dict[str, str] = {
    "MKL_CBWR": "COMPATIBLE",
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
"""The environment variables that pin the CPU kernel paths, and their values."""


def pinned_env(numerics: Numerics, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the kernel paths pinned, or, for `native`,
    with any pin removed (each library picks its own path, as on a box without agentrl's settings)."""
    env = dict(os.environ if base is None else base)
    for key, value in PINNED.items():
        if numerics == "pinned":
            env[key] = value
        else:
            env.pop(key, None)
    return env


def pin(numerics: Numerics = "pinned") -> None:
    """Set (or, for `native`, clear) the pins in this process's environment: every process started
    from here on inherits them; this process itself only if torch is not imported yet."""
    for key, value in PINNED.items():
        if numerics == "pinned":
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
