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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agentrl import verifiers
from agentrl.checks import attack_base, audit
from agentrl.checks.audit import Outcome, render_calls, run_audit
from agentrl.core.task import Task
from agentrl.env.agents import AnswerOracle
from agentrl.env.parsers import get_parser
from agentrl.env.tool_env import ToolEnv
from agentrl.env.tools import tool
from agentrl.envs.guess_number import GuessNumberEnv
from agentrl.verifiers import ExactMatchVerifier, Verdict


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
from agentrl.checks.audit import Outcome, Play


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
    monkeypatch.setattr(audit, "ATTACK_PLUGINS", audit.ATTACK_PLUGINS.copy())
    audit.ATTACK_PLUGINS.rescan()
    monkeypatch.setattr(attack_base, "_REGISTRY", dict(attack_base._REGISTRY))
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


# --- answer attacks: the verifier is judged by what it does, not by its name ----------------


@dataclass
class MyAnswerCheck:
    """A third-party answer verifier: the submission is the answer, case-insensitively, or the
    same number within 1e-6."""

    name: str = "my-answer-check"

    def verify(self, sandbox, task, episode):
        got, want = (episode.submission or "").strip().casefold(), (task.answer or "").strip().casefold()
        try:
            ok = abs(float(got) - float(want)) <= 1e-6
        except ValueError:
            ok = bool(want) and got == want
        return Verdict(float(ok), ok, f"submitted {got!r}")


@dataclass
class ContainsAnswer:
    """A deliberately weak one: any submission that contains the answer passes."""

    name: str = "contains-answer"

    def verify(self, sandbox, task, episode):
        ok = bool(task.answer) and task.answer.casefold() in (episode.submission or "").casefold()
        return Verdict(float(ok), ok, "contains the answer" if ok else "does not contain the answer")


@dataclass
class NoteTaken:
    """Scores the work, never the answer: passes when the `note` tool ran."""

    name: str = "note-taken"

    def verify(self, sandbox, task, episode):
        ok = episode.calls_ran("note") >= 1
        return Verdict(float(ok), ok, f"note ran {episode.calls_ran('note')} time(s)")


@tool(needs_sandbox=False)
def note(ctx, text: str) -> str:
    """Write a note.

    Args:
        text: The note.
    """
    return "noted"


ANSWER_TASKS = [
    Task(
        id="capital/0",
        prompt="The capital of France?",
        answer="Paris",
        metadata={"oracle_calls": [{"name": "note", "arguments": {"text": "France"}}]},
    ),
    Task(
        id="sum/0",
        prompt="0.1 + 0.2?",
        answer="0.3",
        metadata={"oracle_calls": [{"name": "note", "arguments": {"text": "add"}}]},
    ),
]
ANSWER_ATTACKS = ["answer-hedging", "answer-flood"]


@pytest.fixture
def third_party_verifiers(monkeypatch):
    """The test's verifiers, registered by name the way a plugin's are (and gone after the test)."""
    from agentrl.verifiers import base

    monkeypatch.setattr(base, "VERIFIERS", base.VERIFIERS.copy())
    for cls in (MyAnswerCheck, ContainsAnswer, NoteTaken):
        verifiers.register(cls.name, cls)


def answer_env(verifier: Any, tools: tuple[Any, ...] = (note, "submit")) -> ToolEnv:
    """Pure tools, so no sandbox: these audits need no engine."""
    return ToolEnv(tasks=ANSWER_TASKS, tools=list(tools), verifier=verifier, oracle=AnswerOracle, max_turns=3)


def test_answer_attacks_are_played_against_a_third_party_answer_verifier(third_party_verifiers):
    report = run_audit(answer_env("my-answer-check"), tasks=ANSWER_TASKS, only=ANSWER_ATTACKS)
    assert all(c.ok for c in report.controls), report.controls
    assert [(f.attack, f.task_id, f.status) for f in report.findings] == [
        (a, t.id, "contained") for t in ANSWER_TASKS for a in ANSWER_ATTACKS
    ]
    assert all(f.reward == 0.0 for f in report.findings) and report.ok
    assert report.summary() == "0 exploited, 4 contained, 0 not applicable, 0 could not run"


@pytest.mark.parametrize(
    "verifier",
    ["contains-answer", ("composite", {"parts": [("contains-answer", 1.0), ("note-taken", 0.0)]})],
    ids=["plain", "in-a-composite"],
)
def test_a_weak_third_party_answer_verifier_is_exploited_by_hedging_and_flooding(
    third_party_verifiers, verifier
):
    report = run_audit(answer_env(verifier), tasks=ANSWER_TASKS[:1], only=ANSWER_ATTACKS)
    assert [f.status for f in report.findings] == ["exploited", "exploited"], report.findings
    assert "'Paris or xParis': 1.0; 'xParis or Paris': 1.0" in report.findings[0].evidence
    assert not report.ok and report.to_json()["exploited"] == 2


