"""Budget-controlled, resumable pass@k evaluation of one or more checkpoints on one environment.

    agentrl eval --env agentrl/calc-v0 --model runs/sft/final --model runs/grpo/final --n 16 --k 1,2,4,8,16

**Budget control.** Every model is held to one `EvalBudget`: the same task list (task ids recorded),
decoding (temperature, top-p), turn limit, per-turn and per-trajectory token limits, wall-clock limit
per episode, and the same per-episode seeds. Episode (task i, sample j) samples with a seed derived
from (seed, i, j) alone, so it gets the same seed for every model, in any order, after any restart.
The budget is written to `<out>/eval_config.json` and into `summary.json`.

**Resumability.** Each finished episode is appended to `<out>/<model>/episodes.jsonl` the moment it
ends, as one line keyed by (task index, sample). A restart reads those lines back and runs only the
missing episodes; a model with none missing does not even start its engine. The budget in the run
directory must match the requested one (a changed temperature would mix two evaluations in one
table), otherwise the run stops and says to use a new `--out` or `--force`. On SIGINT the episodes in
flight are cancelled, everything already written stays (each line is written whole, between two
awaits), and a partial last line (a hard kill mid-write) is cut off on the next start.

Layout of `<out>`:

    eval_config.json          the budget and the task ids every model here is held to
    <model>/episodes.jsonl    one `EpisodeRecord` per line
    <model>/model.json        the checkpoint path and fingerprint this name stands for; wall time
    summary.json              pass@k with bootstrap CIs, pass^k, agent metrics per model, the budget
    report.md                 the Markdown summary
    pass_at_k.png             pass@k against k, every model
    task_scatter.png          per-task pass rate, first model (x) against last model (y)
    paired_diff.png           per-task pass-rate difference of each later model against the first

**LoRA adapters.** A `--model` may be a LoRA adapter directory (peft's `adapter_config.json` +
`adapter_model.safetensors`, what a LoRA `agentrl train` writes): every adapter of one base runs in ONE
engine (vLLM's multi-LoRA), the base itself too when it is also evaluated, each model's requests carrying
its adapter; the comparison is paired as for full checkpoints.

**Paired comparison.** With two or more models, each later model is compared with the first on
the same episodes (`agentrl.eval.paired`): per-task differences, a paired bootstrap interval of the
pass@1 difference and McNemar's exact test, with a one-line verdict, in `summary.json` ("paired"),
`report.md` and `paired_diff.png`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.eval.failures import failures
from agentrl.eval.paired import PairedComparison, compare_trajectories, markdown_section, plot_differences
from agentrl.eval.report import (
    ModelSummary,
    markdown_report,
    plot_pass_at_k,
    plot_task_scatter,
    summarize,
    write_summary_json,
)
from agentrl.rollout.adapters import is_adapter_dir
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.trajectory import Trajectory

CONFIG_FILE = "eval_config.json"
EPISODES_FILE = "episodes.jsonl"
MODEL_FILE = "model.json"


class EvalError(UserError, ValueError):
    """An evaluation cannot go on as asked: the message says what was wrong and how to fix it."""


class EvalConfig(BaseModel):
    """Everything `agentrl eval` needs; the budget fields are held identical for every model."""

    model_config = ConfigDict(extra="forbid")

    env: str = Field(description="Environment id, e.g. agentrl/calc-v0.")
    models: list[str] = Field(
        min_length=1,
        description="Checkpoint directories (transformers format) or LoRA adapter directories (peft's), "
        "evaluated in this order; the adapters of one base share one engine.",
    )
    names: list[str] | None = Field(
        None,
        description="A name per model (directory names under `out`, legend labels); default: from the paths.",
    )
    samples: int = Field(16, ge=1, description="Samples (episodes) per task: the n of pass@k.")
    ks: list[int] = Field(
        default_factory=lambda: [1, 2, 4, 8, 16], description="The k of pass@k and pass^k; each k <= samples."
    )
    split: str = Field("test", description="Task split to evaluate on.")
    tasks: int = Field(64, ge=1, description="Tasks 0..tasks-1 of the split.")
    max_turns: int | None = Field(
        None, ge=1, description="Turn limit per episode; None: the environment's registered limit."
    )
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig,
        description="Sampling and limits every model is held to (`RolloutConfig.BUDGET_FIELDS`), and the "
        "episodes in flight (`concurrency`, not part of the budget: seeds are per episode). Without "
        "`group_size`: each of the `samples` episodes of a task is its own one-episode rollout.",
    )
    seed: int = Field(0, ge=0, description="Base seed: fixes every episode's sampling and environment seed.")
    env_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides passed to agentrl.make (e.g. backend); part of the budget.",
    )
    out: str = Field("runs/eval", description="Run directory: episodes, summary, report, plots.")
    force: bool = Field(
        False, description="Discard what `out` holds for a different budget or checkpoint and start over."
    )
    progress: bool = Field(True, description="Show a progress bar with the running pass@1.")

    RENAMED: ClassVar[dict[str, str]] = {"n": "samples", "num_tasks": "tasks"}
    """Former names of fields: given one, the error says the new name (not a silent second name)."""

    @model_validator(mode="before")
    @classmethod
    def _no_former_names(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in cls.RENAMED if k in data]
            if old:
                raise ValueError("; ".join(f"'{k}' is now called '{cls.RENAMED[k]}'" for k in old))
        return data

    @field_validator("rollout", mode="before")
    @classmethod
    def _no_group_size(cls, rollout: Any) -> Any:
        given = rollout.model_fields_set if isinstance(rollout, RolloutConfig) else rollout
        if isinstance(given, dict | set) and "group_size" in given:
            raise ValueError(
                "group_size is not an evaluation setting: each episode is its own rollout; set `samples` "
                "(episodes per task) instead"
            )
        return rollout

    @field_validator("ks")
    @classmethod
    def _ks_positive(cls, ks: list[int]) -> list[int]:
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"ks must be positive integers, got {ks}")
        return ks

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if max(self.ks) > self.samples:
            raise ValueError(
                f"pass@{max(self.ks)} needs at least {max(self.ks)} samples per task but samples={self.samples}; "
                f"raise samples or drop the larger k"
            )
        if self.names is not None and len(self.names) != len(self.models):
            raise ValueError(
                f"{len(self.names)} names for {len(self.models)} models; give one name per model"
            )
        return self

    @model_validator(mode="after")
    def _env_settings(self) -> EvalConfig:
        from agentrl.env.registry import check_env_kwargs

        check_env_kwargs(self.env, self.env_kwargs)  # against the env's settings (`agentrl env show ENV`)
        return self


class EvalBudget(BaseModel):
    """What must be identical for every model compared, and across restarts of one evaluation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str = Field(description="Environment id.")
    env_kwargs: dict[str, Any] = Field(description="Overrides passed to agentrl.make.")
    split: str = Field(description="Task split.")
    num_tasks: int = Field(description="Tasks 0..num_tasks-1 of the split.")
    n: int = Field(description="Samples per task.")
    max_turns: int = Field(description="Turn limit per episode (resolved from the environment if unset).")
    seed: int = Field(description="Base seed of the per-episode seeds.")
    task_ids: list[str] = Field(description="The task list, in index order.")
    rollout: RolloutConfig = Field(description="The rollout settings; its `BUDGET_FIELDS` are the budget's.")

    def record(self) -> dict[str, Any]:
        """The budget as compared and reported: every field, the rollout's budget fields among them
        (`concurrency` and the rest of the rollout settings change no outcome)."""
        return {**self.model_dump(mode="json", exclude={"rollout"}), **self.rollout.budget()}


