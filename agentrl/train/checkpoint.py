"""Trainer checkpoints: Hugging Face-loadable `checkpoint-N` directories that also resume the run exactly.

Layout of a run directory (`TrainConfig.out`):

    config.json                 the run's config; a resume must match it (or `--force`, which keeps
                                the old one as config.step-N.json)
    metrics.jsonl               one row per step
    checkpoint-N/               after step N: config.json, model.safetensors, tokenizer files, as
                                `save_pretrained` writes them; loadable by
                                AutoModelForCausalLM.from_pretrained, vLLM and `agentrl eval --model`
    checkpoint-N/trainer_state/ the newest checkpoint only: optimizer state, the step and update
                                counts, the curriculum, the rollout seed counter and every RNG state
    final/                      the trained model (Hugging Face layout)

A LoRA run (`model.lora`) writes the adapter directory instead of the full weights, in `checkpoint-N/`
and `final/` alike: adapter_config.json, adapter_model.safetensors and the tokenizer files, as
`PeftModel.save_pretrained` writes them (`agentrl.train.lora`); `trainer_state/` then holds the
optimizer state of the adapters only.

The last `keep_last` checkpoints are kept; only the newest carries `trainer_state/` (what resuming
needs; the optimizer state is the large part). A checkpoint is written to a temporary directory
and renamed into place, so a crash mid-save leaves the previous one intact.

`trainer_state/optimizer.pt` holds plain tensors, numbers, strings, lists and dicts only, and is
loaded with `torch.load(weights_only=True)`: a run directory may come from anywhere (a shared
filesystem, a downloaded run), and a pickle that asks to call anything is refused before it runs.

A resume is exact: on CPU, with the same seed, the resumed run's metrics and weights are bit for
bit those of the uninterrupted run (tests/test_resume.py), because everything the next step
depends on is in `trainer_state/`.
"""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agentrl.core.errors import UserError, one_line

STATE_DIR = "trainer_state"
_CKPT = re.compile(r"^checkpoint-(\d+)$")

#: Config fields a resumed run may change: they do not change what the steps already taken would
#: compute (more steps, another checkpoint or logging schedule). Anything else needs --force.
RESUMABLE_CHANGES = frozenset(
    # `sandbox`: where and how many sandboxes run (Docker hosts, pool size, engine limits) does not
    # change what is learned, so a resumed run may move to other hosts.
    {
        "steps",
        "checkpoint_every",
        "keep_last",
        "report_to",
        "resume",
        "wandb",
        "stop_uninformative_after",
        "sandbox",
    }
)


