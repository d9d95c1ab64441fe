"""The package's shape, checked from its source: which modules may import which, who may reach into
an environment's private parts, where the shared types are defined."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {
    "agentrl": ROOT / "agentrl",
    "agentrl.sandbox": ROOT / "sandbox",
    "agentrl.verifiers": ROOT / "verifiers",
    "agentrl.envs": ROOT / "envs",
}


def modules(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, Path]:
    """Every module of the distribution, by its import name."""
    out = {}
    for name, folder in package_dirs.items():
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


# --- the stages ---------------------------------------------------------------------------------
# Top to bottom. A module may import its own stage or a lower one, never a higher one: at module
# level, inside a function, or under TYPE_CHECKING alike (an import a type checker follows is an
# arrow in the drawing too). Every module belongs to exactly one stage (a new module is placed
# here), and the facade `agentrl/__init__.py` is the top: nothing inside the package imports from
# it (`from agentrl import make` in a module is an import that climbs back up).
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("facade", ("agentrl",)),
    ("command line", ("agentrl.cli",)),
    ("kit", ("agentrl.kit",)),
    ("train", ("agentrl.train",)),
    ("eval", ("agentrl.eval",)),
    ("checks", ("agentrl.checks",)),
    ("gateway", ("agentrl.gateway",)),
    ("rollout", ("agentrl.rollout",)),
    ("env", ("agentrl.env", "agentrl.envs")),
    ("verifiers", ("agentrl.verifiers",)),
    ("sandbox", ("agentrl.sandbox",)),
    ("core", ("agentrl.core",)),
)


def command_line(module: str) -> bool:
    """Whether `module` is in the command line stage (`agentrl.cli` and its command groups)."""
    return stage_of(module) == [name for name, _ in STAGES].index("command line")


def stage_of(module: str) -> int | None:
    """The index in STAGES of the stage `module` belongs to (0 is the top); None when unplaced.
    The facade is `agentrl` itself only; any other entry holds a module and its submodules."""
    for index, (_, members) in enumerate(STAGES):
        for member in members:
            if module == member or (member != "agentrl" and module.startswith(member + ".")):
                return index
    return None


def _within(name: str, known: dict[str, Path]) -> str | None:
    """The module of the distribution that importing `name` loads: itself, or the package that
    holds an attribute of that name (`agentrl.env.tools.tool` -> `agentrl.env.tools`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _literal(call: ast.Call) -> bool:
    """Whether the call's first argument is a string written in the source."""
    return bool(call.args) and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str)


