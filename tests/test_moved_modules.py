"""A module path that moved fails in one line naming where the module is now; there is one way to each."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import agentrl


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("agentrl.task", "agentrl.core.task"),
        ("agentrl.registry", "agentrl.env.registry"),
        ("agentrl.mcp", "agentrl.env.mcp"),
        ("agentrl.policy", "agentrl.rollout.policy"),
    ],
)
def test_an_old_module_path_says_where_the_module_went(old, new):
    out = subprocess.run([sys.executable, "-c", f"import {old}"], capture_output=True, text=True, timeout=120)
    under = subprocess.run(
        [sys.executable, "-c", f"import {old}.x"], capture_output=True, text=True, timeout=120
    )
    assert under.stderr.strip().splitlines()[-1] == out.stderr.strip().splitlines()[-1]  # said of the package
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1] == (
        f"ModuleNotFoundError: No module named '{old}': it moved to {new}; import it from there"
    )
    assert importlib.util.find_spec(new) is not None


def test_every_moved_path_names_a_module_that_exists_and_no_old_path_does():
    root = {p.stem for p in Path(agentrl.__file__).parent.iterdir()}  # modules and packages at the root
    for old, new in agentrl.MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, f"{old} -> {new}: no such module"
        assert old.removeprefix("agentrl.") not in root, (
            f"{old} is in the tree again: take it off the moved list"
        )


def test_an_unknown_name_is_still_the_plain_error():
    out = subprocess.run(
        [sys.executable, "-c", "import agentrl.no_such_module"], capture_output=True, text=True, timeout=120
    )
    assert (
        out.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'agentrl.no_such_module'"
    )
