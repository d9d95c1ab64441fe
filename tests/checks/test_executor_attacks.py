"""The audit's attacks on the resident executor (`agentrl.checks.attacks_executor`), played for real.

On docker the agent can kill its executor: the episode must then end `env_error` with no reward,
even though the env's reference solution finishes it. On bwrap the executor is PID 1 of the
sandbox's pid namespace and the kill does not land. Everywhere, ptrace, the channel's descriptors,
forged frames and a flood get nowhere.
"""

from __future__ import annotations

import pytest

import agentrl
from agentrl.checks import attacks_executor
from agentrl.checks.audit import attacks, run_audit

NAMES = [cls.name for cls in attacks_executor.ATTACKS]


def test_the_executor_attacks_are_in_the_library():
    assert set(NAMES) <= {a.name for a in attacks()}
    assert len(NAMES) == 5


@pytest.mark.docker
@pytest.mark.parametrize("backend", ["docker", "bwrap"])
def test_calc_contains_every_executor_attack(backend, request):
    if backend == "bwrap":
        request.getfixturevalue("bwrap_path")
    env = agentrl.make("agentrl/calc-v0", backend=backend)
    try:
        report = run_audit(env, tasks=1, only=NAMES)
    finally:
        env.close()
    by_name = {f.attack: f for f in report.findings}
    assert set(by_name) == set(NAMES)
    assert all(f.status == "contained" for f in report.findings), [
        (f.attack, f.status, f.evidence) for f in report.findings
    ]
    kill = by_name["executor-kill"]
    if backend == "docker":  # the kill lands: detected, the episode unscored
        assert kill.reward == 0 and "tampered with" in kill.evidence and "env_error" in kill.evidence
    else:  # PID 1 of its namespace: the kill never lands, the honest solution's reward stands
        assert kill.reward == 1 and "unharmed" in kill.evidence
    assert "still-answering" in by_name["executor-flood"].evidence
    assert "genuine-output" in by_name["executor-forged-frames"].evidence


def test_local_sandboxes_have_no_executor_to_attack():
    env = agentrl.make("agentrl/calc-v0", backend="local")
    try:
        for name in NAMES:
            assert "no resident executor" in str(
                attacks_executor.ATTACKS[NAMES.index(name)]().applies_to(env)
            )
    finally:
        env.close()
