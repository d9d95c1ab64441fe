import os
import subprocess
import time
from pathlib import Path

import pytest

import agentrl
from agentrl.checks.env_check import check_env, garbage_actions
from agentrl.core.task import Task
from agentrl.env.parsers import get_parser
from agentrl.env.registry import all_specs
from agentrl.env.tool_env import ToolEnv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.docker
@pytest.mark.parametrize("env_id", [s.id for s in all_specs() if s.id.startswith("agentrl/")])
def test_check_env_on_every_registered_id(env_id):
    env = agentrl.make(env_id)
    check_env(env)


class NonDeterministic(ToolEnv):
    """Ignores the seed: picks a task from a counter."""

    counter = 0

    def _pick_task(self, options):
        NonDeterministic.counter += 1
        return Task(id=f"t{self.counter}", prompt=f"task {self.counter}", answer="1")


def test_check_env_catches_a_non_deterministic_reset():
    env = NonDeterministic(tasks=[], tools=["submit"], backend="local", use_pool=False)
    with pytest.raises(AssertionError, match="not deterministic"):
        check_env(env)


def test_check_env_rejects_non_envs():
    with pytest.raises(AssertionError, match="not a gymnasium.Env"):
        check_env(object())


@pytest.mark.parametrize("parser", ["hermes", "llama3-json"])
def test_every_garbage_action_is_a_mistake_in_the_envs_own_format(parser):
    """None of them is read as a well-formed call: each parses to an error, or to no call at all."""
    fmt = get_parser(parser)
    actions = garbage_actions(fmt)
    assert {"broken json", "unknown tool", "arguments not an object", "cut short"} <= set(actions)
    for label, text in actions.items():
        parsed = fmt.parse(text)
        known = [c for c in parsed.calls if c.name != "definitely_not_a_tool"]
        assert parsed.errors or not known, (label, text, parsed)


def test_check_env_passes_a_pure_env_in_llama3_json():
    env = ToolEnv(
        tasks=[Task(id="t", prompt="Say 1.", answer="1")],
        tools=["submit"],
        parser="llama3-json",
        backend="local",
        use_pool=False,
    )
    check_env(env)


# --- `agentrl env check` on an environment whose tool or verifier hangs: it finishes -------------


def run_env_check(env_id: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    res = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "env", "check", env_id, "--backend", "local", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    return res, time.monotonic() - t0


def test_env_check_finishes_on_a_hanging_host_tool_and_says_why_the_oracle_failed():
    """The oracle calls a tool that sleeps an hour: each episode ends at the tool's deadline, and the
    command exits (the abandoned call's thread does not hold the process)."""
    res, elapsed = run_env_check("tests.hanging_envs:test/HangingTool-v0", "--tasks", "2")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "[ok] tests.hanging_envs:test/HangingTool-v0: check_env passed" in res.stdout
    assert res.stdout.count("did not return within its 1s deadline (tool_timeout_s)") == 2, res.stdout
    assert "[!!] oracle solved 0/2 tasks" in res.stdout
    assert elapsed < 120, elapsed  # two 1 s deadlines and the start-up, not two hours


def test_env_check_finishes_on_a_hanging_verifier():
    res, elapsed = run_env_check("tests.hanging_envs:test/HangingVerifier-v0", "--tasks", "1")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "check_env passed" in res.stdout
    assert "verifier 'hanging' exceeded its 1s deadline" in res.stdout
    assert elapsed < 120, elapsed


def test_env_check_of_a_harness_env_checks_the_environment_it_plays():
    """`agentrl env check` on a harness env (`agentrl.gateway:HarnessEnv`): the contract and the oracle of the
    environment its agent plays; the harness itself is not a gymnasium env and is not what is checked."""
    res, _ = run_env_check("tests.coin_env:test/PickHarness-v0", "--tasks", "2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "is a harness: checking the environment it plays, test/Pick-v0" in res.stdout
    assert "check_env passed" in res.stdout and "[ok] oracle solved 2/2 tasks" in res.stdout
