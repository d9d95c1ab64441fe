"""The quick lane's type checker: it covers the public API, sees the installed layout, and types the facade."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import typecheck  # noqa: E402  (scripts/typecheck.py)


def facade() -> tuple[dict[str, str], dict[str, str], list[str]]:
    """agentrl/__init__.py's lazy names (name -> module), its TYPE_CHECKING imports, and its __all__."""
    tree = ast.parse((ROOT / "agentrl" / "__init__.py").read_text())
    lazy: dict[str, str] = {}
    typed: dict[str, str] = {}
    exported: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "_LAZY":
            lazy = ast.literal_eval(node.value)
        elif isinstance(node, ast.Assign) and [getattr(t, "id", "") for t in node.targets] == ["__all__"]:
            exported = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                typed |= {alias.name: imp.module for alias in imp.names}
    return lazy, typed, exported


def test_the_facade_declares_its_lazy_names_to_type_checkers():
    """Every name `import agentrl` serves lazily is imported under TYPE_CHECKING from the same module and
    listed in __all__, so `agentrl.make(...)` has a type where users (and the checker) read it."""
    lazy, typed, exported = facade()
    assert lazy and typed == lazy
    assert sorted(exported) == sorted(lazy)


def test_the_checker_covers_every_module_of_the_public_api():
    lazy, _, _ = facade()
    checked = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["modules"])
    missing = sorted(set(lazy.values()) - checked)
    assert not missing, (
        f"modules of agentrl's public names the type checker skips ([tool.mypy] modules): {missing}"
    )


def test_the_checker_sees_the_installed_layout_and_reports_this_trees_paths(tmp_path):
    package = typecheck.installed_view(tmp_path / "view")
    assert (package / "sandbox").resolve() == ROOT / "sandbox"
    assert (package / "env" / "tool_env.py").resolve() == ROOT / "agentrl" / "env" / "tool_env.py"
    line = f"{package}/sandbox/base.py:1: error: x  [misc]"
    assert typecheck.tree_paths(line, package) == "sandbox/base.py:1: error: x  [misc]"
    default = typecheck.VIEW / "agentrl"
    relative = f"{default.relative_to(ROOT)}/verifiers/base.py:2: note: y"  # how mypy names them: relative
    assert typecheck.tree_paths(relative, default) == "verifiers/base.py:2: note: y"
    assert (
        typecheck.tree_paths(f"{package}/env/tool_env.py:3: error: z", package)
        == "agentrl/env/tool_env.py:3: error: z"
    )


@pytest.mark.slow
def test_the_checker_types_the_facade_and_finds_a_planted_error(tmp_path):
    """mypy through the view: a user's `agentrl.make(...)` is an AgentEnv, not Any (so a wrong use fails)."""
    view = tmp_path / "view"
    typecheck.installed_view(view)
    user = tmp_path / "user.py"
    user.write_text("import agentrl\n\nenv: int = agentrl.make('agentrl/calc-v0')\n")
    cache = ["--cache-dir", str(tmp_path / "cache")]
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *cache, str(user)]
    env = {**os.environ, "MYPYPATH": str(view)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        'Incompatible types in assignment (expression has type "AgentEnv", variable has type "int")'
        in out.stdout
    )


def test_pre_commit_runs_the_quick_lanes_linters():
    """The hooks are the commands `make check` lints with (the Makefile's LINT), on the project's venv."""
    import yaml

    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = [hook["entry"] for repo in config["repos"] for hook in repo["hooks"]]
    lint = next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith("LINT ="))
    for command in lint.removeprefix("LINT =").split("&&"):
        program = " ".join(
            command.split()[:2]
        )  # `.venv/bin/ruff check`, `.venv/bin/python scripts/typecheck.py`
        assert any(entry.startswith(program) for entry in entries), f"no hook runs {program!r}"
    assert all(hook["language"] == "system" for repo in config["repos"] for hook in repo["hooks"])
