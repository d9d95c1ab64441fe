"""The hidden-tests runner: runs INSIDE the sandbox, as the verifier identity, never imported on the host.

`agentrl.verifiers.hidden_tests` runs `python3 -I -B -c BOOTSTRAP`, where BOOTSTRAP
compiles and runs this file's text read from stdin; the MAC key and then the run's settings (a
length-prefixed JSON object) follow the program on stdin and are read by `main` into locals.
So neither the program, the key nor the settings exist on the sandbox's disk, in an environment
block, on a command line, as a module global or as a constant of any code object; `main`
drops the settings before pytest starts, keeping only what the run needs. The one setting that
stays in the process, the node ids to keep (`select`), is a set of every member of every twin
set alike: read by the code under test, it says nothing about which member is real. It must run
on the image's own interpreter and pytest (3.8+, pytest 7+): standard library only, plain
syntax.

What it does, in order (the `hidden_tests` module docstring says why):

1. Keeps the command's stdout for its own records (the *result stream*) and points fd 1 at
   stderr, so nothing else (pytest, the tests, the code under test) writes into the stream
   by accident.
2. Every record is one line, `MAC<TAB>SEQ<TAB>KIND<TAB>FIELD...`: fields are Python
   literals, SEQ counts from 0, MAC is HMAC-SHA256 over the rest, keyed by KEY (held only in
   OpenSSL's state once the emitter exists). Records go out the moment they exist: a test's
   outcome is in the stream before the next test starts, so nothing the code under test does
   later (atexit, os._exit, a rewritten file) can take it back.
3. Imports pytest and every default plugin, then takes a *guard* snapshot: the identity of
   every module, class and function of pytest, pluggy and their dependencies, of this runner,
   of builtins and of sys's functions, all before the workspace is importable.
4. Installs an audit hook (`sys.addaudithook`: it cannot be removed) that records a `tamper`
   record on events that a test run does not need and forging does: attribute writes to
   the guarded classes and functions (`__code__` swaps included) and to hidden tests'
   functions, ctypes memory access, the gc's object graph, other threads' frames,
   trace/profile functions, /proc/*/mem. If the record cannot be written, the hook raises,
   so the operation fails instead of passing unseen.
5. Restricts the workspace to source files: a path hook gives workspace directories a
   finder whose only loader compiles `.py` sources and never reads bytecode (`__pycache__`,
   a sourceless `.pyc`, an unchecked hash-based `.pyc`) or loads extension modules (`.so`).
6. Appends the workspace to sys.path and runs pytest with a reporter plugin that streams
   collection errors, the collected node ids, and every test phase's outcome, and re-checks
   the guard (all of it after collection and at the end; the plugins, hook implementations
   and the test's own function at each test).
7. Writes `end` with pytest's exit status and exits with it.
"""

import os
import sys


def _emitter(fd, key):
    """The only way records are written: signed, numbered, written whole, one at a time."""
    import _thread
    import itertools

    try:
        import _hashlib

        proto = _hashlib.hmac_new(key, digestmod="sha256")
    except Exception:  # no OpenSSL: the pure-Python HMAC (same MACs)
        import hmac

        proto = hmac.new(key, digestmod="sha256")
    counter = itertools.count()

    # Everything it calls is bound here, as default values: replacing `os.write`, `repr` or the
    # hmac module later changes nothing here, and rebinding the defaults is an audited event.
    # The fields are rendered before the lock (repr can run other code, which can emit); under
    # the lock only C code runs, so records from several threads never interleave or reorder.
    def emit(kind, *fields, _write=os.write, _fd=fd, _proto=proto, _next=counter.__next__, _repr=repr,
             _len=len, _lock=_thread.RLock()):  # fmt: skip
        payload = "\t".join([kind, *[_repr(f) for f in fields]])
        with _lock:
            body = str(_next()) + "\t" + payload
            mac = _proto.copy()
            mac.update(body.encode("utf-8", "backslashreplace"))
            line = (mac.hexdigest()[:32] + "\t" + body + "\n").encode("utf-8", "backslashreplace")
            done = 0
            while done < _len(line):
                done += _write(_fd, line[done:])

    return emit


