"""The warm start: a tiny model fine-tuned on oracle demonstrations into RL's learnability band, cached.

    agentrl model warm-start --env agentrl/calc-v0 --out runs/warm-calc

One recipe (`WarmStartRecipe`), all deterministic from `seed`:

1. `init_tiny`: the random-init Qwen2 model and its tokenizer (`model_overrides` change its sizes);
2. the short stage: `generate_demos` (the environment's oracle through the rollout engine and its
   masker) in a short context (the environment without the tool schemas in its system prompt), then
   masked SFT (`agentrl.train.sft`: only the oracle's tokens train). Calc's skill is copying: the expression
   from the question into the python call, the printed number into `submit`. A tiny model learns to
   copy in a sudden transition after ~8,000 demonstration sequences (an induction-head phase change;
   digit loss stays at ln 10 until then), and at 420 tokens an episode, 85% of them the system
   prompt, those sequences are what a CPU build cannot afford; at 150 tokens each costs a third.
   Some seeds have not come to the transition when the stage ends (their SFT loss stays near 0.2): the
   stage checks its loss (`short_fit_loss`) and trains on from where it stands, `short_round_epochs`
   more passes at a time, up to `short_max_rounds` extra rounds, then fails with a one-line message;
3. the main stage: demonstrations in the environment's own context (the token ids RL will see), a
   short SFT from the short stage's checkpoint: it learns to look past the tool schemas (a model
   that copies well in the short context copies nothing in the long one before this stage);
4. the measurement: held-out pass@1, `eval_tasks` tasks of the test split x `eval_samples` samples at
   `eval_temperature`, with vLLM, in a subprocess of its own (vLLM's process-wide state, its
   distributed group included, must not leak into the SFT of a later build in this process).

**From a checkpoint** (`start_from`, `agentrl model warm-start --from PATH`): any transformers causal LM
instead of the tiny model; only the main stage runs. With `target_pass` the checkpoint is measured first:
one already at the target is copied as it is, without SFT. For a harness environment (your
own agent, `agentrl.gateway.HarnessEnv`) the demonstrations are played through the agent
(`agentrl.kit.demonstrations`): the SFT teaches the model the agent's own prompt and tool format, and
the measurement plays the agent too.

Why a band: GRPO learns only from groups whose rewards differ. A model that always fails (p = 0) or
always passes (p = 1) gives zero advantages everywhere; pass@1 between 0.2 and 0.7 leaves most
groups of 4-8 samples informative and room to improve.

Cache: `<out>/agentrl_warm_start.json` records the hash of the build fields of the recipe (with the
library versions, `WARM_START_VERSION` and a digest of the code that builds, `BUILD_CODE`), the
build's statistics and the measurement. A second call with the same build fields and code returns
the directory untouched; different build fields rebuild it (beside
the target, renamed into place at the end, so no reader sees half a model); a different measurement
spec (`eval_*` fields) only re-measures. A non-empty directory we did not write is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentrl.core.errors import UserError
from agentrl.kit.numerics import Numerics, pinned_env

if TYPE_CHECKING:
    from agentrl.kit.demonstrations import DemoStats

RECORD_FILE = "agentrl_warm_start.json"
# A tiny model learns to copy after ~8,000 demonstration sequences (the module docstring): a short stage
# given fewer is not expected to have learned, and its loss is not checked.
COPY_SEQUENCES = 8192
# Bump when a stage changes in a way the recipe fields do not capture (a new masker, a new SFT loss).
# 2: the SFT on the trainer's token-budget micro-batches builds another model from the same recipe
# than version 1 did (benchmarks/RESULTS.md, the curriculum runs), so version-1 caches are rebuilt.
# 3: the SFT holds each micro-batch's common prefix once (`optim.share_prefix`): the same loss, rounded
# otherwise, and 832 steps make that another model (docs/DEMO.md).
# 4: the SFT's micro-batch plan keeps a group's episodes together (another model from the same recipe);
# a digest of the code that builds (`BUILD_CODE`) now catches such a change without a bump.
WARM_START_VERSION = 4
BUILD_CODE = (
    "agentrl.kit.warm_start",
    "agentrl.kit.tiny_model",
    "agentrl.kit.tokenizer",
    "agentrl.kit.demonstrations",
    "agentrl.rollout.masker",
    "agentrl.train.sft",
    "agentrl.train.batch",
    "agentrl.train.packing",
    "agentrl.train.varlen",
    "agentrl.train.logprobs",
    "agentrl.train.compiled",
    "agentrl.train.distributed",
    "agentrl.envs.calc",
)
"""The modules whose source decides what a recipe builds (initialisation, demonstrations, masking,
the SFT's batches and loss): their digest is part of the build hash, so a cache built by other code is
rebuilt, never reused as if it were this code's model."""
_EVAL_FIELDS = ("eval_tasks", "eval_samples", "eval_temperature", "eval_split", "eval_seed")
# Fields of the tiny model built from scratch (its short stage): a build from a checkpoint has none.
_SHORT_FIELDS = (
    "model_overrides",
    "short_demos",
    "short_epochs",
    "short_lr",
    "short_fit_loss",
    "short_round_epochs",
    "short_max_rounds",
)
# Steps at the end of an SFT whose mean loss says whether it fitted: one step's batch of 16 sequences
# is noisy (a learned main stage's last 16 steps spread 0.007-0.031), 16 steps are an epoch's quarter.
_TAIL_STEPS = 16


class WarmStartRecipe(BaseModel):
    """Everything a warm start depends on. The defaults are the best calc-v0 recipe measured so far
    (the measurements, and the recipes that did worse: benchmarks/RESULTS.md, "Warm-start recipe").

    The learning rate is what decides whether the copying transition comes at all; the main stage
    adapts fast, and `epochs` (steps = demos x epochs / batch_size) is the knob that moves pass@1
    inside the learnability band.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str = Field(
        "agentrl/calc-v0",
        description="Environment id; it must have an oracle. A harness env (your agent) plays the oracle's "
        "demonstrations in its own prompt and tool format.",
    )
    start_from: str | None = Field(
        None,
        description="Fine-tune this checkpoint (a transformers model directory) instead of building the tiny "
        "model: only the main stage runs, and with target_pass the checkpoint is measured first.",
    )
    seed: int = Field(0, description="Seed of the weight initialisation and of the SFT's shuffling.")
    model_overrides: dict[str, Any] = Field(
        default_factory=lambda: dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=352,
            rope_theta=10_000.0,
        ),
        description="`init_tiny` overrides (TinyModelSpec / TokenizerRecipe fields), e.g. num_hidden_layers.",
    )
    short_demos: int = Field(
        1024,
        ge=0,
        description="Demonstrations for a first SFT stage in a short context: the environment made with "
        "`short_env_kwargs` (default: no tool schemas in the system prompt, 150 tokens an episode instead of "
        "420), so each step costs a third. 0 skips the stage.",
    )
    short_env_kwargs: dict[str, Any] = Field(
        default_factory=lambda: {"tools_in_prompt": False},
        description="`agentrl.make` overrides of the short stage's environment.",
    )
    short_epochs: int = Field(12, ge=1, description="SFT passes over the short-context demonstrations.")
    short_lr: float = Field(1e-3, gt=0, description="SFT peak learning rate of the short stage.")
    short_fit_loss: float | None = Field(
        0.06,
        gt=0,
        description="The short stage has learned to copy when its SFT loss per action token (the mean of its "
        "last 16 steps) is at most this; above it, extra rounds train on from where it stands. The short "
        "stages that learned ended at 0.004-0.023, the two that never did at 0.164 and 0.236 (docs/DEMO.md): "
        "0.06 is 2.6x from either. Checked only when `short_demos` x `short_epochs` reaches the ~8,000 sequences "
        "copying takes (`COPY_SEQUENCES`); None: no check (the stage ends after `short_epochs`, learned or not).",
    )
    short_round_epochs: int = Field(
        4,
        ge=1,
        description="SFT passes over the same short-context demonstrations in each extra round (a fresh warm-up "
        "and decay at `short_lr`, from the checkpoint the stage ended at).",
    )
    short_max_rounds: int = Field(
        3,
        ge=0,
        description="Most extra rounds of the short stage while its loss is above `short_fit_loss`; still above "
        "after them, the build fails and says so (another seed builds another model). Seed 3 (pinned) needed "
        "2 and seed 1 needed 1 (docs/DEMO.md): 3 leaves one in hand.",
    )
    demos: int = Field(
        256, ge=1, description="Oracle demonstrations in the environment's own context (one per train task)."
    )
    demo_kinds: list[str] | None = Field(
        None, description="Keep only train tasks of these kinds (task.metadata['kind']); None keeps all."
    )
    epochs: int = Field(4, ge=1, description="SFT passes over the demonstrations.")
    lr: float = Field(1e-3, gt=0, description="SFT peak learning rate.")
    batch_size: int = Field(16, ge=1, description="SFT sequences per optimizer step (both stages).")
    micro_batch_size: int = Field(
        16, ge=1, description="SFT sequences per forward pass (memory, not results)."
    )
    warmup_steps: int = Field(10, ge=0, description="SFT linear warm-up steps.")
    target_pass: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Train until the held-out pass@1 reaches this (0.2: the band's low edge): after the main "
        "stage, measure; below it, another round (`round_epochs` passes over the same demonstrations, or "
        "fresh ones: `round_demos`), up to `max_rounds`. None: one round, the fixed recipe. Needs "
        "eval_tasks > 0.",
    )
    max_rounds: int = Field(
        8, ge=1, description="Most SFT rounds of the main stage while below `target_pass`."
    )
    round_epochs: int | None = Field(
        None,
        ge=1,
        description="SFT passes of each round after the first (None: `epochs`): a coarse first round, then "
        "finer ones, so that a sharp rise is measured inside the band rather than past it.",
    )
    round_demos: Literal["same", "fresh"] = Field(
        "same",
        description="The demonstrations of each round after the first: `same` (the first round's again), or "
        "`fresh` (the oracle on `demos` more train tasks each round): new demonstrations teach a model that "
        "has fit the first ones and still fails; the same ones again mostly fit them closer (docs/DEMO.md).",
    )
    numerics: Numerics = Field(
        "pinned",
        description="CPU kernel paths of the SFT: `pinned` (MKL, ATen and oneDNN on paths that round the same "
        "on any x86-64 box, `agentrl.kit.numerics`), or `native` (each library's choice for this CPU: "
        "another box may build another model from the same seed).",
    )
    backend: str = Field(
        "local",
        description="Sandbox backend of the oracle's and the measurement's tool calls. `local` (no isolation) "
        "is safe for calc-v0 demonstrations, whose only code is print(<generated expression>), and fast.",
    )
    eval_tasks: int = Field(
        100, ge=0, description="Held-out tasks (test split) for the pass@1 measurement; 0 skips it."
    )
    eval_samples: int = Field(1, ge=1, description="Samples per held-out task.")
    eval_temperature: float = Field(1.0, ge=0, description="Sampling temperature of the measurement.")
    eval_split: Literal["validation", "test"] = Field("test", description="Split of the held-out tasks.")
    eval_seed: int = Field(1, description="Seed of the measurement's sampling.")

    @model_validator(mode="after")
    def _target_needs_a_measurement(self) -> WarmStartRecipe:
        if self.target_pass is not None and not self.eval_tasks:
            raise ValueError("target_pass needs the held-out measurement: set eval_tasks above 0")
        fields = type(self).model_fields
        scratch = [  # set to other than their defaults (a dump read back sets every field)
            f for f in _SHORT_FIELDS if getattr(self, f) != fields[f].get_default(call_default_factory=True)
        ]
        if self.start_from is not None and scratch:
            raise ValueError(
                f"{', '.join(scratch)}: settings of the tiny model built from scratch; from a checkpoint (start_from) "
                "only the main stage runs: leave them out"
            )
        return self

    @property
    def short_stage(self) -> int:
        """Demonstrations of the short stage this build runs (none from a checkpoint)."""
        return 0 if self.start_from is not None else self.short_demos

    @property
    def short_checked(self) -> bool:
        """Whether the short stage's loss is checked (`short_fit_loss`): only a stage long enough for the
        copying transition (`COPY_SEQUENCES` demonstration sequences) is expected to have learned; a
        shorter one (a smoke run, `agentrl demo --quick`, a test) ends after `short_epochs` as it is."""
        return (
            self.short_fit_loss is not None
            and self.short_stage > 0
            and self.short_demos * self.short_epochs >= COPY_SEQUENCES
        )

    def build_fields(self) -> dict[str, Any]:
        """The fields the model depends on (the measurement fields are not among them)."""
        fields = self.model_dump(exclude=set(_EVAL_FIELDS))
        for added in ("start_from", "round_epochs"):  # unset, the hash of an older recipe stays what it was
            if fields[added] is None:
                del fields[added]
        if fields["round_demos"] == "same":
            del fields["round_demos"]
        if self.target_pass is not None:  # the measurement decides how many rounds train: the model's too
            fields["measured_by"] = self.eval_fields()
        # The short stage's check at its defaults builds the model it built before the check whenever
        # the stage learns the first time, so those caches keep their hash; a cache whose short stage did
        # not learn was built without the check, and `_built_before_the_check` rebuilds it.
        defaults = type(self).model_fields
        for added in ("short_fit_loss", "short_round_epochs", "short_max_rounds"):
            if fields[added] == defaults[added].get_default():
                del fields[added]
        return fields

    def eval_fields(self) -> dict[str, Any]:
        return self.model_dump(include=set(_EVAL_FIELDS))


class WarmStart(BaseModel):
    """What `warm_start` returns: the checkpoint and what is known about it."""

    path: str = Field(description="The warm-started checkpoint directory (transformers format).")
    reused: bool = Field(description="True when the cached build was returned without training.")
    build_hash: str = Field(description="Hash of the recipe's build fields and the library versions.")
    build_s: float = Field(description="Seconds the build took (init + demos + SFT), when it was built.")
    pass_at_1: float | None = Field(
        description="Held-out pass@1; None when the recipe skips the measurement."
    )
    eval_tasks: int = Field(description="Held-out tasks measured.")
    eval_samples: int = Field(description="Samples per held-out task.")
    record: dict[str, Any] = Field(description=f"The whole {RECORD_FILE}.")


def build_hash(recipe: WarmStartRecipe) -> str:
    import tokenizers
    import torch
    import transformers

    from agentrl.kit.tiny_model import RECIPE_VERSION

    key = {
        "warm_start_version": WARM_START_VERSION,
        "code": code_digest(),
        "model_kit_version": RECIPE_VERSION,
        "recipe": recipe.build_fields(),
        # The checkpoint's content, not only its path: one retrained in place is another start.
        **({"start": _fingerprint(recipe.start_from)} if recipe.start_from is not None else {}),
        # Other versions may initialise, tokenize or train differently: a different version rebuilds.
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def code_digest(modules: tuple[str, ...] = BUILD_CODE) -> str:
    """A digest of the source of `modules` (found without importing them)."""
    import importlib.util

    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no module {name} to digest (warm_start.BUILD_CODE lists it)")
        h.update(name.encode() + b"\0" + Path(spec.origin).read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _fingerprint(model_dir: str) -> str:
    from agentrl.eval.evaluate import checkpoint_fingerprint

    return checkpoint_fingerprint(model_dir)


def read_record(out: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads((Path(out) / RECORD_FILE).read_text())
    except (OSError, ValueError):
        return None


def _log(msg: str) -> None:
    print(f"[warm-start] {msg}", file=sys.stderr, flush=True)


def warm_start(
    out: str | Path, recipe: WarmStartRecipe | None = None, *, force: bool = False, threads: int = 1
) -> WarmStart:
    """Build (or reuse) the warm-started model in `out`; see the module docstring.

    `force` rebuilds even when the cache matches; `threads` are the SFT's CPU threads (they do not
    change the recipe: the same steps, up to float summation order).
    """
    recipe = recipe or WarmStartRecipe()
    out = Path(out)
    if recipe.start_from is not None:
        from agentrl.core.errors import check_model_dir

        check_model_dir(recipe.start_from)
    digest = build_hash(recipe)
    record = read_record(out)
    have_model = (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    if record is None and out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} is not empty and holds no {RECORD_FILE}, so it is not a warm-start build; "
            "pass an empty or new directory (warm_start never overwrites files it did not write)"
        )
    reused = not force and record is not None and record.get("hash") == digest and have_model
    if reused and _built_before_the_check(record, recipe):
        _log(f"{out}: its short stage never learned to copy (built before the check): rebuilding")
        reused = False
    if not reused:
        record = _build(out, recipe, digest, threads)
    assert record is not None
    measurement = record.get("measurement")
    if recipe.eval_tasks and (measurement is None or measurement.get("spec") != recipe.eval_fields()):
        _log(f"measuring held-out pass@1 on {recipe.eval_tasks} x {recipe.eval_samples} episodes")
        record["measurement"] = measure(out, recipe)
        (out / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    m = record.get("measurement") if recipe.eval_tasks else None
    return WarmStart(
        path=str(out),
        reused=reused,
        build_hash=digest,
        build_s=record["build"]["seconds"],
        pass_at_1=m["pass_at_1"] if m else None,
        eval_tasks=m["tasks"] if m else 0,
        eval_samples=m["samples"] if m else 0,
        record=record,
    )


def _build(out: Path, recipe: WarmStartRecipe, digest: str, threads: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from agentrl.kit.tiny_model import init_tiny

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.build-", dir=out.parent))
    try:
        t0 = time.perf_counter()
        if recipe.start_from is not None:
            base = Path(recipe.start_from)
            t_init = 0.0
        else:
            base = init_tiny(work / "base", seed=recipe.seed, **recipe.model_overrides)
            t_init = time.perf_counter() - t0
            _log(f"tiny model in {t_init:.1f}s")
        tokenizer = AutoTokenizer.from_pretrained(base)
        stages: list[dict[str, Any]] = []
        start = _measure_start(base, recipe)
        if start is not None and start["pass_at_1"] >= recipe.target_pass:
            return _already_there(out, work, base, recipe, digest, t0, start)
        short_rounds: list[dict[str, Any]] = []
        if recipe.short_stage:
            base, short_rounds = _short_stage(work, base, tokenizer, recipe, threads, stages)
        model = _main_stage(work, base, tokenizer, recipe, threads, stages)
        rounds = _rounds_to_target(work, model, tokenizer, recipe, threads, stages)
        if start is not None:
            rounds.insert(0, start)
        main = stages[-1]
        record: dict[str, Any] = {
            "hash": digest,
            "recipe": recipe.model_dump(),
            "build": {
                "seconds": round(time.perf_counter() - t0, 1),
                "init_s": round(t_init, 1),
                "stages": stages,
                "demos": stages[-1]["demos"],
                "sft_steps": main["sft_steps"],
                "sft_first_loss": main["sft_first_loss"],
                "sft_last_loss": main["sft_last_loss"],
                "rounds": rounds,
                # The short stage's first pass, then its extra rounds, each with its loss.
                "short_rounds": short_rounds,
            },
            # Rounds measured as they went; the last one is the model's measurement.
            "measurement": rounds[-1]["measurement"] if rounds else None,
        }
        (model / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        model.rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"built {out} in {record['build']['seconds']}s")
    return record


def _measure_start(base: Path, recipe: WarmStartRecipe) -> dict[str, Any] | None:
    """The first record of a build from a checkpoint with a target: the checkpoint itself, measured before any SFT."""
    if recipe.start_from is None or recipe.target_pass is None:
        return None
    m = measure(base, recipe)
    _log(f"before SFT: {recipe.start_from} as it is, held-out pass@1 {m['pass_at_1']:.3f}")
    return {"round": 0, "sft_steps": 0, "sft_last_loss": None, "pass_at_1": m["pass_at_1"], "measurement": m}


def _already_there(
    out: Path, work: Path, base: Path, recipe: WarmStartRecipe, digest: str, t0: float, start: dict[str, Any]
) -> dict[str, Any]:
    """The checkpoint measured at the target already: copied into `out` as it is, without SFT."""
    model = work / "main"
    shutil.copytree(base, model)
    record: dict[str, Any] = {
        "hash": digest,
        "recipe": recipe.model_dump(),
        "build": {
            "seconds": round(time.perf_counter() - t0, 1),
            "init_s": 0.0,
            "stages": [],
            "demos": None,
            "sft_steps": 0,
            "sft_first_loss": None,
            "sft_last_loss": None,
            "rounds": [start],
        },
        "measurement": start["measurement"],
    }
    (model / RECORD_FILE).write_text(json.dumps(record, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    model.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    _log(f"{recipe.start_from} is at the target already: copied to {out} without SFT")
    return record


def _stage(
    name: str,
    work: Path,
    base: Path,
    tokenizer: Any,
    recipe: WarmStartRecipe,
    n: int,
    env_kwargs: dict[str, Any],
    epochs: int,
    lr: float,
    threads: int,
    log: list[dict[str, Any]],
    keep_files: bool,
    demos: Path | None = None,
    start: int = 0,
) -> Path:
    """Demonstrations of `recipe.env` (with `env_kwargs`), then SFT of `base` on them; returns the checkpoint.

    `keep_files` keeps the demonstrations and the SFT metrics in the checkpoint (the last stage's).
    `demos`: train on these demonstrations instead of generating new ones (another round); `start`: the
    first train task of new ones.
    """
    from agentrl.train.config import SFTConfig

    demos_path = work / f"{name}-demos.jsonl"
    stats = _stage_demos(demos_path, recipe, n, tokenizer, env_kwargs, demos, start)
    if stats.passed == 0:
        raise RuntimeError(
            f"the oracle of {recipe.env} passed none of {stats.episodes} tasks; check the environment "
            f"with `agentrl env check {recipe.env} --backend {recipe.backend}`"
        )
    _log(f"{name}: {stats.passed}/{stats.episodes} demonstrations passed in {stats.seconds:.1f}s; SFT")
    t0 = time.perf_counter()
    out = work / name
    cfg = SFTConfig(
        model=str(base),
        data=str(demos_path),
        out=str(out),
        epochs=epochs,
        lr=lr,
        batch_size=recipe.batch_size,
        micro_batch_size=recipe.micro_batch_size,
        warmup_steps=recipe.warmup_steps,
        seed=recipe.seed,
    )
    _sft(cfg, threads, recipe.numerics)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    if keep_files:
        shutil.move(str(demos_path), out / "demos.jsonl")
    else:
        # `export_hf` copies every non-weight file of the base checkpoint into the next SFT's output,
        # which would overwrite that SFT's own metrics.jsonl and sft_config.json with these.
        for leftover in ("metrics.jsonl", "sft_config.json"):
            (out / leftover).unlink(missing_ok=True)
    log.append(
        {
            "stage": name,
            "demos": asdict(stats),
            "sft_s": round(time.perf_counter() - t0, 1),
            "sft_steps": len(losses),
            "sft_first_loss": losses[0],
            "sft_last_loss": losses[-1],
            "sft_tail_loss": sum(losses[-_TAIL_STEPS:]) / len(losses[-_TAIL_STEPS:]),
        }
    )
    _log(f"{name}: {len(losses)} SFT steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return out


def _stage_demos(
    path: Path,
    recipe: WarmStartRecipe,
    n: int,
    tokenizer: Any,
    env_kwargs: dict[str, Any],
    demos: Path | None,
    start: int,
) -> DemoStats:
    """A stage's demonstrations at `path`: a copy of `demos`, or the oracle on `n` train tasks from `start`;
    returns their `DemoStats`."""
    from agentrl.kit.demonstrations import DemoStats, generate_demos

    if demos is not None:
        shutil.copyfile(demos, path)
        lines = len(path.read_text().splitlines())
        return DemoStats(lines, lines, 0, 0.0, 0.0, 0.0, {})
    _, stats = generate_demos(
        recipe.env,
        n,
        path,
        tokenizer,
        split="train",
        start=start,
        kinds=recipe.demo_kinds,
        backend=recipe.backend,
        env_kwargs=env_kwargs,
    )
    return stats


class ShortStageNotLearned(UserError, RuntimeError):
    """The short stage's loss stayed above `short_fit_loss` after its extra rounds (a user error: the
    command line says it in one line, and which seed to change)."""


def _short_stage(
    work: Path,
    base: Path,
    tokenizer: Any,
    recipe: WarmStartRecipe,
    threads: int,
    stages: list[dict[str, Any]],
    stage: Any = None,
) -> tuple[Path, list[dict[str, Any]]]:
    """The short stage, then while its loss says it has not learned to copy (`short_fit_loss`), extra rounds
    of `short_round_epochs` passes over its demonstrations from the checkpoint it ended at, up to
    `short_max_rounds`. Returns the checkpoint and each round's record (the first: the stage's own pass).

    A stage that learns the first time runs exactly as it did before the check. `stage` stands in for
    `_stage` (tests)."""
    stage = stage or _stage
    model = stage(
        "short",
        work,
        base,
        tokenizer,
        recipe,
        recipe.short_demos,
        recipe.short_env_kwargs,
        recipe.short_epochs,
        recipe.short_lr,
        threads,
        stages,
        keep_files=False,
    )
    demos = work / "short-demos.jsonl"  # left in `work` by a stage that does not keep its files
    rounds = [_short_round(0, stages[-1], stages[-1]["sft_steps"], recipe)]
    while rounds[-1]["learned"] is False:
        k = len(rounds)
        last = rounds[-1]
        if k > recipe.short_max_rounds:
            raise ShortStageNotLearned(
                f"the short stage of seed {recipe.seed} did not learn to copy: its SFT loss is "
                f"{last['sft_tail_loss']:.3f} per action token after {last['sft_steps']} steps "
                f"({k - 1} extra round(s)), above {recipe.short_fit_loss} (stages that learn end near 0.01); "
                "this seed builds no warm start with this recipe: use another seed"
            )
        _log(
            f"short stage has not learned to copy (loss {last['sft_tail_loss']:.3f} > {recipe.short_fit_loss} "
            f"after {last['sft_steps']} steps): extra round {k} of {recipe.short_max_rounds}, "
            f"{recipe.short_round_epochs} more passes"
        )
        model = stage(
            f"short-round-{k}",
            work,
            model,
            tokenizer,
            recipe,
            recipe.short_demos,
            recipe.short_env_kwargs,
            recipe.short_round_epochs,
            recipe.short_lr,
            threads,
            stages,
            keep_files=False,
            demos=demos,
        )
        rounds.append(_short_round(k, stages[-1], last["sft_steps"] + stages[-1]["sft_steps"], recipe))
    if len(rounds) > 1:
        _log(
            f"short stage learned to copy after {len(rounds) - 1} extra round(s), {rounds[-1]['sft_steps']} steps"
        )
    return model, rounds


def _short_round(k: int, entry: dict[str, Any], steps: int, recipe: WarmStartRecipe) -> dict[str, Any]:
    """Round `k`'s record from its stage entry: `learned` is None without the check."""
    tail = entry.get("sft_tail_loss", entry["sft_last_loss"])
    return {
        "round": k,
        "sft_steps": steps,
        "sft_last_loss": entry["sft_last_loss"],
        "sft_tail_loss": tail,
        "learned": tail <= recipe.short_fit_loss if recipe.short_checked and recipe.short_fit_loss else None,
    }