def import_graph(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, set[str]]:
    """Module -> the modules of the distribution it imports, as grimp (import-linter) draws it:
    every `import` and `from ... import` at any depth (functions, TYPE_CHECKING blocks), relative
    imports resolved, `from pkg import sub` an import of `pkg.sub` (of `pkg` when `sub` is a name in
    it), and `importlib.import_module("literal")` an import of that module."""
    known = modules(package_dirs)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {_within(alias.name, known) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in known else _within(base, known))
            elif isinstance(node, ast.Call) and _called(node) == "import_module" and _literal(node):
                targets.add(_within(node.args[0].value, known))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def backward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher stage (or of a module no stage holds), as `importer -> imported`."""
    found = []
    for importer, imports in sorted(graph.items()):
        for target in sorted(imports):
            here, there = stage_of(importer), stage_of(target)
            if here is None or there is None or there < here:
                found.append(
                    f"{importer} ({STAGES[here][0] if here is not None else 'no stage'}) -> "
                    f"{target} ({STAGES[there][0] if there is not None else 'no stage'})"
                )
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_every_module_has_a_stage():
    unplaced = sorted(name for name in modules() if stage_of(name) is None)
    assert not unplaced, f"modules in no stage (add each to STAGES, at the stage it belongs to): {unplaced}"


def test_no_module_imports_a_higher_stage():
    """kit -> train -> eval -> checks -> gateway -> rollout -> env -> verifiers -> sandbox -> core: the
    arrows only point down (docs/LAYOUT.md). The rollout drives an episode an outside agent plays through
    its own protocol (`agentrl.rollout.driver`), which the gateway implements: it never imports the gateway."""
    backward = backward_imports(import_graph())
    assert not backward, "imports of a higher stage:\n" + "\n".join(backward)


def test_no_import_circles():
    circles = import_circles(import_graph())
    assert not circles, f"modules that import each other, directly or around a circle: {circles}"


def _copy_sources(tmp_path: Path) -> dict[str, Path]:
    """The distribution's Python files under tmp_path, with the same import names."""
    copies = {}
    for name, folder in PACKAGE_DIRS.items():
        dest = tmp_path / name
        for path in folder.rglob("*.py"):
            (dest / path.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
            (dest / path.relative_to(folder)).write_text(path.read_text())
        copies[name] = dest
    return copies


def test_the_checks_fail_on_a_planted_backward_import_and_circle(tmp_path):
    """The checks above are not vacuous: on a copy of the sources, a lazy import of the trainer from
    the core, a TYPE_CHECKING import of the facade from the sandbox, a lazy import of the gateway from
    the rollout loop and a relative import that closes a circle are each caught (compared with the same copy before the planting, so the test
    says whether the checker works, whatever the tree holds)."""
    copies = _copy_sources(tmp_path)
    backward_before = set(backward_imports(import_graph(copies)))
    circles_before = import_circles(import_graph(copies))
    task = copies["agentrl"] / "core" / "task.py"
    task.write_text(task.read_text() + "\n\ndef _planted():\n    from agentrl.train.trainer import train\n")
    spec = copies["agentrl.sandbox"] / "spec.py"
    spec.write_text(spec.read_text() + "\nif typing.TYPE_CHECKING:\n    from agentrl import make\n")
    types = copies["agentrl"] / "core" / "types.py"
    types.write_text(types.read_text() + "\n\ndef _planted():\n    from .episode import Episode\n")
    loop = copies["agentrl"] / "rollout" / "loop.py"
    loop.write_text(
        loop.read_text() + "\n\ndef _planted():\n    from agentrl.gateway.server import Gateway\n"
    )
    graph = import_graph(copies)
    assert set(backward_imports(graph)) - backward_before == {
        "agentrl.sandbox.spec (sandbox) -> agentrl (facade)",
        "agentrl.core.task (core) -> agentrl.train.trainer (train)",
        "agentrl.rollout.loop (rollout) -> agentrl.gateway.server (gateway)",
    }
    circles = import_circles(graph)
    planted_circle = ["agentrl.core.episode", "agentrl.core.types"]
    assert planted_circle in circles and planted_circle not in circles_before
    assert any({"agentrl.core.task", "agentrl.train.trainer"} <= set(circle) for circle in circles)
    assert not any({"agentrl.core.task", "agentrl.train.trainer"} <= set(circle) for circle in circles_before)


def private_crossings(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> list[str]:
    """Every private name (a leading underscore) a module takes from a module of another stage: imported
    (`from agentrl.gateway.session import _count`, a private module alike) or read off a module it imported
    (`import agentrl.rollout.loop as loop; loop._in_thread`), as `importer -> module.name`."""
    known = modules(package_dirs)
    found = []
    for name, path in sorted(known.items()):
        here = stage_of(name)
        bound: dict[str, str] = {}  # local name -> the module it is bound to
        taken: list[tuple[str, str]] = []  # (module, private name)
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname and alias.name in known:
                        bound[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in known:
                        bound[alias.asname or alias.name] = full
                    if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split(".")):
                        taken.append((node.module, alias.name))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.attr.startswith("_")
            ):
                module = bound.get(node.value.id)
                if module is not None and not node.attr.startswith("__"):
                    taken.append((module, node.attr))
        for module, private in taken:
            owner = _within(module, known)
            if owner is not None and stage_of(owner) != here:
                found.append(f"{name} -> {module}.{private}")
    return sorted(set(found))


def test_no_private_name_crosses_a_stage(tmp_path):
    """What a stage offers the others is its public names: a private one taken across stages is an arrow
    the drawing does not show (the two stages change together). Planted on a copy, each form is caught."""
    assert not private_crossings(), "private names used from another stage:\n" + "\n".join(
        private_crossings()
    )
    copies = _copy_sources(tmp_path)
    before = set(private_crossings(copies))
    loop = copies["agentrl"] / "rollout" / "loop.py"
    loop.write_text(
        loop.read_text() + "\n\ndef _planted():\n    from agentrl.core.types import _planted_name\n"
    )
    harness = copies["agentrl"] / "gateway" / "harness.py"
    harness.write_text(
        harness.read_text() + "\n\ndef _planted():\n    import agentrl.rollout.loop as loop\n\n"
        "    return loop._in_thread, loop.collect\n"
    )
    session = copies["agentrl"] / "gateway" / "session.py"
    session.write_text(
        session.read_text() + "\n\ndef _planted_inside():\n    from agentrl.gateway.server import _x\n"
    )
    assert set(private_crossings(copies)) - before == {
        "agentrl.rollout.loop -> agentrl.core.types._planted_name",
        "agentrl.gateway.harness -> agentrl.rollout.loop._in_thread",
    }


def test_nothing_in_the_core_imports_the_kit():
    """The kit (tiny model, tokenizer, demonstrations, warm start, demo) sits on top of the core:
    only the kit itself and the command line (whose `model`, `demos` and `demo` commands are the
    kit's) may import it."""
    offenders = {}
    for name, path in modules().items():
        if name.startswith("agentrl.kit") or command_line(name):
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
        if path == ROOT / "agentrl" / "env" / "tool_env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "_pick_task":
                users.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not users, f"private task accessor used outside the env: {users}"


def test_the_shared_types_are_defined_once():
    """`Message`, `FinishReason`, `Split`, `CallStatus`, `StepInfo` and `Verdict` live in agentrl.core.types
    only, the env contract (`AgentEnv`, `OracleEnv`, `Agent`) in agentrl.env.protocols only."""
    home = {
        name: "agentrl.core.types"
        for name in ("Message", "FinishReason", "Split", "CallStatus", "StepInfo", "Verdict")
    }
    home |= {name: "agentrl.env.protocols" for name in ("AgentEnv", "OracleEnv", "Agent")}
    shared = set(home)
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
    assert sorted(definitions) == sorted(home.items())


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
    "tasks": "how many tasks `agentrl eval` runs, and the fewer of each in-training evaluation",
    "samples": "samples per task of `agentrl eval`, and the fewer of each in-training evaluation",
    "max_turns": "an environment's turn limit (ToolEnvSettings), and `agentrl eval`'s override of it (None: the env's)",
    "backend": "an environment's sandbox backend (ToolEnvSettings), and the warm-start recipe's measured one",
    # OpenAI's request fields (agentrl.gateway.protocol: the wire format a harness sends), not settings.
    "tools": "an environment's tools (ToolEnvSettings), and the tools field of an OpenAI request",
    "name": "the W&B run's name, and the name field of an OpenAI chat message",
    "max_tokens": "one engine request's budget (SamplingConfig), and the max_tokens field of an OpenAI request",
    "metadata": "a task's metadata, and the metadata field of an OpenAI request",
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

    core = sorted(name for name in modules() if not (name.startswith("agentrl.kit") or command_line(name)))
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


BACKEND_NAMES = {"docker", "bwrap", "local"}


def _names_a_backend(node: ast.AST) -> bool:
    """A string constant that is a built-in backend's name, alone or in a tuple, list or set."""
    if isinstance(node, ast.Constant):
        return node.value in BACKEND_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_backend(e) for e in node.elts)
    return False