KEY_HEX_CHARS = 64
SETTINGS_LEN_CHARS = 8

# What the snapshot covers: pytest, pluggy (its hook machinery), unittest (which runs
# TestCase-style tests: its _callTestMethod decides what a test does) and this runner. Their
# dependencies (py, iniconfig, attrs, packaging) shape configuration, not outcomes, and are
# left out to keep the snapshot cheap.
GUARDED_ROOTS = ("pytest", "_pytest", "pluggy", "unittest", "__main__")
# Checked at every test, not only after collection and at the end: where outcomes are made.
CRITICAL = (
    "_pytest.runner",
    "_pytest.reports",
    "_pytest.skipping",
    "_pytest.outcomes",
    "_pytest.python",
    "_pytest.main",
    "pluggy._callers",
    "pluggy._hooks",
    "pluggy._manager",
    "unittest.case",
    "__main__",
)
# Audit events a hidden-test run has no use for and a forger does (module docstring, step 4).
FLAGGED_EVENTS = frozenset(
    {
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
        "sys._current_frames",
        "sys.settrace",
        "sys.setprofile",
        "ctypes.cdata",
        "ctypes.addressof",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.dlsym",
        "ctypes.dlsym/handle",
        "ctypes.call_function",
    }
)


def _guarded(name):
    return name.split(".", 1)[0] in GUARDED_ROOTS


