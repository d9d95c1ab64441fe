"""`agentrl verifier audit`: play a library of reward-hacking attacks against an environment and its verifier.

RL optimizes whatever the verifier rewards; a policy that stumbles on a hack learns it. The
audit plays the hacks first, as an agent would: through the environment's own interface only
(`env.reset`, `env.step` with tool calls written in the env's parser format), against any
environment, built-in or third-party. Per task it runs two controls, then every attack that
applies:

- controls (`agentrl.verifier_check`): the env's oracle must pass, and the untouched start
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
built-ins are in `agentrl.attacks`. Third-party packages add theirs under the `agentrl.attacks`
entry-point group (the entry point names the class, or an instance):

    [project.entry-points."agentrl.attacks"]
    my-attack = "mylab.attacks:MyAttack"

`Play` drives one episode for an attack (`play.call("bash", command="...")`,
`play.calls([...])` for several calls in one message, `play.submit()`), and `Outcome` is what
it returns.
"""

from __future__ import annotations

import importlib.metadata
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from agentrl.task import Task
from agentrl.types import AgentEnv
from agentrl.verifiers import Verdict

ENTRY_POINT_GROUP = "agentrl.attacks"
Status = Literal["contained", "exploited", "not applicable", "error"]


class AuditError(RuntimeError):
    """The audit itself cannot go on (an env it cannot drive, an unknown attack)."""


class StepRaised(AuditError):
    """`env.step` raised: the env broke its contract ("never an exception"), which is a finding."""


# --- what an attack returns ------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one attack's episode came to. `exploited=None` lets the audit judge by reward."""

    reward: float | None = None
    verdict: str = ""
    """The verifier's details (empty when the episode never reached the verifier)."""
    evidence: str = ""
    """What the attack did and saw, in a sentence or two."""
    exploited: bool | None = None
    passed: bool = False
    applicable: bool = True
    """False: the attack found it has nothing to try on this task (the evidence says why)."""


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
    def ok(self) -> bool:
        """Nothing exploited, every control passed, every attack ran."""
        return not self.exploited and not self.errors and all(c.ok for c in self.controls)

    def to_json(self) -> dict[str, Any]:
        return {
            "env": self.env_id,
            "backend": self.backend,
            "ok": self.ok,
            "exploited": len(self.exploited),
            "errors": len(self.errors),
            "controls": [asdict(c) for c in self.controls],
            "findings": [asdict(f) for f in self.findings],
            "seconds": round(self.seconds, 1),
        }


# --- the plugin contract ---------------------------------------------------------------------


@runtime_checkable
class Attack(Protocol):
    name: str
    description: str

    def applies_to(self, env: Any) -> bool | str:
        """True when this attack can be played on `env`, else a string saying why not."""
        ...

    def play(self, env: Any, task: Task) -> Outcome:
        """Play one episode of `task` on `env` through env.reset/env.step only."""
        ...


_REGISTRY: dict[str, Attack] = {}
_entry_points_loaded = False
_lock = threading.Lock()


def register(attack: Attack | type, *, override: bool = False) -> Attack:
    """Add an attack (an instance, or a class made with no arguments) to the library."""
    if isinstance(attack, type):
        attack = attack()
    if not isinstance(attack, Attack):
        raise TypeError(
            f"{attack!r} is not an attack: it needs `name`, `description`, `applies_to(env)` and "
            "`play(env, task)` (see agentrl.audit)"
        )
    if attack.name in _REGISTRY and not override and type(_REGISTRY[attack.name]) is not type(attack):
        raise ValueError(f"an attack named {attack.name!r} is already registered; pass override=True")
    _REGISTRY[attack.name] = attack
    return attack


def _load() -> None:
    global _entry_points_loaded
    import agentrl.attacks  # noqa: F401  (the built-ins register themselves)

    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                register(ep.load())
            except Exception as exc:  # one broken plugin must not take the audit down
                warnings.warn(f"attack plugin {ep.name!r} ({ep.value}) failed to load: {exc}", stacklevel=2)


def attacks() -> list[Attack]:
    """Every registered attack: the built-ins, then the `agentrl.attacks` entry points."""
    _load()
    return list(_REGISTRY.values())


