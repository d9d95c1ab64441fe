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
it returns. `probe_answers(env, answers)` tells by behaviour whether the env's verdict depends on
the submitted answer (the answer attacks use it on verifiers they do not know).

The summary counts every status and names the attacks that were not applicable: an attack never
tried must not read as one that held.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
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


def verifier_parts(env: Any) -> list[Any]:
    """The env's verifier, then its parts and gates, recursively (composite verifiers)."""
    out: list[Any] = []

    def walk(v: Any) -> None:
        if v is None:
            return
        out.append(v)
        for part in getattr(v, "_parts", []) or []:
            walk(part[0] if isinstance(part, tuple) else part)
        for gate in getattr(v, "_gates", []) or []:
            walk(gate)

    walk(getattr(env, "verifier", None))
    return out


def verifier_names(env: Any) -> set[str]:
    """The names of the env's verifier and of its parts and gates (composite verifiers)."""
    return {str(getattr(v, "name", type(v).__name__)) for v in verifier_parts(env)}


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


# --- does the verdict depend on the submitted answer? ------------------------------------------

NOT_ANSWER_DEPENDENT = "the verifier's verdict does not depend on the submitted answer"


def _verdict_key(verdict: Any) -> tuple[Any, ...]:
    if isinstance(verdict, Verdict):
        return (float(verdict.reward), bool(verdict.passed), str(verdict.details))
    return ("not a Verdict", repr(verdict)[:300])


class AnswerProbe:
    """Stands in for the env's verifier during one episode (see `probe_answers`): it returns the real
    verdict, then scores the same end state (same sandbox, same episode record) again with other
    submissions. Whether the verdict moves is what the verifier does with the answer, whatever it
    is called and however it reads it."""

    def __init__(self, verifier: Any, answers: Sequence[str]):
        self._verifier = verifier
        self._answers = list(answers)
        # (submission, verdict) of the first verification: the real one, its repeat, then each answer.
        self.scored: list[tuple[str | None, tuple[Any, ...]]] | None = None

    def __getattr__(self, name: str) -> Any:
        # Everything else (name, gates, needs_sandbox, needs_capabilities) is the real verifier's.
        # Not `averify`: the async path would score around the probe.
        inner = self.__dict__.get("_verifier")
        if inner is None or name == "averify" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def runs_per_verdict(self) -> int:
        return 2 + len(self._answers)

    def verify(self, sandbox: Any, task: Task, episode: Any) -> Any:
        verdict = self._verifier.verify(sandbox, task, episode)
        if self.scored is None:
            scored = [(episode.submission, _verdict_key(verdict))]
            # The same submission once more tells noise in the details (timings) from the answer's effect.
            for answer in [episode.submission, *self._answers]:
                other = copy.copy(episode)
                other.submission = answer
                try:
                    key = _verdict_key(self._verifier.verify(sandbox, task, other))
                except Exception as exc:  # a crash on one answer and not another is still a dependence
                    key = ("raised", f"{type(exc).__name__}: {exc}"[:300])
                scored.append((answer, key))
            self.scored = scored
        return verdict

    @property
    def depends(self) -> bool | None:
        """Whether the verdict changed with the submission; None when the verifier never ran through
        the probe (the env scores its episodes some other way)."""
        if not self.scored:
            return None
        keys = [k for _, k in self.scored]
        noisy = keys[0] != keys[1]
        return len({k[:2] if noisy else k for k in keys}) > 1

    @property
    def evidence(self) -> str:
        if not self.scored:
            return "the verifier was not called through the probe"
        subs = ", ".join(_short(s) for s in dict.fromkeys(s for s, _ in self.scored))
        key = self.scored[0][1]
        said = f"reward {key[0]:g}: {' '.join(str(key[2]).split())[:160]}" if len(key) == 3 else str(key[-1])
        return (
            f"{NOT_ANSWER_DEPENDENT}: submitting {subs} on the same end state gives the same verdict ({said})"
        )


@contextlib.contextmanager
def probe_answers(env: Any, answers: Sequence[str]) -> Iterator[AnswerProbe | None]:
    """Within the block, the env's first verification also scores `answers` (see `AnswerProbe`);
    None when the env has no verifier attribute to stand in for."""
    verifier = getattr(env, "verifier", None)
    if verifier is None or not callable(getattr(verifier, "verify", None)):
        yield None
        return
    # The probe's extra runs happen inside the env's one timed verifier call: give it their time.
    timeout = getattr(env, "verifier_timeout_s", None)
    deadline = getattr(env, "verifier_deadline_s", timeout)  # what the env would allow the verifier
    scaled = _seconds(deadline) and hasattr(env, "verifier_timeout_s")
    probe = AnswerProbe(verifier, answers)
    try:
        env.verifier = probe
    except AttributeError:  # a read-only property: nothing to stand in for
        yield None
        return
    if scaled:
        env.verifier_timeout_s = deadline * probe.runs_per_verdict
    try:
        yield probe
    finally:
        env.verifier = verifier
        if scaled:
            env.verifier_timeout_s = timeout


def _short(submission: str | None, limit: int = 48) -> str:
    text = repr(submission)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-1]}"


def _seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


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
