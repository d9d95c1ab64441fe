"""The one plugin registry (agentrl.core.plugins): names listed without importing, entry points found once,
one-line errors for a broken or unknown plugin, and all five plugin kinds going through it."""

from __future__ import annotations

import ast
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

from agentrl.core.errors import UserError
from agentrl.core.plugins import PluginError, Plugins, UnknownPluginError, load_target

ROOT = Path(__file__).resolve().parents[2]


def install(
    root: Path, monkeypatch: pytest.MonkeyPatch, dist: str, modules: dict[str, str], entry_points: str
) -> None:
    """A distribution `dist` with `modules` and `entry_points` (an entry_points.txt), importable from root."""
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))
    monkeypatch.syspath_prepend(str(root))
    for name in modules:
        monkeypatch.delitem(sys.modules, name, raising=False)


GREETERS = """
    def hello():
        return "hello"

    def shout():
        return "HEY"
"""


def test_builtins_and_entry_points_are_listed_without_importing_anything(tmp_path, monkeypatch):
    install(
        tmp_path,
        monkeypatch,
        "greeters",
        {"greeters_mod": GREETERS},
        "[test.greeters]\nshout = greeters_mod:shout\nhello = greeters_mod:hello\n",
    )
    plugins = Plugins("test.greeters", "greeter", builtins={"hello": "greeters_mod:hello", "wave": print})
    assert plugins.names() == ["hello", "wave", "shout"]  # own ones in order, then the installed, sorted
    assert "greeters_mod" not in sys.modules
    assert plugins.source("shout") == "entry point of greeters 1.0" and plugins.source("hello") == "built in"
    assert plugins.target("shout") == "greeters_mod:shout" and plugins.target("wave") is None
    assert plugins.get("shout")() == "HEY" and "greeters_mod" in sys.modules
    assert plugins.get("hello")() == "hello"  # the built-in, not the entry point of the same name
    assert "shout" in plugins and "whisper" not in plugins and list(plugins) == plugins.names()


def test_entry_points_are_listed_once_per_process_until_rescanned(tmp_path, monkeypatch):
    plugins = Plugins("test.late", "late plugin")
    assert plugins.names() == []
    install(tmp_path, monkeypatch, "late", {"late_mod": GREETERS}, "[test.late]\nhello = late_mod:hello\n")
    assert plugins.names() == []  # listed once: a package installed after the first look is not seen
    plugins.rescan()
    assert plugins.names() == ["hello"]


def test_an_unknown_name_is_one_line_with_the_closest_name_and_how_to_add_one():
    plugins = Plugins("test.nothing", "widget", builtins={"numeric": print, "regex": print})
    with pytest.raises(UnknownPluginError) as info:
        plugins.get("numerik")
    message = str(info.value)
    assert message == (
        "no widget named 'numerik'. Did you mean 'numeric'? Available: numeric, regex "
        "(a package adds one in the entry-point group 'test.nothing')"
    )
    # A looked-up name (KeyError) and a bad setting (ValueError), as callers caught before; for people.
    assert isinstance(info.value, KeyError | ValueError) and isinstance(info.value, UserError)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_a_broken_plugin_is_one_line_and_does_not_take_the_others_down(tmp_path, monkeypatch):
    install(
        tmp_path,
        monkeypatch,
        "mixed",
        {"good_mod": GREETERS, "bad_mod": "import no_such_module_at_all\n"},
        "[test.mixed]\ngood = good_mod:hello\nbad = bad_mod:thing\nmissing = good_mod:nope\n",
    )
    plugins = Plugins("test.mixed", "greeter")
    with pytest.raises(PluginError) as info:
        plugins.get("bad")
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, UserError)
    assert message.startswith("greeter 'bad' (bad_mod:thing, entry point of mixed 1.0, group 'test.mixed')")
    assert message.endswith("failed to load: ModuleNotFoundError: No module named 'no_such_module_at_all'")
    with pytest.raises(PluginError, match="failed to load: AttributeError: .*'nope'"):
        plugins.get("missing")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loaded = plugins.load_all()
    assert list(loaded) == ["good"]
    assert seen == []  # both failures were said already, by get: not again
    fresh = Plugins("test.mixed", "greeter")
    with pytest.warns(UserWarning) as said:
        assert list(fresh.load_all()) == ["good"]
    assert sorted(str(w.message).split(" (")[0] for w in said) == ["greeter 'bad'", "greeter 'missing'"]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        fresh.load_all()
    assert again == []  # once per plugin, not at every listing


