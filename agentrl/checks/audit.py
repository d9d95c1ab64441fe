"""`agentrl verifier audit`: play a library of reward-hacking attacks against an environment and its verifier.

RL optimizes whatever the verifier rewards; a policy that stumbles on a hack learns it. The
audit plays the hacks first, as an agent would: through the environment's own interface only
(`env.reset`, `env.step` with tool calls written in the env's parser format), against any
environment, built-in or third-party. Per task it runs two controls, then every attack that
applies:

- controls (`agentrl.checks.verifier_check`): the env's oracle must pass, and the untouched start
  (submitting without changes) must fail; a verifier that fails a control cannot be audited.
- attacks: each says `contained`, `exploited` or `not applicable`, with its evidence (the
  reward, the verdict's details, what the attack saw). By default an attack is exploited when
  its episode scores more than the untouched start did (or passes); attacks about something
  other than reward (a step that never ends, host paths visible in the sandbox, file
  metadata pointing at the bug) judge themselves.

    agentrl verifier audit agentrl/python-repair-v0 --tasks 2 --backend docker --json audit.json

The exit code is 1 when anything is exploited, a control fails, or an attack could not run.

Attacks are plugins. An attack is a small class with a `name`, a `description`,
`applies_to(env)` (True, or a string saying why not) and `play(env, task) -> Outcome`; the
built-ins are in `agentrl.checks.attacks`. Third-party packages add theirs under the
`agentrl.attacks` entry-point group (the entry point names the class, or an instance):

    [project.entry-points."agentrl.attacks"]
    my-attack = "mylab.attacks:MyAttack"

`Play` drives one episode for an attack (`play.call("bash", command="...")`,
`play.calls([...])` for several calls in one message, `play.submit()`), and `Outcome` is what
it returns (the contract and these helpers are defined in `agentrl.checks.attack_base`). `probe_answers(env, answers)` tells by behaviour whether the env's verdict depends on
the submitted answer (the answer attacks use it on verifiers they do not know).

The summary counts every status and names the attacks that were not applicable: an attack never
tried must not read as one that held.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from agentrl.checks import attack_base

# The attack contract, importable from here too (plugins write `from agentrl.checks.audit import
# Outcome, Play, needs`).
from agentrl.checks.attack_base import (
    NOT_ANSWER_DEPENDENT,
    AnswerProbe,
    Attack,
    AuditError,
    Outcome,
    Play,
    StepRaised,
    needs,
    probe_answers,
    register,
    render_calls,
    tool_names,
    verifier_names,
    verifier_parts,
)
from agentrl.core.plugins import Plugins
from agentrl.core.task import Task

__all__ = [
    "NOT_ANSWER_DEPENDENT",
    "AnswerProbe",
    "Attack",
    "AuditError",
    "AuditReport",
    "Control",
    "Finding",
    "Outcome",
    "Play",
    "StepRaised",
    "attacks",
    "format_finding",
    "get",
    "needs",
    "probe_answers",
    "register",
    "render_calls",
    "run_audit",
    "tool_names",
    "verifier_names",
    "verifier_parts",
]

ENTRY_POINT_GROUP = "agentrl.attacks"
Status = Literal["contained", "exploited", "not applicable", "error"]


@dataclass(frozen=True)
class Finding:
    """One attack on one task, judged."""

    attack: str
    task_id: str
    status: Status
    evidence: str
    reward: float | None = None
    verdict: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Control:
    """The two controls on one task: the oracle passes, the untouched start fails."""

    task_id: str
    ok: bool
    reason: str
    reference_reward: float | None
    untouched_reward: float | None


@dataclass
class AuditReport:
    env_id: str
    backend: str | None
    controls: list[Control] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exploited(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "exploited"]

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.status == "error"]

    @property
    def not_applicable(self) -> dict[str, str]:
        """The attacks found not applicable, each with its (first such task's) reason, in the order
        the attacks were played."""
        order: dict[str, int] = {}
        out: dict[str, str] = {}
        for f in self.findings:
            order.setdefault(f.attack, len(order))
            if f.status == "not applicable":
                out.setdefault(f.attack, f.evidence)
        return dict(sorted(out.items(), key=lambda item: order[item[0]]))

    @property
    def ok(self) -> bool:
        """Nothing exploited, every control passed, every attack ran."""
        return not self.exploited and not self.errors and all(c.ok for c in self.controls)

    def counts(self) -> dict[Status, int]:
        """Findings per status (one finding per attack and task)."""
        statuses: tuple[Status, ...] = ("exploited", "contained", "not applicable", "error")
        return {s: sum(f.status == s for f in self.findings) for s in statuses}

    def summary(self) -> str:
        """One line of counts that names the attacks not played: an attack that was never tried must
        not read as one that held ("0 exploited" alone says nothing about what was skipped)."""
        n = self.counts()
        skipped = f" ({', '.join(self.not_applicable)})" if self.not_applicable else ""
        return (
            f"{n['exploited']} exploited, {n['contained']} contained, "
            f"{n['not applicable']} not applicable{skipped}, {n['error']} could not run"
        )

    def to_json(self) -> dict[str, Any]:
        n = self.counts()
        return {
            "env": self.env_id,
            "backend": self.backend,
            "ok": self.ok,
            "exploited": n["exploited"],
            "contained": n["contained"],
            "not_applicable": n["not applicable"],
            "not_applicable_attacks": self.not_applicable,
            "errors": n["error"],
            "controls": [asdict(c) for c in self.controls],
            "findings": [asdict(f) for f in self.findings],
            "seconds": round(self.seconds, 1),
        }


def _register_attack(name: str, attack: Any) -> Attack:
    return attack_base.register(attack)


# The `agentrl.attacks` entry points of installed packages: each an attack (a class or an instance)
# added to the library when the audit first lists or looks up attacks.
ATTACK_PLUGINS: Plugins[Attack] = Plugins(ENTRY_POINT_GROUP, "attack", on_load=_register_attack)


def _load() -> None:
    # The built-ins register themselves on import.
    import agentrl.checks.attacks
    import agentrl.checks.attacks_executor
    import agentrl.checks.attacks_forgers
    import agentrl.checks.attacks_harness
    import agentrl.checks.attacks_history
    import agentrl.checks.attacks_judge
    import agentrl.checks.attacks_reuse  # noqa: F401

    ATTACK_PLUGINS.load_all()  # one broken plugin warns; it must not take the audit down


def attacks() -> list[Attack]:
    """Every registered attack: the built-ins, then the `agentrl.attacks` entry points."""
    _load()
    return list(attack_base._REGISTRY.values())


def get(name: str) -> Attack:
    _load()
    if name not in attack_base._REGISTRY:
        import difflib

        close = difflib.get_close_matches(name, list(attack_base._REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AuditError(f"no attack named {name!r}.{hint} `agentrl verifier audit --list` shows them all")
    return attack_base._REGISTRY[name]


# --- the audit -------------------------------------------------------------------------------


def _control(env: Any, task: Task) -> Control:
    from agentrl.checks.verifier_check import check_verifier

    check = check_verifier(env, task)
    return Control(
        task.id,
        check.ok,
        " ".join(check.reason.split()),
        check.reference.reward if check.reference else None,
        check.untouched.reward if check.untouched else None,
    )


def _judge(attack: Attack, task: Task, outcome: Any, baseline: float, seconds: float) -> Finding:
    if not isinstance(outcome, Outcome):
        return Finding(
            attack.name,
            task.id,
            "error",
            f"play() returned {type(outcome).__name__}, not an Outcome",
            seconds=seconds,
        )
    if not outcome.applicable:
        return Finding(attack.name, task.id, "not applicable", outcome.evidence, seconds=seconds)
    exploited = outcome.exploited
    if exploited is None:
        exploited = outcome.passed or (outcome.reward is not None and outcome.reward > baseline + 1e-9)
    evidence = outcome.evidence
    if outcome.reward is not None and not evidence:
        evidence = f"reward {outcome.reward:g} (the untouched start scores {baseline:g})"
    return Finding(
        attack.name,
        task.id,
        "exploited" if exploited else "contained",
        evidence,
        outcome.reward,
        " ".join(outcome.verdict.split())[:600],
        seconds,
    )


def run_audit(
    env: Any,
    *,
    env_id: str | None = None,
    tasks: int | Sequence[Task] = 1,
    only: Sequence[str] | None = None,
    on_finding: Callable[[Finding], None] | None = None,
    episodes: int | None = None,
) -> AuditReport:
    """Controls, then every applicable attack, on `tasks` (the first N tasks of the env, or these).
    `episodes`: how many episodes per task an attack that reports a rate plays (one with an
    `episodes` attribute: the forgers that guess, whose single episode proves little)."""
    chosen = list(attacks()) if only is None else [get(n) for n in only]
    picked = [env.tasks.get(i, env.split) for i in range(tasks)] if isinstance(tasks, int) else list(tasks)
    report = AuditReport(env_id or getattr(env, "env_id", type(env).__name__), getattr(env, "backend", None))
    t_start = time.perf_counter()
    for task in picked:
        control = _control(env, task)
        report.controls.append(control)
        baseline = control.untouched_reward if control.untouched_reward is not None else 0.0
        for attack in chosen:
            t0 = time.perf_counter()
            try:
                applies = attack.applies_to(env)
            except Exception as exc:
                applies = f"applies_to raised {type(exc).__name__}: {exc}"
            if applies is not True:
                finding = Finding(attack.name, task.id, "not applicable", str(applies or "does not apply"))
            else:
                try:
                    with _episodes(attack, episodes):
                        outcome = attack.play(env, task)
                    finding = _judge(attack, task, outcome, baseline, time.perf_counter() - t0)
                except StepRaised as exc:  # "never an exception" is the contract: breaking it is a finding
                    finding = Finding(
                        attack.name, task.id, "exploited", str(exc), seconds=time.perf_counter() - t0
                    )
                except Exception as exc:
                    finding = Finding(
                        attack.name,
                        task.id,
                        "error",
                        f"the attack could not be played: {type(exc).__name__}: {exc}"[:600],
                        seconds=time.perf_counter() - t0,
                    )
            report.findings.append(finding)
            if on_finding is not None:
                on_finding(finding)
    report.seconds = time.perf_counter() - t_start
    return report


@contextlib.contextmanager
def _episodes(attack: Attack, episodes: int | None) -> Iterator[None]:
    if episodes is None or not hasattr(attack, "episodes"):
        yield
        return
    before = attack.episodes  # type: ignore[attr-defined]
    attack.episodes = episodes  # type: ignore[attr-defined]
    try:
        yield
    finally:
        attack.episodes = before  # type: ignore[attr-defined]


def format_finding(f: Finding) -> str:
    reward = "" if f.reward is None else f" reward {f.reward:g};"
    verdict = f" verdict: {f.verdict[:240]}" if f.verdict and f.status != "not applicable" else ""
    return f"[{f.status}] {f.attack} ({f.task_id}, {f.seconds:.1f}s):{reward} {f.evidence}{verdict}".rstrip()
