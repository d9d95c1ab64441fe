"""`agentrl tasks export`: our tasks in the field's formats, so other harnesses run them.

    export_harbor(tasks, "out/harbor")        # one Harbor task directory per task
    export_swebench(tasks, "out/swe")         # out/swe/instances.jsonl + out/swe/images/<instance_id>/

Any task with hidden tests exports: its workspace (python-repair: the package's source with the
mutant module; otherwise `task.files`) becomes the image's working directory, its hidden tests the
verifier, FAIL_TO_PASS + PASS_TO_PASS the tests that must pass. A task whose fixed state is known
(python-repair: the original function) gets a solution (Harbor's solution/solve.sh, SWE-bench's
`patch`); others export without one.

The images' recipe (documented in docs/ENVIRONMENTS.md): `FROM debian:bookworm-slim`, Debian's
python3, python3-pytest (and git for SWE-bench rows), the workspace copied in (/workspace for Harbor,
/testbed as a git repository with one commit, base_commit, for SWE-bench). Offline, agentrl's FROM
mapping builds them on agentrl/base:bookworm; elsewhere they build as written.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.envs.swebench.instances import VERIFIER_HINTS

HARBOR_DOCKERFILE = """\
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pytest \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /workspace
COPY workspace/ /workspace/
"""

SWE_DOCKERFILE = """\
FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pytest git \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /testbed
COPY repo/ /testbed/
"""

TEST_SH = """\
#!/bin/bash
# The task's hidden tests (FAIL_TO_PASS + PASS_TO_PASS, listed in agentrl_tests.json) against the
# workspace: reward 1 when every one passes, else 0.
mkdir -p /logs/verifier
cd /tests
PYTHONPATH={workdir} PYTHONDONTWRITEBYTECODE=1 python3 -c '
import json, sys
import pytest
ids = json.load(open("/tests/agentrl_tests.json"))
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir=/tests", *ids]))
' > /logs/verifier/pytest.txt 2>&1
status=$?
tail -n 20 /logs/verifier/pytest.txt
if [ "$status" -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""

SOLVE_SH = """\
#!/bin/bash
# The reference fix: the fixed files written over the workspace's.
set -e
python3 - <<'PY'
import base64, json
for path, data in json.loads(base64.b64decode("{payload}")).items():
    with open(path, "w", encoding="utf-8") as f:
        f.write(data)
PY
"""

# Fixed author, committer and dates: the same workspace gives the same base_commit on every export.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "agentrl",
    "GIT_AUTHOR_EMAIL": "agentrl@localhost",
    "GIT_COMMITTER_NAME": "agentrl",
    "GIT_COMMITTER_EMAIL": "agentrl@localhost",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}


class ExportError(UserError):
    """A task that cannot be written in the asked format (one line: which, and why)."""


