"""`agentrl verifier list` and `agentrl verifier check`, run as the real command line in a subprocess.

Third-party plugins come from a throw-away distribution made visible through PYTHONPATH (a
`.dist-info` with entry points is all importlib.metadata needs): a verifier for `list`, and
an environment with one deliberately broken task for `check`.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENTRL = str(ROOT / ".venv/bin/agentrl")

PLUGIN = '''
from dataclasses import dataclass

import agentrl
from agentrl.env.agents import AnswerOracle, tool_call
from agentrl.env.tool_env import ToolEnv
from agentrl.core.task import Task
from agentrl.verifiers import Verdict


@dataclass
class PalindromeVerifier:
    """Passes when the submission reads the same backwards (a third-party plugin)."""

    name: str = "palindrome"

    def verify(self, sandbox, task, episode):
        s = episode.submission or ""
        return Verdict(float(s == s[::-1] and bool(s)), s == s[::-1] and bool(s))


@dataclass
class ContainsAnswerVerifier:
    """Passes when the submission contains the answer anywhere (deliberately weak)."""

    name: str = "contains-answer"

    def verify(self, sandbox, task, episode):
        ok = bool(task.answer) and task.answer.casefold() in (episode.submission or "").casefold()
        return Verdict(float(ok), ok, "contains the answer" if ok else "does not contain the answer")


class CapitalEnv(ToolEnv):
    """Name a capital; scored by the `contains-answer` plugin, a verifier the audit knows only by its entry point."""

    def __init__(self, **kw):
        tasks = [Task(id="capital/0", prompt="The capital of France?", answer="Paris")]
        super().__init__(tasks=tasks, tools=["submit"], oracle=AnswerOracle, **kw)


class SayEnv(ToolEnv):
    """Say the answer; task 1's reference answer is wrong, so its verifier cannot be trusted."""

    def __init__(self, **kw):
        tasks = [
            Task(id="say/0", prompt="Say hi.", answer="hi", metadata={"reference": "hi"}),
            Task(id="say/1", prompt="Say yo.", answer="yo", metadata={"reference": "no"}),
        ]
        super().__init__(tasks=tasks, tools=["submit"], **kw)

    def oracle(self, task):
        class Oracle:
            def act(self, observation):
                return tool_call("submit", answer=task.metadata["reference"])

        return Oracle()


def register_envs():
    agentrl.register("cli-plugin/Say-v0", "cli_verifier_plugin:SayEnv", max_turns=2)
    agentrl.register(
        "cli-plugin/Capital-v0", "cli_verifier_plugin:CapitalEnv", max_turns=2, verifier="contains-answer"
    )
'''


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cli_plugin")
    (root / "cli_verifier_plugin.py").write_text(PLUGIN)
    info = root / "cli_verifier_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cli-verifier-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""
        [agentrl.verifiers]
        palindrome = cli_verifier_plugin:PalindromeVerifier
        contains-answer = cli_verifier_plugin:ContainsAnswerVerifier

        [agentrl.envs]
        cli-plugin = cli_verifier_plugin:register_envs
    """)
    )
    return {**os.environ, "PYTHONPATH": str(root)}


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AGENTRL, *args], capture_output=True, text=True, env=env, timeout=300)


def test_verifier_list_shows_builtins_and_plugins_with_descriptions(plugin_env):
    out = run("verifier", "list", env=plugin_env)
    assert out.returncode == 0, out.stderr
    lines = {line.split()[0]: line for line in out.stdout.splitlines()}
    assert {"hidden-tests", "exact-match", "numeric", "state", "composite", "palindrome"} <= set(lines)
    assert "hidden pytest suite" in lines["hidden-tests"]
    assert "reads the same backwards" in lines["palindrome"]


@pytest.mark.docker
def test_verifier_check_keeps_every_calc_task():
    out = run("verifier", "check", "agentrl/calc-v0", "--tasks", "3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[kept]") == 3
    assert "kept 3 of 3 tasks, dropped 0" in out.stdout


def test_verifier_check_reports_dropped_task_and_exits_1(plugin_env):
    out = run("verifier", "check", "cli-plugin/Say-v0", "--tasks", "2", env=plugin_env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[kept] say/0" in out.stdout
    assert "[dropped] say/1: the reference solution is not accepted" in out.stdout
    assert "kept 1 of 2 tasks, dropped 1" in out.stdout


def test_verifier_audit_plays_answer_attacks_on_a_plugin_verifier_and_counts_what_it_did_not_play(
    plugin_env, tmp_path
):
    attacks = ["--attack", "answer-hedging", "--attack", "answer-flood", "--attack", "pristine-symlink"]
    out = tmp_path / "audit.json"
    proc = run("verifier", "audit", "cli-plugin/Capital-v0", *attacks, "--json", str(out), env=plugin_env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[exploited] answer-hedging" in proc.stdout and "[exploited] answer-flood" in proc.stdout
    assert "[not applicable] pristine-symlink" in proc.stdout
    assert (
        "cli-plugin/Capital-v0 (docker): 2 exploited, 0 contained, 1 not applicable (pristine-symlink), "
        "0 could not run; controls ok"
    ) in proc.stdout
    report = json.loads(out.read_text())
    assert (report["exploited"], report["contained"], report["not_applicable"]) == (2, 0, 1)
    assert list(report["not_applicable_attacks"]) == ["pristine-symlink"]
    assert (
        report["not_applicable_attacks"]["pristine-symlink"] == "the env has none of the tools bash, python"
    )


def test_verifier_check_unknown_env_says_did_you_mean():
    out = run("verifier", "check", "agentrl/cacl-v0", "--tasks", "1")
    assert out.returncode == 2 and "Did you mean 'agentrl/calc-v0'" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
