"""SWE-bench-style instances as an environment, scored by the `hidden-tests` verifier.

    env_id = agentrl.envs.swebench.register_instances("swe.jsonl", id="mylab/swe-v0")
    env = agentrl.make(env_id)                     # or SweBenchEnv(path="swe.jsonl") / instances=dataset

The repository is at `base_commit` in /testbed (the workspace, a copy of the image's, its git
history pruned to base_commit and its ancestors); the problem statement is the prompt. After the
episode the files `test_patch` touches, as they are after it (base version from the image, the
patch applied on the host), are the hidden tests: copied in only then, run as the verifier identity
with canary twins, exactly the FAIL_TO_PASS and PASS_TO_PASS ids counted (all must pass). The
oracle applies the instance's `patch` with `git apply`.

Limits: node ids must be pytest's; tests that live inside the package (`pkg/tests/...`) cannot run
apart from the workspace and are refused when the hidden tests are made.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from pydantic import Field

from agentrl.core.errors import UserError
from agentrl.core.task import Task
from agentrl.core.types import Message
from agentrl.env.agents import ScriptedOracle
from agentrl.env.parsers import HERMES, ToolCallParser
from agentrl.env.registry import register
from agentrl.env.tasksource import TaskSource, as_task_source
from agentrl.envs.harbor.env import HarborEnv, HarborSettings, _slug
from agentrl.envs.swebench.instances import REPO_DIR, instance_task, patch_files, read_rows
from agentrl.sandbox.base import Sandbox

GOLD_PATCH = "/tmp/agentrl-gold.patch"


class SweBenchSettings(HarborSettings):
    """agentrl's SWE-bench environment: which instances, where their image recipes are."""

    path: str | list[str] = Field(
        "", description="A JSONL file of SWE-bench-style instances (or give `instances=`)."
    )
    instances: Any = Field(
        None, description="The instances as rows or a datasets.Dataset split, instead of path."
    )
    images_dir: str | None = Field(
        None,
        description="Folder of image recipes, <instance_id>/Dockerfile (default: images/ beside the JSONL, "
        "when it exists); an instance without one runs its named image.",
    )
    verifier: Any = Field(
        ("hidden-tests", {"mode": "all", "timeout_s": 300.0}),
        description="How an episode is scored: the FAIL_TO_PASS and PASS_TO_PASS tests as hidden tests "
        "(give 'python' in its kwargs for an image whose interpreter is not /usr/bin/python3).",
    )


class GitApplyOracle(ScriptedOracle):
    """Applies the instance's gold patch with `git apply` in /testbed, then submits."""

    def __init__(self, task: Task, parser: ToolCallParser = HERMES):
        super().__init__(task, parser)
        if not task.metadata.get("patch"):
            raise ValueError(f"instance {task.id} has no patch for the oracle to apply")
        self.turn = 0

    def act(self, observation: list[Message]) -> str:
        self.turn += 1
        if self.turn == 1:
            return self.call("write_file", path=GOLD_PATCH, content=self.task.metadata["patch"])
        if self.turn == 2:
            return self.call(
                "bash", command=f"cd {REPO_DIR} && git apply -v {GOLD_PATCH} && rm -f {GOLD_PATCH}"
            )
        return self.call("submit", answer="applied the fix")


class SweBenchEnv(HarborEnv):
    settings_model = SweBenchSettings
    instructions = (
        "You are a software engineer. A repository with an open issue is checked out in /testbed. "
        "Investigate with the tools, change the source to resolve the issue, then call `submit`."
    )

    @classmethod
    def make_tasks(
        cls,
        *,
        path: Any = "",
        instances: Any = None,
        images_dir: str | None = None,
        tasks: Any = None,
        env_id: str | None = None,
        **_: Any,
    ) -> TaskSource:
        if tasks is None:
            source = instances if instances is not None else path
            if not source:
                raise UserError("a SWE-bench environment needs instances: path= (a JSONL file) or instances=")
            images = Path(images_dir) if images_dir else None
            if images is None and isinstance(source, str) and (Path(source).parent / "images").is_dir():
                images = Path(source).parent / "images"
            tasks = [
                instance_task(r, images_dir=images, where=f" (row {i})")
                for i, r in enumerate(read_rows(source))
            ]
        return as_task_source(tasks, name=env_id or cls.__name__)

    def image_for(self, task: Task) -> tuple[str, str]:
        from agentrl.sandbox.images import build_task_image

        meta = task.metadata
        key = meta["instance_id"]
        with self._images_lock:
            if self._images is None:
                self._images = {}
            if key not in self._images:
                context = meta.get("image_context")
                with tempfile.TemporaryDirectory(prefix="agentrl-swe-") as empty:
                    tag = build_task_image(
                        context or empty,
                        repo=f"agentrl/swe-{_slug(key)}",
                        dockerfile=None if context else f"FROM {meta['image_name']}\nWORKDIR {REPO_DIR}\n",
                        from_map=self.settings.from_map,
                        registry=self.settings.registry,
                        base_commit=meta["base_commit"],
                        keep_git_history=self.settings.keep_git_history,
                        what=f"instance {key}",
                    )
                self._images[key] = (tag, REPO_DIR)
            return self._images[key]

    def sandbox_workdir(self, task: Task) -> str:
        return REPO_DIR

    def _prepare_sandbox(self, task: Task) -> Sandbox:
        tag, _ = self.image_for(task)
        make_hidden_tests(task, tag)  # once per instance, before any of the agent's actions
        return super()._prepare_sandbox(task)

    def oracle(self, task: Task) -> GitApplyOracle:  # type: ignore[override]
        return GitApplyOracle(task, self.parser)