def _functions_of(value):
    """The plain functions a module or class attribute holds (through method wrappers).
    Type checks only: touching an attribute of an arbitrary object can run its code."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [f for f in (value.fget, value.fset, value.fdel) if isinstance(f, _FunctionType)]
    return [value] if isinstance(value, _FunctionType) else []


_FunctionType = type(_functions_of)
_ModuleType = type(sys)
_CONSTANT_TYPES = (type(None), bool, int, float, str, bytes)


class Guard:
    """Identity snapshot of the harness, taken before the workspace is importable.

    Until pytest's session starts, its own plugins still adjust its classes (`pytest_configure`
    of the legacypath plugin adds properties to Config, Node, Cache): a change whose new value
    is itself harness code (a guarded function, or a property/method over one) or a plain
    constant is taken into the snapshot then (`settle`). From the session's start on, every
    change is tampering.
    """

    def __init__(self):
        import builtins

        self.modules = {}  # name -> (module, copy of its dict)
        self.classes = {}  # id -> (class, copy of its dict)
        self.functions = {}  # id -> (function, code, defaults, kwdefaults)
        for name, mod in list(sys.modules.items()):
            if mod is None or not _guarded(name):
                continue
            self.modules[name] = (mod, dict(vars(mod)))
            for value in list(vars(mod).values()):
                self._take(value)
        self.builtins = dict(vars(builtins))
        # The files of every module loaded before the workspace is importable: a test's
        # decorator may come from one of them, never from the workspace.
        self.files = frozenset(
            f for m in list(sys.modules.values()) if isinstance(f := getattr(m, "__file__", None), str)
        )
        self.sys_functions = {
            k: v for k, v in vars(sys).items() if type(v).__name__ == "builtin_function_or_method"
        }
        self.ids = set(self.classes) | set(self.functions)
        self._flat = None

    def _take(self, value):
        if isinstance(value, type) and _guarded(getattr(value, "__module__", "") or ""):
            if id(value) in self.classes:
                return
            self.classes[id(value)] = (value, dict(vars(value)))
            for inner in list(vars(value).values()):
                self._take(inner)
            return
        for fn in _functions_of(value):
            if _guarded(getattr(fn, "__module__", "") or "") and id(fn) not in self.functions:
                self.functions[id(fn)] = (fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__)

    def harness_value(self, value):
        """Whether a value is made of harness code only (see the class docstring)."""
        if isinstance(value, _CONSTANT_TYPES):
            return True
        if isinstance(value, type):
            return id(value) in self.classes
        if isinstance(value, _ModuleType):
            return _guarded(value.__name__)
        if id(type(value)) in self.classes:  # pytest's own objects (a plugin manager, a config)
            return True
        value = getattr(value, "__func__", value) if type(value).__name__ == "method" else value
        if type(value).__name__ == "partial":  # functools.partial over harness code
            value = value.func
        fns = _functions_of(value)
        return bool(fns) and all(id(f) in self.ids for f in fns)

    def settle(self):
        """Take pytest's own configure-time changes into the snapshot; return the other changes."""
        out = []
        for snaps in ([v for v in self.modules.values()], [v for v in self.classes.values()]):
            for owner, snap in snaps:
                now = vars(owner)
                for key in set(now) | set(snap):
                    before, after = snap.get(key, _MISSING), now.get(key, _MISSING)
                    if before is after or key in _VOLATILE:
                        continue
                    if after is not _MISSING and self.harness_value(after):
                        snap[key] = after
                        if isinstance(after, type):
                            continue
                        for fn in _functions_of(after):
                            self.functions.setdefault(
                                id(fn), (fn, fn.__code__, fn.__defaults__, fn.__kwdefaults__)
                            )
                    else:
                        out.append(
                            f"{getattr(owner, '__name__', owner)}.{key} was changed before the session started"
                        )
        self.ids = set(self.classes) | set(self.functions)
        self._flat = None
        return out + self.check()

    def quick(self):
        """The functions and classes among the CRITICAL modules' globals, as a flat list (about
        50 us per test); the full check covers the rest after collection and at the end."""
        if self._flat is None:
            self._flat = [
                (vars(self.modules[n][0]), k, v)
                for n in CRITICAL
                if n in self.modules
                for k, v in self.modules[n][1].items()
                if k not in _VOLATILE
                and (isinstance(v, (type, _FunctionType)) or type(v).__name__ == "builtin_function_or_method")
            ]
        return [
            f"{d.get('__name__')}.{k} was replaced" for d, k, v in self._flat if d.get(k, _MISSING) is not v
        ]

    def check(self):
        """What changed since the snapshot (empty: nothing)."""
        import builtins

        out = []
        for name, (mod, snap) in self.modules.items():
            if sys.modules.get(name) is not mod:
                out.append(f"sys.modules[{name!r}] was replaced")
            now = vars(mod)
            for key, value in snap.items():
                if now.get(key, _MISSING) is not value and key not in _VOLATILE:
                    out.append(f"{name}.{key} was replaced")
            for key in now.keys() - snap.keys():
                # A new global can shadow a builtin the module calls; a submodule imported
                # later (pytest imports some lazily) is the only addition that is its own.
                value = now[key]
                if key not in _VOLATILE and not (isinstance(value, _ModuleType) and _guarded(value.__name__)):
                    out.append(f"{name}.{key} was added")
        # Identity only, never ==: a replaced value could answer == with anything.
        now = vars(builtins)
        out.extend(
            f"builtins.{k} was replaced" for k, v in self.builtins.items() if now.get(k, _MISSING) is not v
        )
        # pytest installs its own sys.unraisablehook (and friends) while it runs: harness code.
        now = vars(sys)
        out.extend(
            f"sys.{k} was replaced"
            for k, v in self.sys_functions.items()
            if now.get(k, _MISSING) is not v and not self.harness_value(now.get(k, _MISSING))
        )
        for cls, snap in self.classes.values():
            now = vars(cls)
            for key, value in snap.items():
                if now.get(key, _MISSING) is not value and key not in _VOLATILE:
                    out.append(f"{cls.__module__}.{cls.__qualname__}.{key} was replaced")
            for key in now.keys() - snap.keys():
                if key not in _VOLATILE:
                    out.append(f"{cls.__module__}.{cls.__qualname__}.{key} was added")
        for fn, code, defaults, kwdefaults in self.functions.values():
            if (
                fn.__code__ is not code
                or fn.__defaults__ is not defaults
                or fn.__kwdefaults__ is not kwdefaults
            ):
                out.append(f"{fn.__module__}.{fn.__qualname__} was rewritten")
        return out


