"""`TrainConfig`: every knob of `agentrl train`, with its docstring, loaded from YAML/TOML with CLI overrides.

    agentrl train examples/calc_grpo.yaml steps=30 optim.lr=3e-5 curriculum.batch_groups=4
    agentrl train examples/calc_grpo.yaml --steps 30 --optim.lr 3e-5 --curriculum.batch-groups 4

An override is `dotted.path=value`; the value is parsed as YAML (so `true`, `3e-5`, `[1, 2]`
work). `model:` is a checkpoint directory, or a section that can add LoRA (`agentrl.train.lora`):

    model: runs/sft                                  # every weight trains
    model: {path: runs/sft, lora: {rank: 16}}        # LoRA adapters train on the frozen checkpoint
    agentrl train c.yaml model.lora.rank=8           # adds LoRA to either form; model.path=DIR: another start

Every field is also an option of `agentrl train` (`agentrl train --help` lists them by
section, with these descriptions; `agentrl.cli.options` makes them). The file is never rewritten;
the resolved config is saved next to the run's metrics.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentrl.core.errors import UserError, did_you_mean_path, format_validation_error, one_line
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.weight_sync import DEFAULT_SLEEP_WAIT_S, DEFAULT_WEIGHT_CHUNK_BYTES
from agentrl.sandbox.settings import SandboxSettings
from agentrl.train.curriculum import CurriculumConfig

# The options a config chooses from, declared once: the components take them as they are.
LossAggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
"""How per-token losses become one number (`agentrl.train.grpo.aggregate`)."""
RatioLevel = Literal["token", "sequence"]
"""Token-level importance ratio (GRPO) or one per sequence (GSPO)."""
ISLevel = Literal["token", "sequence"]
"""The importance weight to the rollout engine's policy: per token, or per sequence."""
ISMode = Literal["truncate", "mask"]
"""Off-policy correction: cap the importance weight (TIS), or drop what leaves the band (masked IS)."""
AdvantageScale = Literal["group", "none"]
"""Divide advantages by the group's reward std (GRPO), or not (Dr. GRPO)."""
PackingMode = Literal["auto", "on", "off"]
"""Packed micro-batches for the varlen attention (`agentrl.train.packing.resolve_packing`)."""