def make_hidden_tests(task: Task, image: str, client: Any = None) -> Path:
    """The hidden tests of an instance (`task.hidden_tests`): every file `test_patch` touches as it is
    after the patch; a file that exists at base_commit is read from the image first. Cached."""
    out = Path(task.hidden_tests or "")
    if out.is_dir():
        return out
    meta = task.metadata
    files = patch_files(meta["test_patch"])
    if not files:
        raise UserError(f"instance {meta['instance_id']}: test_patch touches no file")
    with tempfile.TemporaryDirectory(prefix="agentrl-swe-tests-") as tmp:
        work = Path(tmp, "tree")
        work.mkdir()
        existing = [old for old, _ in files if old is not None]
        if existing:
            _extract_from_image(image, [f"/opt/agentrl/seed/{p}" for p in existing], work, client)
        (Path(tmp) / "test.patch").write_text(meta["test_patch"])
        try:
            res = subprocess.run(
                ["git", "apply", "--whitespace=nowarn", str(Path(tmp) / "test.patch")],
                cwd=work,
                capture_output=True,
                text=True,
                timeout=120,
            )
        except FileNotFoundError:
            raise UserError(
                "making SWE-bench hidden tests needs git on this machine (apt-get install git)"
            ) from None
        if res.returncode != 0:
            raise UserError(
                f"instance {meta['instance_id']}: test_patch does not apply at base_commit: {res.stderr.strip()[:300]}"
            )
        for _, new in files:
            if new is None:
                continue
            top = new.split("/", 1)[0]
            if (
                "/" in new
                and top not in ("tests", "test", "testing")
                and (work / top / "__init__.py").exists()
            ):
                raise UserError(
                    f"instance {meta['instance_id']}: its tests live inside the package ({new}); hidden tests run "
                    "apart from the workspace and cannot import them from there"
                )
        staged = Path(tmp, "staged")
        shutil.copytree(work, staged)
        out.parent.mkdir(parents=True, exist_ok=True)
        if not out.exists():
            staged.rename(out) if staged.stat().st_dev == out.parent.stat().st_dev else shutil.copytree(
                staged, out
            )
    return out


def _extract_from_image(image: str, paths: list[str], dest: Path, client: Any = None) -> None:
    """Copy files out of an image (a created, never started container) into `dest`, by their path
    relative to the image's workspace seed."""
    import docker
    import docker.errors

    client = client or docker.from_env()
    container = client.containers.create(image, command=["true"], labels={"agentrl.purpose": "extract"})
    try:
        for path in paths:
            rel = path.removeprefix("/opt/agentrl/seed/")
            try:
                stream, _ = container.get_archive(path)
            except docker.errors.NotFound:
                continue  # the patch's own check says what is missing
            with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                member = tar.getmembers()[0]
                data = tar.extractfile(member)
                if data is None:
                    continue
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data.read())
    finally:
        container.remove(force=True)


def register_instances(path: str | Path, *, id: str | None = None, **defaults: Any) -> str:
    """Register a JSONL file of SWE-bench-style instances under an id of their own; returns it."""
    p = Path(path).resolve()
    env_id = id or f"swebench/{_slug(p.stem)}-v0"
    SweBenchEnv.make_tasks(path=str(p), images_dir=defaults.get("images_dir"))  # bad rows: an error now
    register(
        env_id,
        "agentrl.envs.swebench.env:SweBenchEnv",
        max_turns=defaults.pop("max_turns", 30),
        description=f"SWE-bench-style instances from {p}",
        path=str(p),
        **defaults,
    )
    return env_id
