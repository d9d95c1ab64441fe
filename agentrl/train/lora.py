"""LoRA training with peft: adapters injected into the transformers model in place, saved in peft's format.

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    apply_lora(model, cfg.model.lora, base)        # the same object, LoRA layers inside, the base frozen
    shard_model(model)                              # FSDP2, as for full fine-tuning
    opt = torch.optim.AdamW(trainable_parameters(model))   # the adapters only
    files = adapter_files(model)                    # collective; rank 0: peft's two files, as bytes
    save_adapter(model, "runs/x/final", base)       # collective; PeftModel.from_pretrained and vLLM load it
    merge_adapter("runs/x/final", "runs/x/merged")  # a full model (`agentrl model merge`)

In place (peft's `inject_adapter_in_model`), not a `PeftModel` wrapper: FSDP2's `shard_model`, the lean
log-prob path (`agentrl.train.logprobs`: the decoder's hidden states, then `lm_head`) and the parameter
names see the same `...ForCausalLM` with or without LoRA. peft keeps its config on the model
(`model.peft_config`), which is how `is_lora` tells a LoRA model and how the files get their config.

An adapter directory is what `PeftModel.save_pretrained` writes (`agentrl.rollout.adapters`): the weights
under peft's names (`base_model.model.<module>.lora_A.weight`), fp32 (the trainer's own precision, so
a resumed run continues from exactly the weights it saved), and `base_model_name_or_path` absolute.
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from agentrl.core.errors import UserError, check_model_dir, one_line
from agentrl.rollout.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_base,
    is_adapter_dir,
    write_adapter_files,
)
from agentrl.rollout.weight_sync import checkpoint_name
from agentrl.train.distributed import HF_CHECKPOINT_FILES

if TYPE_CHECKING:
    from agentrl.train.config import LoraSettings

ADAPTER_NAME = "default"
"""peft's name of the one adapter; it never reaches the files (peft drops it from the keys)."""
_FILE_PREFIX = "base_model.model."
"""What `PeftModel.save_pretrained` puts before a module's name in adapter_model.safetensors."""
_TOKENIZER_FILES = HF_CHECKPOINT_FILES - {"config.json", "generation_config.json", "preprocessor_config.json"}
"""Tokenizer files besides tokenizer*, copied beside an adapter (never config.json: an adapter directory
is not a full model, and transformers and vLLM tell the two apart by it)."""


def base_reference(base: str | os.PathLike[str]) -> str:
    """How an adapter names its base: a local directory absolute (the adapter may be read from elsewhere),
    a Hub id as it is."""
    path = Path(base).expanduser()
    return str(path.resolve()) if path.exists() else str(base)


