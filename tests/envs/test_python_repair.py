"""python-repair-v0: mutation operators (pure), the synthesizer (deterministic, through docker), the
environment's oracle and the ways of not fixing the bug that must score 0.

The docker tests share one small synthesized set (inflection: its suite is the fastest) made
once per session into a temporary cache, so the whole file stays around a minute or two.
"""

from __future__ import annotations

import ast
import difflib
import json

import pytest

from agentrl.env.agents import run_episode, tool_call
from agentrl.envs.python_repair.mutate import KINDS, MutationError, Site, apply_site, enumerate_sites
from agentrl.envs.python_repair.packages import get_spec, unpacked
from agentrl.envs.python_repair.synth import SynthConfig, candidates, read_log, split_of, synthesize

SRC = '''\
import os


def clip(values, low=0, high=10, strict=False):
    """Clip every value into [low, high]."""
    out = []
    for v in values:  # keep order
        if v < low and not strict:
            v = low
        out.append(min(v, high))
    total = len(out) - 1
    return out[1:total]


class Box:
    def area(self, w, h):
        if w is None or h == 0:
            return 0
        return w * h + sum(range(w))
'''


def _site(kind: str, function: str, variant: int = 0, nth: int = 0) -> Site:
    sites = [
        s for s in enumerate_sites(SRC) if s.kind == kind and s.function == function and s.variant == variant
    ]
    return sites[nth]


def _changed_lines(a: str, b: str) -> list[tuple[str, str]]:
    """(old line, new line) pairs of a one-region edit."""
    sm = difflib.SequenceMatcher(None, a.splitlines(), b.splitlines())
    ops = [op for op in sm.get_opcodes() if op[0] != "equal"]
    assert len(ops) == 1, ops
    _, i1, i2, j1, j2 = ops[0]
    return list(zip(a.splitlines()[i1:i2], b.splitlines()[j1:j2], strict=False)) or [
        ("\n".join(a.splitlines()[i1:i2]), "\n".join(b.splitlines()[j1:j2]))
    ]


@pytest.mark.parametrize(
    ("kind", "function", "variant", "nth", "old", "new"),
    [
        ("compare_negate", "clip", 0, 0, "        if v < low and not strict:", "        if v >= low and not strict:"),
        ("compare_boundary", "clip", 0, 0, "        if v < low and not strict:", "        if v <= low and not strict:"),
        ("bool_operator", "clip", 0, 0, "        if v < low and not strict:", "        if v < low or not strict:"),
        ("constant_off_by_one", "clip", 0, 0, "    total = len(out) - 1", "    total = len(out) - 2"),
        ("constant_off_by_one", "clip", 1, 1, "    return out[1:total]", "    return out[0:total]"),
        ("slice_off_by_one", "clip", 1, 0, "    return out[1:total]", "    return out[1:total - 1]"),
        ("arith_operator", "clip", 0, 0, "    total = len(out) - 1", "    total = len(out) + 1"),
        ("swap_arguments", "clip", 0, 0, "        out.append(min(v, high))", "        out.append(min(high, v))"),
        ("wrong_return", "clip", 0, 0, "    return out[1:total]", "    return None"),
        ("range_off_by_one", "Box.area", 0, 0, "        return w * h + sum(range(w))", "        return w * h + sum(range(w + 1))"),
        ("swap_operands", "clip", 0, 0, "    total = len(out) - 1", "    total = 1 - len(out)"),
        ("negate_condition", "Box.area", 0, 0, "        if w is None or h == 0:", "        if not (w is None or h == 0):"),
        ("change_default", "clip", 1, 0, "def clip(values, low=0, high=10, strict=False):", "def clip(values, low=0, high=11, strict=False):"),
        ("change_default", "clip", 2, 0, "def clip(values, low=0, high=10, strict=False):", "def clip(values, low=0, high=10, strict=True):"),
    ],
)  # fmt: skip
def test_each_operator_changes_exactly_its_node(kind, function, variant, nth, old, new):
    mutant = apply_site(SRC, _site(kind, function, variant, nth))
    assert _changed_lines(SRC, mutant.source) == [(old, new)]
    assert "# keep order" in mutant.source  # comments elsewhere survive: only the node's span is rewritten
    assert mutant.source.replace(mutant.mutated_function, mutant.original_function) == SRC


