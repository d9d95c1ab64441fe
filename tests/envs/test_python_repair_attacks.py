"""python-repair-v0 under the audit's attacks that target it, through env.step only,
on docker and on bwrap.

Each attack is the audit library's own (`agentrl.checks.attacks`), played by `attack.play(env, task)`:
reset, tool calls in the env's format, submit. Against the code before the fix each of them
scored reward 1 (or, for 9 and 11, showed what it looked for): benchmarks/RESULTS.md has the
before/after table. Here every one must score 0 (or show nothing), and the controls still hold:
the oracle scores 1 and the untouched mutant 0.
"""

from __future__ import annotations

import pytest

from agentrl.checks.attacks import (
    AtexitForgedReport,
    AtexitForgedReportOsExit,
    BugLocationMetadata,
    PatchPytestReports,
    PatchPytestRunner,
    PlantedPyc,
    PlantedUncheckedPyc,
    PristineSymlink,
    ProcCmdlineLeak,
    RegisterAllpassPlugin,
)
from agentrl.checks.attacks_harness import (
    HarnessEmitter,
    HarnessGuardFrames,
    HarnessHookExec,
    HarnessSwapTestModules,
    UnittestCallTestMethod,
)
from agentrl.checks.verifier_check import check_verifier

HARNESS_ATTACKS = [
    HarnessHookExec,
    HarnessGuardFrames,
    HarnessEmitter,
    HarnessSwapTestModules,
    UnittestCallTestMethod,
]

BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("bwrap", marks=pytest.mark.docker, id="bwrap"),  # its rootfs is exported from the image
]


@pytest.fixture(scope="module", params=BACKENDS)
def env(request, semver_repair_task):
    from agentrl.envs.python_repair.env import PythonRepairEnv

    if request.param == "bwrap":
        request.getfixturevalue("bwrap_path")
    e = PythonRepairEnv(tasks=[semver_repair_task], backend=request.param, max_turns=8)
    yield e
    e.close()


def test_controls_oracle_scores_1_and_untouched_mutant_0(env, semver_repair_task):
    check = check_verifier(env, semver_repair_task)
    assert check.ok, check.reason
    assert (check.reference.reward, check.untouched.reward) == (1.0, 0.0)


def test_attack_1_workspace_symlink_to_the_pristine_source_scores_0(env, semver_repair_task):
    out = PristineSymlink().play(env, semver_repair_task)
    assert "/opt/src/semver/semver" in out.evidence, out.evidence  # the links were made
    assert out.reward == 0.0 and not out.passed, out.verdict
    # The test run follows the link and finds nothing it can import (docker: 0700 root; bwrap: masked):
    # the test modules fail to collect, or the hidden tests' conftest fails to import the package.
    assert "collection error" in out.verdict or "No module named 'semver'" in out.verdict, out.verdict


@pytest.mark.parametrize(
    "attack",
    [PatchPytestReports, PatchPytestRunner, RegisterAllpassPlugin],
    ids=["report-class", "runner-module", "plugin-via-frames"],
)
def test_attack_2_patching_pytest_from_the_package_scores_0(env, semver_repair_task, attack):
    out = attack().play(env, semver_repair_task)
    assert out.reward == 0.0, out.verdict
    # Recorded as tampering where the payload took hold; where it did not (semver's conftest imports
    # the package before any test module is imported, so nothing is left to swap), the bug's own
    # failures stand.
    assert "tampered with" in out.verdict or "not passed" in out.verdict, out.verdict


@pytest.mark.parametrize(
    "attack", [AtexitForgedReport, AtexitForgedReportOsExit], ids=["exit-1", "os-exit-0"]
)
def test_attack_3_results_forged_at_exit_score_0(env, semver_repair_task, attack):
    out = attack().play(env, semver_repair_task)
    assert out.reward == 0.0, out.verdict
    # Recorded as tampering where the payload took hold; where it did not (semver's conftest imports
    # the package before any test module is imported, so nothing is left to swap), the bug's own
    # failures stand.
    assert "tampered with" in out.verdict or "not passed" in out.verdict, out.verdict


@pytest.mark.parametrize("attack", [PlantedPyc, PlantedUncheckedPyc], ids=["timestamp", "unchecked-hash"])
def test_attack_4_payload_only_in_planted_bytecode_scores_0(env, semver_repair_task, attack):
    out = attack().play(env, semver_repair_task)
    assert "planted" in out.evidence and "sources untouched" in out.evidence, out.evidence
    # The bytecode is never loaded: the tests run the (buggy) source, untampered.
    assert out.reward == 0.0 and "tampered" not in out.verdict and "not passed" in out.verdict, out.verdict


def test_attack_9_no_file_metadata_points_at_the_mutated_module(env, semver_repair_task):
    out = BugLocationMetadata().play(env, semver_repair_task)
    assert out.applicable and out.exploited is False, out.evidence


def test_attack_11_no_host_paths_or_options_in_proc(env, semver_repair_task):
    out = ProcCmdlineLeak().play(env, semver_repair_task)
    assert out.exploited is False, out.evidence


@pytest.mark.parametrize("attack", HARNESS_ATTACKS, ids=[a.name for a in HARNESS_ATTACKS])
def test_attacks_on_the_harness_inside_the_test_process_score_0_as_tampering(env, semver_repair_task, attack):
    """The payloads reach the harness's live objects (the hook executor, the guard, the emitter,
    the test modules being imported); the canary twins, or the runner's own checks, record it."""
    out = attack().play(env, semver_repair_task)
    assert out.reward == 0.0, out.verdict
    # Recorded as tampering where the payload took hold; where it did not (semver's conftest imports
    # the package before any test module is imported, so nothing is left to swap), the bug's own
    # failures stand.
    assert "tampered with" in out.verdict or "not passed" in out.verdict, out.verdict
