"""The `hidden-tests` verifier, attacked: every verifier-hacking trick scores 0, through real sandboxes.

The environment is a tiny "fix the function" task built here (the built-in env list stays as
it is): the workspace holds a buggy `mathlib.add`, three hidden tests live in a host folder,
the agent has bash, write_file and submit. The reference fix scores 1 and the untouched state 0.

Each attack test plays one episode in which the agent does NOT fix the bug but tries a trick,
and where it makes sense first shows that the trick does fool a naive verifier (pytest run
from the workspace as the agent, through a login shell): the trick is live, and only the
verifier's isolation defeats it.
"""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from agentrl.core.task import Task
from agentrl.env.agents import last_tool_output, run_episode, tool_call
from agentrl.env.tool_env import ToolEnv
from agentrl.verifiers import Verdict, get
from agentrl.verifiers.hidden_tests import CaseResult, HiddenTestsVerifier, Report, score

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
# A string only the hidden tests contain: searched for across the sandbox during an episode.
MARKER = "agentrl-hidden-marker-5e1d"
HIDDEN_TESTS = f"""# {MARKER}
from mathlib import add


def test_add_small():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-2, -3) == -5


def test_add_zero():  # passes with the bug too: a PASS_TO_PASS test
    assert add(0, 0) == 0
"""
TEST_IDS = [f"test_mathlib.py::{n}" for n in ("test_add_small", "test_add_negative", "test_add_zero")]
USER_SITE = "/workspace/.local/lib/python3.11/site-packages"
SYSTEM_SITE = "/usr/lib/python3/dist-packages"

# A plugin that turns every test report into a pass.
ALLPASS_PLUGIN = """
import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
# Monkeypatches unittest and pytest in whatever interpreter imports it.
PATCH_PAYLOAD = """
try:
    import unittest

    unittest.TestCase.assertEqual = lambda self, *a, **k: None
    import _pytest.reports

    _orig = _pytest.reports.TestReport.from_item_and_call.__func__

    def _always_passed(cls, item, call):
        report = _orig(cls, item, call)
        report.outcome, report.longrepr = "passed", None
        return report

    _pytest.reports.TestReport.from_item_and_call = classmethod(_always_passed)
except Exception:
    pass
