"""SWE-bench-style instances (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym rows) read as `Task`s.

A row has `instance_id`, `repo`, `base_commit`, `problem_statement`, `patch` (the fix, never shown),
`test_patch` (the tests that judge it, applied only at verification), `FAIL_TO_PASS` and
`PASS_TO_PASS` (pytest node ids relative to the repository's root; a list, or a JSON string of one
as the SWE-bench datasets have them). Its image is, in this order:

1. a build context `<images_dir>/<instance_id>/Dockerfile` (the recipe `agentrl tasks export`
   writes: the repository at base_commit in /testbed), built and cached per recipe;
2. the row's `image_name` (SWE-Gym, SWE-smith), `docker_image` or `image`;
3. SWE-bench's own name, `swebench/sweb.eval.x86_64.<instance_id with __ as _1776_>:latest`.

Whichever it is, agentrl's layer goes on top (checkout of base_commit, the history pruned to it,
the agent's user, /verifier). A name that is neither on this engine nor pullable is an error that
says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.core.types import SPLITS

REQUIRED = ("instance_id", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")
REPO_DIR = "/testbed"
VERIFIER_HINTS = ("FAIL_TO_PASS_LINES", "FAIL_TO_PASS_ERRORS", "FAIL_TO_PASS_VALUES", "TWIN_SITES")
"""Optional row keys passed on to the hidden-tests verifier (where each failing test fails on the base)."""


class InstanceError(UserError):
    """A row that is not a usable SWE-bench-style instance (one line: which, and what is missing)."""


def _ids(value: Any, what: str) -> list[str]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise InstanceError(f"{what} is a string but not a JSON list of test ids") from None
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise InstanceError(f"{what} must be a list of pytest node ids")
    return list(value)


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl" / "swebench"


def read_rows(source: Any) -> list[Mapping[str, Any]]:
    """Rows from a JSONL path, a list of mappings, or a `datasets.Dataset` (a split)."""
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.is_file():
            raise InstanceError(f"SWE-bench instances {path}: no such file")
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise InstanceError(f"{path}:{n} is not a JSON object ({exc})") from None
        return rows
    if hasattr(source, "column_names") and hasattr(source, "__getitem__"):  # a datasets.Dataset
        return [source[i] for i in range(len(source))]
    if isinstance(source, Iterable):
        return list(source)
    raise InstanceError(
        f"SWE-bench instances: expected a JSONL path, rows or a datasets.Dataset, got {type(source).__name__}"
    )


def instance_task(row: Mapping[str, Any], *, images_dir: Path | None = None, where: str = "") -> Task:
    """One row as a `Task` (the image and the hidden tests are made by the environment)."""
    missing = [k for k in REQUIRED if k not in row]
    iid = str(row.get("instance_id", "?"))
    if missing:
        raise InstanceError(f"instance {iid}{where}: missing {', '.join(missing)}")
    f2p = _ids(row["FAIL_TO_PASS"], f"instance {iid}: FAIL_TO_PASS")
    p2p = _ids(row["PASS_TO_PASS"], f"instance {iid}: PASS_TO_PASS")
    bad = [t for t in [*f2p, *p2p] if "::" not in t]
    if bad:
        raise InstanceError(
            f"instance {iid}: {bad[0]!r} is not a pytest node id (path::test); only pytest suites can be run "
            "as hidden tests"
        )
    context = images_dir / iid if images_dir is not None else None
    split = row.get("split") or "test"
    if split not in SPLITS:
        raise InstanceError(f"instance {iid}: split {split!r} is not one of {', '.join(SPLITS)}")
    image = row.get("image_name") or row.get("docker_image") or row.get("image")
    if not image and not (context is not None and (context / "Dockerfile").is_file()):
        image = f"swebench/sweb.eval.x86_64.{iid.replace('__', '_1776_').lower()}:latest"
    digest = hashlib.sha256(f"{row['base_commit']}\0{row['test_patch']}".encode()).hexdigest()[:12]
    statement = str(row["problem_statement"]).strip()
    return Task(
        id=f"swebench/{iid}",
        prompt=(
            f"{statement}\n\nThe repository ({row.get('repo', iid)}) is checked out in {REPO_DIR}. Change its "
            "source so that the issue above is resolved, without breaking anything else, then call `submit`."
        ),
        image=str(image or f"swebench-context:{iid}"),
        hidden_tests=str(cache_root() / "tests" / f"{iid}-{digest}"),
        split=split,
        metadata={
            "instance_id": iid,
            "repo": row.get("repo"),
            "base_commit": str(row["base_commit"]),
            "patch": row.get("patch") or "",
            "test_patch": str(row["test_patch"]),
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            "image_context": str(context)
            if context is not None and (context / "Dockerfile").is_file()
            else None,
            "image_name": image or None,
            # What the hidden-tests verifier reads about the failing tests, where a row has it.
            **{k: row[k] for k in VERIFIER_HINTS if row.get(k)},
        },
    )


def patch_files(patch: str) -> list[tuple[str | None, str | None]]:
    """(old path, new path) of every file a unified diff touches (None: /dev/null). Git's headers
    first: an empty new file has no ---/+++ lines."""
    out: list[tuple[str | None, str | None]] = []
    block: dict[str, Any] | None = None

    def close() -> None:
        if block is not None:
            out.append((None if block["new"] else block["a"], None if block["deleted"] else block["b"]))

    for line in patch.splitlines():
        if line.startswith("diff --git "):
            close()
            m = re.match(r"diff --git a/(.+) b/(.+)$", line)
            block = {"a": m.group(1), "b": m.group(2), "new": False, "deleted": False} if m else None
        elif block is not None and (line.startswith("new file mode") or line.strip() == "--- /dev/null"):
            block["new"] = True
        elif block is not None and (line.startswith("deleted file mode") or line.strip() == "+++ /dev/null"):
            block["deleted"] = True
        elif block is None and line.startswith("--- "):
            p = line[4:].split("\t")[0].strip()
            old = None if p == "/dev/null" else p.removeprefix("a/")
        elif block is None and line.startswith("+++ "):
            p = line[4:].split("\t")[0].strip()
            out.append((old, None if p == "/dev/null" else p.removeprefix("b/")))
    close()
    return out
