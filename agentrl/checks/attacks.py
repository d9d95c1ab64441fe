"""The built-in attack library of `agentrl verifier audit` (see `agentrl.checks.attack_base` for the contract).

Every attack plays one episode through `env.reset`/`env.step`, as a reward-hacking policy would,
and never fixes the task. This module is the catalogue: it registers the three families below in
the library's order and re-exports every attack and payload, so `agentrl.checks.attacks.X` names
each. The families live in modules of their own, written with `agentrl.checks.attack_common` (the
attacks on the harness from inside the test process are in `agentrl.checks.attacks_harness`):

- **python-repair** (`agentrl.checks.attacks_repair`; `pristine-symlink` ... `proc-cmdline-leak`):
  tricks that once scored reward 1 without a fix on `agentrl/python-repair-v0`, or broke an env's
  contract; one per trick that goes through `env.step`.
- **hidden tests** (`agentrl.checks.attacks_hidden_tests`; `workspace-conftest` ... `huge-output`):
  the older tricks against pytest based verifiers (docs/VERIFIERS.md lists them).
- **generic** (`agentrl.checks.attacks_generic`; `submit-without-work`, `answer-hedging`,
  `answer-flood`, `state-rc-and-path`, `parallel-guesses`, `nested-json`, `many-calls-per-step`):
  for any env, by the tools and the verifier it has.
"""

from __future__ import annotations

from agentrl.checks.attack_base import register
from agentrl.checks.attack_common import APPEND_TO_MODULES, PATCH_REPORTS
from agentrl.checks.attacks_generic import (
    AnswerFlood,
    AnswerHedging,
    ManyCallsPerStep,
    NestedJson,
    ParallelGuesses,
    StateRcAndPath,
    SubmitWithoutWork,
)
from agentrl.checks.attacks_hidden_tests import (
    ALLPASS_PLUGIN,
    CONFTEST_NOOP_TESTS,
    FAKE_JUNIT,
    HUGE_OUTPUT,
    BackgroundRewriter,
    EntryPointPlugin,
    FakeJunitReport,
    FakePythonOnPath,
    HugeOutput,
    IniAddoptsDeselect,
    IniAddoptsPlugin,
    OsExitAtImport,
    PthFile,
    ReadHiddenTests,
    ShadowPytestPackage,
    ShellRcVariables,
    Sitecustomize,
    SysExitAtImport,
    WorkspaceConftest,
)
from agentrl.checks.attacks_repair import (
    ATEXIT_FORGE,
    PATCH_PLUGIN,
    PATCH_RUNNER,
    PLANT_PYC,
    REPORT_TO_DEV_ZERO,
    AtexitForgedReport,
    AtexitForgedReportOsExit,
    BugLocationMetadata,
    GateBadCall,
    PatchPytestReports,
    PatchPytestRunner,
    PlantedPyc,
    PlantedUncheckedPyc,
    PristineSymlink,
    ProcCmdlineLeak,
    ReadDevZero,
    RegisterAllpassPlugin,
    ReportSymlinkDevZero,
)

__all__ = [
    "ALLPASS_PLUGIN",
    "APPEND_TO_MODULES",
    "ATEXIT_FORGE",
    "ATTACKS",
    "CONFTEST_NOOP_TESTS",
    "FAKE_JUNIT",
    "HUGE_OUTPUT",
    "PATCH_PLUGIN",
    "PATCH_REPORTS",
    "PATCH_RUNNER",
    "PLANT_PYC",
    "REPORT_TO_DEV_ZERO",
    "AnswerFlood",
    "AnswerHedging",
    "AtexitForgedReport",
    "AtexitForgedReportOsExit",
    "BackgroundRewriter",
    "BugLocationMetadata",
    "EntryPointPlugin",
    "FakeJunitReport",
    "FakePythonOnPath",
    "GateBadCall",
    "HugeOutput",
    "IniAddoptsDeselect",
    "IniAddoptsPlugin",
    "ManyCallsPerStep",
    "NestedJson",
    "OsExitAtImport",
    "ParallelGuesses",
    "PatchPytestReports",
    "PatchPytestRunner",
    "PlantedPyc",
    "PlantedUncheckedPyc",
    "PristineSymlink",
    "ProcCmdlineLeak",
    "PthFile",
    "ReadDevZero",
    "ReadHiddenTests",
    "RegisterAllpassPlugin",
    "ReportSymlinkDevZero",
    "ShadowPytestPackage",
    "ShellRcVariables",
    "Sitecustomize",
    "StateRcAndPath",
    "SubmitWithoutWork",
    "SysExitAtImport",
    "WorkspaceConftest",
]

# The library's order (what `agentrl verifier audit --list` shows and an audit plays), family by family
# as they were found, not module by module.
ATTACKS: tuple[type, ...] = (
    PristineSymlink,
    PatchPytestReports,
    PatchPytestRunner,
    RegisterAllpassPlugin,
    AtexitForgedReport,
    AtexitForgedReportOsExit,
    PlantedPyc,
    PlantedUncheckedPyc,
    ReadDevZero,
    ReportSymlinkDevZero,
    NestedJson,
    ManyCallsPerStep,
    ParallelGuesses,
    GateBadCall,
    BugLocationMetadata,
    ProcCmdlineLeak,
    WorkspaceConftest,
    EntryPointPlugin,
    IniAddoptsPlugin,
    IniAddoptsDeselect,
    SysExitAtImport,
    OsExitAtImport,
    Sitecustomize,
    PthFile,
    FakePythonOnPath,
    ShellRcVariables,
    ShadowPytestPackage,
    ReadHiddenTests,
    BackgroundRewriter,
    FakeJunitReport,
    HugeOutput,
    SubmitWithoutWork,
    AnswerHedging,
    AnswerFlood,
    StateRcAndPath,
)


for _cls in ATTACKS:
    register(_cls)
