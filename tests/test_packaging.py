"""The distribution: built as a wheel, installed into a clean venv, the mapped subpackages import."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAPPED = {
    "agentrl": "agentrl",
    "agentrl.sandbox": "sandbox",
    "agentrl.verifiers": "verifiers",
    "agentrl.envs": "envs",
}


def test_every_package_folder_is_listed_in_pyproject():
    """`packages` is listed by hand (discovery ignores package-dir); a forgotten subfolder would vanish from the wheel."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"] == MAPPED
    expected = set()
    for name, folder in MAPPED.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            expected.add(".".join([name, *rel.parts]))
    assert expected == set(conf["packages"])


def test_editable_install_resolves_mapped_folders():
    import agentrl
    import agentrl.envs
    import agentrl.sandbox
    import agentrl.verifiers

    assert Path(agentrl.__file__).parent == ROOT / "agentrl"
    assert Path(agentrl.sandbox.__file__).parent == ROOT / "sandbox"
    assert Path(agentrl.verifiers.__file__).parent == ROOT / "verifiers"
    assert Path(agentrl.envs.__file__).parent == ROOT / "envs"


def test_bare_folder_names_are_not_importable_as_ours():
    """`sandbox`, `verifiers`, `envs` are other projects' names on PyPI; we must never shadow them."""
    for init in (ROOT / "agentrl").rglob("*.py"):
        tree = ast.parse(init.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                assert node.module.split(".")[0] not in {"sandbox", "verifiers", "envs"}, (
                    f"{init}: {node.module}"
                )


@pytest.mark.slow
def test_wheel_installs_and_imports_in_a_clean_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(ROOT)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    wheels = list(dist.glob("agentrl-*.whl"))
    assert len(wheels) == 1
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    py = env_dir / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[0])], check=True)
    # Dependencies come from the test venv's site-packages as a plain path: a path line in a
    # .pth file adds the folder but does not run the .pth files inside it, so the editable
    # install of agentrl there stays inactive and only the wheel can answer `import agentrl`.
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import agentrl, agentrl.sandbox, agentrl.verifiers, agentrl.envs, agentrl.cli, agentrl.sandbox.images;"
        "from agentrl.sandbox import open_sandbox, Limits;"
        "import pathlib, sys;"
        "mods=[agentrl, agentrl.sandbox, agentrl.verifiers, agentrl.envs];"
        "print('\\n'.join(str(pathlib.Path(m.__file__)) for m in mods))"
    )
    out = subprocess.run(
        [py, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    ).stdout.split()
    assert len(out) == 4
    for path in out:
        assert path.startswith(site), f"{path} not from the wheel's install in {site}"
    # The console script is installed too.
    assert (env_dir / "bin" / "agentrl").exists()
