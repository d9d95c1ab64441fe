"""Where an environment's tasks come from, checked at the boundary: a generator, or a fixed dataset.

`ToolEnv(tasks=...)` (and `agentrl.register(..., tasks=...)`) accepts any of:

- a **task generator**: an object with `generate(index, split) -> Task` (procedural, unbounded);
- a **list** of `Task`s or of dicts (rows);
- a **JSONL file** path (one task per line; `.json` holding a list works too);
- a Hugging Face **`datasets.Dataset`** (rows), or a **mapping of split -> any of the fixed kinds**
  (a `datasets.DatasetDict` is one: `load_dataset(...)` as it comes);
- a **zero-argument callable** returning any of the above, called on first use (so registering an
  environment never loads its data).

A fixed dataset is a finite **pool** per split. A row's split is its own `split` field (or column),
else the mapping key it came under, else `train`; task *i* of a split is the *i*-th row of that
split (wrapping around). A row may be a `Task` or a mapping: keys that are `Task` fields fill them
(`columns={"prompt": "question"}` renames columns first), every other key goes into
`task.metadata`, and a missing `id` becomes `<name>/<row>`. `to_task(row, row_index)` replaces all
of that with your own conversion.

Everything crossing this boundary is validated once, with one message naming the source, the index
and what came back: a generator that returns `None`, a dict or anything but a `Task` is an error
here (`TaskSourceError`, a `UserError`), not an `AttributeError` deep in a rollout.

    pool = TaskPool("data/tasks.jsonl")                      # or a list, or a datasets.Dataset
    pool.size("train"), pool.get(0, "train")
    as_task_source(MyGenerator()).get(7, "test")            # validated Task
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentrl.core.errors import UserError, did_you_mean, format_validation_error
from agentrl.core.task import Task
from agentrl.core.types import SPLITS, Split

_TASK_FIELDS = frozenset(Task.model_fields)


class TaskSourceError(UserError):
    """A task source handed back something that is not a task, or has no task where one was asked for."""


def _describe(value: Any) -> str:
    """`None`, `a dict (keys: id, prompt)`, `an int (3)`: what came back, for an error message."""
    if value is None:
        return "None"
    kind = type(value).__name__
    article = "an" if kind[:1].lower() in "aeiou" else "a"
    if isinstance(value, Mapping):
        keys = ", ".join(str(k) for k in list(value)[:6])
        return f"{article} {kind} (keys: {keys})" if keys else f"an empty {kind}"
    text = repr(value)
    return f"{article} {kind} ({text[:40]}{'...' if len(text) > 40 else ''})"


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


class TaskSource:
    """The uniform, validated view the environment, the curriculum and the commands use."""

    name: str = "tasks"

    def get(self, index: int, split: Split = "train") -> Task:
        """Task `index` of `split`, validated."""
        raise NotImplementedError

    def size(self, split: Split = "train") -> int | None:
        """How many tasks `split` has; None for an unbounded generator."""
        raise NotImplementedError

    def split_sizes(self) -> dict[str, int] | None:
        """Tasks per split of a fixed pool; None for a generator."""
        return None

    @property
    def finite(self) -> bool:
        return self.split_sizes() is not None


class GeneratorSource(TaskSource):
    """A procedural generator (`generate(index, split) -> Task`), its return values checked."""

    def __init__(self, generator: Any, owner: str | None = None):
        self.generator = generator
        self.name = _qualname(generator)
        self.owner = owner  # the environment it feeds, for messages

    def get(self, index: int, split: Split = "train") -> Task:
        task = self.generator.generate(index, split)
        if isinstance(task, Task):
            return task
        hint = (
            " Did a code path miss its `return`?"
            if task is None
            else " Build one with agentrl.Task(**fields)."
            if isinstance(task, Mapping)
            else ""
        )
        of = f" (environment {self.owner})" if self.owner else ""
        raise TaskSourceError(
            f"task generator {self.name}.generate({index}, {split!r}){of} returned {_describe(task)}, "
            f"not an agentrl.Task.{hint}"
        )

    def size(self, split: Split = "train") -> int | None:
        return None


class TaskPool(TaskSource):
    """A fixed dataset: a list of tasks or rows, a JSONL file, a `datasets.Dataset`, or a mapping of
    split -> any of these (see the module docstring for how rows become tasks)."""

    def __init__(
        self,
        data: Any,
        *,
        name: str | None = None,
        columns: Mapping[str, str] | None = None,
        to_task: Callable[[Any, int], Task] | None = None,
    ):
        self._data = data
        self.columns = dict(columns or {})
        self.to_task = to_task
        self.name = name or _pool_name(data)
        self._loaded = False
        self._parts: list[tuple[Any, Split | None]] = []  # (rows, split the mapping key gives them)
        self._by_split: dict[str, list[tuple[int, int]]] = {}  # split -> [(part, row)]
        self._cache: dict[tuple[int, int], Task] = {}

    # -- loading -------------------------------------------------------------------------------
    def _load(self) -> None:
        if self._loaded:
            return
        data = self._data
        if isinstance(data, Mapping) and not _is_dataset(data):
            unknown = [k for k in data if k not in SPLITS]
            if unknown:
                raise TaskSourceError(
                    f"tasks for {self.name}: a mapping of tasks must be keyed by split ({', '.join(SPLITS)}); "
                    f"got {unknown[0]!r}.{did_you_mean(str(unknown[0]), SPLITS)}"
                )
            self._parts = [(_rows(v, self.name), k) for k, v in data.items()]
        else:
            self._parts = [(_rows(data, self.name), None)]
        self._by_split = {}
        for p, (rows, key_split) in enumerate(self._parts):
            for r, split in enumerate(self._row_splits(rows, key_split)):
                self._by_split.setdefault(split, []).append((p, r))
        self._loaded = True

    def _row_splits(self, rows: Any, key_split: Split | None) -> list[str]:
        default = key_split or "train"
        split_col = self.columns.get("split", "split")
        if _is_dataset(rows):
            if split_col in rows.column_names:
                return [str(s) if s else default for s in rows[split_col]]
            return [default] * len(rows)
        out: list[str] = []
        for row in rows:
            if isinstance(row, Task):
                out.append(row.split if key_split is None else key_split)
            elif isinstance(row, Mapping) and row.get(split_col):
                out.append(str(row[split_col]))
            else:
                out.append(default)
        return out

    # -- TaskSource -----------------------------------------------------------------------------
    def split_sizes(self) -> dict[str, int]:
        self._load()
        return {s: len(v) for s, v in self._by_split.items()}

    def size(self, split: Split = "train") -> int:
        self._load()
        return len(self._by_split.get(split, ()))

    def get(self, index: int, split: Split = "train") -> Task:
        self._load()
        members = self._by_split.get(split)
        if not members:
            sizes = self.split_sizes()
            if not sizes:
                raise TaskSourceError(f"the task list of {self.name} is empty: it has no tasks to run")
            have = ", ".join(f"{n} {s}" for s, n in sizes.items())
            raise TaskSourceError(
                f"{self.name} has no {split} tasks (it has {have}); use a split it has, or give tasks "
                f'"split": "{split}" (a field of each task, or the key of a mapping of split -> tasks)'
            )
        key = members[index % len(members)]
        if key not in self._cache:
            part, row_index = key
            rows, key_split = self._parts[part]
            self._cache[key] = self._convert(rows[row_index], row_index, key_split, part)
        return self._cache[key]

    def _convert(self, row: Any, row_index: int, key_split: Split | None, part: int) -> Task:
        where = f"row {row_index} of {self.name}" + (f" ({key_split})" if key_split else "")
        if self.to_task is not None:
            task = self.to_task(row, row_index)
            if not isinstance(task, Task):
                raise TaskSourceError(f"to_task({where}) returned {_describe(task)}, not an agentrl.Task")
            return task
        if isinstance(row, Task):
            return (
                row
                if key_split is None or row.split == key_split
                else row.model_copy(update={"split": key_split})
            )
        if not isinstance(row, Mapping):
            raise TaskSourceError(
                f"{where} is {_describe(row)}, not a task: give Task objects or mappings with at least "
                "'prompt' (and 'answer' for answer-checking verifiers)"
            )
        fields: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        renamed = {src: dst for dst, src in self.columns.items()}
        for key, value in row.items():
            field = renamed.get(key, key)
            if field == "metadata" and isinstance(value, Mapping):
                metadata.update(value)
            elif field in _TASK_FIELDS:
                fields[field] = value
            else:
                metadata[str(key)] = value
        if key_split and not fields.get("split"):
            fields["split"] = key_split
        if not fields.get("split"):
            fields.pop("split", None)
        if fields.get("id") is None:
            prefix = f"{self.name}/{key_split}" if key_split and len(self._parts) > 1 else self.name
            fields["id"] = f"{prefix}/{row_index}"
        if "answer" in fields and fields["answer"] is not None and not isinstance(fields["answer"], str):
            fields["answer"] = str(fields["answer"])  # numeric answers in datasets are common
        if metadata:
            fields["metadata"] = metadata
        from pydantic import ValidationError

        try:
            return Task.model_validate(fields)
        except ValidationError as exc:
            raise TaskSourceError(f"{where}: " + format_validation_error(exc, Task, what="task")) from None

    def __len__(self) -> int:
        return sum(self.split_sizes().values())


class _LazySource(TaskSource):
    """A zero-argument callable, called on first use; its result is normalized like `tasks=`."""

    def __init__(self, factory: Callable[[], Any], name: str | None = None):
        self.factory = factory
        self.name = name or str(getattr(factory, "__qualname__", "tasks"))
        self._source: TaskSource | None = None

    @property
    def source(self) -> TaskSource:
        if self._source is None:
            made = self.factory()
            if callable(made) and not hasattr(made, "generate") and not _is_dataset(made):
                raise TaskSourceError(
                    f"the tasks factory {self.name}() returned another callable; return the tasks"
                )
            self._source = as_task_source(made, name=self.name)
        return self._source

    def get(self, index: int, split: Split = "train") -> Task:
        return self.source.get(index, split)

    def size(self, split: Split = "train") -> int | None:
        return self.source.size(split)

    def split_sizes(self) -> dict[str, int] | None:
        return self.source.split_sizes()


def _is_dataset(obj: Any) -> bool:
    """A Hugging Face `datasets.Dataset` (duck-typed: no import of `datasets` needed to check)."""
    return hasattr(obj, "column_names") and hasattr(obj, "features") and hasattr(obj, "__getitem__")


def _pool_name(data: Any) -> str:
    if isinstance(data, str | os.PathLike):
        return str(data)
    if _is_dataset(data):
        info = getattr(data, "info", None)
        return getattr(info, "dataset_name", None) or "dataset"
    return "tasks"


def _rows(data: Any, name: str) -> Any:
    """The rows of one fixed part: a list or a `datasets.Dataset`."""
    if isinstance(data, str | os.PathLike):
        return _read_file(Path(data))
    if _is_dataset(data):
        return data
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        return list(data)
    raise TaskSourceError(
        f"tasks for {name}: expected a task generator, a list of tasks, a JSONL path, a datasets.Dataset "
        f"or a mapping of split -> tasks; got {_describe(data)}"
    )


def _read_file(path: Path) -> list[Any]:
    if not path.exists():
        raise TaskSourceError(f"task file {path}: no such file")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            rows = json.loads(text)
        except ValueError as exc:
            raise TaskSourceError(f"task file {path} is not valid JSON ({exc})") from None
        if not isinstance(rows, list):
            raise TaskSourceError(f"task file {path} must hold a JSON list of tasks, got {_describe(rows)}")
        return rows
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError as exc:
            raise TaskSourceError(
                f"{path}:{lineno} is not a JSON object ({exc}); one task per line"
            ) from None
    return rows


def as_task_source(tasks: Any, name: str | None = None) -> TaskSource:
    """Normalize anything `ToolEnv(tasks=...)` accepts into a `TaskSource` (see the module docstring)."""
    if isinstance(tasks, TaskSource):
        return tasks
    if callable(getattr(tasks, "generate", None)):
        return GeneratorSource(tasks, name)
    if isinstance(tasks, str | os.PathLike) or _is_dataset(tasks) or isinstance(tasks, Mapping):
        return TaskPool(tasks, name=name if not isinstance(tasks, str | os.PathLike) else None)
    if isinstance(tasks, Sequence) and not isinstance(tasks, bytes):
        return TaskPool(tasks, name=name)
    if callable(tasks):
        return _LazySource(tasks, name)
    raise TaskSourceError(
        f"tasks{f' for {name}' if name else ''}: expected a task generator (an object with "
        "generate(index, split)), a list of tasks, a JSONL path, a datasets.Dataset, a mapping of "
        f"split -> tasks, or a zero-argument callable returning one; got {_describe(tasks)}"
    )


def coerce_task(value: Any, where: str = "options['task']") -> Task:
    """A task handed in directly (`reset(options={"task": ...})`): a Task, or a mapping of its fields."""
    if isinstance(value, Task):
        return value
    if isinstance(value, Mapping):
        from pydantic import ValidationError

        try:
            return Task.model_validate(value)
        except ValidationError as exc:
            raise TaskSourceError(f"{where}: " + format_validation_error(exc, Task, what="task")) from None
    raise TaskSourceError(f"{where} is {_describe(value)}, not an agentrl.Task")
