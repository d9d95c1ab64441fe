"""The package's shape, checked from its source: which modules may import which, who may reach into
an environment's private parts, where the shared types are defined."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "agentrl": ROOT / "agentrl",
    "agentrl.sandbox": ROOT / "sandbox",
    "agentrl.verifiers": ROOT / "verifiers",
    "agentrl.envs": ROOT / "envs",
}


def modules() -> dict[str, Path]:
    """Every module of the distribution, by its import name."""
    out = {}
    for name, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([name, *parts])] = path
    return out


def imported(path: Path) -> set[str]:
    """The modules a file imports, at any depth (imports inside functions count)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_nothing_in_the_core_imports_the_kit():
    """The kit (tiny model, tokenizer, demonstrations, warm start, demo) sits on top of the core:
    only the kit itself and the command line (whose `model`, `demos` and `demo` commands are the
    kit's) may import it."""
    offenders = {}
    for name, path in modules().items():
        if name.startswith("agentrl.kit") or name == "agentrl.cli":
            continue
        kit = sorted(m for m in imported(path) if m == "agentrl.kit" or m.startswith("agentrl.kit."))
        if kit:
            offenders[name] = kit
    assert not offenders, f"core modules import the kit: {offenders}"


def test_the_scan_finds_imports_inside_functions(tmp_path):
    """The scan above misses nothing a lazy import hides: a function-level import is found."""
    path = tmp_path / "lazy.py"
    path.write_text(
        "def f():\n    from agentrl.kit.tiny_model import init_tiny\n    import agentrl.kit.demo\n"
    )
    assert {"agentrl.kit.tiny_model", "agentrl.kit.demo"} <= imported(path)


def test_nothing_outside_the_env_calls_its_private_task_accessor():
    """Task i of a split is public: `agentrl.task_source(env_id)` without an env, `env.tasks` with one."""
    users = []
    for path in [*modules().values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]:
        if path == ROOT / "agentrl" / "env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_pick_task":
                users.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not users, f"private task accessor used outside the env: {users}"


def test_the_shared_types_are_defined_once():
    """`Message`, `FinishReason`, `Split`, `CallStatus` and the env contract live in agentrl.types only."""
    shared = {"Message", "FinishReason", "Split", "CallStatus", "AgentEnv", "Agent", "StepInfo"}
    definitions = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            defined = []
            if isinstance(node, ast.ClassDef):
                defined = [node.name]
            elif isinstance(node, ast.Assign):
                defined = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                defined = [node.target.id]
            definitions += [(d, name) for d in defined if d in shared]
    assert sorted(definitions) == sorted((d, "agentrl.types") for d in shared)


# Fields that more than one config model declares with a default, on purpose: they are different
# settings that share a name. Anything else declared twice is one setting with two defaults.
SAME_NAME_DIFFERENT_SETTING = {
    "seed": "each run's (or one request's) own random stream",
    "split": "three splits: a task's own, `agentrl eval`'s, and the held-out one of in-training evaluation",
    "mode": "two settings: synchronous or asynchronous training; W&B online or offline",
    "out": "each command's own run directory",
    "env": "`agentrl train`'s environment and the warm-start recipe's, each the demo's by default",
    "env_kwargs": "each command's own overrides of agentrl.make",
    "lr": "each recipe's own schedule: GRPO's, SFT's, and the warm start's measured one",
    "warmup_steps": "each recipe's own schedule: GRPO's, SFT's, and the warm start's measured one",
    "epochs": "PPO epochs over each GRPO batch; passes over the SFT data (and the warm start's measured number)",
    "batch_size": "the warm-start recipe's measured SFT batch",
    "micro_batch_size": "the warm-start recipe's measured SFT micro-batch",
    "temperature": "SamplingConfig is one request's parameters, which the rollout fills from RolloutConfig",
    "top_p": "SamplingConfig is one request's parameters, which the rollout fills from RolloutConfig",
}


def config_models() -> list[type]:
    import importlib
    import pkgutil

    from pydantic import BaseModel

    import agentrl

    found = []
    for info in pkgutil.walk_packages(agentrl.__path__, "agentrl."):
        module = importlib.import_module(info.name)
        found += [
            obj
            for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == info.name
        ]
    return found


def test_each_config_default_is_defined_once():
    """A setting with a default is declared in one model: composed (`TrainConfig.rollout` is a
    `RolloutConfig`) or inherited (`StepSettings`), never re-declared with a default of its own."""
    from pydantic import BaseModel

    declared: dict[str, list[str]] = {}
    models = config_models()
    assert {"RolloutConfig", "TrainConfig", "EvalConfig", "SFTConfig", "StepSettings"} <= {
        m.__name__ for m in models
    }
    for model in models:
        for name in model.__annotations__:
            field = model.model_fields.get(name)
            if field is None or field.is_required():
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel):  # a composed section: its defaults are its model's
                continue
            declared.setdefault(name, []).append(f"{model.__module__}.{model.__qualname__}={default!r}")
    twice = {name: where for name, where in declared.items() if len(where) > 1}
    unexplained = {name: where for name, where in twice.items() if name not in SAME_NAME_DIFFERENT_SETTING}
    assert not unexplained, f"settings with a default in more than one model: {unexplained}"
    stale = set(SAME_NAME_DIFFERENT_SETTING) - set(twice)
    assert not stale, f"no longer declared twice, drop them from the list: {stale}"


def test_importing_the_core_loads_no_kit_module():
    """What the scan promises, checked at run time: every core module imported in a fresh interpreter
    (so module-level imports of imports count too) leaves no `agentrl.kit` module loaded."""
    import subprocess
    import sys

    core = sorted(name for name in modules() if not (name.startswith("agentrl.kit") or name == "agentrl.cli"))
    script = (
        "import importlib, sys\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'agentrl.kit' or m.startswith('agentrl.kit.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
