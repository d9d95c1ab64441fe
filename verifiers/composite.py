"""The `composite` verifier: a weighted sum of verifiers, with gates that must pass for any reward.

    composite(parts=[("numeric", 1.0)], gates=["tool-used"])

A typical gate is a format reward: the answer only counts when the agent worked the way the
task demands (called the python tool, produced a well-formed answer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.core.episode import Episode
from agentrl.core.task import Task
from agentrl.sandbox.base import Sandbox
from agentrl.verifiers.base import Verdict, Verifier, get


def _build(spec: Any) -> Verifier:
    """A verifier, a registered name, or (name, kwargs)."""
    if isinstance(spec, str):
        return get(spec)
    if (
        isinstance(spec, tuple | list)
        and len(spec) == 2
        and isinstance(spec[0], str)
        and isinstance(spec[1], dict)
    ):
        return get(spec[0], **spec[1])
    if hasattr(spec, "verify"):
        return spec
    raise TypeError(f"cannot build a verifier from {spec!r}; give a name, (name, kwargs) or a Verifier")


@dataclass
class CompositeVerifier:
    parts: list[Any] = field(default_factory=list)  # [(verifier spec, weight)]
    gates: list[Any] = field(default_factory=list)  # verifier specs that must all pass
    pass_threshold: float = 1.0
    name: str = "composite"

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError("composite verifier needs at least one part: parts=[(verifier, weight), ...]")
        self._parts = [(_build(v), float(w)) for v, w in self.parts]
        self._gates = [_build(g) for g in self.gates]
        total = sum(w for _, w in self._parts)
        if total <= 0:
            raise ValueError(f"composite weights must sum to > 0, got {total}")
        self._total = total

    @property
    def needs_sandbox(self) -> bool:
        """Whether any part or gate needs a sandbox (the env starts one for the episode if so)."""
        return any(getattr(v, "needs_sandbox", False) for v in self._members())

    @property
    def needs_capabilities(self) -> tuple[str, ...]:
        """Every sandbox capability a part or gate needs (`run_verifier` checks them)."""
        return tuple(dict.fromkeys(c for v in self._members() for c in getattr(v, "needs_capabilities", ())))

    def _members(self) -> list[Verifier]:
        return [*self._gates, *(v for v, _ in self._parts)]

    def verify(self, sandbox: Sandbox | None, task: Task, episode: Episode) -> Verdict:
        lines = []
        for gate in self._gates:
            v = gate.verify(sandbox, task, episode)
            lines.append(f"gate {gate.name}: {'pass' if v.passed else 'FAIL'} ({v.details})")
            if not v.passed:
                return Verdict(0.0, False, "; ".join(lines), judged=v.judged)
        reward = 0.0
        judged = True
        for part, weight in self._parts:
            v = part.verify(sandbox, task, episode)
            reward += weight * v.reward
            # One part not judged (a judge that failed): the sum is no score of the episode either.
            judged = judged and v.judged
            lines.append(f"{part.name} x{weight:g}: {v.reward:g} ({v.details})")
        reward /= self._total
        if not judged:
            return Verdict(0.0, False, "not judged: " + "; ".join(lines), judged=False)
        return Verdict(reward, reward >= self.pass_threshold, "; ".join(lines))
