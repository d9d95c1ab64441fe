"""`Task`: one problem an environment poses, and the helpers that generate and store task sets.

A task says what the agent sees (prompt, workspace files, set-up commands, image) and what
the verifier checks against (answer, state check, hidden tests). The hidden tests are only a
*reference* (a host path): they are never placed in the workspace, and verifiers copy them in
only after the agent's last action.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from agentrl.core.types import Split

DEFAULT_IMAGE = "agentrl/base:bookworm"
"""The sandbox image a task runs in unless it names another (and a sandbox's, unless asked for another)."""


class Task(BaseModel):
    """One problem: what the agent gets, and what its verifier checks against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Unique, stable id, e.g. 'calc/train/17'.")
    prompt: str = Field(description="The user's request, shown as the first user message.")
    files: dict[str, str] = Field(
        default_factory=dict, description="Workspace files (relative path -> text) placed at reset."
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell commands run in the workspace, as the agent user, after the files are placed.",
    )
    image: str = Field(DEFAULT_IMAGE, description="Sandbox image the task runs in.")
    hidden_tests: str | None = Field(
        None,
        description="Host path of the hidden tests (file or folder). Never inside the workspace; copied in after the episode.",
    )
    answer: str | None = Field(
        None, description="Reference answer for answer-checking verifiers (exact-match, numeric, regex)."
    )
    check_command: str | None = Field(
        None,
        description="For the `state` verifier: a command run after the episode whose output must equal `answer`.",
    )
    split: Split = Field(
        "train", description="train, validation or test; generators never share a problem across splits."
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="Generator facts (kind, difficulty, ...) for reports and oracles, and per-task verifier inputs such as FAIL_TO_PASS / PASS_TO_PASS.",
    )


class TaskGenerator(Protocol):
    """Procedural, unbounded task supply: task `index` of `split` is a pure function of (seed, split, index)."""

    def generate(self, index: int, split: Split = "train") -> Task: ...


def split_rng_seed(seed: int, split: Split, index: int) -> int:
    """A 63-bit seed for one task: disjoint streams per split, stable across Python versions (no `hash()`)."""
    digest = hashlib.sha256(f"{seed}/{split}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def save_tasks(path: str | Path, tasks: Iterable[Task]) -> int:
    """Write tasks as JSONL (one task per line); returns how many were written."""
    n = 0
    with open(path, "w") as f:
        for task in tasks:
            f.write(task.model_dump_json() + "\n")
            n += 1
    return n


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file; a bad line is reported with its number, not skipped."""
    return list(iter_tasks(path))


def iter_tasks(path: str | Path) -> Iterator[Task]:
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Task.model_validate(json.loads(line))
            except Exception as exc:
                raise ValueError(f"{path}:{lineno}: not a valid Task ({exc})") from exc