def _built_before_the_check(record: dict[str, Any], recipe: WarmStartRecipe) -> bool:
    """A cache with this recipe's hash whose short stage never learned: built before the short stage checked
    its loss (the check adds no field to the hash at its defaults), so this recipe builds another model."""
    build = record.get("build") or {}
    if not recipe.short_checked or recipe.short_fit_loss is None or "short_rounds" in build:
        return False
    short = [s for s in build.get("stages") or [] if s.get("stage") == "short"]
    return bool(short) and short[0]["sft_last_loss"] > recipe.short_fit_loss


def _main_stage(
    work: Path,
    base: Path,
    tokenizer: Any,
    recipe: WarmStartRecipe,
    threads: int,
    stages: list[dict[str, Any]],
    demos: Path | None = None,
    round_no: int = 1,
) -> Path:
    """The main stage (the environment's own context) from `base`. A round after the first (`round_no`)
    trains `round_epochs` passes over `demos` (the first round's again) or, without them, over fresh
    demonstrations of the train tasks after the earlier rounds' ones."""
    return _stage(
        "main",
        work,
        base,
        tokenizer,
        recipe,
        recipe.demos,
        {},
        recipe.epochs if round_no == 1 else recipe.round_epochs or recipe.epochs,
        recipe.lr,
        threads,
        stages,
        keep_files=True,
        demos=demos,
        start=(round_no - 1) * recipe.demos,
    )


