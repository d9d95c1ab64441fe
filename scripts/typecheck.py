"""The type checker of the quick lane: mypy over the public API (`agentrl/__init__.py`'s names and the
modules they come from; `[tool.mypy]` in pyproject.toml lists them).

mypy reads packages as folders, and ours is three folders mapped into one (`sandbox/` installs as
`agentrl.sandbox`, and so on: `[tool.setuptools] package-dir`), which an editable install serves through an
import hook no type checker follows. So the checker gets the installed layout as links, rebuilt on every run
under build/typecheck/ (new modules are seen at once), and its report names the files of this tree.

    .venv/bin/python scripts/typecheck.py          # what `make check` runs; exit 1 on any error
    .venv/bin/python scripts/typecheck.py --all    # every module of the package (not clean yet)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIEW = ROOT / "build" / "typecheck"


def installed_view(view: Path = VIEW) -> Path:
    """view/agentrl/: a link to each entry of agentrl/, plus the folders the package-dir maps in."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = view / "agentrl"
    shutil.rmtree(view, ignore_errors=True)
    package.mkdir(parents=True)
    for entry in (ROOT / mapping["agentrl"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "agentrl":
            (package / name.removeprefix("agentrl.")).symlink_to(ROOT / folder)
    return package


def tree_paths(line: str, package: Path) -> str:
    """A report line with the view's paths turned back into this tree's (`sandbox/base.py`, not the link)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in sorted(mapping.items(), key=lambda item: -len(item[0])):
        sub = name.removeprefix("agentrl").lstrip(".").replace(".", "/")
        linked = package / sub
        # mypy names a file as it found it: under MYPYPATH, relative to the working directory when inside it.
        prefixes = [linked, linked.relative_to(ROOT)] if linked.is_relative_to(ROOT) else [linked]
        for prefix in prefixes:
            line = line.replace(f"{prefix}/", f"{folder}/")
    return line


def main(argv: list[str]) -> int:
    package = installed_view()
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    if "--all" in argv:
        cmd += ["--package", "agentrl"]
    env = {**os.environ, "MYPYPATH": str(VIEW)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    for line in (proc.stdout + proc.stderr).splitlines():
        print(tree_paths(line, package))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