def test_drop_statement_removes_one_statement_and_keeps_blocks_valid():
    drops = [s for s in enumerate_sites(SRC) if s.kind == "drop_statement"]
    assert {s.function for s in drops} == {"clip", "Box.area"}
    for site in drops:
        try:
            mutant = apply_site(SRC, site)
        except MutationError:
            continue
        ast.parse(mutant.source)
        assert len(mutant.source.splitlines()) <= len(SRC.splitlines())
    # The only statement of a block becomes `pass`, so the block stays valid.
    only = next(s for s in drops if s.function == "clip" and s.lineno == 9)
    assert "            pass\n" in apply_site(SRC, only).source
    # Docstrings are never dropped.
    assert all(s.lineno != 5 for s in drops)


def test_every_site_of_a_real_module_is_a_one_region_edit_inside_its_function():
    """On inflection's real source: the mutant equals the original outside the mutated function."""
    spec = get_spec("inflection")
    src = (unpacked(spec) / "source" / spec.targets[0]).read_text()  # the sdist, downloaded once
    sites = enumerate_sites(src)
    assert {s.kind for s in sites} >= set(KINDS) - {
        "compare_boundary",
        "range_off_by_one",
        "slice_off_by_one",
    }
    for site in sites[::7]:  # a sample keeps this fast
        try:
            m = apply_site(src, site)
        except MutationError:
            continue
        assert m.source != src
        assert m.source.replace(m.mutated_function, m.original_function, 1) == src
        assert m.source.count(m.mutated_function) == 1


def test_candidate_order_and_split_are_functions_of_the_seed_and_the_function():
    spec = get_spec("inflection")
    unpacked(spec)
    a, b, c = candidates(spec, 0), candidates(spec, 0), candidates(spec, 1)
    assert a == b and a != c and sorted(a, key=str) == sorted(c, key=str)
    # Round-robin: the first candidates all mutate different functions.
    n_functions = len({x.function_key for x in a})
    assert len({x.function_key for x in a[:n_functions]}) == n_functions
    assert split_of("toolz", "toolz/itertoolz.py", "groupby") == split_of(
        "toolz", "toolz/itertoolz.py", "groupby"
    )
    splits = {split_of("p", "m.py", f"f{i}") for i in range(200)}
    assert splits == {"train", "validation", "test"}


# --- through docker -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory):
    """Three inflection tasks from seed 7, synthesized twice into separate caches."""
    spec = get_spec("inflection")
    dirs = [tmp_path_factory.mktemp(f"synth{i}") for i in range(2)]
    results = [synthesize(["inflection"], 3, SynthConfig(seed=7, cache_dir=d)) for d in dirs]
    return spec, dirs, results


@pytest.mark.docker
def test_synthesis_is_deterministic_and_keeps_only_caught_mutants(synthesized):
    spec, dirs, (first, second) = synthesized
    assert len(first.tasks) == 3

    def content(tasks):  # everything but the measured suite time
        return [t.model_dump(exclude={"metadata": {"test_seconds"}}) for t in tasks]

    assert content(first.tasks) == content(second.tasks)
    trials = read_log(spec, 7, dirs[0])
    assert [(t.site, t.outcome) for t in trials] == [(t.site, t.outcome) for t in read_log(spec, 7, dirs[1])]
    for task in first.tasks:
        meta = task.metadata
        assert meta["FAIL_TO_PASS"] and not set(meta["FAIL_TO_PASS"]) & set(meta["PASS_TO_PASS"])
        assert task.split == split_of("inflection", meta["module"], meta["function"])
        # The bug report names failing tests (never a case's parameters: the twin sets differ in
        # them), never the mutated function or its line; the task says where each test fails.
        failing = meta["FAIL_TO_PASS"][0]
        assert failing.split("[", 1)[0] in task.prompt and ("[" not in failing or failing not in task.prompt)
        assert set(meta["FAIL_TO_PASS_LINES"]) <= set(meta["FAIL_TO_PASS"])
        assert meta["twin_sets"]["covered"] and meta["twin_sets"]["odds"] >= 32
        # ... in most draws, and no reader of the run's files beats a guess at those odds on it.
        readers = meta["twin_sets"]["readers"]
        assert readers["plans"] >= readers["drawn"] / 2 and not readers["short"], readers
        assert readers["plans"] > 0 and not readers["leaks"], readers
        assert meta["mutated_function"] not in task.prompt
        assert f"line {meta['lineno']}" not in task.prompt
        assert list(task.files) == [meta["module"]]
        assert "test_inflection" not in json.dumps(task.files)
    # A second call is served from the log: no new trials.
    again = synthesize(["inflection"], 3, SynthConfig(seed=7, cache_dir=dirs[0]))
    assert [t.id for t in again.tasks] == [t.id for t in first.tasks]
    assert len(read_log(spec, 7, dirs[0])) == len(trials)


