"""What an attack of the verifier audit is, and what it plays with (`agentrl.checks.audit` runs them).

An attack is a small class with a `name`, a `description`, `applies_to(env)` (True, or a string
saying why not) and `play(env, task) -> Outcome`; `register` adds one to the library. `Play` drives
one episode for an attack (`play.call("bash", command="...")`, `play.calls([...])` for several
calls in one message, `play.submit()`), and `Outcome` is what it returns. `needs(env, ...)` is a
ready-made `applies_to`, and `probe_answers(env, answers)` tells by behaviour whether the env's
verdict depends on the submitted answer (the answer attacks use it on verifiers they do not know).

The built-in attacks (`agentrl.checks.attacks`, `agentrl.checks.attacks_harness`) are written
against this module only; the audit, which loads and plays them, sits above both.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from agentrl.core.task import Task
from agentrl.core.types import Verdict
from agentrl.env.protocols import AgentEnv


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
"""The library, by attack name: the built-ins register on import, plugins when the audit loads them."""


def register(attack: Attack | type, *, override: bool = False) -> Attack:
    """Add an attack (an instance, or a class made with no arguments) to the library."""
    if isinstance(attack, type):
        attack = attack()
    if not isinstance(attack, Attack):
        raise TypeError(
            f"{attack!r} is not an attack: it needs `name`, `description`, `applies_to(env)` and "
            "`play(env, task)` (see agentrl.checks.audit)"
        )
    if attack.name in _REGISTRY and not override and type(_REGISTRY[attack.name]) is not type(attack):
        raise ValueError(f"an attack named {attack.name!r} is already registered; pass override=True")
    _REGISTRY[attack.name] = attack
    return attack


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