class _Strict(BaseModel):
    # A field documents itself with `description=` or with the docstring under it.
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class LoraSettings(_Strict):
    """LoRA adapters (peft) on the model's linear layers: only they train, the base weights stay frozen."""

    rank: int = Field(
        16,
        gt=0,
        description="LoRA rank r: the inner size of each adapter (A is [r, in], B is [out, r]). "
        "vLLM serves ranks up to 512.",
    )
    alpha: float = Field(32, gt=0, description="LoRA alpha: an adapter's output is scaled by alpha / rank.")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input while training (0: none)."
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description="Layers that get an adapter: all-linear (every linear layer of the decoder blocks, not the "
        "output head), or a list of module names such as [q_proj, v_proj] (peft's target_modules).",
    )

    push: Literal["adapter", "merged"] = Field(
        "adapter",
        description="What reaches the engine after each step: the adapter alone (vLLM serves it on its resident "
        "base weights; a push of megabytes), or merged full weights (base + adapter, as full fine-tuning "
        "pushes them; for comparison).",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _known_form(cls, value: Any) -> Any:
        # One message for both forms, where the union alone would report one error per form.
        if value == "all-linear":
            return value
        if isinstance(value, list | tuple) and value and all(isinstance(v, str) and v for v in value):
            return list(value)
        raise ValueError(
            "target_modules must be all-linear or a non-empty list of module names such as [q_proj, v_proj]"
        )


class ModelSettings(_Strict):
    """The starting checkpoint, and whether LoRA adapters train on it instead of its weights.

    `model: DIR` is short for `model: {path: DIR}` (every weight trains)."""

    path: str = Field(
        description="Starting checkpoint (transformers directory or Hub id), e.g. the SFT warm start."
    )
    lora: LoraSettings | None = Field(
        None,
        description="Train LoRA adapters on the frozen checkpoint instead of every weight: {rank, alpha, "
        "dropout, target_modules}, {} for the defaults. Checkpoints and the final model are then adapter "
        "directories (`agentrl model merge` makes a full model). None: full fine-tuning.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_path(cls, data: Any) -> Any:
        if isinstance(data, os.PathLike):
            data = os.fspath(data)
        if isinstance(data, str):
            return {"path": data}
        if isinstance(data, dict | ModelSettings):
            return data
        raise ValueError(
            "model must be a checkpoint directory (model: DIR) or a mapping "
            "(model: {path: DIR, lora: {rank: 16}})"
        )


class EngineSettings(_Strict):
    """Where the vLLM engines run: beside the trainer (`agentrl.rollout.placement`; nothing to set on a CPU
    machine), or `count` of them on the Ray cluster of `cluster.ray_address` (`agentrl.rollout.ray_policy`)."""

    devices: list[int] | None = Field(
        None,
        description="GPUs (indices among the visible ones) of the vLLM engine. None: colocated on the "
        "trainer's first GPU. GPUs the trainer does not use: dedicated (weights over NCCL); "
        "trainer GPUs: colocated (weights over CUDA IPC).",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of each engine GPU's memory vLLM may take (weights + KV cache). "
        "None: 0.9 on dedicated GPUs, 0.4 colocated with the trainer.",
    )
    sleep: bool = Field(
        True,
        description="Colocated, synchronous: the engine sleeps during each update (frees its weights and "
        "KV cache) and wakes for generation.",
    )
    sleep_wait_s: float = Field(
        DEFAULT_SLEEP_WAIT_S,
        gt=0,
        description="Longest the update waits for requests still running in the engine before it sleeps; "
        "past it the run stops with an error naming them (in synchronous mode none should be left).",
    )
    weight_chunk_mib: float = Field(
        DEFAULT_WEIGHT_CHUNK_BYTES / (1 << 20),
        gt=0,
        description="Size of one chunk of a weight push, in MiB: the staging buffer of the GPU transfers "
        "(grown to the largest tensor, which travels whole) and the bucket of the CPU path. Smaller: less "
        "memory next to a colocated engine, more round trips.",
    )
    count: int = Field(
        1,
        ge=1,
        description="vLLM engines generating the rollouts. More than 1 needs cluster.ray_address: each engine "
        "is a Ray actor (one GPU each where the cluster has GPUs), every one receives every weight push, and a "
        "group's episodes all go to one engine (its prefix cache).",
    )
    resources: dict[str, float] | list[dict[str, float]] | None = Field(
        None,
        description="Custom Ray resources each engine asks for, on top of its GPU (or CPU): one mapping for all "
        "engines, or a list with one per engine (e.g. [{node_a: 1}, {node_b: 1}] pins engine i to a node).",
    )


class ClusterSettings(_Strict):
    ray_address: str | None = Field(
        None,
        description="Ray cluster of the rollout engines: `auto` (the cluster this machine joined with "
        "`ray start`), or an address like head:6379. None: everything on this machine, without Ray. "
        "Needs the ray extra: pip install 'agentrl[ray]'.",
    )


class StepSettings(_Strict):
    """How one optimizer step runs, the same for GRPO (`optim:`) and SFT (`SFTConfig`)."""

    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="AdamW's decay rates of its first and second moment estimates (β1, β2)."
    )
    eps: float = Field(
        1e-8,
        gt=0,
        description="AdamW's ε, added to the root of the second moment: a parameter whose gradients are "
        "smaller than it moves less than the learning rate (PPO implementations use 1e-5).",
    )
    grad_clip: float = Field(1.0, gt=0, description="Clip the global gradient norm to this.")
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="Most sequences per forward pass on one process (None: only the token budget bounds it).",
    )
    max_tokens_per_micro_batch: int | None = Field(
        8192,
        gt=0,
        description="Token budget of one forward pass on one process: padded, count x longest; packed, the "
        "sum of lengths. Sequences are length-bucketed; a longer one runs alone. None: no budget.",
    )
    packing: PackingMode = Field(
        "auto",
        description="Pack a micro-batch's sequences into one row for the varlen attention (no padding). "
        "auto: on, except on a GPU without the varlen flash kernel (fp32, old torch): length-bucketed padding there.",
    )
    activation_checkpointing: bool = Field(
        False, description="Recompute decoder-layer activations in backward (less memory, the same numbers)."
    )
    share_prefix: PackingMode = Field(
        "auto",
        description="In a packed micro-batch, run the tokens every sequence starts with (the system prompt and "
        "tool schemas, a GRPO group's prompt) once; the rest of each sequence attends to that one copy, and "
        "micro-batches are planned to keep sequences with a long common start together. auto: on wherever "
        "micro-batches are packed (the varlen flash kernel on GPUs, the reference on the CPU). Needs packing.",
    )
    compile: PackingMode = Field(
        "auto",
        description="Compile each decoder layer with torch.compile, which fuses its elementwise work (RMS norms, "
        "rotary embeddings, SwiGLU, residual adds) into a few kernels; the first steps take longer while it "
        "compiles. auto: on with CUDA where torch.compile works (Triton), off on the CPU.",
    )

    @field_validator("betas")
    @classmethod
    def _betas_are_decay_rates(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each of betas must be in [0, 1), e.g. [0.9, 0.999]")
        return betas

    @model_validator(mode="after")
    def _prefix_needs_packing(self) -> StepSettings:
        if self.share_prefix == "on" and self.packing == "off":
            raise ValueError("share_prefix: on needs packing (packing: on or auto), or set share_prefix: off")
        return self


class OptimSettings(StepSettings):
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate (constant after warm-up).")
    warmup_steps: int = Field(
        0, ge=0, description="Linear warm-up over this many optimizer steps, then constant."
    )
    epochs: int = Field(
        1,
        ge=1,
        description="Passes over each batch (PPO epochs; verl's ppo_epochs, TRL's num_iterations). "
        "After the first update the ratio to the pre-update policy leaves 1 and the clip bounds the step.",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass: the batch is split into this many mini-batches of whole trajectories.",
    )
    bf16: bool | None = Field(
        None, description="bf16 params/compute with fp32 reduction; default: on with CUDA, off on CPU."
    )


class LossSettings(_Strict):
    clip_low: float = Field(0.2, ge=0, description="PPO clip below: ratio >= 1 - clip_low.")
    clip_high: float = Field(
        0.28, ge=0, description="PPO clip above (DAPO clip-higher): ratio <= 1 + clip_high."
    )
    agg: LossAggregation = Field(
        "token-mean", description="How per-token losses become one number (DAPO token-mean by default)."
    )
    ratio: RatioLevel = Field("token", description="Token-level ratio (GRPO) or sequence-level (GSPO).")
    adv_scale: AdvantageScale = Field(
        "group", description="Divide advantages by the group's reward std, or not (Dr. GRPO)."
    )
    negative_weight: float = Field(
        1.0,
        ge=0,
        le=1,
        description="Scale on negative advantages: 1 is GRPO, 0 positive-sample reinforcement only "
        "(Zhu et al. 2025); agentrl.train.grpo.weight_negatives. At 0 (and no KL term) the updates skip the "
        "negatives, which add nothing to the gradient, and their share of the update's compute.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of the k3 KL penalty to the starting model (0: no reference model)."
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of an entropy bonus: the loss subtracts entropy_coef times the entropy of the "
        "policy at the action tokens it trains on, aggregated as the policy term (0: none). Counters the "
        "collapse of a policy that positive-only updates sharpen; every trajectory then trains, negatives "
        "included (their entropy counts), as with a KL term.",
    )
    entropy_floor: float | None = Field(
        None,
        ge=0,
        description="With entropy_coef: the bonus applies only to a micro-batch whose mean action-token "
        "entropy (nats) is below this, so it holds the entropy up at a floor instead of pushing it up "
        "everywhere (None: always on).",
    )
    tis_cap: float | None = Field(
        2.0,
        description="Truncated importance-sampling cap between the rollout engine's and the trainer's log-probs (None: off).",
    )
    tis_level: ISLevel = Field(
        "token",
        description="The importance weight to the rollout engine's policy per token, or per sequence (the "
        "geometric mean of its token ratios, on every token of it).",
    )
    tis_mode: ISMode = Field(
        "truncate",
        description="truncate: the weight is min(ratio, tis_cap); mask: the ratio inside [1/tis_cap, tis_cap], "
        "0 outside (tokens or sequences sampled too far from the trainer's policy do not train).",
    )

    @model_validator(mode="after")
    def _floor_needs_a_bonus(self) -> LossSettings:
        if self.entropy_floor is not None and self.entropy_coef == 0.0:
            raise ValueError(
                "loss.entropy_floor is set but loss.entropy_coef is 0, so no bonus would ever apply; set "
                "entropy_coef (e.g. 0.01) or drop entropy_floor"
            )
        return self


class AsyncSettings(_Strict):
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: generate then train; async: generate the next batch while training."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="Async: batches generated ahead of the trainer, so no trajectory is more than this many "
        "policy versions old when trained on (enforced when episodes start); 0 is the synchronous mode.",
    )
    stale: Literal["drop", "importance-weight"] = Field(
        "drop",
        description="Async: what happens to a trajectory found older than max_staleness when trained on "
        "(none is, by admission; a safety net): dropped, or kept with the TIS correction.",
    )
    overlap: bool = Field(
        False,
        description="Async: build the batches the staleness bound admits at the same time instead of one "
        "after another, so the slowest episodes of one batch no longer hold back the next one's (continuous "
        "generation; `rollout.concurrency` bounds the episodes of all of them together). The curriculum "
        "learns from each batch in batch order when it is handed to the trainer; a checkpoint records the "
        "estimates of the batches trained, and a resume draws the untrained ones anew (not the same tasks).",
    )