def _rounds_to_target(
    work: Path,
    model: Path,
    tokenizer: Any,
    recipe: WarmStartRecipe,
    threads: int,
    stages: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """With `target_pass`: measure `model` (the main stage's checkpoint, trained further in place) and
    train another round (`round_epochs` passes over the same demonstrations or fresh ones: `round_demos`)
    while the held-out pass@1 is below the target, up to `max_rounds` rounds in all. Returns each round's
    record ([] without a target)."""
    if recipe.target_pass is None:
        return []
    rounds: list[dict[str, Any]] = []
    steps = stages[-1]["sft_steps"]
    demos: Path | None
    for k in range(1, recipe.max_rounds + 1):
        if k > 1:
            previous = work / f"round-{k - 1}"
            shutil.rmtree(previous, ignore_errors=True)
            model.rename(previous)
            demos = None  # fresh ones
            if recipe.round_demos == "same":
                demos = work / "round-demos.jsonl"
                shutil.move(str(previous / "demos.jsonl"), demos)
            # The next SFT copies its base's non-weight files into its output (see `_stage`).
            for leftover in ("metrics.jsonl", "sft_config.json", "demos.jsonl"):
                (previous / leftover).unlink(missing_ok=True)
            trained = _main_stage(work, previous, tokenizer, recipe, threads, stages, demos=demos, round_no=k)
            steps += stages[-1]["sft_steps"]
            assert trained == model
        m = measure(model, recipe)
        rounds.append(
            {
                "round": k,
                "sft_steps": steps,
                "sft_last_loss": stages[-1]["sft_last_loss"],
                "pass_at_1": m["pass_at_1"],
                "measurement": m,
            }
        )
        _log(f"round {k}: {steps} main-stage SFT steps, held-out pass@1 {m['pass_at_1']:.3f}")
        if m["pass_at_1"] >= recipe.target_pass:
            break
    return rounds


BAND_HIGH = 0.8
"""The learnability band's upper edge (`agentrl.train.curriculum`'s default): a warm start above it is said."""

# An SFT loss per action token above this has not learnt the demonstrations yet (calc's stages end
# near 0.01): training longer comes before more data.
_UNFIT_LOSS = 0.5


def advice(record: dict[str, Any], recipe: WarmStartRecipe) -> str | None:
    """What to do when the build's rounds ended below `target_pass`; None when it got there (or had no target)."""
    rounds = (record.get("build") or {}).get("rounds") or []
    if rounds and rounds[-1]["pass_at_1"] > BAND_HIGH:
        return (
            f"held-out pass@1 {rounds[-1]['pass_at_1']:.3f} is above the learnability band (up to {BAND_HIGH}): "
            "most GRPO groups would pass whole and teach nothing. Train on harder tasks, or fewer SFT steps "
            "(--epochs, --max-rounds)"
        )
    if recipe.target_pass is None or not rounds or rounds[-1]["pass_at_1"] >= recipe.target_pass:
        return None
    last = rounds[-1]
    loss = last.get("sft_last_loss")
    if not last.get("sft_steps"):  # the checkpoint's own measurement only: no SFT round ran
        return f"held-out pass@1 {last['pass_at_1']:.3f} of the checkpoint is below the target {recipe.target_pass}"
    if loss is not None and loss > _UNFIT_LOSS:
        todo = (
            f"Its SFT loss is still {loss:.2f} per action token: train longer (--max-rounds, --epochs) or "
            "faster (--lr)"
        )
    else:
        todo = (
            "It fits the demonstrations but does not solve held-out tasks: more demonstrations (--demos, "
            "--short-demos) or a larger model (--model-overrides)"
        )
    return (
        f"held-out pass@1 {last['pass_at_1']:.3f} after {len(rounds)} round(s) and {last['sft_steps']} "
        f"main-stage SFT steps is below the target {recipe.target_pass}. {todo}; check the oracle's "
        "demonstrations with `agentrl env check`"
    )


def _sft(cfg: Any, threads: int, numerics: Numerics = "pinned") -> None:
    """SFT in a subprocess: `launch` here would leave torch.distributed state behind in this process;
    and the CPU kernel paths (`numerics`) are chosen when torch is first imported, so a child can pin them.

    `threads` sets its OpenMP threads. On a shared 2-core box one thread trains faster than two
    (benchmarks/RESULTS.md, "Warm-start recipe"): two threads spin-wait on each other whenever
    another process holds a core.
    """
    env = {**pinned_env(numerics), "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.train.sft", cfg.model_dump_json()], env=env, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"SFT failed (exit {proc.returncode}); its log is above. Config: {cfg.model_dump_json()}"
        )