def test_an_env_whose_verifier_ignores_the_answer_reports_the_answer_attacks_not_applicable(
    third_party_verifiers,
):
    report = run_audit(
        answer_env("note-taken"), tasks=ANSWER_TASKS, only=[*ANSWER_ATTACKS, "submit-without-work"]
    )
    assert all(c.ok for c in report.controls), report.controls
    statuses = {(f.attack, f.task_id): f.status for f in report.findings}
    assert statuses == {
        **{(a, t.id): "not applicable" for a in ANSWER_ATTACKS for t in ANSWER_TASKS},
        **{("submit-without-work", t.id): "contained" for t in ANSWER_TASKS},
    }
    why = report.not_applicable["answer-hedging"]
    assert why.startswith("the verifier's verdict does not depend on the submitted answer: submitting ")
    assert "'Paris'" in why and "note ran 0 time(s)" in why
    assert report.ok  # nothing was exploited, but the summary says what was not tried
    assert report.summary() == (
        "0 exploited, 2 contained, 4 not applicable (answer-hedging, answer-flood), 0 could not run"
    )
    out = report.to_json()
    assert (out["exploited"], out["contained"], out["not_applicable"]) == (0, 2, 4)
    assert set(out["not_applicable_attacks"]) == set(ANSWER_ATTACKS)
    assert json.loads(json.dumps(out)) == out


def test_the_summary_names_the_attacks_not_played_in_the_order_they_were_played():
    report = audit.AuditReport("e", None)
    for task, attack, status, why in [
        ("t/0", "a", "contained", ""),
        ("t/0", "b", "contained", ""),
        ("t/1", "b", "not applicable", "why b"),
        ("t/1", "a", "not applicable", "why a"),
        ("t/2", "a", "not applicable", "why a again"),
    ]:
        report.findings.append(audit.Finding(attack, task, status, why))
    assert report.not_applicable == {"a": "why a", "b": "why b"} and list(report.not_applicable) == ["a", "b"]
    assert report.summary() == "0 exploited, 2 contained, 3 not applicable (a, b), 0 could not run"


@pytest.mark.parametrize(
    "verifier",
    [
        "exact-match",
        "numeric",
        "regex",
        "auto",
        ("composite", {"parts": [("numeric", 1.0)], "gates": ["tool-used"]}),
        ExactMatchVerifier(name="strict"),  # a built-in under another name
        "my-answer-check",  # not known: its episodes are probed
    ],
)
def test_answer_attacks_apply_to_builtin_answer_verifiers_and_unknown_ones(third_party_verifiers, verifier):
    env = answer_env(verifier)
    for attack in ANSWER_ATTACKS:
        assert audit.get(attack).applies_to(env) is True


@pytest.mark.parametrize(
    ("verifier", "tools"),
    [
        ("hidden-tests", ("bash", "submit")),
        (("tool-used", {"tool": "note"}), (note, "submit")),
        (("composite", {"parts": [("state", 1.0)], "gates": ["tool-used"]}), ("bash", "submit")),
    ],
)
def test_builtin_verifiers_that_never_read_the_answer_are_not_applicable_without_an_episode(verifier, tools):
    env = answer_env(verifier, tools)
    for attack in ANSWER_ATTACKS:
        why = audit.get(attack).applies_to(env)
        assert isinstance(why, str) and why.startswith(
            "the verifier's verdict does not depend on the submitted answer ("
        ), why


def test_answer_attacks_need_a_submit_tool_that_carries_an_answer():
    @tool(terminal=True, needs_sandbox=False)
    def submit(ctx) -> str:
        """Say that you are done."""
        return "done"

    env = answer_env("exact-match", (submit,))
    assert audit.get("answer-hedging").applies_to(env) == "the env's submit tool takes no answer"
    env = ToolEnv(tasks=ANSWER_TASKS, tools=[note], verifier="exact-match")
    assert audit.get("answer-flood").applies_to(env) == "the env has no submit tool"


def test_the_probe_gives_back_the_envs_verifier_and_its_deadline(third_party_verifiers):
    env = answer_env("contains-answer")
    verifier, timeout = env.verifier, env.verifier_timeout_s
    with audit.probe_answers(env, ["Paris", "none"]) as probe:
        assert probe is not None and env.verifier is probe and env.verifier.name == "contains-answer"
        audit.Play(env, ANSWER_TASKS[0]).submit("the capital is Paris")
    assert env.verifier is verifier and env.verifier_timeout_s == timeout
    assert env.episode.verdict.passed  # the episode's own verdict, not a probe's
    assert probe.depends is True and [s for s, _ in probe.scored] == [
        "the capital is Paris",
        "the capital is Paris",
        "Paris",
        "none",
    ]


# --- the CI gate: every built-in env, the whole library -------------------------------------


def _builtin(env_id: str, request: pytest.FixtureRequest) -> tuple[Any, list[Task]]:
    import agentrl

    if env_id == "agentrl/python-repair-v0":
        from agentrl.envs.python_repair.env import PythonRepairEnv

        task = request.getfixturevalue("semver_repair_task")
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
        # Two episodes per guessing forger: a forger that always wins is still caught (p = 1/odds^2),
        # and a lucky guess alone is not a finding (p = 1/odds).
        report = run_audit(env, env_id=env_id, tasks=tasks, episodes=2)
    finally:
        env.close()
    assert all(c.ok for c in report.controls), report.controls
    bad = [audit.format_finding(f) for f in report.findings if f.status in ("exploited", "error")]
    assert not bad, "\n".join(bad)
    assert any(f.status == "contained" for f in report.findings)