class EvalSettings(_Strict):
    every: int = Field(
        0,
        ge=0,
        description="Evaluate every N steps on the held-out split (0: never; with keep_best, after the last "
        "step too).",
    )
    at_start: bool = Field(
        False,
        description="Also evaluate the starting model (step 0) before the first step: the baseline of the "
        "curve in eval.jsonl, and with keep_best a candidate too (its weights are saved as checkpoint-0), so "
        "a run in which no trained step beats the model it started from keeps that model and says so.",
    )
    keep_best: bool = Field(
        False,
        description="Keep the checkpoint with the best held-out pass@1 (the evaluations every `every` steps "
        "and after the last one, and the starting model's with at_start; a tie keeps the earlier step) and "
        "write it to out/best, as trainers that load the best model at the end do. Needs every > 0 and the "
        "validation split.",
    )
    split: Literal["validation", "test"] = Field(
        "validation", description="Held-out split for in-training evaluation."
    )
    tasks: int = Field(32, gt=0, description="Held-out tasks per evaluation.")
    samples: int = Field(4, gt=0, description="Samples per task (pass@k for k up to this).")
    temperature: float | None = Field(
        None,
        ge=0,
        description="Sampling temperature for evaluation (0: greedy). None: the rollout's; every other "
        "limit is the rollout's too.",
    )