def lora_config(settings: LoraSettings, base: str | os.PathLike[str]) -> Any:
    """The peft `LoraConfig` of `settings`, for a causal LM whose base is `base`."""
    from peft import LoraConfig

    alpha = settings.alpha
    return LoraConfig(
        r=settings.rank,
        # peft declares lora_alpha an int; a whole number is written as one (vLLM reads the file too).
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules
        if isinstance(settings.target_modules, str)
        else list(settings.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_reference(base),
    )


def apply_lora(model: nn.Module, settings: LoraSettings, base: str | os.PathLike[str]) -> nn.Module:
    """Inject LoRA layers into `model` in place and freeze everything else; returns `model` itself.

    Call it before `shard_model`, with the same RNG state on every rank: the A matrices start random
    (B at zero, so the model's output is unchanged), and every rank must start from the same ones.
    """
    from peft import inject_adapter_in_model

    if is_lora(model):
        raise ValueError(f"{type(model).__name__} already carries LoRA adapters")
    try:
        inject_adapter_in_model(lora_config(settings, base), model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # peft's "Target modules ... not found in the base model"
        raise UserError(
            one_line(
                f"model.lora.target_modules={settings.target_modules!r} does not fit {type(model).__name__}: "
                f"{exc}. Use all-linear, or names of its linear layers such as q_proj, v_proj"
            )
        ) from None
    # peft leaves only the adapters trainable; said here, since the optimizer relies on it.
    for name, param in model.named_parameters():
        param.requires_grad_(_is_adapter(name))
    return model


def is_lora(model: nn.Module) -> bool:
    """True when `apply_lora` (peft) injected adapters into `model`."""
    return bool(getattr(model, "peft_config", None))


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer gets: the adapters of a LoRA model (every weight of any other)."""
    return [p for p in model.parameters() if p.requires_grad]


def _is_adapter(name: str) -> bool:
    # peft names every LoRA parameter lora_* (lora_A, lora_B; lora_embedding_*, lora_magnitude_vector).
    return "lora_" in name


def _adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters, full (gathered from the FSDP2 shards: a collective, every rank in the
    same order) and on the CPU in fp32, by the model's parameter names (wrappers' prefixes included,
    as peft finds its layers by module name)."""
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if not _is_adapter(name):
            continue
        full = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = full.detach().to("cpu", torch.float32, copy=True)
    return out


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's weights under the names of peft's adapter_model.safetensors, on every rank
    (a collective under FSDP2)."""
    from peft import get_peft_model_state_dict

    tensors = _adapter_tensors(model)
    sd = get_peft_model_state_dict(
        model, state_dict=tensors, adapter_name=ADAPTER_NAME, save_embedding_layers=False
    )
    if len(sd) != len(tensors):  # peft selects by module name: a wrapper it did not expect would drop some
        raise RuntimeError(
            f"peft kept {len(sd)} of the {len(tensors)} adapter tensors of {type(model).__name__}"
        )
    # The names of the unwrapped model (no FSDP2 / activation-checkpointing wrappers), as PeftModel saves them.
    return {_FILE_PREFIX + checkpoint_name(k): v.contiguous() for k, v in sd.items()}


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Base + adapter as one full state dict under the checkpoint's names (W + alpha/r · B A for every adapted
    layer), for an engine that takes full weights (`model.lora.push: merged`). A collective under FSDP2."""
    from agentrl.rollout.weight_sync import full_state_dict

    config = model.peft_config[ADAPTER_NAME]  # type: ignore[index]
    scale = config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)
    sd = {checkpoint_name(k): v for k, v in full_state_dict(model).items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if _is_adapter(key):
            continue
        if ".base_layer." not in key:
            out[key] = value
            continue
        layer, kind = key.split(".base_layer.")
        if kind == "weight":
            a = sd[f"{layer}.lora_A.{ADAPTER_NAME}.weight"]  # [r, in]
            b = sd[f"{layer}.lora_B.{ADAPTER_NAME}.weight"]  # [out, r]
            value = value + scale * (b.float() @ a.float()).to(value.dtype)  # [out, in]
        out[f"{layer}.{kind}"] = value
    return out


def _config_bytes(model: nn.Module) -> bytes:
    """adapter_config.json as `PeftModel.save_pretrained` writes it (inference mode, the resolved
    target modules), by peft's own writer."""
    config = copy.deepcopy(model.peft_config[ADAPTER_NAME])  # type: ignore[index]
    config.inference_mode = True
    with tempfile.TemporaryDirectory(prefix="agentrl-adapter-") as tmp:
        config.save_pretrained(tmp)
        return (Path(tmp) / ADAPTER_CONFIG).read_bytes()


def adapter_files(model: nn.Module) -> dict[str, bytes] | None:
    """The adapter as peft's two files, `{ADAPTER_CONFIG: ..., ADAPTER_WEIGHTS: ...}`, on rank 0; None on
    the other ranks. A collective under FSDP2: call it on every rank."""
    from safetensors.torch import save

    sd = adapter_state_dict(model)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return {ADAPTER_CONFIG: _config_bytes(model), ADAPTER_WEIGHTS: save(sd, metadata={"format": "pt"})}


def copy_tokenizer(base: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> None:
    """The tokenizer files of `base` (a directory, or a Hub id) into `out_dir`."""
    src, out = Path(base).expanduser(), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        for f in src.iterdir():
            if f.is_file() and (f.name in _TOKENIZER_FILES or f.name.startswith("tokenizer")):
                shutil.copy2(f, out / f.name)
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(base)).save_pretrained(out)


def save_adapter(
    model: nn.Module, out_dir: str | os.PathLike[str], tokenizer_from: str | os.PathLike[str]
) -> Path | None:
    """Write the adapter directory (peft's two files + the tokenizer of `tokenizer_from`, the base) to
    `out_dir`; returns it on rank 0, None elsewhere. A collective: call it on every rank."""
    files = adapter_files(model)
    if files is None:
        return None
    out = write_adapter_files(files, out_dir)
    copy_tokenizer(tokenizer_from, out)
    return out


def load_adapter_weights(model: nn.Module, adapter_dir: str | os.PathLike[str]) -> None:
    """Load the adapter weights saved in `adapter_dir` into the LoRA model `model`, sharded or not (every
    rank reads the file and keeps its own shard; no communication). The adapter must have the model's
    shape (same rank, same modules): a `UserError` naming the difference otherwise."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    saved = load_file(path)
    own = {n: p for n, p in model.named_parameters() if _is_adapter(n)}
    # The file's name of each parameter: peft's prefix, no wrappers, no adapter name.
    by_file = {_FILE_PREFIX + checkpoint_name(n).replace(f".{ADAPTER_NAME}", ""): n for n in own}
    fix = "resume with the model.lora settings the run was trained with, or train into another out="
    missing, extra = sorted(by_file.keys() - saved.keys()), sorted(saved.keys() - by_file.keys())
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model does not"
        more = len(missing) + len(extra) - 1
        raise UserError(
            f"{path} does not fit this model's adapters: it {what}"
            + (f" (and {more} more differences)" if more else "")
            + f"; {fix}"
        )
    for key, name in by_file.items():
        if tuple(saved[key].shape) != tuple(own[name].shape):  # a DTensor's shape is the full one
            raise UserError(
                f"{path}: {key} is {list(saved[key].shape)}, this model's adapter is {list(own[name].shape)} "
                f"(another LoRA rank?); {fix}"
            )
    with torch.no_grad():
        for key, name in by_file.items():
            param = own[name]
            value = saved[key].to(param.device, param.dtype)
            if isinstance(param, DTensor):  # this rank's shard of the full tensor, cut locally
                value = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(value)


def merge_adapter(
    adapter_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    base: str | os.PathLike[str] | None = None,
) -> Path:
    """A full Hugging Face model of base + adapter (peft's `merge_and_unload`) and the tokenizer, in `out_dir`.

    `base`: the base checkpoint; None, the one the adapter names. Merged in fp32, saved in the base's
    own dtype. Bad input (not an adapter directory, a missing base, an `out_dir` in use) is a `UserError`.
    """
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter, out = Path(adapter_dir).expanduser(), Path(out_dir).expanduser()
    if not is_adapter_dir(adapter):
        raise UserError(
            f"{adapter} is not a LoRA adapter directory (it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); "
            "pass a checkpoint-N or final/ of a run trained with model.lora"
        )
    if base is None:
        base = adapter_base(adapter)
        check_model_dir(base, what=f"the base model named by {adapter / ADAPTER_CONFIG} (pass --base DIR)")
    else:
        check_model_dir(base, what="--base")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not an empty directory; choose another --out")
    if out.resolve() == adapter.resolve():
        raise UserError(f"--out {out} is the adapter directory itself; choose another --out")
    config = AutoConfig.from_pretrained(str(base))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.to(dtype)
    merged.config.dtype = dtype
    merged.save_pretrained(out)
    tokenizer_src = adapter if any(adapter.glob("tokenizer*")) else base
    copy_tokenizer(tokenizer_src, out)
    return out
