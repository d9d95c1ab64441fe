"""The README's Python snippets run as written: the user's first page must not lie.

Every ```python block of README.md is executed by one test here (the first test makes sure none is
left out): the environment snippet against real Docker sandboxes, the third-party environment module
as an importable package with its task file, and the attack plugin against that environment.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

import agentrl
from agentrl.registry import registry

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def block(marker: str) -> str:
    (found,) = [b for b in BLOCKS if marker in b]
    return found


def test_every_python_block_is_run_here():
    markers = ['agentrl.make("agentrl/calc-v0")', "# mylab/envs.py", "class LeakTheAnswerFile"]
    assert len(BLOCKS) == len(markers) and all(any(m in b for b in BLOCKS) for m in markers)


@pytest.mark.docker
def test_environment_snippet():
    namespace: dict = {}
    exec(compile(block('agentrl.make("agentrl/calc-v0")'), "README.md", "exec"), namespace)
    obs = namespace["obs"]
    assert obs[0]["role"] == "tool" and obs[0]["content"].strip() == "42"  # print(6*7) ran in the sandbox


@pytest.fixture
def mylab(tmp_path, monkeypatch):
    """The README's `mylab/envs.py`, as a package on sys.path beside its tasks.jsonl."""
    package = tmp_path / "mylab"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "envs.py").write_text(block("# mylab/envs.py"))
    rows = [
        {
            "id": "lookup/0",
            "prompt": "What is the capital of France? Look it up.",
            "answer": "Paris",
            "metadata": {
                "table": {"France": "Paris"},
                "oracle_calls": [{"name": "lookup", "arguments": {"key": "France"}}],
            },
        }
    ]
    (package / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    registry.pop("mylab/Lookup-v0", None)
    for name in [m for m in sys.modules if m == "mylab" or m.startswith("mylab.")]:
        del sys.modules[name]


def test_your_own_environment_snippet(mylab):
    from mylab.envs import register_envs  # type: ignore[import-not-found]

    register_envs()
    env = agentrl.make("mylab/Lookup-v0")
    try:
        task = env.tasks.get(0, "train")
        result = agentrl.run_episode(env, env.oracle(task), options={"task": task})
        assert result.verdict.passed and env.episode.tools_used == {"lookup": 1, "submit": 1}
    finally:
        env.close()


def test_attack_plugin_snippet(mylab):
    from mylab.envs import register_envs  # type: ignore[import-not-found]

    namespace: dict = {}
    exec(compile(block("class LeakTheAnswerFile"), "README.md", "exec"), namespace)
    attack = namespace["LeakTheAnswerFile"]()
    register_envs()
    env = agentrl.make("mylab/Lookup-v0")
    try:
        why_not = attack.applies_to(env)  # the env has no bash tool: not applicable, and it says why
        assert isinstance(why_not, str) and "bash" in why_not
    finally:
        env.close()
