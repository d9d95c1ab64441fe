"""Errors meant for the person running agentrl, and the checks that raise them.

A `UserError` is bad input: a misspelled id, a path that is not a checkpoint, a config key that
does not exist. Its message says what was wrong and how to fix it, in one line. The command line
prints it as `error: <message>` and exits 2, without a traceback (`agentrl --debug ...` shows
one); library callers get an ordinary exception they can catch.

Everything else that escapes a command is a bug (ours, or in a plugin) and keeps its traceback.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

EXIT_USER_ERROR = 2
"""Exit status of a command stopped by bad input (the same status argument-parsing errors get)."""


class UserError(Exception):
    """Bad input: the message (one line) says what was wrong and how to fix it."""


def did_you_mean(word: str, choices: Any, n: int = 1, cutoff: float = 0.6) -> str:
    """ " Did you mean 'x'?" for the closest of `choices`, or "" when nothing is close."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=n, cutoff=cutoff)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


def did_you_mean_path(path: str | os.PathLike[str], dirs_only: bool = False) -> str:
    """ " Did you mean 'dir/x'?" for the closest entry beside a path that does not exist (a directory,
    if `dirs_only`), with the directory part as it was given, so the suggestion can be used as is; ""
    when nothing is close or the directory does not exist either."""
    text = os.fspath(path).rstrip("/")
    folder = os.path.dirname(text)  # as typed: "", "./", "~/runs", "/abs"
    try:
        entries = [p for p in Path(folder or ".").expanduser().iterdir() if not dirs_only or p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(os.path.basename(text), [p.name for p in entries], n=1, cutoff=0.6)
    if not close:
        return ""
    return f" Did you mean {os.path.join(folder, close[0])!r}?"


def one_line(text: str) -> str:
    """Collapse whitespace (newlines included) so a message prints as one line."""
    return " ".join(str(text).split())


# --- pydantic validation errors, as people read them ---------------------------------------------

#: Keys that were renamed or replaced: an unknown key listed here (by its dotted path, or by its last
#: part anywhere) gets this hint instead of a guess.
RENAMED_KEYS: dict[str, str] = {
    "tensorboard": "report_to: [jsonl, tensorboard] (tracking backends are listed in report_to)",
    "rollout.devices": "engine.devices (where the vLLM engine runs has its own section, engine:)",
    "rollout.gpu_memory_utilization": "engine.gpu_memory_utilization (where the vLLM engine runs has its own "
    "section, engine:)",
    "rollout.sleep": "engine.sleep (where the vLLM engine runs has its own section, engine:)",
    "rollout.seed": "seed (each rollout's seed is derived from the run's seed and its step)",
}


def _model_at(model: Any, loc: tuple[Any, ...]) -> Any:
    """The pydantic model class that owns the last part of `loc`, or None (a dict field, a list)."""
    from pydantic import BaseModel

    current = model
    for part in loc[:-1]:
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = field.annotation
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def format_validation_error(exc: Any, model: Any = None, what: str = "config") -> str:
    """A pydantic `ValidationError` as one line: every problem with its dotted key, the value that
    was given, and for an unknown key the closest known one."""
    problems = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        key = ".".join(str(p) for p in loc) or "(top level)"
        kind = err.get("type", "")
        if kind == "extra_forbidden":
            name = str(loc[-1]) if loc else key
            renamed = RENAMED_KEYS.get(key, RENAMED_KEYS.get(name))
            if renamed is not None:
                problems.append(f"unknown key '{key}'; use {renamed}")
                continue
            owner = _model_at(model, loc) if model is not None else None
            hint = did_you_mean(name, owner.model_fields) if owner is not None else ""
            prefix = ".".join(str(p) for p in loc[:-1])
            if hint and prefix:  # suggest the full dotted key
                hint = hint.replace("'", f"'{prefix}.", 1)
            problems.append(f"unknown key '{key}'.{hint}".rstrip("."))
        elif kind == "missing":
            problems.append(f"'{key}' is required")
        elif kind == "value_error" and not loc:  # a check across fields: its message says it all
            problems.append(str(err.get("ctx", {}).get("error", err.get("msg", "invalid"))))
        else:
            msg = err.get("msg", "invalid")
            if kind == "value_error":
                msg = str(err.get("ctx", {}).get("error", msg))
            msg = msg[0].lower() + msg[1:] if msg else msg
            given = err.get("input")
            shown = repr(given)
            if len(shown) > 60:
                shown = shown[:57] + "..."
            problems.append(f"'{key}': {msg} (got {shown})")
    n = len(problems)
    head = f"invalid {what}" if n == 1 else f"invalid {what} ({n} problems)"
    return one_line(f"{head}: " + "; ".join(problems))


# --- checks shared by the commands ------------------------------------------------------------------


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def cuda_visible_note() -> str:
    """How CUDA_VISIBLE_DEVICES is set, for messages about GPU counts."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f"CUDA_VISIBLE_DEVICES={value!r}" if value is not None else "CUDA_VISIBLE_DEVICES unset"


def check_nproc(nproc: int, gpus: int | None = None) -> None:
    """`--nproc`, the trainer processes of *this node*: at least 1, and on a GPU machine at most its visible
    GPUs (`gpus`, counted when None): one trainer rank per GPU, or torchrun dies with "invalid device
    ordinal". Across nodes each node checks its own count (`--nnodes 2 --nproc 8` needs 8 GPUs per node, not
    16). CPU ranks (gloo) may be any number."""
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1 (processes, one FSDP rank each), got {nproc}")
    gpus = visible_gpus() if gpus is None else gpus
    if gpus and nproc > gpus:
        raise UserError(
            f"--nproc {nproc} needs {nproc} GPUs (one per trainer process) but {gpus} "
            f"{'is' if gpus == 1 else 'are'} visible ({cuda_visible_note()}); use --nproc {gpus} (processes "
            "per node: --nnodes multiplies them), or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU"
        )


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _checkpoints_inside(path: Path) -> list[Path]:
    """Checkpoint directories one level down (a run directory's final/ and checkpoint-N/)."""
    found = [p for p in path.iterdir() if p.is_dir() and (p / "config.json").is_file()]

    def order(p: Path) -> tuple[int, int]:
        m = re.fullmatch(r"checkpoint-(\d+)", p.name)
        return (2, 0) if p.name == "final" else (1, int(m.group(1))) if m else (0, 0)

    return sorted(found, key=order, reverse=True)


def check_model_dir(
    model: str | os.PathLike[str], what: str = "--model", *, adapter_ok: bool = False
) -> None:
    """Raise a `UserError` unless `model` is a Hugging Face checkpoint directory (config, weights,
    tokenizer), or a Hub id to hand to transformers (a name like `org/model` with no such local path
    and whose first part is not a local directory either: `runs/sft` with a `runs/` here is a path).

    A LoRA adapter directory (peft's adapter_config.json) passes when `adapter_ok` and its base model
    does; otherwise the error says how to make a full model of it."""
    text = str(model)
    adapter_cfg = Path(text).expanduser() / "adapter_config.json"  # agentrl.rollout.adapters.ADAPTER_CONFIG
    if adapter_cfg.is_file():
        _check_adapter_dir(Path(text).expanduser(), what, adapter_ok)
        return
    if not text.strip():
        raise UserError(f"{what} is empty; give a checkpoint directory")
    path = Path(text).expanduser()
    if not path.exists():
        first = Path(text.split("/", 1)[0])
        if _HUB_ID.match(text) and not first.is_dir():
            return  # a Hub id: transformers and vLLM resolve it (download or their cache)
        hint = did_you_mean_path(text, dirs_only=True)
        raise UserError(f"{what} {text}: no such directory.{hint}".rstrip("."))
    if not path.is_dir():
        raise UserError(
            f"{what} {text} is a file, not a checkpoint directory (config.json, weights, tokenizer)"
        )
    if not (path / "config.json").is_file():
        inside = _checkpoints_inside(path)
        if inside:
            raise UserError(
                f"{what} {text} is not a checkpoint (no config.json) but holds checkpoints: use "
                + " or ".join(str(p) for p in inside[:2])
            )
        raise UserError(
            f"{what} {text} is not a checkpoint: no config.json. A checkpoint directory holds config.json, "
            "model.safetensors and the tokenizer files (what save_pretrained, `agentrl model init`, "
            "`agentrl sft` and `agentrl train` write)"
        )
    if not any((path / f).is_file() for f in _WEIGHT_FILES) and not any(path.glob("*.safetensors")):
        raise UserError(
            f"{what} {text} has a config.json but no weights (model.safetensors or pytorch_model.bin)"
        )
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        raise UserError(
            f"{what} {text} has no tokenizer (tokenizer.json / tokenizer_config.json); save the tokenizer "
            "beside the model with tokenizer.save_pretrained(dir)"
        )


def _check_adapter_dir(path: Path, what: str, adapter_ok: bool) -> None:
    if not adapter_ok:
        raise UserError(
            f"{what} {path} is a LoRA adapter, not a full model; `agentrl model merge {path} --out DIR` "
            "writes a full model to start from"
        )
    if not (path / "adapter_model.safetensors").is_file():
        raise UserError(f"{what} {path} has an adapter_config.json but no adapter_model.safetensors")
    try:
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise UserError(f"{what} {path}/adapter_config.json is not readable JSON ({exc})") from None
    if not base:
        raise UserError(f"{what} {path}/adapter_config.json names no base model (base_model_name_or_path)")
    check_model_dir(base, f"{what} {path}'s base model")


def check_nonempty_file(path: str | os.PathLike[str], what: str, kind: str = "JSONL") -> None:
    """A data file must exist, be a file and hold at least one non-blank line."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p}: no such file.{did_you_mean_path(p)}".rstrip("."))
    if not p.is_file():
        raise UserError(f"{what} {p} is a directory, not a {kind} file")
    with p.open("rb") as f:
        for line in f:
            if line.strip():
                return
    raise UserError(f"{what} {p} is empty: no {kind} records in it")