def backend_name_tests(path: Path) -> list[int]:
    """The lines of `path` that compare something with a built-in backend's name (`== "docker"`,
    `in ("docker", "bwrap")`)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(_names_a_backend(n) for n in [node.left, *node.comparators]):
            lines.append(node.lineno)
    return lines


def test_nothing_outside_the_sandbox_tests_a_backend_name(tmp_path):
    """Environments, checks, verifiers and task generators ask a backend's capabilities (`resident_executor`,
    `engine_images`, `outlives_process`, ...) or its provider, never its name: a backend of a plugin
    then works wherever a built-in does."""
    found = [
        f"{path.relative_to(ROOT)}:{line}"
        for name, path in modules().items()
        if not name.startswith("agentrl.sandbox")
        for line in backend_name_tests(path)
    ]
    assert not found, f"backend names tested outside agentrl.sandbox (ask its capabilities): {found}"
    planted = tmp_path / "planted.py"
    planted.write_text('def f(env):\n    return env.backend not in ("docker", "bwrap") or env.x == "local"\n')
    assert backend_name_tests(planted) == [2, 2]


# Addresses and names the tree may hold: this machine's, documentation names and addresses (RFC 2606,
# RFC 5737), and names that are not hosts at all (a Debian package, a Kubernetes resource).
_OUR_HOSTS = re.compile(
    r"^(127(\.\d+){1,3}|0\.0\.0\.0|localhost|\[::1\]|::1|([\w-]+\.)*example\.(com|org|net)"
    r"|(192\.0\.2|198\.51\.100|203\.0\.113)\.\d+)$"
)
NOT_HOSTS = {
    "docker.io": "the Debian package of the Docker engine (scripts/ensure-system.sh)",
    "nvidia.com": "nvidia.com/gpu, the Kubernetes resource name of a GPU (examples/k8s)",
}
_URL_HOST = re.compile(r"\b(?:https?|tcp|ssh|ftp|wss?|git)://(?:[^/\s\"'@]*@)?([A-Za-z0-9.-]+)")
_IPV4 = re.compile(r"(?<![\w.])(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3})(?![\w.])")
_DOMAIN = re.compile(r"(?<![\w.-])((?:[a-z0-9-]+\.)+(?:com|org|net|ai))\b")


def outside_hosts(text: str, allowed: re.Pattern[str] = _OUR_HOSTS) -> list[str]:
    """The host names and addresses in `text` that `allowed` does not match (by default: this machine's and
    documentation names): URL hosts with a dot (a single label such as `node2` is a placeholder), IPv4
    literals, bare .com/.org/.net/.ai names."""
    url_hosts = [h.rstrip(".") for h in _URL_HOST.findall(text)]
    found = [h for h in url_hosts if "." in h] + _IPV4.findall(text) + _DOMAIN.findall(text)
    return sorted({h for h in found if not allowed.match(h) and h not in NOT_HOSTS})


def test_no_outside_host_is_named_in_the_tree(tmp_path):
    """Code, tests and docs name no outside host: a tool's own default serves (debootstrap's mirror, W&B's
    server), and isolation tests aim at this machine's loopback (`tests/fixtures_net.py`)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    found = {}
    for name in listed.stdout.splitlines():
        path = ROOT / name
        if path.suffix in {".png", ".jpg", ".gz", ".whl"} or not path.is_file():
            continue
        hosts = outside_hosts(path.read_text(errors="ignore"))
        if hosts:
            found[name] = hosts
    assert not found, f"outside hosts named in the tree: {found}"
    # The detector, on documentation names (RFC 2606 / 5737) that only loopback is allowed beside here.
    planted = "mirror = 'http://deb.example.com/debian'; dns = '192.0.2.1'; see pkgs.example.org; http://127.0.0.1:80"
    loopback_only = re.compile(r"^127(\.\d+){3}$")
    assert outside_hosts(planted, loopback_only) == ["192.0.2.1", "deb.example.com", "pkgs.example.org"]
    assert outside_hosts(planted) == []