class WandbSettings(_Strict):
    project: str = Field("agentrl", description="W&B project the run is logged to.")
    entity: str | None = Field(None, description="W&B entity (user or team); None: your default.")
    name: str | None = Field(None, description="Run name shown in W&B; None: W&B picks one.")
    mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="online, offline (files under out/wandb; `wandb sync` uploads them later), or auto: "
        "online when an API key is configured (WANDB_API_KEY or `wandb login`), else offline. "
        "WANDB_MODE, when set, wins.",
    )


class TrainConfig(_Strict):
    env: str = Field("agentrl/calc-v0", description="Environment id.")
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="The environment's settings (e.g. backend), passed to agentrl.make and checked against "
        "its settings model when the config loads; `agentrl env show ENV` lists them.",
    )
    model: ModelSettings = Field(
        description="The starting checkpoint: a directory (model: DIR), or {path: DIR, lora: {...}} to train "
        "LoRA adapters on it."
    )
    out: str = Field(
        "runs/train", description="Run directory: metrics.jsonl, checkpoints/, final/, config.json."
    )
    steps: int = Field(20, ge=1, description="Optimizer steps (one batch of groups each).")
    seed: int = Field(
        0,
        description="Seed of the rollouts' sampling and of initialisation (the curriculum draws with its own, "
        "curriculum.seed).",
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="How episodes are rolled out: sampling, limits, group size.",
    )
    engine: EngineSettings = Field(
        default_factory=EngineSettings, description="Where the vLLM engine runs on GPUs."
    )
    optim: OptimSettings = Field(default_factory=OptimSettings, description="Optimizer settings.")
    sandbox: SandboxSettings = Field(
        default_factory=SandboxSettings,
        description="Where the episodes' sandboxes run, the warm pool and the Docker engine's limits "
        "(AGENTRL_POOL_SIZE and the other AGENTRL_ variables of agentrl.sandbox.settings override them).",
    )
    cluster: ClusterSettings = Field(
        default_factory=ClusterSettings,
        description="Beyond one machine: the Ray cluster of the rollout engines.",
    )
    loss: LossSettings = Field(default_factory=LossSettings, description="GRPO loss settings.")
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig, description="Learnability-band curriculum and dynamic sampling."
    )
    asynchronous: AsyncSettings = Field(
        default_factory=AsyncSettings, description="Synchronous or asynchronous training."
    )
    eval: EvalSettings = Field(
        default_factory=EvalSettings, description="Held-out evaluation during training."
    )
    checkpoint_every: int = Field(10, ge=0)
    """Save out/checkpoint-N (Hugging Face layout, or the adapter directory with model.lora, plus what resuming needs) every N steps; 0: only at the end and on Ctrl-C."""
    keep_last: int = Field(3, ge=1)
    """Keep the newest N checkpoint-N directories (only the newest keeps the optimizer state)."""
    resume: bool = Field(
        True,
        description="Resume from the newest out/checkpoint-N when there is one (the config must match; "
        "`agentrl train --force` accepts a changed one).",
    )
    replay: str | None = Field(
        None, description="Train on this trajectory JSONL instead of generating (offline steps; tests)."
    )
    report_to: list[Literal["jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["jsonl"],
        description="Where metrics go: jsonl (out/metrics.jsonl, always written), tensorboard (out/tb), "
        "wandb (see `wandb`); tensorboard and wandb need the tracking extra: pip install 'agentrl[tracking]'.",
    )
    wandb: WandbSettings = Field(
        default_factory=WandbSettings, description="Weights & Biases settings, used when report_to has wandb."
    )
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Longest one collective of the update may wait for the other ranks before the run stops "
        "(NCCL's watchdog). Waits for rank 0's rollouts, engine start-up and evaluation are not bounded by it.",
    )
    stop_uninformative_after: int = Field(3, ge=0)
    """Stop after this many steps in a row without one informative group (all-pass or all-fail groups only: nothing to learn from); 0: never stop. Each such step is reported."""

    @model_validator(mode="after")
    def _trainable(self) -> TrainConfig:
        if self.rollout.group_size < 2:
            raise ValueError(
                f"rollout.group_size={self.rollout.group_size}: GRPO compares the episodes of a group, so it "
                "needs at least 2"
            )
        if self.rollout.temperature == 0:
            raise ValueError(
                "rollout.temperature=0 is greedy decoding: every episode of a group would be the same, and the "
                "trainer's log-probs are taken at the sampling temperature; use a temperature > 0"
            )
        if self.eval.keep_best and not self.eval.every:
            raise ValueError(
                "eval.keep_best needs in-training evaluations to choose from: set eval.every (e.g. 2)"
            )
        if self.eval.keep_best and self.eval.split != "validation":
            raise ValueError(
                f"eval.keep_best with eval.split={self.eval.split}: a checkpoint chosen on the split it is "
                "judged on scores too high there; select on validation (eval.split=validation)"
            )
        if self.engine.count > 1 and self.cluster.ray_address is None:
            raise ValueError(
                f"engine.count={self.engine.count} needs a Ray cluster: set cluster.ray_address "
                "(auto, or HEAD:6379), or engine.count=1 for the one engine beside the trainer"
            )
        return self

    @model_validator(mode="after")
    def _env_settings(self) -> TrainConfig:
        from agentrl.env.registry import check_env_kwargs

        check_env_kwargs(self.env, self.env_kwargs)  # against the env's settings (`agentrl env show ENV`)
        return self


