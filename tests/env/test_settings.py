"""An environment's settings as a pydantic model: declared, validated where they are given, documented.

No sandbox: every environment here is built with `backend="local", use_pool=False` or not at all.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

import agentrl
from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.env.registry import check_env_kwargs, registry, settings_model
from agentrl.env.settings import EnvSettingsError, ToolEnvSettings, describe, type_name
from agentrl.env.tool_env import ToolEnv

ROOT = Path(__file__).resolve().parents[2]
AGENTRL = str(ROOT / ".venv/bin/agentrl")
BUILTINS = [
    "agentrl/calc-v0",
    "agentrl/calc-levels-v0",
    "agentrl/sqlite-v0",
    "agentrl/guess-number-v0",
    "agentrl/python-repair-v0",
    "agentrl/harbor-v0",
]
TASKS = [Task(id="s/0", prompt="Say 1.", answer="1")]


@pytest.mark.parametrize("env_id", BUILTINS)
def test_every_builtin_declares_its_settings_documented_and_matching_its_spec(env_id):
    model, declared = settings_model(env_id)
    assert declared and issubclass(model, ToolEnvSettings) and model is not ToolEnvSettings
    assert all(field.description for field in model.model_fields.values())
    assert model.model_fields["max_turns"].default == agentrl.spec(env_id).max_turns


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"max_turn": 3}, r"unknown key 'max_turn'\. Did you mean 'max_turns'\?"),
        ({"max_turns": "many"}, r"'max_turns': input should be a valid integer"),
        ({"max_turns": 0}, r"'max_turns': input should be greater than or equal to 1 \(got 0\)"),
        ({"require_python": "perhaps"}, r"'require_python': input should be a valid boolean"),
        ({"limits": {"memory": 512}}, r"unknown key 'limits\.memory'\. Did you mean 'limits\.memory_mb'\?"),
        ({"tool_timeout_s": -1}, r"tool_timeout_s must be > 0 seconds"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_wherever_it_is_given(kwargs, said):
    fix = r".*\(`agentrl env show agentrl/calc-v0` lists them\)$"
    for give in (
        lambda: check_env_kwargs("agentrl/calc-v0", kwargs),
        lambda: agentrl.make("agentrl/calc-v0", backend="local", use_pool=False, **kwargs),
    ):
        with pytest.raises(
            EnvSettingsError, match=r"^invalid settings of agentrl/calc-v0: .*" + said + fix
        ) as e:
            give()
        assert isinstance(e.value, UserError) and isinstance(e.value, ValueError)


def test_an_envs_own_settings_reach_it_typed():
    env = agentrl.make("agentrl/calc-levels-v0", backend="local", use_pool=False, level="2", seed=3)
    assert env.settings.level == 2 and env.settings.seed == 3  # "2" from a command line or YAML: coerced
    assert {t.metadata["level"] for t in (env.tasks.get(i, "train") for i in range(5))} == {2}
    with pytest.raises(EnvSettingsError, match=r"level must be in 0\.\.2 \(levels=3\), got 4"):
        check_env_kwargs("agentrl/calc-levels-v0", {"levels": 3, "level": 4})
    calc = agentrl.make("agentrl/calc-v0", backend="local", use_pool=False, require_python=False)
    assert calc.verifier.gates == [] and agentrl.make("agentrl/calc-v0", backend="local").verifier.gates


def test_python_repair_keeps_its_bytecode_setting_whatever_sandbox_env_is_given():
    from agentrl.envs.python_repair.env import PythonRepairSettings

    s = PythonRepairSettings(sandbox_env={"X": "1"}, packages="toolz, parse")
    assert s.sandbox_env == {"PYTHONDONTWRITEBYTECODE": "1", "X": "1"} and s.packages == ["toolz", "parse"]


def test_config_env_kwargs_are_checked_when_the_config_loads():
    from agentrl.eval.evaluate import EvalConfig
    from agentrl.train.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"invalid settings of agentrl/guess-number-v0: unknown key 'max_turn'"
    ):
        load_config(None, ["env=agentrl/guess-number-v0", "env_kwargs.max_turn=3"], model="m")
    assert load_config(None, ["env_kwargs.max_turns=3"], model="m").env_kwargs == {"max_turns": 3}
    with pytest.raises(ValueError, match=r"'exec_timeout_s': input should be a valid number"):
        EvalConfig(env="agentrl/sqlite-v0", models=["m"], env_kwargs={"exec_timeout_s": "long"})
    # An id that does not resolve is left for `make` to report, as before.
    assert EvalConfig(env="mylab/NoSuch-v0", models=["m"], env_kwargs={"anything": 1}).env_kwargs


class Difficult(ToolEnv):
    """A third-party subclass with a keyword argument of its own and no settings model of its own."""

    def __init__(self, *, difficulty: int = 1, **kw: Any):
        self.difficulty = difficulty
        super().__init__(tasks=TASKS, tools=["submit"], **kw)


def test_an_env_without_a_model_of_its_own_keeps_its_keyword_arguments():
    agentrl.register("test/Difficult-v0", Difficult, max_turns=2)
    try:
        assert settings_model("test/Difficult-v0") == (ToolEnvSettings, False)
        check_env_kwargs("test/Difficult-v0", {"difficulty": 3, "backend": "local"})  # its own: passed on
        with pytest.raises(EnvSettingsError, match="'max_turns': input should be a valid integer"):
            check_env_kwargs("test/Difficult-v0", {"difficulty": 3, "max_turns": "x"})  # ToolEnv's: checked
        env = agentrl.make("test/Difficult-v0", difficulty=3, backend="local", use_pool=False)
        assert env.difficulty == 3 and env.max_turns == 2
    finally:
        registry.pop("test/Difficult-v0")


class MazeSettings(BaseModel):
    size: int = Field(8, ge=2, description="Side of the maze, in cells.")
    backend: str = Field("docker", description="Sandbox backend.")


def maze(*, size: int, backend: str, env_id: str) -> ToolEnv:
    """A factory entry point: it declares no model, `register(settings=...)` does it for it."""
    return ToolEnv(
        tasks=[Task(id=f"maze/{size}", prompt="p")], tools=["submit"], backend=backend, env_id=env_id
    )


def test_a_factory_registered_with_a_model_gets_every_setting_validated():
    agentrl.register("test/Maze-v0", maze, settings=MazeSettings)
    try:
        assert settings_model("test/Maze-v0") == (MazeSettings, True)
        env = agentrl.make("test/Maze-v0", backend="local", size="12")
        assert env.tasks.get(0, "train").id == "maze/12"  # validated, coerced, the defaults filled in
        with pytest.raises(EnvSettingsError, match=r"unknown key 'sise'\. Did you mean 'size'\?"):
            agentrl.make("test/Maze-v0", sise=3)
        with pytest.raises(EnvSettingsError, match="'size': input should be greater than or equal to 2"):
            check_env_kwargs("test/Maze-v0", {"size": 1})
    finally:
        registry.pop("test/Maze-v0")


def loose(**kw: Any) -> ToolEnv:
    """A factory without a model: whatever it is given."""
    env = ToolEnv(tasks=TASKS, tools=["submit"], backend="local", env_id=kw.pop("env_id"))
    env.given = kw
    return env


def test_a_factory_registered_without_a_model_gets_its_kwargs_as_given():
    agentrl.register("test/Loose-v0", loose)
    try:
        assert settings_model("test/Loose-v0") == (None, False)
        marker = object()
        check_env_kwargs("test/Loose-v0", {"whatever": marker})
        assert agentrl.make("test/Loose-v0", whatever=marker).given == {"whatever": marker}
    finally:
        registry.pop("test/Loose-v0")


def test_tool_env_takes_its_settings_as_one_model_or_as_keywords():
    base = ToolEnvSettings(tasks=TASKS, tools=["submit"], max_turns=3, backend="local")
    env = ToolEnv(settings=base, max_turns=5, use_pool=False)
    assert (env.max_turns, env.backend, env.use_pool, base.max_turns) == (5, "local", False, 3)
    env.exec_timeout_s = 4  # attributes read and write the settings, validated
    assert env.settings.exec_timeout_s == 4.0 and env.step_budget_s == 8.0
    with pytest.raises(
        EnvSettingsError, match=r"settings of ToolEnv: 'exec_timeout_s': input should be greater than 0"
    ):
        env.exec_timeout_s = 0
    with pytest.raises(EnvSettingsError, match="settings of ToolEnv: unknown key 'foo'"):
        ToolEnv(tasks=TASKS, tools=["submit"], foo=1)
    with pytest.raises(EnvSettingsError, match="has no tools: give tools="):
        ToolEnv(tasks=TASKS)
    with pytest.raises(EnvSettingsError, match="has no tasks: give tasks="):
        ToolEnv(tools=["submit"])
    yaml_verifier = ToolEnv(tasks=TASKS, tools=["submit"], verifier=["regex", {"pattern": "1"}])
    assert yaml_verifier.verifier.name == "regex"  # (name, kwargs) as a YAML list


def test_describe_lists_an_envs_own_settings_first_with_types_and_defaults():
    from agentrl.envs.guess_number import GuessNumberSettings

    rows = describe(GuessNumberSettings)
    assert [r[0] for r in rows[:3]] == ["tools", "max_turns", "max_tool_calls_per_step"]
    assert rows[0][2] == "[guess]" and rows[1][1:3] == ("int", "12")
    assert type_name(ToolEnvSettings.model_fields["render_mode"].annotation) == "'ansi' | None"
    assert {r[0] for r in rows} == set(GuessNumberSettings.model_fields)


def test_env_show_prints_each_setting_with_its_type_default_and_description():
    out = subprocess.run(
        [AGENTRL, "env", "show", "agentrl/calc-levels-v0"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("settings:    (CalcLevelsSettings; set with agentrl.make") for line in lines)
    at = lines.index("  level: int | None = None")
    assert "Every task at this level" in lines[at + 1]
    assert "  max_turns: int = 4" in lines and "  require_python: bool = True" in lines