@pytest.fixture(scope="module")
def env(synthesized):
    from agentrl.envs.python_repair.env import PythonRepairEnv

    _, _, (first, _) = synthesized
    e = PythonRepairEnv(tasks=first.tasks, max_turns=4)
    yield e
    e.close()


@pytest.mark.docker
def test_oracle_scores_1_and_the_untouched_mutant_0(env, synthesized):
    from agentrl.checks.verifier_check import check_verifier

    for task in synthesized[2][0].tasks:
        check = check_verifier(env, task)
        assert check.ok, check.reason
        assert check.reference.reward == 1.0 and check.untouched.reward == 0.0


class Script:
    """Runs the given tool calls in order, then submits."""

    def __init__(self, *calls: str):
        self.calls = list(calls)

    def act(self, observation):
        return self.calls.pop(0) if self.calls else tool_call("submit", answer="done")


def _reward(env, task, agent) -> tuple[float, str]:
    result = run_episode(env, agent, options={"task": task})
    return result.reward, result.info["verdict"].details


@pytest.mark.docker
def test_the_workspace_has_the_mutant_and_no_tests_and_cannot_read_the_original(env, synthesized):
    task = synthesized[2][0].tasks[0]
    env.reset(options={"task": task})
    sb = env.sandbox
    module = task.metadata["module"]
    assert sb.read_file(module).decode() == task.files[module]
    listing = sb.exec(
        ["bash", "-c", "find / -name 'test_*.py' -not -path '/proc/*' -not -path '/usr/*' 2>/dev/null"]
    )
    assert listing.stdout.strip() == ""
    peek = sb.exec(["bash", "-c", f"cat {task.metadata['source_dir']}/{module}"])
    assert peek.exit_code != 0 and "Permission denied" in peek.stderr
    # No bytecode caches: a stale .pyc of the buggy module could outlive a same-size fix.
    assert sb.exec(["bash", "-c", "echo $PYTHONDONTWRITEBYTECODE"]).stdout.strip() == "1"
    env.close()


@pytest.mark.docker
def test_deleting_the_mutated_function_or_module_scores_0(env, synthesized):
    task = synthesized[2][0].tasks[0]
    meta = task.metadata
    assert (
        _reward(
            env,
            task,
            Script(tool_call("str_replace", path=meta["module"], old=meta["mutated_function"], new="")),
        )[0]
        == 0.0
    )
    reward, details = _reward(env, task, Script(tool_call("bash", command=f"rm -f {meta['module']}")))
    assert reward == 0.0, details


@pytest.mark.docker
def test_deleting_or_shadowing_the_failing_tests_scores_0(env, synthesized):
    """The agent cannot reach the hidden tests; planting empty look-alikes in the workspace changes nothing."""
    task = synthesized[2][0].tasks[0]
    test_file = task.metadata["FAIL_TO_PASS"][0].split("::")[0]
    attack = (
        "find / -name 'test_*.py' -not -path '/proc/*' -delete 2>/dev/null; "
        f"mkdir -p tests && : > {test_file} && : > tests/{test_file} && "
        "printf 'import pytest\\n@pytest.hookimpl(tryfirst=True)\\ndef pytest_runtest_makereport(item, call):\\n    pass\\n' > conftest.py"
    )
    reward, details = _reward(env, task, Script(tool_call("bash", command=attack)))
    assert reward == 0.0, details


RAISE_EVERYWHERE = r"""
import ast, pathlib
for path in pathlib.Path('.').rglob('*.py'):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = [ast.parse('raise NotImplementedError').body[0]]
    path.write_text(ast.unparse(tree))
print('rewritten')
"""


@pytest.mark.docker
def test_every_function_raising_scores_0(env, synthesized):
    task = synthesized[2][0].tasks[0]
    reward, details = _reward(env, task, Script(tool_call("python", code=RAISE_EVERYWHERE)))
    assert reward == 0.0, details