class SFTConfig(StepSettings):
    """Everything `agentrl sft` needs; the step settings (`StepSettings`) are GRPO's `optim:` ones."""

    model: ModelSettings = Field(
        description="Checkpoint directory to start from (transformers format), or {path: DIR, lora: {...}} to "
        "train LoRA adapters on it (the output is then an adapter directory)."
    )
    data: str = Field(description="Trajectory JSONL to train on.")
    out: str = Field(
        description="Output directory: the fine-tuned checkpoint (transformers format; with model.lora, the "
        "adapter directory) and metrics.jsonl."
    )
    epochs: int = Field(3, ge=1, description="Passes over the data.")
    lr: float = Field(1e-3, gt=0, description="Peak AdamW learning rate.")
    warmup_steps: int = Field(5, ge=0, description="Linear warm-up steps, then cosine decay to 10% of lr.")
    batch_size: int = Field(32, gt=0, description="Sequences per optimizer step, over all processes.")
    only_passed: bool = Field(
        True, description="Train only on trajectories whose verifier passed (rejection sampling)."
    )
    max_seq_len: int = Field(4096, gt=0, description="Drop trajectories longer than this many tokens.")
    seed: int = Field(0, description="Seed for shuffling and dropout.")
    log_every: int = Field(10, gt=0, description="Log metrics every N optimizer steps.")