_MISSING = object()
# Set by pytest itself while it runs (caches, counters): identity changes here are its own.
_VOLATILE = frozenset(
    {
        "__warningregistry__",
        "_cache",
        "__abstractmethods__",
        "_abc_impl",
        "_pytest_diamond_inheritance_warning_shown",
    }
)
ARM_EVENT = "agentrl.hidden-tests.session-started"
FINISH_EVENT = "agentrl.hidden-tests.session-finished"


def _audit_hook(emit, guard, tests_dir, code_names):
    """The irremovable tripwire (module docstring, step 4). Until the session starts (the
    reporter raises ARM_EVENT then), and again after it finished (FINISH_EVENT), a write of
    harness code into a guarded object is pytest configuring or unconfiguring itself; in
    between, every write to one is tampering."""
    compiled = {}
    armed = []
    interesting = FLAGGED_EVENTS | {
        "object.__setattr__",
        "object.__delattr__",
        "open",
        "compile",
        "code.__new__",
        "function.__new__",
        ARM_EVENT,
        FINISH_EVENT,
    }

    def hook(event, args, _emit=emit, _guard=guard, _interesting=interesting, _flagged=FLAGGED_EVENTS,
             _tests=tests_dir, _compiled=compiled, _armed=armed, _type=type, _str=str, _id=id,
             _names=code_names, _len=len, _getframe=sys._getframe,
             _doctest=os.path.join(os.path.dirname(os.__file__), "doctest.py")):  # fmt: skip
        if event not in _interesting:
            return
        if event in _flagged:
            caller = _getframe(1)
            filename = caller.f_code.co_filename if caller is not None else "?"
            # doctest saves, clears and restores the trace function around every example; the
            # reporter also checks at each test that no trace or profile function is left.
            if event != "sys.settrace" or filename != _doctest:
                _emit("tamper", f"audit event {event} from {filename}:{caller.f_lineno if caller else 0}")
        elif event == "object.__setattr__" or event == "object.__delattr__":
            obj = args[0]
            if _id(obj) in _guard.ids:
                if _len(_armed) or event == "object.__delattr__" or not _guard.harness_value(args[2]):
                    _emit(
                        "tamper", f"{event} {args[1]!r} on pytest's own {getattr(obj, '__qualname__', '?')}"
                    )
            elif _type(obj).__name__ == "function" and args[1] in _names:
                filename = obj.__code__.co_filename
                if _type(filename) is _str and filename.startswith(_tests):
                    _emit("tamper", f"{event} {args[1]!r} on the hidden test {obj.__qualname__}")
        elif event == "open":
            path = args[0]
            if _type(path) is _str and path.startswith("/proc/") and path.endswith("/mem"):
                _emit("tamper", f"opened {path} (writing process memory directly)")
        elif event == "function.__new__":
            filename = args[0].co_filename
            if _type(filename) is _str and filename.startswith(_tests):
                _emit("tamper", "a new function was made from a hidden test's code")
        elif event == ARM_EVENT:
            _armed.append(True)
        elif event == FINISH_EVENT:
            # One way only: raising it early just ends the tripwire; the guard checks remain.
            _armed.clear()
        else:  # compile, code.__new__: a second code object named after a hidden test file
            filename = args[1]
            if _type(filename) is _str and filename.startswith(_tests):
                _compiled[filename] = _compiled.get(filename, 0) + 1
                if _compiled[filename] > 1:
                    _emit("tamper", f"code was compiled twice under the name of the hidden test {filename}")

    return hook


def _source_only_hook(roots):
    """A path hook: workspace directories get a finder that loads `.py` sources only, compiled
    from the source every time (no bytecode read, no extension module)."""
    import importlib.machinery as machinery

    class SourceOnlyLoader(machinery.SourceFileLoader):
        def get_code(self, fullname):
            path = self.get_filename(fullname)
            return self.source_to_code(self.get_data(path), path)

    def hook(path):
        p = os.path.abspath(path) if path else ""
        if p and any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots):
            return machinery.FileFinder(path, (SourceOnlyLoader, machinery.SOURCE_SUFFIXES))
        raise ImportError("not a workspace path")

    return hook


