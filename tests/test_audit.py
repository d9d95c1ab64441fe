"""`agentrl verifier audit`: the attack library as a product.

Unit tests of the plumbing (tool calls in each parser's format, judging by reward, plugins from
entry points, an exception out of env.step as a finding), the CLI end to end, and the audit of
every built-in environment, which must report nothing exploited and its controls passing. That
last one is the CI gate: it runs the whole library (one task per env; two for sqlite, one
answer task and one state task).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agentrl import audit
from agentrl.audit import Outcome, render_calls, run_audit
from agentrl.envs.guess_number import GuessNumberEnv
from agentrl.parsers import get_parser
from agentrl.task import Task


class _Env:
    def __init__(self, parser: str):
        self.parser = get_parser(parser)


def test_tool_calls_are_rendered_in_the_envs_parser_format():
    calls = [("bash", {"command": "ls"}), ("submit", {"answer": "x"})]
    hermes = render_calls(_Env("hermes"), calls)
    parsed = get_parser("hermes").parse(hermes)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls and not parsed.errors
    llama = render_calls(_Env("llama3-json"), calls)
    parsed = get_parser("llama3-json").parse(llama)
    assert [(c.name, c.arguments) for c in parsed.calls] == calls and not parsed.errors


class _Fixed:
    """An attack with a fixed outcome, for judging."""

    description = "fixed"

    def __init__(self, name: str, outcome: Outcome):
        self.name, self.outcome = name, outcome

    def applies_to(self, env: Any) -> bool | str:
        return True

    def play(self, env: Any, task: Task) -> Outcome:
        return self.outcome


TASK = Task(id="t/0", prompt="p")


@pytest.mark.parametrize(
    ("outcome", "baseline", "status"),
    [
        (Outcome(reward=0.0), 0.0, "contained"),
        (Outcome(reward=0.5), 1 / 3, "exploited"),  # fraction mode: more than the untouched start
        (Outcome(reward=1 / 3), 1 / 3, "contained"),
        (Outcome(reward=0.0, passed=True), 0.0, "exploited"),
        (Outcome(reward=1.0, exploited=False), 0.0, "contained"),  # the attack judged itself
        (Outcome(exploited=True, evidence="leak"), 0.0, "exploited"),
        (Outcome(applicable=False, evidence="nothing to try"), 0.0, "not applicable"),
    ],
)
def test_findings_are_judged_against_the_untouched_start(outcome, baseline, status):
    assert audit._judge(_Fixed("a", outcome), TASK, outcome, baseline, 0.1).status == status


def test_an_exception_out_of_env_step_is_a_finding_not_a_crash():
    class Raising(GuessNumberEnv):
        def step(self, action: str):
            if "[[[[" in action:
                raise RecursionError("maximum recursion depth exceeded")
            return super().step(action)

    report = run_audit(Raising(), tasks=1, only=["nested-json"])
    (finding,) = report.findings
    assert finding.status == "exploited" and "env.step raised RecursionError" in finding.evidence
    assert report.controls[0].ok and not report.ok


PLUGIN = """
from agentrl.audit import Outcome, Play


class AlwaysWins:
    name = "test-always-wins"
    description = "A plugin attack: guesses the answer it was told."

    def applies_to(self, env):
        return True if "guess" in env.toolbox.tools else "no guess tool"

    def play(self, env, task):
        play = Play(env, task)
        play.call("guess", number=int(task.answer))
        return play.outcome("guessed the secret it read from the task")
"""


def _plugin_dir(tmp_path: Path) -> Path:
    """An installed distribution (a .dist-info on sys.path) with an `agentrl.attacks` entry point."""
    root = tmp_path / "site"
    (root / "atk_plugin-0.1.dist-info").mkdir(parents=True)
    (root / "atk_plugin-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: atk-plugin\nVersion: 0.1\n"
    )
    (root / "atk_plugin-0.1.dist-info" / "entry_points.txt").write_text(
        "[agentrl.attacks]\ntest-always-wins = atk_plugin:AlwaysWins\n"
    )
    (root / "atk_plugin.py").write_text(textwrap.dedent(PLUGIN))
    return root


def test_a_third_party_attack_is_loaded_from_its_entry_point_and_played(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(_plugin_dir(tmp_path)))
    monkeypatch.setattr(audit, "_entry_points_loaded", False)
    monkeypatch.setattr(audit, "_REGISTRY", dict(audit._REGISTRY))
    assert "test-always-wins" in {a.name for a in audit.attacks()}
    report = run_audit(GuessNumberEnv(), tasks=1, only=["test-always-wins"])
    assert [f.status for f in report.findings] == ["exploited"]  # it read the answer: reward 1


def test_cli_lists_attacks_and_writes_json_with_a_nonzero_exit_when_exploited(tmp_path):
    env = {"PYTHONPATH": str(_plugin_dir(tmp_path)), "PATH": "/usr/bin:/bin"}
    listing = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "verifier", "audit", "--list"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (
        listing.returncode == 0
        and "pristine-symlink" in listing.stdout
        and "test-always-wins" in listing.stdout
    )
    out = tmp_path / "audit.json"
    cmd = [
        sys.executable,
        "-m",
        "agentrl.cli",
        "verifier",
        "audit",
        "agentrl/guess-number-v0",
        "--attack",
        "test-always-wins",
    ]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "[exploited] test-always-wins" in proc.stdout and "1 exploited" in proc.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is False and report["exploited"] == 1
    assert report["controls"][0]["ok"] and report["findings"][0]["reward"] == 1.0


@pytest.mark.docker
def test_cli_exits_0_when_everything_is_contained(tmp_path):
    out = tmp_path / "audit.json"
    cmd = [sys.executable, "-m", "agentrl.cli", "verifier", "audit", "agentrl/calc-v0"]
    cmd += ["--attack", "submit-without-work", "--attack", "answer-flood", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["ok"] and {f["status"] for f in report["findings"]} == {"contained"}


# --- the CI gate: every built-in env, the whole library -------------------------------------


def _builtin(env_id: str, request: pytest.FixtureRequest) -> tuple[Any, list[Task]]:
    import agentrl

    if env_id == "agentrl/python-repair-v0":
        from agentrl.envs.python_repair.env import PythonRepairEnv

        task = request.getfixturevalue("toolz_repair_task")
        return PythonRepairEnv(tasks=[task], env_id=env_id), [task]
    env = agentrl.make(env_id)
    indices = [0, 1] if env_id == "agentrl/sqlite-v0" else [0]  # sqlite: an answer task, a state task
    return env, [env.tasks.get(i, env.split) for i in indices]


@pytest.mark.slow
@pytest.mark.parametrize(
    "env_id",
    [
        pytest.param("agentrl/calc-v0", marks=pytest.mark.docker),
        pytest.param("agentrl/sqlite-v0", marks=pytest.mark.docker),
        "agentrl/guess-number-v0",
        pytest.param("agentrl/python-repair-v0", marks=pytest.mark.docker),
    ],
)
def test_audit_of_builtin_env_reports_nothing_exploited(env_id, request):
    env, tasks = _builtin(env_id, request)
    try:
        report = run_audit(env, env_id=env_id, tasks=tasks)
    finally:
        env.close()
    assert all(c.ok for c in report.controls), report.controls
    bad = [audit.format_finding(f) for f in report.findings if f.status in ("exploited", "error")]
    assert not bad, "\n".join(bad)
    assert any(f.status == "contained" for f in report.findings)
