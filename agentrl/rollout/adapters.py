"""LoRA adapter directories, as peft writes them and vLLM reads them: what the trainer pushes and the engines load.

    is_adapter_dir("runs/x/checkpoint-8")     # True: adapter_config.json + adapter_model.safetensors
    adapter_base("runs/x/checkpoint-8")       # the base checkpoint it was trained on
    write_adapter_files(files, tmp_dir)       # the bytes of a push, as a directory vLLM loads
    adapter_dir(files_or_dir, scratch)        # either kind of source, as a checked directory

An adapter travels as the two files of peft's `save_pretrained` (`ADAPTER_CONFIG`, `ADAPTER_WEIGHTS`), as
bytes: a Ray engine on another node needs no shared disk, and nothing but tensors and JSON is ever loaded
(safetensors, never a pickle).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias

from agentrl.core.errors import UserError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)

AdapterSource: TypeAlias = Mapping[str, bytes] | str | os.PathLike[str]
"""An adapter as a push carries it (`{file name: bytes}`) or as a directory on this machine."""


def is_adapter_dir(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a directory holding a LoRA adapter (peft's two files)."""
    p = Path(path)
    return all((p / name).is_file() for name in ADAPTER_FILES)


def adapter_config(path: str | os.PathLike[str]) -> dict:
    """The adapter's `adapter_config.json`; a UserError naming the file when it is missing or unreadable."""
    f = Path(path) / ADAPTER_CONFIG
    try:
        return json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(
            f"{f} is not a readable LoRA adapter config ({exc}); pass a directory peft's save_pretrained wrote"
        ) from None


def adapter_base(path: str | os.PathLike[str]) -> str:
    """The base checkpoint the adapter at `path` was trained on (`base_model_name_or_path`)."""
    base = adapter_config(path).get("base_model_name_or_path")
    if not base:
        raise UserError(
            f"{Path(path) / ADAPTER_CONFIG} names no base model (base_model_name_or_path); pass the base with --base"
        )
    return str(base)


def adapter_rank(path: str | os.PathLike[str]) -> int:
    """The adapter's LoRA rank `r` (the largest, when ranks differ per module)."""
    cfg = adapter_config(path)
    ranks = [int(cfg.get("r", 8)), *(int(v) for v in (cfg.get("rank_pattern") or {}).values())]
    return max(ranks)


def write_adapter_files(files: Mapping[str, bytes], dest: str | os.PathLike[str]) -> Path:
    """Write a pushed adapter (`{file name: bytes}`, peft's two files at least) into `dest`; returns it.

    Only plain file names are accepted: a name with a directory part could write outside `dest`.
    """
    missing = [name for name in ADAPTER_FILES if name not in files]
    if missing:
        raise ValueError(f"an adapter push needs {list(ADAPTER_FILES)}; missing {missing}")
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"adapter file name {name!r} is not a plain file name")
        (out / name).write_bytes(data)
    return out


def check_adapter_dir(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path when it is an adapter directory; else a UserError saying what it lacks."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(
            f"LoRA adapter directory {p} does not exist; pass a directory peft's save_pretrained wrote"
        )
    missing = [name for name in ADAPTER_FILES if not (p / name).is_file()]
    if missing:
        raise UserError(
            f"{p} is not a LoRA adapter directory: it has no {' or '.join(missing)}; pass a directory "
            "peft's save_pretrained wrote (a full checkpoint is served as the model, not as an adapter)"
        )
    return p


def adapter_dir(source: AdapterSource, scratch: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """The adapter `source` as a directory: pushed bytes are written into a fresh directory under `scratch`,
    a directory is used as it is. Returns (directory, the directory to delete when done with it, or None
    when it is not ours)."""
    if isinstance(source, Mapping):
        out = Path(tempfile.mkdtemp(prefix="adapter-", dir=scratch))
        try:
            write_adapter_files(source, out)
        except BaseException:
            shutil.rmtree(out, ignore_errors=True)
            raise
        return out, out
    return check_adapter_dir(source), None