def workspace_files(task: Task) -> dict[str, bytes]:
    """The task's starting workspace, path -> bytes."""
    files: dict[str, bytes] = {}
    if "package" in task.metadata and "source_dir" in task.metadata:  # python-repair: the source + mutant
        from agentrl.envs.python_repair.packages import get_spec, unpacked

        src = unpacked(get_spec(task.metadata["package"])) / "source"
        for p in sorted(src.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                files[str(p.relative_to(src))] = p.read_bytes()
    elif task.setup:
        raise ExportError(f"task {task.id} has set-up commands; only tasks whose workspace is files export")
    for rel, text in task.files.items():
        files[rel] = text.encode()
    return files


def fixed_files(task: Task) -> dict[str, str] | None:
    """The files the reference fix changes, path -> text; None when no fix is known."""
    m = task.metadata
    if {"module", "mutated_function", "original_function"} <= set(m) and m["module"] in task.files:
        module = task.files[m["module"]]
        if m["mutated_function"] not in module:
            raise ExportError(f"task {task.id}: the mutated function is not in its module")
        return {m["module"]: module.replace(m["mutated_function"], m["original_function"], 1)}
    return None


def _lists(task: Task) -> tuple[list[str], list[str]]:
    f2p, p2p = task.metadata.get("FAIL_TO_PASS") or [], task.metadata.get("PASS_TO_PASS") or []
    f2p = json.loads(f2p) if isinstance(f2p, str) else list(f2p)
    p2p = json.loads(p2p) if isinstance(p2p, str) else list(p2p)
    return f2p, p2p


def _hidden(task: Task) -> Path:
    if not task.hidden_tests or not Path(task.hidden_tests).is_dir():
        raise ExportError(
            f"task {task.id} has no hidden tests folder to export (hidden_tests={task.hidden_tests})"
        )
    return Path(task.hidden_tests)


def slug(task_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", task_id).strip("-.")


def _write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        target = (root / rel).resolve()
        if not str(target).startswith(str(root.resolve()) + os.sep):
            raise ExportError(f"a workspace file outside the workspace: {rel}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def export_harbor(tasks: Iterable[Task], out: str | Path, *, source_env: str = "") -> list[Path]:
    """Write each task as a Harbor task directory under `out`; returns them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for task in tasks:
        hidden = _hidden(task)
        f2p, p2p = _lists(task)
        d = out / slug(task.id)
        if d.exists():
            shutil.rmtree(d)
        (d / "environment").mkdir(parents=True)
        (d / "environment" / "Dockerfile").write_text(HARBOR_DOCKERFILE)
        _write_files(d / "environment" / "workspace", workspace_files(task))
        (d / "instruction.md").write_text(task.prompt.rstrip() + "\n")
        shutil.copytree(hidden, d / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        ids = list(dict.fromkeys([*f2p, *p2p]))
        if not ids:
            raise ExportError(f"task {task.id} lists no FAIL_TO_PASS or PASS_TO_PASS tests")
        (d / "tests" / "agentrl_tests.json").write_text(json.dumps(ids, indent=0) + "\n")
        (d / "tests" / "test.sh").write_text(TEST_SH.replace("{workdir}", "/workspace"))
        (d / "tests" / "test.sh").chmod(0o755)
        fixed = fixed_files(task)
        if fixed is not None:
            (d / "solution").mkdir()
            payload = base64.b64encode(json.dumps({f"/workspace/{k}": v for k, v in fixed.items()}).encode())
            (d / "solution" / "solve.sh").write_text(SOLVE_SH.replace("{payload}", payload.decode()))
            (d / "solution" / "solve.sh").chmod(0o755)
        verifier_timeout = 120.0
        vt = task.metadata.get("test_seconds")
        if isinstance(vt, int | float):
            verifier_timeout = max(verifier_timeout, 10 * float(vt))
        meta = {
            "agentrl_task_id": task.id,
            "source_env": source_env,
            "split": task.split,
            "FAIL_TO_PASS": f2p,
            "PASS_TO_PASS": p2p,
            **{
                k: task.metadata[k]
                for k in ("package", "version", "module", "function", "kind")
                if k in task.metadata
            },
        }
        lines = ['version = "1.0"', f"split = {_toml_str(task.split)}", "", "[metadata]"]
        for k, v in meta.items():
            lines.append(f"{k} = {json.dumps(v)}")
        lines += [
            "",
            "[verifier]",
            f"timeout_sec = {verifier_timeout}",
            "",
            "[agent]",
            "timeout_sec = 1800.0",
            "",
            "[environment]",
            "build_timeout_sec = 900.0",
            "cpus = 1",
            "memory_mb = 2048",
            "",
        ]
        (d / "task.toml").write_text("\n".join(lines))
        written.append(d)
    return written


def _git(repo: Path, *args: str, check: bool = True) -> str:
    try:
        res = subprocess.run(
            ["git", "-c", "core.autocrlf=false", *args],
            cwd=repo,
            capture_output=True,
            text=True,
            env={**os.environ, **_GIT_ENV},
            timeout=120,
        )
    except FileNotFoundError:
        raise ExportError(
            "exporting SWE-bench instances needs git on this machine (apt-get install git)"
        ) from None
    if check and res.returncode != 0:
        raise ExportError(f"git {' '.join(args)} failed: {res.stderr.strip()[:300]}")
    return res.stdout


def export_swebench(tasks: Iterable[Task], out: str | Path, *, source_env: str = "") -> Path:
    """Write the tasks as SWE-bench-style rows (`out/instances.jsonl`) and each one's image recipe
    (`out/images/<instance_id>/`: the Dockerfile and the repository at base_commit); returns the JSONL."""
    out = Path(out)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    rows = []
    for task in tasks:
        hidden = _hidden(task)
        f2p, p2p = _lists(task)
        iid = "agentrl__" + slug(task.id.removeprefix("python-repair/").replace("/", "-"))
        ctx = images / iid
        if ctx.exists():
            shutil.rmtree(ctx)
        repo = ctx / "repo"
        repo.mkdir(parents=True)
        (ctx / "Dockerfile").write_text(SWE_DOCKERFILE)
        _write_files(repo, workspace_files(task))
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "base")
        base = _git(repo, "rev-parse", "HEAD").strip()
        patch = ""
        fixed = fixed_files(task)
        with tempfile.TemporaryDirectory(prefix="agentrl-export-") as tmp:
            # The diffs are made in a copy, so no object of the fix or the tests is ever in the repository.
            scratch = Path(tmp, "repo")
            shutil.copytree(repo, scratch)
            if fixed is not None:
                for rel, text in fixed.items():
                    (scratch / rel).write_text(text)
                patch = _git(scratch, "diff", "--no-color", "--no-ext-diff")
                _git(scratch, "checkout", "-q", "--", ".")
            for p in sorted(hidden.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts:
                    target = scratch / p.relative_to(hidden)
                    if target.exists():
                        raise ExportError(
                            f"task {task.id}: hidden test {target.name} would overwrite a workspace file"
                        )
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(p, target)
            _git(scratch, "add", "-A", "-N")
            test_patch = _git(scratch, "diff", "--no-color", "--no-ext-diff")
        rows.append(
            {
                "instance_id": iid,
                "repo": f"agentrl/{task.metadata.get('package', 'tasks')}",
                "base_commit": base,
                "problem_statement": task.prompt.replace("/workspace", "/testbed"),
                "patch": patch,
                "test_patch": test_patch,
                "FAIL_TO_PASS": json.dumps(f2p),
                "PASS_TO_PASS": json.dumps(p2p),
                "version": str(task.metadata.get("version", "")),
                "environment_setup_commit": base,
                "hints_text": "",
                "created_at": "2024-01-01T00:00:00Z",
                "split": task.split,
                "agentrl_task_id": task.id,
                "source_env": source_env,
                **{k: task.metadata[k] for k in VERIFIER_HINTS if task.metadata.get(k)},
            }
        )
    path = out / "instances.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
