"""agentrl ids are Gymnasium ids too: `gymnasium.make` builds every built-in environment, and
Gymnasium's own `check_env` passes on each."""

from __future__ import annotations

import subprocess
import sys
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env as gymnasium_check_env

import agentrl
from agentrl.envs.python_repair.synth import SynthConfig, synthesize

BUILTIN_IDS = [
    "agentrl/calc-v0",
    "agentrl/calc-levels-v0",
    "agentrl/sqlite-v0",
    "agentrl/guess-number-v0",
    "agentrl/python-repair-v0",
    "agentrl/harbor-v0",
    "agentrl/sqlite-mcp-v0",
]


def test_every_builtin_id_is_registered_with_gymnasium():
    assert set(BUILTIN_IDS) <= set(gymnasium.registry)
    assert {s.id for s in agentrl.env.registry.all_specs() if s.id.startswith("agentrl/")} == set(BUILTIN_IDS)


def test_import_agentrl_alone_makes_the_ids_known_to_gymnasium():
    code = "import gymnasium, agentrl; env = gymnasium.make('agentrl/guess-number-v0'); print(env.unwrapped.env_id)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "agentrl/guess-number-v0"


def test_a_third_party_id_is_registered_with_gymnasium_when_registered():
    agentrl.register("thirdparty/Echo-v0", "agentrl.envs.guess_number:GuessNumberEnv", max_turns=3)
    try:
        env = gymnasium.make("thirdparty/Echo-v0", max_turns=5)
        assert env.unwrapped.max_turns == 5 and env.unwrapped.env_id == "thirdparty/Echo-v0"
        env.close()
    finally:
        agentrl.env.registry.registry.pop("thirdparty/Echo-v0")
        gymnasium.registry.pop("thirdparty/Echo-v0")


@pytest.fixture(scope="module")
def repair_tasks(tmp_path_factory):
    """One synthesized python-repair task (a fresh machine has no task cache yet)."""
    return synthesize(
        ["inflection"], 1, SynthConfig(seed=7, cache_dir=tmp_path_factory.mktemp("synth"))
    ).tasks


@pytest.mark.docker
@pytest.mark.parametrize("env_id", BUILTIN_IDS)
def test_gymnasium_make_and_gymnasiums_check_env_pass(env_id, repair_tasks):
    kwargs = {"tasks": repair_tasks, "max_turns": 2} if env_id == "agentrl/python-repair-v0" else {}
    env = gymnasium.make(env_id, **kwargs)
    try:
        assert isinstance(env.unwrapped, agentrl.ToolEnv) and env.unwrapped.env_id == env_id
        obs, info = env.reset(seed=3)
        assert [m["role"] for m in obs] == ["system", "user"] and "task_id" in info
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gymnasium_check_env(env.unwrapped, skip_render_check=True)
        failures = [
            str(w.message) for w in caught if "WARN" in str(w.message) and "render" not in str(w.message)
        ]
        assert not failures, failures
    finally:
        env.close()