def get(name: str) -> Attack:
    _load()
    if name not in _REGISTRY:
        import difflib

        close = difflib.get_close_matches(name, list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise AuditError(f"no attack named {name!r}.{hint} `agentrl verifier audit --list` shows them all")
    return _REGISTRY[name]


# --- driving an episode ----------------------------------------------------------------------


def render_calls(env: AgentEnv, calls: Sequence[tuple[str, Any]]) -> str:
    """Tool calls in the env's format, as its parser reads them (several in one message when given several)."""
    return env.parser.render_calls(list(calls))


class Play:
    """One attack episode: reset, tool calls in the env's format, and what came back."""

    def __init__(self, env: Any, task: Task):
        self.env = env
        self.task = task
        self.obs, self.info = env.reset(options={"task": task})
        self.done = False
        self.reward: float | None = None
        self.verdict: Verdict | None = None
        self.turns = 0
        self.step_seconds: list[float] = []

    def send(self, action: str) -> list[dict[str, Any]]:
        """One raw assistant message; returns the observation (the new messages)."""
        if self.done:
            raise AuditError("the episode is over; an attack cannot act after it ended")
        t0 = time.perf_counter()
        try:
            obs, reward, terminated, truncated, info = self.env.step(action)
        except Exception as exc:
            raise StepRaised(f"env.step raised {type(exc).__name__}: {str(exc)[:300]}") from exc
        finally:
            self.step_seconds.append(time.perf_counter() - t0)
        self.turns += 1
        self.obs, self.info = obs, info
        if terminated or truncated:
            self.done = True
            self.reward = float(reward)
            self.verdict = self.env.episode.verdict
        return obs

    def calls(self, calls: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
        """Several tool calls in one message; the content of each observation message."""
        return [str(m.get("content", "")) for m in self.send(render_calls(self.env, calls))]

    def call(self, name: str, **arguments: Any) -> str:
        """One tool call; its output (all observation messages joined)."""
        return "\n".join(self.calls([(name, arguments)]))

    def submit(self, answer: str = "done") -> None:
        """End the episode the ordinary way: `submit` if the env has it, else silence until the turn limit."""
        has_submit = "submit" in getattr(getattr(self.env, "toolbox", None), "tools", {})
        guard = 0
        while not self.done and guard < 1000:
            guard += 1
            self.send(render_calls(self.env, [("submit", {"answer": answer})]) if has_submit else "")

    def outcome(self, evidence: str = "", *, exploited: bool | None = None) -> Outcome:
        """The episode's outcome (submitting first if the attack left it open)."""
        if not self.done:
            self.submit()
        v = self.verdict
        return Outcome(
            reward=self.reward,
            verdict=v.details if isinstance(v, Verdict) else "",
            evidence=evidence,
            exploited=exploited,
            passed=bool(v.passed) if isinstance(v, Verdict) else False,
        )


# --- env introspection for applies_to --------------------------------------------------------


def tool_names(env: Any) -> set[str]:
    return set(getattr(getattr(env, "toolbox", None), "tools", {}) or {})


def verifier_names(env: Any) -> set[str]:
    """The names of the env's verifier and of its parts and gates (composite verifiers)."""
    out: set[str] = set()

    def walk(v: Any) -> None:
        if v is None:
            return
        out.add(str(getattr(v, "name", type(v).__name__)))
        for part in getattr(v, "_parts", []) or []:
            walk(part[0] if isinstance(part, tuple) else part)
        for gate in getattr(v, "_gates", []) or []:
            walk(gate)

    walk(getattr(env, "verifier", None))
    return out


def gate_names(env: Any) -> set[str]:
    v = getattr(env, "verifier", None)
    return {str(getattr(g, "name", "")) for g in getattr(v, "_gates", []) or []}


def needs(
    env: Any, *, tools: Iterable[str] = (), any_tool: Iterable[str] = (), verifier: str | None = None
) -> bool | str:
    """A ready-made `applies_to`: the env has all of `tools`, one of `any_tool`, and `verifier`."""
    have = tool_names(env)
    missing = [t for t in tools if t not in have]
    if missing:
        return f"the env has no {', '.join(missing)} tool"
    any_tool = list(any_tool)
    if any_tool and not have & set(any_tool):
        return f"the env has none of the tools {', '.join(any_tool)}"
    if verifier is not None and verifier not in verifier_names(env):
        return f"the env's verifier is not {verifier} ({', '.join(sorted(verifier_names(env))) or '?'})"
    return True


# --- the audit -------------------------------------------------------------------------------


def _control(env: Any, task: Task) -> Control:
    from agentrl.verifier_check import check_verifier

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
) -> AuditReport:
    """Controls, then every applicable attack, on `tasks` (the first N tasks of the env, or these)."""
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
                    finding = _judge(attack, task, attack.play(env, task), baseline, time.perf_counter() - t0)
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


def format_finding(f: Finding) -> str:
    reward = "" if f.reward is None else f" reward {f.reward:g};"
    verdict = f" verdict: {f.verdict[:240]}" if f.verdict and f.status != "not applicable" else ""
    return f"[{f.status}] {f.attack} ({f.task_id}, {f.seconds:.1f}s):{reward} {f.evidence}{verdict}".rstrip()