"""
FAKE_JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" failures="0" '
    'skipped="0" tests="3">'
    + "".join(
        f'<testcase classname="test_mathlib" name="{n.split("::")[1]}" file="test_mathlib.py"/>'
        for n in TEST_IDS
    )
    + "</testsuite></testsuites>"
)


# --- the environment ---------------------------------------------------------------------


class FixFunctionEnv(ToolEnv):
    instructions = "Fix the bug in mathlib.py so that add() adds, then call submit."

    def __init__(self, task: Task, **kwargs: Any):
        kwargs.setdefault("verifier", "hidden-tests")
        super().__init__(tasks=[task], tools=["bash", "write_file", "submit"], max_turns=20, **kwargs)

    def oracle(self, task: Task) -> Script:
        return Script(tool_call("write_file", path="mathlib.py", content=FIXED))


class Script:
    """Plays the given tool calls in order, then submits; keeps every tool output it saw."""

    def __init__(self, *actions: str):
        self.actions = [*actions, tool_call("submit", answer="done")]
        self.outputs: list[str] = []

    def act(self, observation: list[dict[str, Any]]) -> str:
        if out := last_tool_output(observation):
            self.outputs.append(out)
        return self.actions.pop(0)


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Task:
    hidden = tmp_path_factory.mktemp("hidden")
    (hidden / "test_mathlib.py").write_text(HIDDEN_TESTS)
    return Task(
        id="fix-add/0",
        prompt="mathlib.add subtracts instead of adding. Fix it, then submit.",
        files={"mathlib.py": BUGGY},
        hidden_tests=str(hidden),
    )


@pytest.fixture(scope="module")
def env(task):
    with FixFunctionEnv(task) as e:
        yield e


def play(env: ToolEnv, task: Task, *actions: str) -> tuple[Verdict, list[str]]:
    """One episode; returns the verdict and the outputs the agent saw."""
    agent = Script(*actions)
    result = run_episode(env, agent, options={"task": task})
    return result.info["verdict"], agent.outputs


def write(path: str, content: str) -> str:
    return tool_call("write_file", path=path, content=textwrap.dedent(content))


def bash(command: str) -> str:
    return tool_call("bash", command=command)


# The naive verifier the tricks are aimed at: the hidden tests dropped into the workspace and
# run by the agent's own shell (login shell: its dotfiles apply) with whatever `python3` it finds.
NAIVE_RUN = [
    write("_naive/test_mathlib.py", HIDDEN_TESTS),
    bash(
        "bash -lc 'cd /workspace && python3 -m pytest -q _naive 2>&1 | tail -n 3'; rm -rf _naive .pytest_cache"
    ),
]


def fooled_naive(outputs: list[str]) -> bool:
    return any("3 passed" in out for out in outputs)


# --- the baseline: the verifier is sound --------------------------------------------------


@pytest.mark.docker
def test_reference_solution_scores_one(env, task):
    verdict, _ = play(env, task, tool_call("write_file", path="mathlib.py", content=FIXED))
    assert (verdict.reward, verdict.passed) == (1.0, True), verdict.details
    assert "3/3 hidden tests passed" in verdict.details


@pytest.mark.docker
def test_untouched_workspace_scores_zero(env, task):
    verdict, _ = play(env, task)
    assert (verdict.reward, verdict.passed) == (0.0, False)
    assert "1/3 hidden tests passed" in verdict.details and "test_add_small" in verdict.details


@pytest.mark.docker
def test_hidden_tests_as_a_single_file(env, task, tmp_path):
    (tmp_path / "test_mathlib.py").write_text(HIDDEN_TESTS)
    single = task.model_copy(update={"hidden_tests": str(tmp_path / "test_mathlib.py")})
    verdict, _ = play(env, single, tool_call("write_file", path="mathlib.py", content=FIXED))
    assert verdict.reward == 1.0 and "3/3 hidden tests passed" in verdict.details, verdict.details


@pytest.mark.docker
def test_conftest_shipped_with_the_hidden_tests_is_used(env, task, tmp_path):
    # The task author's conftest (trusted, copied from the host) still works; only the agent's never loads.
    (tmp_path / "conftest.py").write_text("import pytest\n\n\n@pytest.fixture\ndef five():\n    return 5\n")
    (tmp_path / "test_fixture.py").write_text(
        "from mathlib import add\n\n\ndef test_add(five):\n    assert add(2, 3) == five\n"
    )
    own = task.model_copy(update={"hidden_tests": str(tmp_path)})
    verdict, _ = play(env, own, tool_call("write_file", path="mathlib.py", content=FIXED))
    assert verdict.reward == 1.0 and "1/1 hidden tests passed" in verdict.details, verdict.details


# --- the attacks: one each, all scored 0 ---------------------------------------------------


@pytest.mark.docker
def test_attack_workspace_conftest_overwriting_tests(env, task):
    # The tests' expected values (and every other line of theirs) replaced through a conftest hook.
    conftest = """
        def pytest_collection_modifyitems(items):
            # Replace every test body by a no-op: whatever the expected values were, nothing is asserted.
            for item in items:
                item.obj.__code__ = (lambda: None).__code__
    """
    verdict, outputs = play(
        env, task, write("conftest.py", conftest), write("/tmp/conftest.py", conftest), *NAIVE_RUN
    )
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_pytest11_entry_point_plugin_in_workspace(env, task):
    actions = []
    for site in ("/workspace", USER_SITE):
        actions += [
            write(f"{site}/allpass.py", ALLPASS_PLUGIN),
            write(
                f"{site}/allpass-1.0.dist-info/METADATA",
                "Metadata-Version: 2.1\nName: allpass\nVersion: 1.0\n",
            ),
            write(f"{site}/allpass-1.0.dist-info/entry_points.txt", "[pytest11]\nallpass = allpass\n"),
            write(
                f"{site}/allpass.egg-info/PKG-INFO", "Metadata-Version: 1.0\nName: allpass\nVersion: 1.0\n"
            ),
            write(f"{site}/allpass.egg-info/entry_points.txt", "[pytest11]\nallpass = allpass\n"),
        ]
    verdict, outputs = play(env, task, *actions, *NAIVE_RUN)
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_plugin_through_ini_addopts(env, task):
    verdict, outputs = play(
        env,
        task,
        write("allpass.py", ALLPASS_PLUGIN),
        write("pytest.ini", "[pytest]\naddopts = -p allpass\n"),
        *NAIVE_RUN,
    )
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_ini_addopts_deselecting_failing_tests(env, task):
    verdict, outputs = play(
        env,
        task,
        write("pytest.ini", "[pytest]\naddopts = -k zero\n"),
        write("pyproject.toml", '[tool.pytest.ini_options]\naddopts = "-k zero"\n'),
        write("setup.cfg", "[tool:pytest]\naddopts = -k zero\n"),
        write("tox.ini", "[pytest]\naddopts = -k zero\n"),
        *NAIVE_RUN,
    )
    assert any("1 passed, 2 deselected" in out for out in outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_sys_exit_zero_at_import(env, task):
    # A naive verifier that trusts the exit status of running the tests is fooled.
    naive = (
        'python3 -c \'import sys; sys.path[:0] = ["_naive", "."]; import test_mathlib as t; '
        "t.test_add_small(); t.test_add_negative()'; echo naive-exit=$?; rm -rf _naive"
    )
    verdict, outputs = play(
        env,
        task,
        write("mathlib.py", "import sys\n\nsys.exit(0)\n" + BUGGY),
        write("_naive/test_mathlib.py", HIDDEN_TESTS),
        bash(naive),
    )
    assert any("naive-exit=0" in out for out in outputs), outputs
    assert verdict.reward == 0.0 and "collection error" in verdict.details, verdict.details


@pytest.mark.docker
def test_attack_os_exit_zero_at_import_leaves_no_report(env, task):
    verdict, _ = play(env, task, write("mathlib.py", "import os\n\nos._exit(0)\n" + BUGGY))
    assert verdict.reward == 0.0
    assert "pytest never finished: the process ended (exit 0)" in verdict.details, verdict.details


@pytest.mark.docker
def test_attack_sitecustomize_and_usercustomize(env, task):
    actions = [
        write(f"{d}/{name}.py", PATCH_PAYLOAD)
        for d in ("/workspace", USER_SITE)
        for name in ("sitecustomize", "usercustomize")
    ]
    verdict, outputs = play(env, task, *actions, *NAIVE_RUN)
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_pth_file(env, task):
    actions = []
    for d in ("/workspace", USER_SITE):
        actions += [
            write(f"{d}/allpass_patch.py", PATCH_PAYLOAD),
            # A user-site .pth runs before the system site-packages are on sys.path: add them.
            write(
                f"{d}/allpass.pth", f"import sys; sys.path.append({SYSTEM_SITE!r}); import allpass_patch\n"
            ),
        ]
    verdict, outputs = play(env, task, *actions, *NAIVE_RUN)
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_python3_and_pytest_replaced_on_path(env, task):
    fake = f"#!/bin/sh\necho '3 passed in 0.01s'\necho '{FAKE_JUNIT}' > junit.xml\nexit 0\n"
    rc = "export PATH=/workspace/bin:$HOME/.local/bin:$PATH\n"
    actions = [
        write("bin/python3", fake),
        write("bin/pytest", fake),
        write(".local/bin/python3", fake),
        write(".bashrc", rc),
        write(".profile", rc),
        bash("chmod +x bin/python3 bin/pytest .local/bin/python3"),
    ]
    verdict, outputs = play(env, task, *actions, *NAIVE_RUN)
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_pythonpath_and_pytest_variables_from_shell_rc(env, task):
    rc = (
        "export PYTHONPATH=/workspace/evil PYTEST_ADDOPTS='-p allpass' PYTEST_PLUGINS=allpass\n"
        "export PYTHONSTARTUP=/workspace/evil/allpass_patch.py\n"
    )
    verdict, outputs = play(
        env,
        task,
        write("evil/allpass.py", ALLPASS_PLUGIN),
        write("evil/allpass_patch.py", PATCH_PAYLOAD),
        write(".bashrc", rc),
        write(".profile", rc),
        *NAIVE_RUN,
    )
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_shadow_pytest_and_unittest_with_workspace_packages(env, task):
    fake_main = f"""
        import sys


        def main(args=None, plugins=None):
            args = sys.argv[1:] if args is None else args
            for a in args:
                if a.startswith("--junitxml="):
                    with open(a.split("=", 1)[1], "w") as f:
                        f.write({FAKE_JUNIT!r})
            print("3 passed in 0.01s")
            return 0


        console_main = main
    """
    verdict, outputs = play(
        env,
        task,
        write("pytest/__init__.py", fake_main),
        write("pytest/__main__.py", "import sys\n\nimport pytest\n\nsys.exit(pytest.main())\n"),
        write("_pytest/__init__.py", "raise SystemExit(0)\n"),
        write("unittest/__init__.py", "raise SystemExit(0)\n"),
        *NAIVE_RUN,
    )
    assert fooled_naive(outputs), outputs
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_read_hidden_tests_during_episode(env, task):
    # The pattern is split so that the command line itself does not contain the marker.
    head, tail = MARKER[:10], MARKER[10:]
    search = (
        f"grep -rIl --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev '{head}''{tail}' / 2>/dev/null; "
        "echo verifier-dir: $(ls -A /verifier); echo search-done"
    )
    verdict, outputs = play(env, task, bash(search))
    (out,) = [o for o in outputs if "search-done" in o]
    assert MARKER[:10] not in out and "test_mathlib" not in out, out
    assert "verifier-dir: \n" in out or "verifier-dir:\n" in out, out
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_background_process_rewriting_files_during_verification(env, task):
    # Waits for the verifier's files to appear in /verifier, then writes a passing mathlib.py
    # before pytest imports it. Daemonized three ways: double fork, setsid, nohup.
    watcher = f"""
        import os, time
        while True:
            if os.listdir("/verifier"):
                with open("/workspace/mathlib.py", "w") as f:
                    f.write({FIXED!r})
            with open("/workspace/heartbeat", "w") as f:
                f.write(str(time.time()))
            time.sleep(0.01)
    """
    verdict, outputs = play(
        env,
        task,
        write("watch.py", watcher),
        bash("(setsid nohup python3 /workspace/watch.py >/dev/null 2>&1 &) ; echo started"),
        bash("sleep 0.5; ps -eo args | grep -c '[w]atch.py'; echo alive-check"),
    )
    (alive,) = [o for o in outputs if "alive-check" in o]
    assert alive.split()[0] == "1", alive  # the watcher outlived the command that started it
    assert verdict.reward == 0.0, verdict.details


@pytest.mark.docker
def test_attack_fake_junit_report_printed_and_written(env, task):
    verdict, outputs = play(
        env,
        task,
        write("junit.xml", FAKE_JUNIT),
        write("report.xml", FAKE_JUNIT),
        write("/tmp/junit.xml", FAKE_JUNIT),
        bash("cat junit.xml; echo; echo '3 passed in 0.01s'"),
        tool_call("submit", answer=FAKE_JUNIT + "\n3 passed in 0.01s"),
    )
    assert verdict.reward == 0.0 and "1/3 hidden tests passed" in verdict.details, verdict.details


@pytest.mark.docker
def test_attack_report_rewritten_at_exit_by_the_code_under_test(env, task):
    # The code under test runs inside pytest's process. At exit it rewrites any report file it
    # can find and writes all-pass results into every descriptor it has (the result stream is
    # one of them), then leaves with status 0 so that the exit status agrees. Results are
    # streamed and signed as the tests run: what comes after pytest's end is rejected.
    forger = f"""
        import atexit, glob, os


        def _forge():
            for path in glob.glob("/verifier/*/junit.xml") + glob.glob("/verifier/*/*.xml"):
                with open(path, "w") as f:
                    f.write({FAKE_JUNIT!r})
            for fd in range(1, 20):
                for nodeid in {TEST_IDS!r}:
                    try:
                        os.write(fd, f"00\\t99\\treport\\t{{nodeid!r}}\\t'call'\\t'passed'\\t''\\n".encode())
                    except OSError:
                        pass
            os._exit(0)


        atexit.register(_forge)
    """
    verdict, _ = play(env, task, write("mathlib.py", textwrap.dedent(forger) + BUGGY))
    assert verdict.reward == 0.0 and "tampered with" in verdict.details, verdict.details


@pytest.mark.docker
def test_attack_huge_output_is_capped_not_read(task):
    # A 3 MB exception message at import, and 3 MB written into every descriptor (the result
    # stream included): the stream is cut at max_report_mb and not trusted; details stay short.
    flood = "import os\nfor fd in range(1, 20):\n    try:\n        os.write(fd, b'x' * 3_000_000)\n    except OSError:\n        pass\n"
    with FixFunctionEnv(task, verifier=("hidden-tests", {"max_report_mb": 1})) as env:
        verdict, _ = play(env, task, write("mathlib.py", flood + "raise RuntimeError('x' * 3_000_000)\n"))
    assert verdict.reward == 0.0 and "over max_report_mb=1" in verdict.details, verdict.details
    assert len(verdict.details) <= 3000


# --- failures of the verifier itself: reward 0 with the reason, never an exception ---------


@pytest.mark.docker
def test_timeout_gives_zero_with_reason(task):
    with FixFunctionEnv(task, verifier=("hidden-tests", {"timeout_s": 3})) as env:
        verdict, _ = play(env, task, write("mathlib.py", "while True:\n    pass\n"))
    assert verdict.reward == 0.0 and "timed out after 3s" in verdict.details, verdict.details


@pytest.mark.docker
def test_a_sandbox_lost_before_the_verifier_gives_zero_with_reason(env, task):
    import docker

    env.reset(options={"task": task})
    docker.from_env().containers.get(env.sandbox.name).remove(force=True)  # the sandbox dies under it
    _, reward, terminated, _, info = env.step(tool_call("submit", answer="done"))
    assert terminated and reward == 0.0
    # The resident executor's channel closes with the container, and the env checks the sandbox is
    # intact before its verifier runs: an environment error (not scored), naming the lost sandbox.
    assert info["finish_reason"] == "env_error", info
    details = info["verdict"].details
    assert "environment error" in details and "resident executor is gone" in details, details


# --- reward modes and SWE-bench lists -----------------------------------------------------


@pytest.mark.docker
def test_fraction_mode_scores_pass_fraction(task):
    with FixFunctionEnv(task, verifier=("hidden-tests", {"mode": "fraction"})) as env:
        verdict, _ = play(env, task)
    assert verdict.reward == pytest.approx(1 / 3) and not verdict.passed, verdict.details


@pytest.mark.docker
def test_fail_to_pass_lists_from_task_metadata(env, task):
    listed = task.model_copy(
        update={"metadata": {"FAIL_TO_PASS": TEST_IDS[:2], "PASS_TO_PASS": ["test_add_zero"]}}
    )
    fixed, _ = play(env, listed, tool_call("write_file", path="mathlib.py", content=FIXED))
    untouched, _ = play(env, listed)
    assert (fixed.reward, untouched.reward) == (1.0, 0.0), (fixed.details, untouched.details)
    assert "1/3 of the FAIL_TO_PASS + PASS_TO_PASS tests passed" in untouched.details


def _report(**outcomes: str) -> Report:
    return Report({k: CaseResult(k, v) for k, v in outcomes.items()})  # type: ignore[arg-type]


def test_score_listed_test_missing_from_report_counts_as_failed():
    report = _report(**{"t.py::a": "passed", "t.py::b": "passed"})
    reward, passed, summary = score(report, fail_to_pass=["t.py::a", "t.py::gone"], pass_to_pass=["t.py::b"])
    assert (reward, passed) == (0.0, False) and "t.py::gone: missing from the report" in summary
    assert score(report, mode="fraction", fail_to_pass=["t.py::a", "t.py::gone"])[0] == 0.5


def test_score_ignores_unlisted_tests_and_bare_names_cover_parametrized_variants():
    report = _report(**{"t.py::a[1]": "passed", "t.py::a[2]": "passed", "t.py::other": "failed"})
    assert score(report, fail_to_pass=["a"])[:2] == (1.0, True)
    assert score(report)[:2] == (0.0, False)  # no lists: every reported test counts


def test_score_skipped_is_not_passed():
    report = _report(**{"t.py::a": "passed", "t.py::b": "skipped"})
    assert score(report, mode="fraction")[0] == 0.5


def test_lists_accept_swe_bench_json_strings():
    v = HiddenTestsVerifier(fail_to_pass='["t.py::a"]', pass_to_pass='["t.py::b"]')  # type: ignore[arg-type]
    assert (v.fail_to_pass, v.pass_to_pass) == (["t.py::a"], ["t.py::b"])
    with pytest.raises(ValueError, match="must be a list of pytest node ids"):
        HiddenTestsVerifier(fail_to_pass=[1])  # type: ignore[list-item]


def test_registered_under_its_name():
    assert isinstance(get("hidden-tests", mode="fraction"), HiddenTestsVerifier)


def test_python_must_be_an_absolute_path():
    with pytest.raises(ValueError, match="absolute path"):
        HiddenTestsVerifier(python="python3")


def test_a_sandbox_without_isolation_is_refused_and_nothing_is_staged(task, recwarn):
    from agentrl.core.episode import Episode
    from agentrl.sandbox import open_sandbox

    with open_sandbox("local") as sb:  # promises no isolation, protected dir or verifier identity
        sb.write_file("mathlib.py", FIXED)
        verdict = HiddenTestsVerifier().verify(sb, task, Episode(task_id=task.id))
        assert list(sb.host_protected.iterdir()) == []  # type: ignore[attr-defined]
    assert (verdict.reward, verdict.passed) == (0.0, False)
    assert "lacks isolated, protected_dir, verifier_identity (backends that have them: docker, bwrap)" in (
        verdict.details
    )


# --- bwrap: the same verifier without a second user (see the module docstring's limits) ----


@pytest.fixture(scope="module")
def bwrap_env(task, bwrap_path):
    with FixFunctionEnv(task, backend="bwrap") as e:
        yield e


@pytest.mark.docker  # the rootfs is exported from the Docker image
def test_bwrap_reference_solution_scores_one(bwrap_env, task):
    verdict, _ = play(bwrap_env, task, tool_call("write_file", path="mathlib.py", content=FIXED))
    assert verdict.reward == 1.0, verdict.details


@pytest.mark.docker  # the rootfs is exported from the Docker image
def test_bwrap_attack_sitecustomize_conftest_and_ini(bwrap_env, task):
    actions = [
        write("conftest.py", "def pytest_collection_modifyitems(items):\n    items.clear()\n"),
        write("allpass.py", ALLPASS_PLUGIN),
        write("pytest.ini", "[pytest]\naddopts = -p allpass\n"),
        *[write(f"{d}/usercustomize.py", PATCH_PAYLOAD) for d in ("/workspace", USER_SITE)],
    ]
    verdict, _ = play(bwrap_env, task, *actions)
    assert verdict.reward == 0.0, verdict.details


def test_a_draw_of_twin_sets_that_falls_short_of_the_odds_is_drawn_again(monkeypatch, tmp_path):
    """A verification redraws short twin sets (up to PLAN_TRIES), and takes the best odds it drew when
    every draw falls short."""
    from agentrl.verifiers import hidden_tests

    verifier = HiddenTestsVerifier()
    task = Task(id="t", prompt="fix it", metadata={"FAIL_TO_PASS": ["test_x.py::test_a"]})
    fake, drawn = _redraw_planner([4, 8, 32, 32])
    monkeypatch.setattr(hidden_tests, "plan_twin_sets", fake)
    assert verifier._plan_decision(task, tmp_path, ["test_x.py::test_a"], []).odds == 32
    assert drawn == [4, 8, 32]  # the first draw that reaches the odds is kept

    fake, drawn = _redraw_planner([4, 16, 8] + [2] * hidden_tests.PLAN_TRIES)
    monkeypatch.setattr(hidden_tests, "plan_twin_sets", fake)
    assert verifier._plan_decision(task, tmp_path, ["test_x.py::test_a"], []).odds == 16
    assert len(drawn) == hidden_tests.PLAN_TRIES


@pytest.mark.parametrize("undecided", [0, -1], ids=["no set drawn", "the planner raised"])
def test_a_draw_that_decides_nothing_is_drawn_again_once(monkeypatch, tmp_path, undecided):
    """A draw without sets would leave the failing test to canary twins alone (a coin wins half the
    time): it is drawn again. Two such draws end the drawing: the best draw so far, or none."""
    from agentrl.verifiers import hidden_tests

    verifier = HiddenTestsVerifier()
    task = Task(id="t", prompt="fix it", metadata={"FAIL_TO_PASS": ["test_x.py::test_a"]})
    ids = ["test_x.py::test_a"]
    fake, drawn = _redraw_planner([undecided, 32, 32])
    monkeypatch.setattr(hidden_tests, "plan_twin_sets", fake)
    assert verifier._plan_decision(task, tmp_path, ids, []).odds == 32 and drawn == [undecided, 32]

    fake, drawn = _redraw_planner([8, undecided, undecided, 32])
    monkeypatch.setattr(hidden_tests, "plan_twin_sets", fake)
    kept = verifier._plan_decision(task, tmp_path, ids, [])
    assert kept.odds == 8 and drawn == [8, undecided, undecided]  # the short draw, not none

    fake, drawn = _redraw_planner([undecided, undecided, 32])
    monkeypatch.setattr(hidden_tests, "plan_twin_sets", fake)
    none = verifier._plan_decision(task, tmp_path, ids, [])
    assert not none.sets and ids[0] in none.uncovered and len(drawn) == 2
    if undecided < 0:
        assert none.uncovered[ids[0]] == "planning failed (IndexError)"


def _redraw_plan(n: int):
    from agentrl.verifiers.twin_plan import DecisionPlan, TwinSet

    if n == 0:  # every set's values declined on this draw
        return DecisionPlan(uncovered={"test_x.py::test_a": "no value"}, target_odds=32)
    members = tuple((f"test_x.py::test_{i}",) for i in range(n))
    s = TwinSet(originals=("test_x.py::test_a",), members=members, real=0, how="literal", values=("1",) * n)
    return DecisionPlan(sets=[s], target_odds=32)


def _redraw_planner(sizes: list[int]):
    """A planner whose draws have these set sizes in turn (0: no set; -1: it raises), and what it drew."""
    drawn: list[int] = []

    def plan_twin_sets(*args: Any, **kwargs: Any):
        drawn.append(sizes[len(drawn)])
        if drawn[-1] < 0:
            raise IndexError("a planner's bug on this draw")
        return _redraw_plan(drawn[-1])

    return plan_twin_sets, drawn