@pytest.mark.docker
def test_cli_prints_statistics_and_writes_the_tasks(synthesized, tmp_path):
    """The real CLI over the fixture's cache: served from the trial log, so it starts no sandbox."""
    import subprocess
    import sys

    _, dirs, (first, _) = synthesized
    out = tmp_path / "tasks.jsonl"
    cmd = [sys.executable, "-m", "agentrl.cli", "tasks", "synth", "python-repair", "--packages", "inflection"]
    cmd += ["--n", "3", "--seed", "7", "--cache-dir", str(dirs[0]), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    assert stats["tasks"]["n"] == 3 and stats["tasks"]["per_package"] == {"inflection": 3}
    total = stats["total"]
    assert total["tried"] == total["kept"] + total["rejected"] and total["kept"] >= 3
    # How many mutants no twin sets could decide at 1 in 32, and why; how many kept tasks have
    # failing tests no set covers, and why.
    assert stats["no_twin_cover"]["tasks"] == total["reasons"].get("no_twin_cover", 0)
    assert set(stats["kept_with_uncovered_failing_tests"]) == {"tasks", "why"}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [t.id for t in first.tasks]


# --- the bug report ---------------------------------------------------------------------------


_PACKAGE = '''
def compare(a, b):
    parts = [a, b]
    return _comparator(*parts)


def _comparator(a, b):
    """Compare two versions.

    :return: negative if a < b, zero if equal, positive if a > b

    >>> _comparator("1.0.0", "2.0.0")
    -1
    """
    return (a > b) - (a < b) + undefined_name
'''

_TESTS = '''
from pkg import compare


def test_compare_orders_versions():
    """Versions compare by their parts."""
    assert compare("1.0.0", "1.0.0") == 0
'''

_CAPTURE = """
import json, os


def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.environ["REPORT_OUT"], "w") as f:
            json.dump(report.longreprtext, f)
"""


def test_the_bug_report_shows_the_package_s_frames_and_error_never_the_test_s_lines_or_values(tmp_path):
    """A real pytest report of an error raised two calls into the package: the excerpt keeps each
    package frame's call and place, and the error; not the test's own line (its values are what the
    hidden tests' twin sets differ in), and not the docstring of the function the error came from
    (pytest shows the last frame's whole source). The failing test's line and its error are read
    off the report for the verifier, never shown."""
    import os
    import subprocess
    import sys

    from agentrl.envs.python_repair.synth import bug_report, failing_error, failing_line, failure_excerpt

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(_PACKAGE)
    (tmp_path / "test_pkg.py").write_text(_TESTS)
    (tmp_path / "dump_report.py").write_text(_CAPTURE)
    out = tmp_path / "report.json"
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "dump_report", "test_pkg.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "REPORT_OUT": str(out)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.exists(), ran.stdout[-2000:] + ran.stderr[-2000:]
    report = json.loads(out.read_text())
    assert ":return:" in report and "NameError" in report  # the whole report has the docstring
    excerpt = failure_excerpt(report, "test_pkg.py")
    lines = excerpt.splitlines()
    assert 'compare("1.0.0", "1.0.0") == 0' not in excerpt and "test_pkg.py" not in excerpt
    assert any(ln.startswith(">") and "_comparator(*parts)" in ln for ln in lines)  # the middle frame
    assert any(ln.startswith(">") and "undefined_name" in ln for ln in lines)
    assert any(ln.startswith("E") and "NameError" in ln and "undefined_name" in ln for ln in lines)
    assert any(ln.endswith(": NameError") and "pkg/__init__.py" in ln for ln in lines)
    assert ":return:" not in excerpt and ">>>" not in excerpt and "Versions compare" not in excerpt
    test_lines = _TESTS.splitlines()
    assert failing_line(report, "test_pkg.py") == 1 + test_lines.index(
        next(ln for ln in test_lines if "compare(" in ln)
    )
    assert failing_error(report) == "NameError"
    # Long reports keep the error and the frames nearest it, and drop the rest.
    middle = [f"pkg/m.py:{i}: in f{i}\n    f{i + 1}()" for i in range(20)]
    deep = "\n".join([*middle, "    def f20():", ">       boom()", "E       boom", "", "pkg/m.py:99: Boom"])
    short = failure_excerpt(deep, "test_pkg.py", max_lines=8).splitlines()
    assert len(short) == 8 and short[0] == "..."
    assert short[-3:] == [">       boom()", "E       boom", "pkg/m.py:99: Boom"]
    prompt = bug_report(get_spec("semver"), [("test_pkg.py::test_compare_orders_versions", report)], 10)
    assert "- test_pkg.py::test_compare_orders_versions: NameError raised in the package" in prompt
    assert 'compare("1.0.0"' not in prompt
    # A parametrized test is named once, with how many of its cases fail; an assertion in the test
    # itself is said to fail, its values never quoted.
    assertion = (
        "    def test_x(a):\n>       assert f(a) == 'want'\nE       AssertionError: assert 'got' == 'want'\n\n"
        "test_pkg.py:3: AssertionError"
    )
    prompt = bug_report(
        get_spec("semver"),
        [("test_pkg.py::test_x[a]", assertion), ("test_pkg.py::test_x[b]", assertion)],
        10,
        cases={"test_pkg.py::test_x": 5},
    )
    assert "- test_pkg.py::test_x (2 of its 5 cases): its own check fails" in prompt
    assert "want" not in prompt and "got" not in prompt and "[a]" not in prompt