class ConfigError(UserError, ValueError):
    """A config file or override that cannot be read or does not validate (one line, with the fix)."""


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    key, raw = item.split("=", 1)
    try:
        return key.strip().split("."), yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({one_line(exc)})") from None


def _read(p: Path) -> Any:
    try:
        return tomllib.loads(p.read_text()) if p.suffix == ".toml" else yaml.safe_load(p.read_text())
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"{p} is not valid {'TOML' if p.suffix == '.toml' else 'YAML'}: {one_line(exc)}"
        ) from None


# Sections a config may give as one value, and the field that value sets: `model: DIR` is
# `model: {path: DIR}`, so that `model.lora.rank=8` (or --model.lora) can add to a file that says `model: DIR`.
_SHORTHANDS = {"model": "path"}


def _expanded(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with each shorthand section spelled out as a mapping."""
    out = dict(data)
    for key, field in _SHORTHANDS.items():
        if isinstance(out.get(key), str | os.PathLike):
            out[key] = {field: os.fspath(out[key])}
    return out


def _merged(base: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    settings: dict[str, Any] | None = None,
    **fields: Any,
) -> TrainConfig:
    """Config from a YAML or TOML file (or none), then keyword fields, then `settings` (a nested
    mapping, merged section by section: the command's options), then `a.b=c` overrides.

    Every problem is a `ConfigError` in one line: a missing file, an unknown key (with the closest
    known one), a value of the wrong type (with the value given).
    """
    data: dict[str, Any] = {}
    where = "config"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist.{did_you_mean_path(p)}".rstrip("."))
        data = _read(p) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of config fields")
        where = f"config {p}"
    data.update({k: v for k, v in fields.items() if v is not None})
    data = _merged(_expanded(data), _expanded(settings or {}))
    for item in overrides or []:
        keys, value = _parse_override(item)
        # `model=DIR` replaces the whole model section (no LoRA unless said); `model.path=DIR` only the path.
        data = _expanded(data) if len(keys) > 1 else data
        node = data
        for k in keys[:-1]:
            if node.get(k) is None:  # a sub-key of an absent or null section (model.lora.rank=8) creates it
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {k} is not a section")
        node[keys[-1]] = value
    try:
        return TrainConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, TrainConfig, what=where)) from None