def test_on_load_runs_once_per_plugin_even_from_many_threads():
    calls = []

    def on_load(name, obj):
        calls.append(name)
        return obj()

    plugins = Plugins("test.none", "thing", builtins={"answer": "operator:truth"}, on_load=on_load)
    plugins.register("made", lambda: 42)
    results = []
    threads = [threading.Thread(target=lambda: results.append(plugins.get("made"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [42] * 8 and calls == ["made"]


def test_on_load_refusing_an_object_is_a_plugin_error():
    def must_be_int(name, obj):
        if not isinstance(obj, int):
            raise TypeError(f"{obj!r} is not an int")
        return obj

    plugins = Plugins("test.none", "number", builtins={"one": 1, "text": "os.path:sep"}, on_load=must_be_int)
    assert plugins.get("one") == 1
    with pytest.raises(
        PluginError, match=r"number 'text' \(os.path:sep, built in.*is not a usable number: TypeError"
    ):
        plugins.get("text")


def test_register_refuses_a_taken_name_unless_asked_and_copies_are_independent():
    plugins = Plugins("test.none", "thing")
    plugins.register("a", print)
    plugins.register("a", print)  # the same object again: fine
    with pytest.raises(ValueError, match="a thing named 'a' is already registered"):
        plugins.register("a", len)
    with pytest.raises(ValueError, match="must look like 'package.module:attribute'"):
        plugins.register("b", "no_colon")
    copy = plugins.copy()
    copy.register("a", len, override=True)
    assert copy.get("a") is len and plugins.get("a") is print


def test_load_target_follows_dotted_attributes():
    assert load_target("os.path:join") is __import__("os").path.join
    assert load_target("agentrl.core.plugins:Plugins.get") is Plugins.get
    with pytest.raises(ValueError, match="must look like"):
        load_target("os.path")


# --- the five kinds ------------------------------------------------------------------------------


def test_the_five_plugin_kinds_go_through_the_one_registry():
    from agentrl.checks import audit
    from agentrl.env import registry
    from agentrl.sandbox import base
    from agentrl.train.curriculum import names
    from agentrl.verifiers import base as verifiers

    groups = {
        p.group: p
        for p in (
            registry.ENV_PLUGINS,
            verifiers.VERIFIERS,
            names.SAMPLERS,
            audit.ATTACK_PLUGINS,
            base.BACKENDS,
        )
    }
    assert set(groups) == {
        "agentrl.envs",
        "agentrl.verifiers",
        "agentrl.samplers",
        "agentrl.attacks",
        "agentrl.sandbox_backends",
    }
    assert all(isinstance(p, Plugins) for p in groups.values())


def test_nothing_else_reads_entry_points():
    """One way in: no module but agentrl.core.plugins lists entry points itself (four copies, each with its own
    lock and loaded flag, were here before)."""
    readers = []
    for folder in ("agentrl", "sandbox", "verifiers", "envs"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "agentrl" / "core" / "plugins.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                name = (
                    node.attr
                    if isinstance(node, ast.Attribute)
                    else node.id
                    if isinstance(node, ast.Name)
                    else None
                )
                if name == "entry_points":
                    readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not readers, f"entry points read outside agentrl.core.plugins: {readers}"


BACKEND = """
    from agentrl.sandbox.local import LocalSandbox
    from agentrl.sandbox.spec import Capabilities

    class EchoSandbox(LocalSandbox):
        backend = "echo"
        capabilities = Capabilities(background_processes=True, isolated=True)

    class NotASandbox:
        pass
"""


def test_a_sandbox_backend_installed_by_entry_point_opens_pools_and_states_its_capabilities(
    tmp_path, monkeypatch
):
    from agentrl.sandbox import base

    base.BACKENDS.discover()  # listed before the package is installed: so it must stay unseen after the block
    install(
        tmp_path,
        monkeypatch,
        "echo-backend",
        {"echo_backend": BACKEND},
        "[agentrl.sandbox_backends]\necho = echo_backend:EchoSandbox\nbroken = echo_backend:NotASandbox\n",
    )
    with base.BACKENDS.isolated():
        base.BACKENDS.rescan()
        check_the_echo_backend()
    assert "echo" not in base.BACKENDS  # gone with the block


def check_the_echo_backend():
    from agentrl.sandbox import base
    from agentrl.sandbox.pool import PoolKey, SandboxPool

    assert base.BACKENDS.names() == ["docker", "bwrap", "local", "broken", "echo"]
    assert "echo_backend" not in sys.modules  # listed, not imported
    assert base.backend_capabilities("echo").lacking("isolated", "protected_dir") == ("protected_dir",)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the local backend's own "no isolation" warning
        with base.open_sandbox("echo") as sb:
            assert type(sb).__name__ == "EchoSandbox" and sb.exec("echo hi").stdout == "hi\n"
        with SandboxPool(size=1) as pool:
            sb = pool.acquire_key(PoolKey.make("echo"))
            assert sb.backend == "echo"
            pool.release(sb)
    with pytest.raises(PluginError, match=r"sandbox backend 'broken' .* lacks the Sandbox methods \['exec'"):
        base.open_sandbox("broken")


def test_a_verifier_needing_capabilities_names_the_backends_that_have_them_despite_a_broken_plugin(
    tmp_path, monkeypatch
):
    from agentrl.sandbox import base
    from agentrl.verifiers.base import capability_refusal

    install(
        tmp_path,
        monkeypatch,
        "broken-backend",
        {"broken_backend": "raise RuntimeError('cannot start')\n"},
        "[agentrl.sandbox_backends]\nbroken = broken_backend:Sandbox\n",
    )

    class NeedsIsolation:
        name = "isolated-only"
        needs_capabilities = ("isolated", "verifier_identity")

    local = base.backend_class("local")
    with base.BACKENDS.isolated(), warnings.catch_warnings():
        base.BACKENDS.rescan()
        warnings.simplefilter("ignore")
        assert "broken" in base.BACKENDS
        with local(base.SandboxSpec()) as sb:
            why = capability_refusal(NeedsIsolation(), sb)
    assert why is not None and why.endswith("(backends that have them: docker, bwrap)")