def _same(a, b):
    """Element-wise identity of two lists of tuples (never ==: a planted object answers == with
    whatever it likes)."""
    return len(a) == len(b) and all(
        len(x) == len(y) and all(u is v for u, v in zip(x, y)) for x, y in zip(a, b)
    )


class Reporter:
    """The pytest plugin that writes the stream (module docstring, step 6)."""

    def __init__(self, emit, guard, tests_dir, message_chars, select=None):
        self.emit = emit
        self.select = frozenset(select) if select is not None else None
        self.guard = guard
        self.tests_dir = tests_dir
        self.message_chars = message_chars
        self.config = None
        self.test_globals = {}  # id(module) -> (module, {name: value}) of the hidden test modules
        self.impls = None
        self.hook_names = (
            "pytest_runtest_protocol",
            "pytest_runtest_setup",
            "pytest_runtest_call",
            "pytest_runtest_teardown",
            "pytest_runtest_makereport",
            "pytest_runtest_logreport",
            "pytest_report_teststatus",
            "pytest_pyfunc_call",
        )

    def _message(self, report):
        try:
            text = report.longreprtext
        except Exception as exc:
            text = f"(no message: {type(exc).__name__})"
        return text[-self.message_chars :] if len(text) > self.message_chars else text

    def tamper(self, problems, where):
        for p in problems[:5]:
            self.emit("tamper", f"{p} (seen {where})")

    # -- provenance: is this plugin / hook implementation / test function what it claims? --

    def _legit_plugin(self, plugin):
        if plugin is self or plugin is None:
            return True
        if isinstance(plugin, _ModuleType):
            name = getattr(plugin, "__name__", "")
            file = getattr(plugin, "__file__", "") or ""
            return _guarded(name) or file.startswith(self.tests_dir)
        if isinstance(plugin, type):  # a class registered as a plugin (legacypath does)
            return id(plugin) in self.guard.classes
        return id(type(plugin)) in self.guard.classes

    def _legit_function(self, fn):
        fn = getattr(fn, "__func__", fn)
        if id(fn) in self.guard.ids:
            return True
        code = getattr(fn, "__code__", None)
        return (
            code is not None
            and isinstance(code.co_filename, str)
            and code.co_filename.startswith(self.tests_dir)
        )

    def check_plugins(self, where):
        """Every plugin and hook implementation comes from pytest or the hidden tests (full pass)."""
        pm = self.config.pluginmanager
        problems = []
        for name, plugin in pm.list_name_plugin():
            if not self._legit_plugin(plugin):
                problems.append(
                    f"a pytest plugin from outside pytest and the hidden tests is registered ({name!r})"
                )
        for hook_name in [n for n in dir(pm.hook) if n.startswith("pytest_")]:
            caller = getattr(pm.hook, hook_name, None)
            for impl in caller.get_hookimpls() if hasattr(caller, "get_hookimpls") else ():
                if not self._legit_plugin(impl.plugin) or not self._legit_function(impl.function):
                    problems.append(
                        f"hook {hook_name} has an implementation from outside pytest and the hidden tests"
                    )
        if problems:
            self.tamper(problems, where)

    def _runtest_impls(self):
        hook = self.config.pluginmanager.hook
        return [
            tuple(i.function for i in getattr(hook, name).get_hookimpls())
            for name in self.hook_names
            if hasattr(hook, name)
        ]

    def _test_code_problem(self, item, fn):
        """Why a test's function is not code compiled from the hidden tests (None: it is). A
        decorator's wrapper may live in a module loaded before the workspace was importable;
        what it wraps must be the hidden test's own code."""
        seen = 0
        while seen < 20:
            code = getattr(fn, "__code__", None)
            filename = getattr(code, "co_filename", None)
            if not isinstance(filename, str):
                return None  # not a Python function (a builtin, a class): nothing to compare
            if filename.startswith(self.tests_dir):
                return None
            if filename not in self.guard.files:
                return f"{item.nodeid}: the test runs code compiled outside the hidden tests ({filename})"
            inner = getattr(fn, "__wrapped__", None)
            if inner is None:
                return f"{item.nodeid}: the test runs code compiled outside the hidden tests ({filename})"
            fn = getattr(inner, "__func__", inner)
            seen += 1
        return f"{item.nodeid}: the test's wrappers never end"

    def check_item(self, item, where):
        problems = []
        if "runtest" in vars(item):
            problems.append(f"{item.nodeid}: runtest was replaced on the item")
        fn = getattr(item, "obj", None)
        fn = getattr(fn, "__func__", fn)
        if isinstance(fn, _FunctionType) and (problem := self._test_code_problem(item, fn)):
            problems.append(problem)
        code = getattr(fn, "__code__", None)
        filename = getattr(code, "co_filename", None)
        if isinstance(filename, str) and filename.startswith(self.tests_dir):
            # Code of a hidden test must run in a hidden test module's globals: the same code
            # over other globals (a correct `add` slipped in) is a different test.
            owner = sys.modules.get(getattr(fn, "__globals__", {}).get("__name__", ""))
            if (
                owner is None
                or vars(owner) is not fn.__globals__
                or not (getattr(owner, "__file__", "") or "").startswith(self.tests_dir)
            ):
                problems.append(f"{item.nodeid}: the test function runs in foreign globals")
        if problems:
            self.tamper(problems, where)

    def check_test_globals(self, where, modules=None):
        problems = []
        for mod, snap in modules if modules is not None else self.test_globals.values():
            now = vars(mod)
            problems.extend(
                f"{mod.__name__}.{k} was replaced" for k, v in snap.items() if now.get(k, _MISSING) is not v
            )
        if problems:
            self.tamper(problems, where)

    # -- pytest hooks -----------------------------------------------------------------------

    def pytest_configure(self, config):
        self.config = config

    def pytest_sessionstart(self, session):
        # pytest has configured itself: from here on the harness must not change at all.
        self.tamper(self.guard.settle(), "when the session started")
        sys.audit(ARM_EVENT)

    def pytest_collection_modifyitems(self, session, config, items):
        # Exactly the listed tests (a listed function id covers its parametrized variants); the
        # rest of their files is deselected here, collected once, rather than matched per id.
        if self.select is None:
            return
        keep = [i for i in items if i.nodeid in self.select or i.nodeid.split("[", 1)[0] in self.select]
        dropped = [
            i for i in items if i.nodeid not in self.select and i.nodeid.split("[", 1)[0] not in self.select
        ]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep

    def pytest_collectreport(self, report):
        if report.failed:
            self.emit("collect_error", report.nodeid, self._message(report))

    def pytest_collection_finish(self, session):
        self.tamper(self.guard.check(), "after collection")
        self.check_plugins("after collection")
        self.impls = self._runtest_impls()
        for item in session.items:
            self.check_item(item, "after collection")
            mod = getattr(item, "module", None)
            if mod is not None and id(mod) not in self.test_globals:
                self.test_globals[id(mod)] = (
                    mod,
                    {k: v for k, v in vars(mod).items() if callable(v) or isinstance(v, _ModuleType)},
                )
        self.emit("collected", [item.nodeid for item in session.items])

    def pytest_runtest_setup(self, item):
        # Per test, only what is cheap (about 0.1 ms): writes to pytest's classes and functions
        # are caught by the audit hook the moment they happen; module globals are not, so the
        # modules where outcomes are made are compared here, and everything at the end.
        where = f"at {item.nodeid}"
        self.tamper(self.guard.quick(), where)
        if not _same(self._runtest_impls(), self.impls):
            self.tamper(["the implementations of the runtest hooks changed"], where)
        mod = self.test_globals.get(id(getattr(item, "module", None)))
        if mod is not None:
            self.check_test_globals(where, [mod])

    def pytest_runtest_call(self, item):
        self.check_item(item, f"when {item.nodeid} ran")

    def pytest_runtest_logreport(self, report):
        if sys.gettrace() is not None or sys.getprofile() is not None:
            self.emit("tamper", f"a trace or profile function is active at {report.nodeid} ({report.when})")
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if outcome == "skipped" else "xpassed" if outcome == "passed" else outcome
        # A passed setup or teardown is not written (the reader takes a missing one as passed):
        # one record per passing test instead of three.
        if report.when == "call" or outcome != "passed":
            self.emit(
                "report", report.nodeid, report.when, outcome, self._message(report) if report.failed else ""
            )

    def pytest_internalerror(self, excrepr):
        self.emit("internal_error", str(excrepr)[-self.message_chars :])

    def pytest_sessionfinish(self, session):
        self.tamper(self.guard.check(), "at the end")
        self.check_plugins("at the end")
        if not _same(self._runtest_impls(), self.impls):
            self.tamper(["the implementations of the runtest hooks changed"], "at the end")
        self.check_test_globals("at the end")
        sys.audit(FINISH_EVENT)  # pytest's unconfigure undoes its configure-time changes next


