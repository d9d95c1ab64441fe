from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import agentrl
from agentrl.core.task import Task
from agentrl.env.registry import EnvSpec, parse_env_id, registry
from agentrl.env.tool_env import ToolEnv
from agentrl.envs.calc import CalcTaskGenerator

ROOT = Path(__file__).resolve().parents[2]


def test_parse_env_id():
    assert parse_env_id("agentrl/calc-v0") == ("agentrl", "calc", 0)
    assert parse_env_id("agentrl/guess-number-v12") == ("agentrl", "guess-number", 12)
    assert parse_env_id("Plain") == (None, "Plain", None)
    with pytest.raises(ValueError, match="malformed environment id"):
        parse_env_id("a/b/c-v0")


def test_builtins_registered_without_importing_them():
    assert {"agentrl/calc-v0", "agentrl/sqlite-v0", "agentrl/guess-number-v0"} <= set(registry)
    code = "import agentrl, sys; agentrl.spec('agentrl/calc-v0'); print('agentrl.envs.calc' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False"]


def test_make_applies_spec_defaults_and_overrides():
    env = agentrl.make("agentrl/guess-number-v0")
    assert env.max_turns == 12 and isinstance(env.spec, EnvSpec) and env.spec.id == "agentrl/guess-number-v0"
    env = agentrl.make("agentrl/guess-number-v0", max_turns=3)
    assert env.max_turns == 3 and env.spec.max_turns == 3


def test_max_tool_calls_per_step_from_the_spec_the_class_or_the_caller():
    # ToolEnv's default, the game's own (one guess per turn), a spec's, and the caller's, in that order.
    assert agentrl.make("agentrl/calc-v0", backend="local").max_tool_calls_per_step == 4
    assert agentrl.make("agentrl/guess-number-v0").spec.max_tool_calls_per_step == 1
    agentrl.register("test/CalcTwo-v0", "agentrl.envs.calc:CalcEnv", max_tool_calls_per_step=2)
    try:
        env = agentrl.make("test/CalcTwo-v0", backend="local")
        assert env.max_tool_calls_per_step == 2 and env.spec.max_tool_calls_per_step == 2
        assert (
            agentrl.make(
                "test/CalcTwo-v0", backend="local", max_tool_calls_per_step=6
            ).max_tool_calls_per_step
            == 6
        )
    finally:
        registry.pop("test/CalcTwo-v0")
    with pytest.raises(ValueError, match="max_tool_calls_per_step must be >= 1"):
        agentrl.register("test/Bad-v0", "agentrl.envs.calc:CalcEnv", max_tool_calls_per_step=0)


def test_did_you_mean_and_missing_version():
    with pytest.raises(KeyError, match="Did you mean 'agentrl/calc-v0'"):
        agentrl.make("agentrl/cacl-v0")
    with pytest.raises(
        KeyError, match=r"version v7 does not exist. Versions registered: \['agentrl/calc-v0'\]"
    ):
        agentrl.spec("agentrl/calc-v7")


def test_register_custom_env_and_bad_entry_points():
    agentrl.register(
        "test/Guess-v1", "agentrl.envs.guess_number:GuessNumberEnv", max_turns=5, description="custom", seed=3
    )
    try:
        env = agentrl.make("test/Guess-v1")
        assert env.max_turns == 5 and env.tasks.generator.seed == 3
        with pytest.raises(ValueError, match="must look like 'package.module:ClassName'"):
            agentrl.register("test/Bad-v0", "no_colon_here")
        agentrl.register("test/Missing-v0", "agentrl.envs.guess_number:Nope")
        with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
            agentrl.make("test/Missing-v0")
    finally:
        for k in ("test/Guess-v1", "test/Missing-v0"):
            registry.pop(k, None)