def measure(model_dir: str | Path, recipe: WarmStartRecipe) -> dict[str, Any]:
    """Held-out pass@1 of `model_dir`, in a subprocess (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "measurement.json"
        cmd = [
            sys.executable,
            "-m",
            "agentrl.kit.warm_start",
            str(model_dir),
            recipe.model_dump_json(),
            str(result),
        ]
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0 or not result.is_file():
            raise RuntimeError(
                f"the pass@1 measurement of {model_dir} failed (exit {proc.returncode}); its log is above"
            )
        return json.loads(result.read_text())


def _measure_here(model_dir: str, recipe: WarmStartRecipe) -> dict[str, Any]:
    from collections import Counter

    from agentrl.env.registry import task_source
    from agentrl.rollout.config import RolloutConfig
    from agentrl.rollout.engine import make_policy
    from agentrl.rollout.loop import collect_sync

    t0 = time.perf_counter()
    source = task_source(recipe.env, split=recipe.eval_split, backend=recipe.backend)
    tasks = [source.get(i, recipe.eval_split) for i in range(recipe.eval_tasks)]
    # A calc episode is two short calls: 128 tokens a turn is plenty, and keeps a derailed sample short.
    cfg = RolloutConfig(
        group_size=recipe.eval_samples, temperature=recipe.eval_temperature, max_tokens_per_turn=128
    )
    with make_policy(model_dir, cfg, seed=recipe.eval_seed, dtype="float32", in_process=True) as policy:
        trajectories = collect_sync(
            recipe.env, tasks, policy, cfg, seed=recipe.eval_seed, env_kwargs={"backend": recipe.backend}
        )
    by_kind: Counter[str] = Counter()
    per_kind: Counter[str] = Counter()
    for i, t in enumerate(trajectories):
        kind = str(tasks[i // recipe.eval_samples].metadata.get("kind", ""))
        per_kind[kind] += 1
        by_kind[kind] += t.passed
    n = len(trajectories)
    # Per task: how often it passed, and how the tasks spread (GRPO learns from the "sometimes" ones;
    # with one sample a task is never or always).
    per_task = [
        sum(t.passed for t in trajectories[i : i + recipe.eval_samples]) / recipe.eval_samples
        for i in range(0, n, recipe.eval_samples)
    ]
    return {
        "spec": recipe.eval_fields(),
        "pass_at_1": sum(t.passed for t in trajectories) / n,
        "task_pass_rates": {
            "never": sum(p == 0.0 for p in per_task),
            "sometimes": sum(0.0 < p < 1.0 for p in per_task),
            "always": sum(p == 1.0 for p in per_task),
        },
        "tasks": recipe.eval_tasks,
        "samples": recipe.eval_samples,
        "pass_at_1_by_kind": {k: by_kind[k] / per_kind[k] for k in sorted(per_kind)},
        "finish_reasons": dict(Counter(t.finish_reason for t in trajectories)),
        "mean_tool_calls": sum(t.tool_calls for t in trajectories) / n,
        "seconds": round(time.perf_counter() - t0, 1),
    }


if __name__ == "__main__":
    # The measurement subprocess: MODEL_DIR RECIPE_JSON RESULT_PATH.
    model_dir, recipe_json, result_path = sys.argv[1:4]
    Path(result_path).write_text(
        json.dumps(_measure_here(model_dir, WarmStartRecipe.model_validate_json(recipe_json)))
    )