def checkpoints(out: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-N` directory under `out`, oldest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _CKPT.match(p.name))]
    return sorted(found)


def latest_resumable(out: str | Path) -> Path | None:
    """The newest checkpoint that carries a complete trainer state (and the weights or the adapter), or None."""
    from agentrl.rollout.adapters import is_adapter_dir

    for _, path in reversed(checkpoints(out)):
        weights = (path / "model.safetensors").is_file() or is_adapter_dir(path)
        if (path / STATE_DIR / "state.json").is_file() and weights:
            return path
    return None


def rng_state() -> dict[str, Any]:
    """Every RNG a step may draw from: torch (CPU and CUDA), Python's `random`, numpy's global one.

    Plain types only (tensors, lists, ints, floats, strings): the checkpoint that holds it must load
    with `torch.load(weights_only=True)`, which refuses numpy arrays."""
    import numpy as np

    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss_next],
        "numpy": [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached_gaussian)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (or, from an older checkpoint, the numpy array it held)."""
    import numpy as np

    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached_gaussian))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_array_globals() -> list[Any]:
    """What a checkpoint written before the RNG states were plain types needs beyond plain tensors:
    numpy's MT19937 key array (a uint32 ndarray), under the names numpy 1 and 2 pickle it by."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    rebuild = core.multiarray._reconstruct
    return [
        np.ndarray,
        np.dtype,
        type(np.dtype(np.uint32)),
        (rebuild, "numpy.core.multiarray._reconstruct"),
        (rebuild, "numpy._core.multiarray._reconstruct"),
    ]


def _global_name(obj: Any) -> str:
    return obj[1] if isinstance(obj, tuple) else f"{obj.__module__}.{obj.__qualname__}"


def _not_plain(path: Path, fix: str) -> UserError | None:
    """The refusal for a file whose pickle asks for more than plain tensors and numpy's key array,
    or None. Reads the pickle's opcodes only: nothing in the file runs."""
    try:
        wanted = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip that torch.save wrote: a bare pickle, say
        return _refusal(path, "it is a bare pickle, not the zip file torch.save writes", fix)
    legacy = {_global_name(g) for g in _numpy_array_globals()}
    unsafe = [name for name in wanted if name not in legacy]
    if not unsafe:
        return None
    shown = ", ".join(unsafe[:3]) + (f" and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
    return _refusal(path, f"loading it would call {shown}", fix)


def _refusal(path: Path, what: str, fix: str) -> UserError:
    return UserError(
        one_line(
            f"{path} is not a plain-tensor checkpoint ({what}), so nothing in it was loaded or run; {fix}"
        )
    )


def check_plain(path: str | Path, fix: str) -> None:
    """Refuse (a `UserError`) a file `load_plain` would refuse for what it asks to call, without
    loading it: cheap (the pickle's opcodes, not the tensors), for checks before any process starts."""
    if (refused := _not_plain(Path(path), fix)) is not None:
        raise refused


def load_plain(path: str | Path, fix: str) -> Any:
    """`torch.load` that runs nothing from the file: plain tensors, dicts, lists, numbers, strings
    (an optimizer state dict is those). A pickle that asks for anything else (a function to call,
    a class to build) is a `UserError` naming the file, raised before any of it runs; `fix` says
    what to do instead.

    Checkpoints from before the RNG states were stored as plain types also hold numpy's key array;
    those still load, with numpy's array rebuilding allowed by name and only when the file asks for
    nothing else (rebuilding an array of numbers calls no code the file chooses)."""
    path = Path(path)
    try:
        with warnings.catch_warnings():
            # A bare pickle (not torch.save's zip) draws a warning about its protocol before it is
            # refused; the refusal says what matters.
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass
    if (refused := _not_plain(path, fix)) is not None:
        raise refused from None
    try:
        with torch.serialization.safe_globals(_numpy_array_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # Only globals we allow, yet refused: opcodes the weights-only unpickler does not take.
        raise _refusal(path, "it holds pickle instructions a plain-tensor load refuses", fix) from None


def save(
    out: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    base_model: str | Path,
    keep_last: int,
    protect: int | None = None,
) -> Path:
    """Write `checkpoint-<step>` (weights in Hugging Face layout, or a LoRA model's adapter directory,
    + trainer state) and prune older ones, except the checkpoint of step `protect` (the best so far).

    Collective: every rank calls it (the full state dict, or the adapter's, is gathered); rank 0 writes.
    `state` is JSON-able (step, update count, curriculum, ...); the RNG states of every rank are added here.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
    )

    from agentrl.train.lora import adapter_files, copy_tokenizer, is_lora

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    lora = is_lora(model)
    files: dict[str, bytes] | None = None
    if lora:
        # The adapters only: gathering the frozen base would cost as much as a full checkpoint.
        files = adapter_files(model)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=opts)
    rngs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    out = Path(out)
    final = out / f"checkpoint-{step}"
    if dist.get_rank() == 0:
        tmp = out / f".checkpoint-{step}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        if files is not None:
            from agentrl.rollout.adapters import write_adapter_files

            write_adapter_files(files, tmp)
            copy_tokenizer(base_model, tmp)
        else:
            from agentrl.train.distributed import export_hf

            export_hf(model_sd, base_model, tmp)
        (tmp / STATE_DIR).mkdir()
        torch.save({"optimizer": optim_sd, "rng": rngs}, tmp / STATE_DIR / "optimizer.pt")
        (tmp / STATE_DIR / "state.json").write_text(json.dumps({**state, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)  # atomic: a crash mid-save never leaves a half-written checkpoint-N
        _prune(out, keep=final, keep_last=keep_last, protect=protect)
    dist.barrier()
    return final


def save_weights(out: str | Path, step: int, model: torch.nn.Module, base_model: str | Path) -> Path:
    """Write `checkpoint-<step>` with the model's weights (or a LoRA model's adapter) and no trainer state:
    a candidate for `eval.keep_best`, not a point to resume from. Collective; rank 0 writes, atomically.

    Not `save`: gathering an optimizer that has not stepped makes torch initialize its state with a
    zero-learning-rate step, which would count one Adam step the run never took."""
    out = Path(out)
    final, tmp = out / f"checkpoint-{step}", out / f".checkpoint-{step}.tmp"
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main and tmp.exists():
        shutil.rmtree(tmp)
    export_model(model, base_model, tmp)
    if main:
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    return final


def export_model(model: torch.nn.Module, base_model: str | Path, out_dir: str | Path) -> Path:
    """The trained model in `out_dir` (a run's final/, SFT's output): a Hugging Face checkpoint, or a LoRA
    model's adapter directory, with the tokenizer of `base_model`. Collective: every rank calls it; rank 0 writes."""
    from agentrl.train.distributed import export_hf, full_state_dict
    from agentrl.train.lora import is_lora, save_adapter

    if is_lora(model):
        save_adapter(model, out_dir, tokenizer_from=base_model)
    else:
        sd = full_state_dict(model)  # rank 0 holds it (cpu_offload); the others gathered their part
        if not dist.is_initialized() or dist.get_rank() == 0:
            export_hf(sd, base_model, out_dir)
    return Path(out_dir)


def _prune(out: Path, keep: Path, keep_last: int, protect: int | None = None) -> None:
    """Keep the newest `keep_last` checkpoints, and the weights of step `protect`; only `keep` (the newest)
    keeps its trainer state."""
    found = checkpoints(out)
    for step, path in found[: max(0, len(found) - keep_last)]:
        if step == protect:
            if (path / STATE_DIR).exists():
                shutil.rmtree(path / STATE_DIR, ignore_errors=True)
            continue
        shutil.rmtree(path, ignore_errors=True)
    for _, path in found[-keep_last:]:
        if path != keep and (path / STATE_DIR).exists():
            shutil.rmtree(path / STATE_DIR, ignore_errors=True)


def _resume_fix(path: Path) -> str:
    return (
        f"resume only from checkpoints agentrl train wrote: delete {path} if you do not trust it, "
        "or train into another out="
    )


def load(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a checkpoint written by `save` into a (sharded) model and its optimizer; returns its state,
    with this rank's RNG state under "rng" (restore it with `set_rng_state` when the loop starts)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
        set_state_dict,
    )

    from agentrl.rollout.adapters import is_adapter_dir
    from agentrl.train.lora import is_lora, load_adapter_weights

    path = Path(path)
    lora = is_lora(model)
    if lora != is_adapter_dir(path):
        held, wanted = ("a LoRA adapter", "full fine-tuning") if not lora else ("full weights", "model.lora")
        raise UserError(
            f"{path} holds {held}, but this run trains with {wanted}; resume with the model settings the run "
            "was trained with, or train into another out="
        )
    blob = load_plain(path / STATE_DIR / "optimizer.pt", fix=_resume_fix(path))
    if lora:
        load_adapter_weights(model, path)
        set_optimizer_state_dict(
            model,
            optimizer,
            optim_state_dict=blob["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )
        return _state(path, blob)
    model_sd = load_file(path / "model.safetensors")
    # A tied output head is saved once (as the embedding), as save_pretrained does.
    expected = {k for k, _ in model.named_parameters()} | set(model.state_dict())
    for key in expected - set(model_sd):
        if key.endswith("lm_head.weight"):
            embed = [k for k in model_sd if k.endswith("embed_tokens.weight")]
            if embed:
                model_sd[key] = model_sd[embed[0]]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_sd,
        optim_state_dict=blob["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    return _state(path, blob)


def _state(path: Path, blob: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's state.json, with this rank's RNG state under "rng"."""
    state = json.loads((path / STATE_DIR / "state.json").read_text())
    rngs = blob.get("rng") or []
    rank = dist.get_rank() if dist.is_initialized() else 0
    state["rng"] = rngs[rank] if rank < len(rngs) else None
    return state


# --- resuming: what a run directory holds, and whether the config still matches ---------------------


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _switched(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Optional sections set on one side and None on the other (`model.lora`), by dotted key: flattened,
    a section's keys would only look added (or removed), not changed."""
    out: dict[str, tuple[Any, Any]] = {}
    for k in a.keys() & b.keys():
        va, vb = a[k], b[k]
        if isinstance(va, dict) and isinstance(vb, dict):
            out.update(_switched(va, vb, f"{prefix}{k}."))
        elif (va is None) != (vb is None) and (isinstance(va, dict) or isinstance(vb, dict)):
            out[f"{prefix}{k}"] = (va, vb)
    return out


def config_changes(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """`key: old -> new` for every config value that differs and may not change on a resume.

    A setting the recorded config does not have at all is one added since that run started: the run
    goes on with the value wanted, and that is not a change. A section switched on or off (`model.lora`
    from None to a mapping) is one change."""
    recorded = _current_form(recorded)
    switched = _switched(recorded, wanted)
    a, b = _flat(recorded), _flat(wanted)
    changes = {key: (a.get(key, "(unset)"), b.get(key, "(unset)")) for key in set(a) | set(b)}
    changes = {key: ab for key, ab in changes.items() if key in a and a[key] != b.get(key)}
    changes = {k: ab for k, ab in changes.items() if not any(k.startswith(f"{s}.") for s in switched)}
    changes.update(switched)
    return [
        f"{key}: {old!r} -> {new!r}"
        for key, (old, new) in sorted(changes.items())
        if key.split(".")[0] not in RESUMABLE_CHANGES
    ]


def _current_form(recorded: dict[str, Any]) -> dict[str, Any]:
    """A recorded config in today's form: `model` was a plain path before it became a section, and a
    run recorded then resumes under a config that says the same (`model.path`, no `model.lora`)."""
    if isinstance(recorded.get("model"), str):
        return {**recorded, "model": {"path": recorded["model"], "lora": None}}
    return recorded


def prepare_run_dir(cfg: Any, force: bool = False) -> str:
    """Before training starts (once, in the launching process): decide fresh start or resume, refuse a
    changed config unless `force`, and write `config.json` when it is new. Returns a one-line note.

    - a run directory with a resumable checkpoint and `resume: true` resumes; a changed config is a
      `UserError` listing the changes, unless `force` (the old config is kept as config.step-N.json);
    - `resume: false` with a run already there is a `UserError`, unless `force`, which deletes its
      checkpoints and metrics and starts over;
    - `config.json` is never overwritten silently.
    """
    out = Path(cfg.out)
    wanted = json.loads(cfg.model_dump_json())
    config_path = out / "config.json"
    legacy = out / "checkpoints" / "latest" / "weights.pt"
    ckpt = latest_resumable(out)
    recorded = json.loads(config_path.read_text()) if config_path.is_file() else None
    recorded = _current_form(recorded) if recorded is not None else None
    has_run = ckpt is not None or legacy.exists() or (out / "metrics.jsonl").exists()
    if legacy.exists() and ckpt is None and cfg.resume and not force:
        raise UserError(
            f"{out} holds a checkpoint in the old single-file format (checkpoints/latest), which this "
            "version cannot resume; train into a new out=, or pass --force to start over there"
        )
    if has_run and not cfg.resume:
        if not force:
            where = f" (checkpoint at step {_step_of(ckpt)})" if ckpt else ""
            raise UserError(
                f"{out} already holds a training run{where} and resume is off; set resume: true to continue "
                "it, choose another out=, or pass --force to delete it and start over"
            )
        _clear_run(out)
        recorded, ckpt = None, None
    if ckpt is None:
        if recorded is not None and recorded != wanted and not force and has_run:
            changes = config_changes(recorded, wanted)
            if changes:
                raise UserError(
                    f"{out} holds a run with another config and no checkpoint to resume ("
                    + "; ".join(changes[:4])
                    + "); choose another out=, or pass --force to start over there"
                )
        if has_run:
            _clear_run(out)
        out.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(wanted, indent=2))
        return f"starting a new run in {out}"
    step = _step_of(ckpt)
    # Before any process starts (and before this directory changes): a trainer state that would run
    # code when loaded stops here, as it would stop every rank in `load`.
    if (ckpt / STATE_DIR / "optimizer.pt").is_file():
        check_plain(ckpt / STATE_DIR / "optimizer.pt", fix=_resume_fix(ckpt))
    if recorded is not None and recorded != wanted:
        changes = config_changes(recorded, wanted)
        if changes and not force:
            more = f" (and {len(changes) - 4} more)" if len(changes) > 4 else ""
            raise UserError(
                one_line(
                    f"{out} holds a run at step {step} trained with another config: "
                    + "; ".join(changes[:4])
                    + more
                    + ". Resume it with the same config, train into another out=, or pass --force to "
                    "continue it under the new config"
                )
            )
        archived = out / f"config.step-{step}.json"
        archived.write_text(config_path.read_text())
        config_path.write_text(json.dumps(wanted, indent=2))
        note = f"; the previous config is kept as {archived.name}" if changes else ""
        return f"resuming {out} from {ckpt.name} under the changed config{note}"
    if recorded is None:
        config_path.write_text(json.dumps(wanted, indent=2))
    return f"resuming {out} from {ckpt.name}"


def _step_of(path: Path | None) -> int:
    m = _CKPT.match(path.name) if path is not None else None
    return int(m.group(1)) if m else 0


def _clear_run(out: Path) -> None:
    """Delete what a previous run wrote (checkpoints, metrics, plots, logs), nothing else."""
    for _, path in checkpoints(out):
        shutil.rmtree(path, ignore_errors=True)
    for name in ("final", "checkpoints", "policy", "tb", "wandb"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "eval.jsonl", "training.png", "config.json", "engine.log"):
        (out / name).unlink(missing_ok=True)
    for tmp in out.glob(".checkpoint-*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def truncate_jsonl(path: Path, step: int) -> None:
    """Drop rows after `step` (written after the checkpoint a run resumes from)."""
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [line for line in rows if json.loads(line).get("step", 0) <= step]
    if len(kept) != len(rows):
        path.write_text("".join(line + "\n" for line in kept))