@pytest.fixture(scope="module")
def plugin_package(tmp_path_factory):
    """A throw-away third-party package that registers an env and a verifier through entry points."""
    root = tmp_path_factory.mktemp("plugin")
    pkg = root / "agentrl_demo_plugin"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent("""
        from dataclasses import dataclass
        import agentrl
        from agentrl.verifiers import Verdict

        def register_envs():
            agentrl.register("demo-plugin/Echo-v0", "agentrl_demo_plugin:EchoEnv", max_turns=2,
                             description="third-party echo env")

        @dataclass
        class ShoutVerifier:
            name: str = "shout"
            def verify(self, sandbox, task, episode):
                ok = (episode.submission or "") == (task.answer or "").upper()
                return Verdict(float(ok), ok, "shouted" if ok else "not shouted")

        from agentrl.env.tool_env import ToolEnv
        from agentrl.core.task import Task

        class EchoEnv(ToolEnv):
            def __init__(self, **kw):
                kw.setdefault("verifier", "shout")
                super().__init__(tasks=[Task(id="echo/0", prompt="Say hi loudly.", answer="hi")], tools=["submit"], **kw)
    """)
    )
    (root / "pyproject.toml").write_text(
        textwrap.dedent("""
        [build-system]
        requires = ["setuptools>=70.1"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "agentrl-demo-plugin"
        version = "0.0.1"
        [project.entry-points."agentrl.envs"]
        demo = "agentrl_demo_plugin:register_envs"
        [project.entry-points."agentrl.verifiers"]
        shout = "agentrl_demo_plugin:ShoutVerifier"
        [tool.setuptools]
        packages = ["agentrl_demo_plugin"]
    """)
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", str(root)], check=True)
    yield root
    subprocess.run([*pip, "uninstall", "-y", "agentrl-demo-plugin"], check=True)


@pytest.mark.slow
def test_third_party_env_and_verifier_found_through_entry_points(plugin_package):
    code = textwrap.dedent("""
        import agentrl, sys
        from agentrl.env.agents import run_episode, tool_call
        assert "agentrl_demo_plugin" not in sys.modules          # lazy: not loaded at import
        env = agentrl.make("demo-plugin/Echo-v0")
        assert env.verifier.name == "shout"                        # plugin verifier, named by the plugin env
        class Shouter:
            def act(self, obs): return tool_call("submit", answer="HI")
        print(run_episode(env, Shouter(), seed=0).reward)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "1.0"
    listing = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "envs", "list"], capture_output=True, text=True, check=True
    )
    assert "demo-plugin/Echo-v0" in listing.stdout and "third-party echo env" in listing.stdout


def test_module_prefix_imports_the_module_that_registers(monkeypatch):
    """`"pkg.module:ns/Env-v0"` imports pkg.module first, as gymnasium.make does."""
    # As if never imported (another test may have imported it already): the prefix must import it.
    monkeypatch.delitem(sys.modules, "tests.coin_env", raising=False)
    for env_id in ("test/Coin-v0", "test/CoinBox-v0"):
        monkeypatch.delitem(registry, env_id, raising=False)
    env = agentrl.make("tests.coin_env:test/Coin-v0")
    assert env.spec.id == "test/Coin-v0"
    with pytest.raises(ImportError, match="cannot import 'no_such_module_xyz'"):
        agentrl.make("no_such_module_xyz:test/Coin-v0")


def test_an_unknown_id_says_how_to_make_a_module_of_yours_register_it():
    with pytest.raises(KeyError, match=r"name the module before the id, `your_module:mylab/Nothing-v0`"):
        agentrl.spec("mylab/Nothing-v0")
    # The module imports, but registers something else: said so, with the id it did register.
    with pytest.raises(
        KeyError, match=r"tests.coin_env was imported but registered no such id.*'test/Coin-v0'"
    ):
        agentrl.spec("tests.coin_env:test/Coin-v9")


def test_module_id_under_the_console_script_finds_the_module_in_the_current_directory(tmp_path):
    """The `agentrl` console script's sys.path starts at its bin directory, not the current one: a
    `mylab.agents:mylab/X-v0` id run from the directory that holds `mylab/` works without PYTHONPATH=."""
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "agents.py").write_text(
        "import agentrl\n"
        "agentrl.register('mylab/Here-v0', 'tests.coin_env:CoinEnv', description='found from the cwd')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)  # only for `tests.coin_env`, the entry point; not the current directory
    res = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "env", "show", "mylab.agents:mylab/Here-v0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "found from the cwd" in res.stdout
    # Without the module, the plain id says how to name it.
    res = subprocess.run(
        [str(ROOT / ".venv/bin/agentrl"), "env", "show", "mylab/Here-v0"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "`your_module:mylab/Here-v0`" in res.stderr, res.stderr


class Unbuildable(ToolEnv):
    """An environment whose constructor must never run: its tasks come from `make_tasks` alone."""

    task_generator = CalcTaskGenerator

    def __init__(self, **kw):
        raise AssertionError("task_source built the environment")


class TasksInInit(ToolEnv):
    """A subclass that picks its tasks in `__init__` (the common third-party shape)."""

    def __init__(self, **kw):
        super().__init__(tasks=[Task(id=f"x/{i}", prompt=str(i)) for i in range(3)], tools=["submit"], **kw)


def test_task_source_reads_tasks_without_building_the_environment():
    agentrl.register("test/Unbuildable-v0", Unbuildable, seed=5)
    try:
        source = agentrl.task_source("test/Unbuildable-v0", split="test")
        assert source.get(3, "test") == CalcTaskGenerator(5).generate(3, "test")
        assert agentrl.get_task("test/Unbuildable-v0", 3, split="test") == source.get(3, "test")
    finally:
        registry.pop("test/Unbuildable-v0", None)


def test_task_source_of_the_builtins_is_what_the_environment_poses():
    env = agentrl.make("agentrl/calc-v0", seed=2)
    try:
        assert agentrl.get_task("agentrl/calc-v0", 4, split="validation", seed=2) == env.tasks.get(
            4, "validation"
        )
    finally:
        env.close()


def test_task_source_builds_an_environment_that_picks_its_tasks_in_init():
    agentrl.register("test/TasksInInit-v0", TasksInInit)
    try:
        source = agentrl.task_source("test/TasksInInit-v0")
        assert source.size("train") == 3 and source.get(1, "train").id == "x/1"
    finally:
        registry.pop("test/TasksInInit-v0", None)