@dataclass(frozen=True)
class EpisodeRecord:
    """One finished episode as written to `episodes.jsonl`: its key, its seed, its trajectory."""

    task_index: int
    sample: int
    seed: int
    trajectory: Trajectory

    @property
    def key(self) -> tuple[int, int]:
        return (self.task_index, self.sample)

    def to_json(self) -> str:
        return json.dumps(
            {
                "task_index": self.task_index,
                "sample": self.sample,
                "seed": self.seed,
                "trajectory": self.trajectory.to_dict(),
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, line: str) -> EpisodeRecord:
        d = json.loads(line)
        return cls(d["task_index"], d["sample"], d["seed"], Trajectory.from_dict(d["trajectory"]))


def episode_seed(seed: int, task_index: int, sample: int) -> int:
    """The seed of episode (task_index, sample): a function of these three numbers only.

    It becomes the rollout's base seed for a one-episode call, which derives the per-turn sampling
    seeds and the environment's reset seed from it; kept below 2**31 so those stay in range.
    """
    return int(np.random.SeedSequence([seed, task_index, sample]).generate_state(1)[0]) & 0x7FFFFFFF


# --- the run directory --------------------------------------------------------------------------------


def read_episodes(path: str | Path, *, repair: bool = True) -> dict[tuple[int, int], EpisodeRecord]:
    """The finished episodes in an `episodes.jsonl`, by (task index, sample).

    A last line without its newline is what a kill mid-write leaves: it is ignored, and cut off the
    file when `repair` (so the next append starts on a fresh line). A broken line anywhere else is
    an error: the file was edited or damaged, and guessing would lose or double-count episodes.
    A duplicate key keeps the first record.
    """
    path = Path(path)
    if not path.exists():
        return {}
    data = path.read_bytes()
    good_end = len(data) if data.endswith(b"\n") or not data else data.rfind(b"\n") + 1
    records: dict[tuple[int, int], EpisodeRecord] = {}
    for lineno, line in enumerate(data[:good_end].decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = EpisodeRecord.from_json(line)
        except Exception as exc:
            raise EvalError(
                f"{path}:{lineno} is not a valid episode record ({exc}); delete that line (its episode will "
                "run again) or start over with --force"
            ) from exc
        records.setdefault(rec.key, rec)
    if good_end < len(data) and repair:
        with path.open("r+b") as f:
            f.truncate(good_end)
        print(
            f"{path}: dropped a partial last line ({len(data) - good_end} bytes; an interrupted write)",
            file=sys.stderr,
        )
    return records


_CHECKPOINT_SUFFIXES = {".safetensors", ".bin", ".pt", ".json", ".model", ".tiktoken", ".txt", ".jinja"}


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """A cheap content fingerprint of a checkpoint: names, sizes and three 1 MiB samples of each
    weight, config and tokenizer file.

    Catches a different checkpoint under a reused path (a retrained `final/`) without hashing many
    gigabytes of weights; a copied or moved checkpoint keeps its fingerprint, and so does one that
    gains a log file beside its weights.
    """
    root = Path(model_dir)
    if not root.is_dir():  # not a local directory (an engine-side id): the name is all there is
        return f"id:{model_dir}"
    h = hashlib.sha256()
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _CHECKPOINT_SUFFIXES)
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with p.open("rb") as f:
            for offset in sorted({0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))}):
                f.seek(offset)
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def model_names(paths: Sequence[str]) -> list[str]:
    """Short, distinct names for checkpoint paths: the directory name, or its last two parts if needed."""

    def clean(s: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("._") or "model"

    parts = [Path(p).resolve().parts for p in paths]
    names = [clean(p[-1]) for p in parts]
    if len(set(names)) < len(names):
        names = [clean("-".join(p[-2:])) for p in parts]
    if len(set(names)) < len(names):
        names = [f"{i}-{n}" for i, n in enumerate(names)]
    return names


def _budget_diff(recorded: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    diffs = []
    for k in sorted(set(recorded) | set(wanted)):
        a, b = recorded.get(k), wanted.get(k)
        if a != b:
            if k == "task_ids":
                diffs.append(
                    f"task list: recorded {len(a or [])} tasks, now {len(b or [])} (or different ids)"
                )
            else:
                diffs.append(f"{k}: recorded {a!r}, now {b!r}")
    return diffs


# --- planning -----------------------------------------------------------------------------------------


def _env_overrides(env_kwargs: dict[str, Any], max_turns: int | None) -> dict[str, Any]:
    kw = dict(env_kwargs)
    if max_turns is not None:
        kw["max_turns"] = max_turns
    return kw


def resolve_tasks(
    env_id: str, split: str, num_tasks: int, env_kwargs: dict[str, Any], max_turns: int | None
) -> tuple[list[Task], int]:
    """Tasks 0..num_tasks-1 of `split`, and the environment's turn limit (`max_turns` or its default)."""
    from agentrl.env.registry import make, spec, task_source

    overrides = _env_overrides(env_kwargs, max_turns)
    source = task_source(env_id, split=split, **overrides)
    size = source.size(split)  # None: a generator, unbounded
    if size is not None and size and num_tasks > size:
        raise EvalError(
            f"{env_id} has {size} {split} tasks (a fixed dataset); ask for at most that many (--tasks {size})"
        )
    tasks = [source.get(i, split) for i in range(num_tasks)]
    resolved_turns = overrides.get("max_turns") or spec(env_id).max_turns
    if resolved_turns is None:  # the environment class's own default: only an instance knows it
        env = make(env_id, **overrides)
        resolved_turns = env.max_turns
        env.close()
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise EvalError(f"{env_id} gave duplicate task ids on split {split!r}; pass@k needs distinct tasks")
    return tasks, int(resolved_turns)


def make_budget(cfg: EvalConfig) -> tuple[EvalBudget, list[Task]]:
    tasks, turns = resolve_tasks(cfg.env, cfg.split, cfg.tasks, cfg.env_kwargs, cfg.max_turns)
    budget = EvalBudget(
        env=cfg.env,
        env_kwargs=cfg.env_kwargs,
        split=cfg.split,
        num_tasks=cfg.tasks,
        n=cfg.samples,
        max_turns=turns,
        seed=cfg.seed,
        task_ids=[t.id for t in tasks],
        rollout=cfg.rollout,
    )
    return budget, tasks


# --- running ------------------------------------------------------------------------------------------


class _Progress:
    """tqdm bar over one model's episodes, with the running pass@1 (resumed episodes included)."""

    def __init__(self, name: str, total: int, done: Sequence[EpisodeRecord], enabled: bool):
        self.passed = sum(r.trajectory.reward >= 1.0 for r in done)
        self.count = len(done)
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=self.count, desc=name, unit="ep", dynamic_ncols=True)
            self._postfix()

    def _postfix(self) -> None:
        if self.bar is not None and self.count:
            self.bar.set_postfix_str(f"pass@1 {self.passed / self.count:.3f}")

    def update(self, rec: EpisodeRecord) -> None:
        self.count += 1
        self.passed += rec.trajectory.reward >= 1.0
        if self.bar is not None:
            self._postfix()
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_episodes(
    policy: Any,
    budget: EvalBudget,
    tasks: Sequence[Task],
    keys: Sequence[tuple[int, int]],
    *,
    on_episode: Callable[[EpisodeRecord], None],
) -> None:
    """Run the episodes `keys` ((task index, sample) pairs) under `budget`, `budget.rollout.concurrency`
    at a time.

    Each episode is its own one-episode rollout whose base seed is `episode_seed(...)`: what it
    samples depends on its key alone, not on which other episodes run beside it or before it.
    `on_episode` is called as each one ends, between two awaits, so it is never cut in half by a
    cancellation (SIGINT).
    """
    from agentrl.rollout.loop import collect
    from agentrl.rollout.masker import ChatMasker

    tokenizer = getattr(policy, "tokenizer", None)
    if tokenizer is None:
        raise EvalError(
            f"{type(policy).__name__} has no `tokenizer` attribute; the evaluation needs the checkpoint's "
            "tokenizer for its chat template (set policy.tokenizer = AutoTokenizer.from_pretrained(path))"
        )
    masker = ChatMasker(tokenizer)
    env_kwargs = _env_overrides(budget.env_kwargs, budget.max_turns)
    semaphore = asyncio.Semaphore(budget.rollout.concurrency)
    # Each episode is a rollout of its own (one episode of one task), whatever the settings' group size.
    one_episode = budget.rollout.model_copy(update={"group_size": 1, "concurrency": 1})

    async def one(task_index: int, sample: int) -> None:
        seed = episode_seed(budget.seed, task_index, sample)
        async with semaphore:
            # A harness episode gives one trajectory per branch; branch 0 (first) is the episode's own.
            traj, *_branches = await collect(
                budget.env,
                [tasks[task_index]],
                policy,
                one_episode,
                seed=seed,
                masker=masker,
                env_kwargs=env_kwargs,
            )
        on_episode(EpisodeRecord(task_index, sample, seed, traj))

    # A TaskGroup cancels the siblings when one fails or when the run is cancelled (SIGINT).
    async with asyncio.TaskGroup() as tg:
        for task_index, sample in keys:
            tg.create_task(one(task_index, sample))


class _Engines:
    """The default policy factory: an engine per full checkpoint, and ONE engine per base model for every
    LoRA adapter of it (vLLM's multi-LoRA), the base itself included when it is evaluated too. Each model
    gets a view whose requests carry its adapter's name; the shared engine closes with its last view, or
    at `close` (models whose episodes were all done never open a view)."""

    def __init__(self, budget: EvalBudget, seed: int, models: Sequence[str]):
        from agentrl.rollout.adapters import adapter_base, adapter_rank, is_adapter_dir

        self.budget, self.seed = budget, seed
        self.base_of: dict[str, str] = {}  # model path -> the base whose shared engine serves it
        self.rank: dict[str, int] = {}  # base -> the largest adapter rank it must serve
        for m in models:
            if is_adapter_dir(m):
                base = str(Path(adapter_base(m)).resolve())
                self.base_of[m] = base
                self.rank[base] = max(self.rank.get(base, 0), adapter_rank(m))
        for m in models:  # a full checkpoint that is some adapter's base: the same engine, no adapter
            if m not in self.base_of and str(Path(m).resolve()) in self.rank:
                self.base_of[m] = str(Path(m).resolve())
        self.users = {b: sum(1 for m in models if self.base_of.get(m) == b) for b in self.rank}
        self.open: dict[str, Any] = {}
        self.added = 0  # adapters added to the shared engines so far: each gets its own name

    def __call__(self, model_dir: str) -> Any:
        from agentrl.rollout.engine import make_policy

        base = self.base_of.get(model_dir)
        if base is None:
            return make_policy(model_dir, self.budget.rollout, seed=self.seed)
        if base not in self.open:
            self.open[base] = make_policy(
                base, self.budget.rollout, seed=self.seed, lora_rank=self.rank[base]
            )
        engine = self.open[base]
        name = None
        if str(Path(model_dir).resolve()) != base:
            self.added += 1
            name = f"adapter-{self.added}"
            engine.add_adapter(name, model_dir)
        return _AdapterView(engine, name, lambda: self._release(base))

    def _release(self, base: str) -> None:
        self.users[base] -= 1
        if self.users[base] <= 0 and base in self.open:
            self.open.pop(base).close()

    def close(self) -> None:
        for engine in self.open.values():
            engine.close()
        self.open.clear()


class _AdapterView:
    """One model of a shared multi-LoRA engine: its requests carry `adapter` (None: the base model)."""

    def __init__(self, engine: Any, adapter: str | None, on_close: Callable[[], None]):
        self.engine, self.adapter, self._on_close = engine, adapter, on_close
        self.tokenizer = engine.tokenizer

    @property
    def version(self) -> int:
        return int(self.engine.version)

    async def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        return await self.engine.generate(prompt_ids, sampling.model_copy(update={"adapter": self.adapter}))

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close, on_close = None, self._on_close
            on_close()


def _prepare_run_dir(out: Path, budget: EvalBudget, force: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / CONFIG_FILE
    wanted = budget.record()
    if cfg_path.exists():
        recorded = json.loads(cfg_path.read_text()).get("budget", {})
        diffs = _budget_diff(recorded, wanted)
        if diffs and not force:
            raise EvalError(
                f"{out} holds an evaluation with a different budget ({'; '.join(diffs)}). Mixing them would "
                "compare models under different conditions. Use a new --out, or --force to discard the "
                "episodes there and start over."
            )
        if diffs:
            _discard(out)
    cfg_path.write_text(json.dumps({"budget": wanted}, indent=2))


def _discard(out: Path) -> None:
    """--force: remove what an earlier evaluation wrote in `out` (only the files this module writes)."""
    for child in out.iterdir():
        if child.is_dir() and (child / MODEL_FILE).exists():
            shutil.rmtree(child)
    for name in (
        CONFIG_FILE,
        "summary.json",
        "report.md",
        "pass_at_k.png",
        "task_scatter.png",
        "paired_diff.png",
    ):
        (out / name).unlink(missing_ok=True)


def _check_model_dir(mdir: Path, name: str, path: str, force: bool) -> dict[str, Any]:
    info = {"path": str(Path(path).resolve()), "fingerprint": checkpoint_fingerprint(path), "wall_s": 0.0}
    meta_path = mdir / MODEL_FILE
    if meta_path.exists():
        recorded = json.loads(meta_path.read_text())
        if recorded.get("fingerprint") != info["fingerprint"]:
            if not force:
                raise EvalError(
                    f"{mdir} holds episodes of a different checkpoint under the name {name!r} "
                    f"(recorded {recorded.get('path')}, fingerprint {recorded.get('fingerprint')}; now {path}, "
                    f"{info['fingerprint']}). Give this model another name (--name), use a new --out, or "
                    "--force to discard the old episodes."
                )
            shutil.rmtree(mdir)
        else:
            info["wall_s"] = float(recorded.get("wall_s", 0.0))
    mdir.mkdir(parents=True, exist_ok=True)
    meta_path.write_text(json.dumps(info, indent=2))
    return info


def _run_model(
    name: str,
    policy: Any,
    budget: EvalBudget,
    tasks: Sequence[Task],
    missing: Sequence[tuple[int, int]],
    done: dict[tuple[int, int], EpisodeRecord],
    episodes_path: Path,
    cfg: EvalConfig,
) -> None:
    """Run one model's missing episodes, appending each to `episodes_path` (and `done`) as it ends."""
    total = budget.num_tasks * budget.n
    progress = _Progress(name, total, list(done.values()), cfg.progress)
    try:
        with episodes_path.open("a") as f:

            def write(rec: EpisodeRecord) -> None:
                f.write(rec.to_json() + "\n")
                f.flush()
                done[rec.key] = rec
                progress.update(rec)

            asyncio.run(run_episodes(policy, budget, tasks, missing, on_episode=write))
    finally:
        progress.close()
        if hasattr(policy, "close"):  # free its memory before the next model's engine starts
            policy.close()


def evaluate(
    cfg: EvalConfig,
    *,
    policy_factory: Callable[[str], Any] | None = None,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr),
) -> list[ModelSummary]:
    """Evaluate every model of `cfg` under one budget; write episodes, summary, report and plots.

    `policy_factory(model_dir)` builds a model's policy (default: a `VLLMPolicy`); one policy at a
    time, closed (if it has `close`) before the next model starts. Raises `KeyboardInterrupt` after a
    SIGINT, once the policy is closed and everything finished is on disk.
    """
    out = Path(cfg.out)
    for path in cfg.models:
        if not (Path(path) / "config.json").is_file() and not is_adapter_dir(path):
            raise EvalError(
                f"{path} is not a checkpoint directory (no config.json) nor a LoRA adapter (no "
                "adapter_config.json); give --model a directory saved with save_pretrained"
            )
    budget, tasks = make_budget(cfg)
    _prepare_run_dir(out, budget, cfg.force)
    if policy_factory is None:  # our vLLM engine: its logs go beside the results, not over the bar
        from agentrl.core.runlog import quiet_libraries

        quiet_libraries(out / "engine.log")
    engines = _Engines(budget, cfg.seed, cfg.models) if policy_factory is None else None
    try:
        per_model = _run_models(cfg, budget, tasks, policy_factory or engines, log)
    finally:
        if engines is not None:
            engines.close()
    return _summarize_models(cfg, budget, per_model, log)


def _run_models(
    cfg: EvalConfig,
    budget: EvalBudget,
    tasks: Sequence[Task],
    factory: Callable[[str], Any],
    log: Callable[[str], None],
) -> list[tuple[str, list[Trajectory], float]]:
    """Each model's missing episodes, in order; every model's episodes (all of them) with its wall time."""
    out = Path(cfg.out)
    names = cfg.names or model_names(cfg.models)
    all_keys = [(i, j) for i in range(budget.num_tasks) for j in range(budget.n)]
    r = budget.rollout
    log(
        f"eval {budget.env} ({budget.split}): {budget.num_tasks} tasks x {budget.n} samples, "
        f"temperature {r.temperature}, top_p {r.top_p}, {budget.max_turns} turns, "
        f"{r.max_tokens_per_turn} tokens/turn, {r.max_total_tokens} tokens/episode -> {out}"
    )
    per_model: list[tuple[str, list[Trajectory], float]] = []
    for name, path in zip(names, cfg.models, strict=True):
        mdir = out / name
        info = _check_model_dir(mdir, name, path, cfg.force)
        episodes_path = mdir / EPISODES_FILE
        done = read_episodes(episodes_path)
        extra = set(done) - set(all_keys)
        if extra:
            raise EvalError(
                f"{episodes_path} holds episodes outside this budget's plan, e.g. {sorted(extra)[0]}"
            )
        missing = [k for k in all_keys if k not in done]
        log(f"{name}: {len(done)} of {len(all_keys)} episodes already done, {len(missing)} to run ({path})")
        if missing:
            t0 = time.perf_counter()
            try:
                _run_model(name, factory(path), budget, tasks, missing, done, episodes_path, cfg)
            except KeyboardInterrupt:  # also while the engine starts, before any episode runs
                log(
                    f"interrupted: {len(done)} of {len(all_keys)} episodes of {name} are saved in "
                    f"{episodes_path}; run the same command again to continue"
                )
                raise
            finally:
                info["wall_s"] += time.perf_counter() - t0
                (mdir / MODEL_FILE).write_text(json.dumps(info, indent=2))
        trajs = [done[k].trajectory for k in all_keys]
        per_model.append((name, trajs, info["wall_s"]))
    return per_model


def _summarize_models(
    cfg: EvalConfig,
    budget: EvalBudget,
    per_model: list[tuple[str, list[Trajectory], float]],
    log: Callable[[str], None],
) -> list[ModelSummary]:
    """Summaries, paired comparisons (each later model against the first) and the report."""
    out = Path(cfg.out)
    names = [name for name, _, _ in per_model]
    all_keys = [(i, j) for i in range(budget.num_tasks) for j in range(budget.n)]
    summaries = [
        summarize(name, trajs, cfg.ks, wall_s=wall, seed=cfg.seed) for name, trajs, wall in per_model
    ]
    for name, trajs, _ in per_model:  # a pass@1 of 0.000 that is an agent's crash says so, with the crash
        failed = failures(trajs)
        if failed is not None and failed.most:
            log(f"warning: {name}: {failed.line(budget.env)} (episodes: {out / name / EPISODES_FILE})")
    # Same keys, same seeds: each later model against the first, episode by episode.
    base_name, base_trajs, _ = per_model[0]
    paired = [
        compare_trajectories(
            base_name,
            dict(zip(all_keys, base_trajs, strict=True)),
            name,
            dict(zip(all_keys, trajs, strict=True)),
            seed=cfg.seed,
        )
        for name, trajs, _ in per_model[1:]
    ]
    write_report(out, summaries, budget, {n: p for n, p in zip(names, cfg.models, strict=True)}, paired)
    for c in paired:
        log(c.verdict)
    return summaries


def write_report(
    out: Path,
    summaries: Sequence[ModelSummary],
    budget: EvalBudget,
    models: dict[str, str],
    paired: Sequence[PairedComparison] = (),
) -> dict[str, Path]:
    """summary.json, report.md and the plots for finished summaries."""
    budget_json = {k: v for k, v in budget.record().items() if k != "task_ids"}
    paths = {
        "summary": write_summary_json(
            summaries,
            out / "summary.json",
            env=budget.env,
            split=budget.split,
            budget=budget_json,
            task_ids=budget.task_ids,
            checkpoints={n: str(Path(p).resolve()) for n, p in models.items()},
            paired=[c.as_dict() for c in paired],
        ),
        "pass_at_k": plot_pass_at_k(
            summaries,
            out / "pass_at_k.png",
            title=f"{budget.env} ({budget.split}): pass@k, 95% bootstrap CI over tasks",
        ),
    }
    if len(summaries) >= 2:
        paths["task_scatter"] = plot_task_scatter(summaries[0], summaries[-1], out / "task_scatter.png")
    if paired:
        paths["paired_diff"] = plot_differences(paired, out / "paired_diff.png")
    md = markdown_report(summaries, env_id=budget.env, split=budget.split, budget=budget_json)
    if paired:
        md += "\n" + markdown_section(paired)
    (out / "report.md").write_text(md)
    paths["report"] = out / "report.md"
    return paths


# --- in-training evaluation ---------------------------------------------------------------------------


def default_ks(samples: int) -> list[int]:
    """1, 2, 4, ... up to `samples`, and `samples` itself."""
    return sorted({2**i for i in range(int(math.log2(samples)) + 1)} | {samples})


def evaluate_policy(
    policy: Any,
    env_id: str,
    *,
    split: str,
    num_tasks: int,
    samples: int,
    rollout: RolloutConfig,
    env_kwargs: dict[str, Any] | None = None,
    model_name: str = "policy",
    seed: int = 0,
    max_turns: int | None = None,
) -> ModelSummary:
    """Evaluate a live policy (the trainer's) in memory: pass@k for k = 1, 2, 4, ... samples.

    Sampling and limits come from `rollout` (the trainer's, at the evaluation's temperature). The task
    list and per-episode seeds are fixed by `seed` (not by the training step), so successive
    in-training evaluations are comparable.
    """
    env_kwargs = dict(env_kwargs or {})
    tasks, turns = resolve_tasks(env_id, split, num_tasks, env_kwargs, max_turns)
    budget = EvalBudget(
        env=env_id,
        env_kwargs=env_kwargs,
        split=split,
        num_tasks=num_tasks,
        n=samples,
        max_turns=turns,
        seed=seed,
        task_ids=[t.id for t in tasks],
        rollout=rollout,
    )
    records: dict[tuple[int, int], EpisodeRecord] = {}
    keys = [(i, j) for i in range(num_tasks) for j in range(samples)]
    t0 = time.perf_counter()

    def keep(rec: EpisodeRecord) -> None:
        records[rec.key] = rec

    coro = run_episodes(policy, budget, tasks, keys, on_episode=keep)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coro)
    else:  # called from inside an event loop: run ours on a thread of its own
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            ex.submit(asyncio.run, coro).result()
    trajs = [records[k].trajectory for k in keys]
    return summarize(model_name, trajs, default_ks(samples), wall_s=time.perf_counter() - t0, seed=seed)