def _read_settings():
    """The run's settings, after the key on stdin: 8 hex digits of length, then JSON."""
    import json

    size = int(sys.stdin.buffer.read(SETTINGS_LEN_CHARS).decode("ascii"), 16)
    return json.loads(sys.stdin.buffer.read(size).decode("utf-8"))


def main():
    rec = os.dup(1)
    os.dup2(2, 1)
    emit = _emitter(rec, bytes.fromhex(sys.stdin.buffer.read(KEY_HEX_CHARS).decode("ascii")))
    config = _read_settings()
    # Nothing more comes on stdin: /dev/null in its place (pytest's capture expects an fd 0).
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    emit("start", os.getpid())
    if not hasattr(sys, "addaudithook"):
        emit(
            "runner_error",
            f"the image's Python {sys.version.split()[0]} has no audit hooks: 3.8 or newer is needed",
        )
        sys.exit(3)
    try:
        # Rebuild the environment: nothing the agent set gets to pytest or to processes the
        # tests start. AGENTRL_* are the sandbox's own bookkeeping (the docker backend finds a
        # timed-out command by one).
        keep = {k: v for k, v in os.environ.items() if k.startswith("AGENTRL_")}
        os.environ.clear()
        os.environ.update(keep)
        os.environ.update(config["env"])
        scratch = config["scratch"]
        os.mkdir(scratch, 0o700)  # fails if anything is already there: the name is fresh
        for sub in ("home", "tmp"):
            os.mkdir(os.path.join(scratch, sub), 0o700)
        os.chdir(scratch)
        sys.path[:] = [p for p in sys.path if p and os.path.isabs(p)]
        sys.dont_write_bytecode = True
        import unittest  # noqa: F401 (guarded: it runs TestCase-style tests)

        import _pytest.config
        import pytest

        for name in _pytest.config.default_plugins:  # all of pytest's own modules, before the snapshot
            try:
                __import__("_pytest." + name)
            except ImportError:
                pass
        guard = Guard()
    except Exception as exc:
        emit("runner_error", f"{type(exc).__name__}: {exc}")
        sys.exit(3)
    tests_dir = config["tests_dir"].rstrip("/") + "/"
    sys.addaudithook(
        _audit_hook(emit, guard, tests_dir, frozenset({"__code__", "__defaults__", "__kwdefaults__"}))
    )
    roots = tuple(config["import_paths"])
    sys.path_hooks.insert(0, _source_only_hook(roots))
    sys.path_importer_cache.clear()
    # Appended, not prepended: the standard library and the system's site-packages win every
    # name, so a workspace `pytest`, `_pytest` or `unittest` never takes over. A plain path
    # entry, not a site directory: its .pth files and sitecustomize are never executed.
    sys.path.extend(roots)
    reporter = Reporter(emit, guard, tests_dir, config["message_chars"], config.get("select"))
    args = list(config["args"])
    # The settings go out of reach before pytest imports any test module (and so the agent's code):
    # what the run needs lives on in the reporter and pytest's own arguments, nothing else.
    del config
    code = int(pytest.main(args, plugins=[reporter]))
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)  # a sandbox reused for many runs (the synthesizer)
    # (No snapshot check here: pytest's unconfigure has undone its own configure-time changes.
    # Every outcome is in the stream already; what is left to forge is the exit status, which
    # must match the process's and agree with those outcomes.)
    emit("end", code)
    sys.exit(code)


if __name__ == "__main__":
    main()
