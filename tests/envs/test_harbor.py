"""Harbor task directories and SWE-bench-style instances as environments, and our tasks exported to both.

Quick lane: reading task directories and rows, the FROM mapping (on a stand-in engine), the reward
file, the export's files and diffs (host git). Through docker: the three hand-made Harbor tasks
(a file edit, a shell job, a repair whose test.sh fails) each played with env.step, oracle 1 and
do-nothing 0, audited with nothing exploited; a Dockerfile that fails says where; python-repair
through Harbor and SWE-bench and back with the same verdicts; the git-history attack on an image
that keeps the fix in its history (exploited) and on the same image as agentrl builds it (contained).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import agentrl
from agentrl.core.task import Task
from agentrl.env.tool_env import EnvError
from agentrl.envs.harbor.export import export_harbor, export_swebench
from agentrl.envs.harbor.tasks import EXAMPLES_DIR, HarborTaskError, find_task_dirs, load_task, load_tasks
from agentrl.envs.swebench.instances import InstanceError, instance_task, patch_files
from agentrl.sandbox.images import ImageBuildError, resolve_dockerfile
from agentrl.verifiers.test_script import parse_reward

# --- quick: reading -----------------------------------------------------------------------------


def test_the_examples_are_three_tasks_with_their_timeouts_and_solutions():
    tasks = load_tasks(EXAMPLES_DIR)
    assert [t.id for t in tasks] == ["harbor/count-errors", "harbor/edit-settings", "harbor/fix-median"]
    for t in tasks:
        assert t.split == "test" and t.prompt.strip()
        assert Path(t.hidden_tests, "test.sh").is_file()
        assert t.metadata["agent_timeout_s"] == 300.0 and t.metadata["solution_dir"]
    assert tasks[2].metadata["verifier_timeout_s"] == 120.0
    # One task dir is a task set of one.
    assert [p.name for p in find_task_dirs(EXAMPLES_DIR / "fix-median")] == ["fix-median"]
    src = agentrl.task_source("agentrl/harbor-v0", split="test")
    assert src.size("test") == 3


def test_a_folder_that_is_not_a_task_says_what_is_missing(tmp_path):
    with pytest.raises(HarborTaskError, match="neither a Harbor task"):
        find_task_dirs(tmp_path)
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "task.toml").write_text("version = '1.0'\n")
    with pytest.raises(HarborTaskError, match="no instruction.md"):
        load_task(tmp_path / "t")
    (tmp_path / "t" / "task.toml").write_text("version = \n")
    with pytest.raises(HarborTaskError, match="cannot be read"):
        load_task(tmp_path / "t")


def test_register_task_set_gives_an_id_every_command_takes():
    env_id = agentrl.envs.harbor.register_task_set(EXAMPLES_DIR, id="test/harbor-examples-v0")
    assert env_id == "test/harbor-examples-v0"
    assert agentrl.get_task(env_id, 0, split="test").id == "harbor/count-errors"
    out = subprocess.run(
        [str(Path(__file__).resolve().parents[2] / ".venv/bin/agentrl"), "env", "show", "agentrl/harbor-v0",
         "--set", f"path={EXAMPLES_DIR / 'edit-settings'}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "sample task (harbor/edit-settings)" in out.stdout and "test-script" in out.stdout


@pytest.mark.parametrize(
    ("name", "data", "reward"),
    [
        ("reward.txt", b"1\n", 1.0),
        ("reward.txt", b"0.25", 0.25),
        ("reward.json", b'{"reward": 0.5, "x": 1}', 0.5),
    ],
)
def test_reward_files_are_read_as_harbor_writes_them(name, data, reward):
    assert parse_reward(name, data) == reward


@pytest.mark.parametrize("data", [b"", b"nan", b"yes", b"\x00" * 10])
def test_a_reward_file_without_a_number_is_refused(data):
    with pytest.raises(ValueError):
        parse_reward("reward.txt", data)


class _Images:
    def __init__(self, have):
        self.have = set(have)

    def get(self, name):
        import docker.errors

        if name not in self.have:
            raise docker.errors.ImageNotFound(name)
        return type("Image", (), {"id": "sha256:" + name})()

    def pull(self, name):
        import docker.errors

        raise docker.errors.APIError("dial tcp: lookup registry-1.docker.io: no such host")


class _Client:
    def __init__(self, have):
        self.images = _Images(have)


def test_from_names_resolve_local_then_mapped_and_an_unmapped_one_says_how_to_map_it():
    client = _Client({"agentrl/base:bookworm", "mine:1"})
    text = "FROM python:3.11-slim AS build\nRUN true\nFROM build\nFROM --platform=linux/amd64 mine:1\n"
    out, how = resolve_dockerfile(text, client=client)
    assert out.splitlines()[0] == "FROM agentrl/base:bookworm AS build"
    assert [r.how for r in how] == ["mapped", "stage", "local"]
    out, _ = resolve_dockerfile("FROM node:20\n", client=client, from_map={"node:*": "mine:1"})
    assert out == "FROM mine:1\n"
    with pytest.raises(ImageBuildError, match=r"FROM node:20: .*no FROM mapping.*from_map=\{'node:20'"):
        resolve_dockerfile("FROM node:20\n", client=client)


# --- quick: SWE-bench rows and the export ---------------------------------------------------------


def test_an_instance_row_becomes_a_task_and_bad_rows_say_why():
    row = {
        "instance_id": "o__r-1",
        "repo": "o/r",
        "base_commit": "a" * 40,
        "problem_statement": "It breaks.",
        "patch": "",
        "test_patch": "diff --git a/tests/test_a.py b/tests/test_a.py\n--- /dev/null\n+++ b/tests/test_a.py\n",
        "FAIL_TO_PASS": '["tests/test_a.py::test_x"]',
        "PASS_TO_PASS": "[]",
    }
    t = instance_task(row)
    assert t.id == "swebench/o__r-1" and t.metadata["FAIL_TO_PASS"] == ["tests/test_a.py::test_x"]
    assert t.image == "swebench/sweb.eval.x86_64.o_1776_r-1:latest" and "/testbed" in t.prompt
    assert patch_files(row["test_patch"]) == [(None, "tests/test_a.py")]
    with pytest.raises(InstanceError, match="missing base_commit"):
        instance_task({k: v for k, v in row.items() if k != "base_commit"})
    with pytest.raises(InstanceError, match="not a pytest node id"):
        instance_task({**row, "FAIL_TO_PASS": '["test_x (tests.TestA)"]'})


def _repair_like_task(tmp_path: Path) -> Task:
    """A python-repair-shaped task (module, mutated and original function, hidden tests) without docker."""
    hidden = tmp_path / "hidden" / "tests"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("")
    (hidden / "test_mathy.py").write_text(
        "from mathy import double\n\ndef test_double():\n    assert double(2) == 4\n\n"
        "def test_zero():\n    assert double(0) == 0\n"
    )
    mutant = "def double(x):\n    return x + 2\n"
    return Task(
        id="python-repair/mathy/abc123",
        prompt="The package in /workspace fails its tests.",
        files={"mathy/__init__.py": mutant},
        hidden_tests=str(tmp_path / "hidden"),
        metadata={
            "module": "mathy/__init__.py",
            "mutated_function": "def double(x):\n    return x + 2\n",
            "original_function": "def double(x):\n    return x * 2\n",
            "FAIL_TO_PASS": ["tests/test_mathy.py::test_double"],
            "PASS_TO_PASS": ["tests/test_mathy.py::test_zero"],
        },
    )


def test_export_writes_harbor_dirs_our_reader_takes_back(tmp_path):
    task = _repair_like_task(tmp_path)
    (d,) = export_harbor([task], tmp_path / "harbor", source_env="x/y-v0")
    back = load_task(d)
    assert back.prompt.strip() == task.prompt
    assert back.metadata["harbor_metadata"]["FAIL_TO_PASS"] == ["tests/test_mathy.py::test_double"]
    assert (d / "environment" / "workspace" / "mathy" / "__init__.py").read_text() == task.files[
        "mathy/__init__.py"
    ]
    assert json.loads((d / "tests" / "agentrl_tests.json").read_text()) == [
        "tests/test_mathy.py::test_double",
        "tests/test_mathy.py::test_zero",
    ]
    assert (d / "tests" / "tests" / "test_mathy.py").is_file() and (d / "solution" / "solve.sh").is_file()
    assert "FROM debian:bookworm-slim" in (d / "environment" / "Dockerfile").read_text()


def test_export_writes_swebench_rows_whose_repo_holds_only_the_base(tmp_path):
    task = _repair_like_task(tmp_path)
    path = export_swebench([task], tmp_path / "swe")
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    repo = path.parent / "images" / row["instance_id"] / "repo"
    git = ["git", "-C", str(repo)]
    assert (
        subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        == row["base_commit"]
    )
    # One commit, and no object of the fix or of the tests anywhere in the store.
    objects = subprocess.run([*git, "count-objects", "-v"], capture_output=True, text=True).stdout
    assert subprocess.run([*git, "rev-list", "--all"], capture_output=True, text=True).stdout.split() == [
        row["base_commit"]
    ]
    assert "count: 4" in objects  # the commit, two trees (root, mathy/) and the mutant: nothing else
    assert patch_files(row["patch"]) == [("mathy/__init__.py", "mathy/__init__.py")]
    assert "+    return x * 2" in row["patch"]
    assert sorted(new for _, new in patch_files(row["test_patch"])) == [
        "tests/__init__.py",
        "tests/test_mathy.py",
    ]
    assert json.loads(row["FAIL_TO_PASS"]) == ["tests/test_mathy.py::test_double"]
    # The gold patch applies at the base.
    assert subprocess.run([*git, "apply", "--check", "-"], input=row["patch"], text=True).returncode == 0
    t = instance_task(row, images_dir=path.parent / "images")
    assert t.metadata["image_context"] and t.metadata["base_commit"] == row["base_commit"]


# --- through docker ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def harbor_env():
    env = agentrl.make("agentrl/harbor-v0", max_turns=4)
    yield env
    env.close()


@pytest.mark.docker
@pytest.mark.parametrize("index", [0, 1, 2])
def test_each_example_scores_its_oracle_1_and_doing_nothing_0(harbor_env, index):
    from agentrl.checks.verifier_check import check_verifier

    task = harbor_env.tasks.get(index, "test")
    check = check_verifier(harbor_env, task)  # both episodes through env.step
    assert check.ok, check.reason
    assert check.reference.reward == 1.0 and check.untouched.reward == 0.0
    if task.id == "harbor/fix-median":  # its test.sh fails (set -e) before writing any reward
        assert "wrote no /logs/verifier/reward.txt" in check.untouched.details


@pytest.mark.docker
def test_the_examples_are_audited_with_nothing_exploited(harbor_env):
    from agentrl.checks.audit import run_audit

    report = run_audit(harbor_env, env_id="agentrl/harbor-v0", tasks=3)
    exploited = [f for f in report.findings if f.status == "exploited"]
    assert not exploited, [(f.attack, f.task_id, f.evidence) for f in exploited]
    assert all(c.ok for c in report.controls) and not report.errors
    assert any(f.attack == "git-history" for f in report.findings)


@pytest.mark.docker
def test_the_workspace_is_the_images_workdir_and_the_tests_are_not_there(harbor_env):
    harbor_env.reset(options={"task": harbor_env.tasks.get(1, "test")})  # edit-settings: WORKDIR /app
    sb = harbor_env.sandbox
    assert sb.workdir == "/app"
    out = sb.exec(
        ["/bin/sh", "-c", "cat settings.ini; ls -la /tests/ /logs/ 2>&1; id -u; touch /logs/x 2>&1"]
    )
    assert "debug = true" in out.stdout and "1000" in out.stdout
    assert "No such file" in out.stdout and "test.sh" not in out.stdout  # /tests links to an empty /verifier


@pytest.mark.docker
def test_a_failing_dockerfile_is_an_error_that_names_the_step(tmp_path):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(EXAMPLES_DIR / "fix-median", d)
    (d / "environment" / "Dockerfile").write_text("FROM python:3.11-slim\nRUN echo about to fail && exit 3\n")
    env = agentrl.make("agentrl/harbor-v0", path=str(d))
    try:
        # reset says it as an EnvError (a sandbox that could not start), the build's own words in it.
        with pytest.raises(
            EnvError,
            match=r"failed at Step 2/\d+ : RUN echo about to fail.*returned a non-zero code: 3",
        ):
            env.reset(options={"index": 0})
    finally:
        env.close()


def _verdicts(env, task) -> tuple[float, float]:
    from agentrl.checks.verifier_check import check_verifier

    check = check_verifier(env, task)
    assert check.reference is not None and check.untouched is not None, check.reason
    return check.reference.reward, check.untouched.reward


@pytest.mark.docker
def test_python_repair_round_trips_through_harbor_and_swebench_with_the_same_verdicts(tmp_path):
    from agentrl.envs.harbor.env import HarborEnv
    from agentrl.envs.python_repair.env import PythonRepairEnv
    from agentrl.envs.python_repair.synth import SynthConfig, synthesize
    from agentrl.envs.swebench.env import SweBenchEnv

    tasks = synthesize(["inflection"], 2, SynthConfig(seed=7, cache_dir=tmp_path / "synth")).tasks
    assert len(tasks) == 2
    ours = PythonRepairEnv(tasks=tasks, max_turns=4)
    harbor_dirs = export_harbor(tasks, tmp_path / "harbor")
    jsonl = export_swebench(tasks, tmp_path / "swe")
    harbor = HarborEnv(path=str(tmp_path / "harbor"), max_turns=4, split="train")
    swe = SweBenchEnv(path=str(jsonl), max_turns=4)
    try:
        for task, d, row in zip(tasks, harbor_dirs, jsonl.read_text().splitlines(), strict=True):
            h_task = load_task(d, default_split=task.split)
            s_task = instance_task(json.loads(row), images_dir=jsonl.parent / "images")
            got = {
                "python-repair": _verdicts(ours, task),
                "harbor": _verdicts(harbor, h_task),
                "swebench": _verdicts(swe, s_task),
            }
            assert set(got.values()) == {(1.0, 0.0)}, (task.id, got)
    finally:
        for env in (ours, harbor, swe):
            env.close()


def _leaky_instance(tmp_path: Path) -> Path:
    """A SWE-bench-style instance whose image's repository also holds the fix (a later commit on main)."""
    from agentrl.envs.harbor.export import _GIT_ENV, SWE_DOCKERFILE

    ctx = tmp_path / "images" / "leak__mathy-1"
    repo = ctx / "repo"
    (repo / "mathy").mkdir(parents=True)
    (ctx / "Dockerfile").write_text(SWE_DOCKERFILE)
    env = {**__import__("os").environ, **_GIT_ENV}

    def git(*args):
        return subprocess.run(
            ["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True
        ).stdout

    git("init", "-q", "-b", "main")
    (repo / "mathy" / "__init__.py").write_text("def double(x):\n    return x + 2\n")
    git("add", "-A")
    git("commit", "-q", "-m", "base")
    base = git("rev-parse", "HEAD").strip()
    (repo / "mathy" / "__init__.py").write_text("def double(x):\n    return x * 2\n")
    git("commit", "-q", "-am", "fix double (upstream, after the task's base)")
    gold = git("diff", base, "HEAD")
    git("tag", "v1.0.1")
    test_patch = (
        "diff --git a/tests/test_mathy.py b/tests/test_mathy.py\nnew file mode 100644\n--- /dev/null\n"
        "+++ b/tests/test_mathy.py\n@@ -0,0 +1,5 @@\n+from mathy import double\n+\n+\n"
        "+def test_double():\n+    assert double(3) == 6\n"
    )
    row = {
        "instance_id": "leak__mathy-1",
        "repo": "leak/mathy",
        "base_commit": base,
        "problem_statement": "double(3) returns 5; it should return 6.",
        "patch": gold,
        "test_patch": test_patch,
        "FAIL_TO_PASS": '["tests/test_mathy.py::test_double"]',
        "PASS_TO_PASS": "[]",
    }
    path = tmp_path / "instances.jsonl"
    path.write_text(json.dumps(row) + "\n")
    return path


@pytest.mark.docker
def test_the_git_history_attack_reads_a_kept_history_and_is_contained_by_the_pruned_one(tmp_path):
    from agentrl.checks.audit import run_audit
    from agentrl.envs.swebench.env import SweBenchEnv

    path = _leaky_instance(tmp_path)
    for keep, exploited in ((True, True), (False, False)):
        env = SweBenchEnv(path=str(path), keep_git_history=keep, max_turns=4)
        try:
            report = run_audit(env, env_id="leak", tasks=1, only=["git-history"])
        finally:
            env.close()
        (finding,) = report.findings
        assert (finding.status == "exploited") is exploited, finding
        if keep:  # it found the fix and the tag, and checking the fix out passed the hidden tests
            assert "LEAK commit" in finding.evidence and "LEAK ref" in finding.evidence
            assert finding.reward == 1.0
        else:
            assert "no commit, ref, reflog or packed ref" in finding.evidence and finding.reward == 0.0


@pytest.mark.docker
def test_nothing_the_agent_leaves_in_the_log_folder_reaches_the_next_verification(harbor_env):
    """The log folder one verification made stays world-writable (the verifier identity writes in
    it); a sandbox verified again (the audit's answer probes) gets a fresh one, whatever is left."""
    task = harbor_env.tasks.get(0, "test")
    harbor_env.reset(options={"task": task})
    sb, verifier = harbor_env.sandbox, harbor_env.verifier
    assert verifier.verify(sb, task, harbor_env.episode).reward == 0.0  # nothing done
    plant = sb.exec(["/bin/sh", "-c", "echo 1 > /logs/reward.txt && mkdir /logs/x && echo 1 > /logs/x/y"])
    assert plant.ok, plant.stderr  # the agent can write beside the verifier's own folder
    refused = sb.exec(["/bin/sh", "-c", "echo 1 > /logs/verifier/reward.txt"])
    assert not refused.ok  # ...never in it
    again = verifier.verify(sb, task, harbor_env.episode)
    assert again.reward == 0.0, again.details
    listing = sb.exec(["/bin/sh", "-c", "ls -A /logs/ /logs/verifier/"], privileged=True)
    assert listing.ok and "reward.txt" not in listing.stdout.split("/logs/verifier/:")[0], listing.stdout
    assert "x" not in listing.stdout.split(), listing.stdout
