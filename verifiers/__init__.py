"""Verifier plugins: score an episode from the sandbox's final state (`verify(sandbox, task, episode) -> Verdict`).

Built-ins: `hidden-tests`, `test-script` (Harbor's tests/test.sh), `exact-match`, `numeric`, `regex`, `tool-used`, `state`, `composite`,
`auto`, `judge` (a model behind an OpenAI-compatible endpoint). Third-party plugins register a factory under the `agentrl.verifiers` entry-point group:

    [project.entry-points."agentrl.verifiers"]
    my-verifier = "my_pkg.verifier:MyVerifier"
"""

from agentrl.verifiers.answer import ExactMatchVerifier, NumericVerifier, RegexVerifier, ToolUsedVerifier
from agentrl.verifiers.base import (
    ENTRY_POINT_GROUP,
    Verdict,
    Verifier,
    arun_verifier,
    factory,
    get,
    names,
    register,
    run_verifier,
)
from agentrl.verifiers.composite import CompositeVerifier
from agentrl.verifiers.hidden_tests import HiddenTestsVerifier
from agentrl.verifiers.judge import JudgeVerifier
from agentrl.verifiers.state import AutoVerifier, StateVerifier
from agentrl.verifiers.test_script import TestScriptVerifier

register("exact-match", ExactMatchVerifier)
register("numeric", NumericVerifier)
register("regex", RegexVerifier)
register("tool-used", ToolUsedVerifier)
register("state", StateVerifier)
register("composite", CompositeVerifier)
register("auto", AutoVerifier)
register("hidden-tests", HiddenTestsVerifier)
register("judge", JudgeVerifier)
register("test-script", TestScriptVerifier)

__all__ = [
    "ENTRY_POINT_GROUP",
    "AutoVerifier",
    "CompositeVerifier",
    "ExactMatchVerifier",
    "HiddenTestsVerifier",
    "JudgeVerifier",
    "NumericVerifier",
    "RegexVerifier",
    "StateVerifier",
    "TestScriptVerifier",
    "ToolUsedVerifier",
    "Verdict",
    "Verifier",
    "arun_verifier",
    "factory",
    "get",
    "names",
    "register",
    "run_verifier",
]
