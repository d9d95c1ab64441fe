"""One sandbox image per package: the base image plus the package's pristine source at /opt/src/<name>.

The source directory is root-only (mode 0700). The agent (uid 1000) can never read it: were it
readable, `diff -r /opt/src/toolz /workspace/toolz` would point at the planted bug. The
environment copies it into the workspace at reset through a root-owned staging copy (see
`stage_source`). The build context is written into the cache from the unpacked sdist, so
`build_dockerfile`'s recipe hash covers the source itself: the image is rebuilt only when the
pinned sdist or this recipe changes.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

from agentrl.envs.python_repair.packages import PACKAGES, PackageSpec, cache_root, unpacked
from agentrl.sandbox.base import DEFAULT_IMAGE

DOCKERFILE = """\
FROM {base}
LABEL agentrl.kind=python-repair agentrl.package={dist}=={version}
COPY src/ {dest}/
# Root-only: the agent must not read the unmutated source (it would give the bug away).
RUN chown -R root:root {dest} && chmod 0700 {dest} && find {dest} -type d -exec chmod 0700 {{}} + \\
    && find {dest} -type f -exec chmod 0600 {{}} +
"""


def build_context(spec: PackageSpec, *, root: Path | None = None) -> Path:
    """Write the Docker build context for one package (downloading its sdist if needed)."""
    root = root or cache_root()
    src = unpacked(spec, root=root) / "source"
    ctx = root / "contexts" / f"repair-{spec.name}"
    if ctx.exists():
        shutil.rmtree(ctx)
    shutil.copytree(src, ctx / "src")
    (ctx / "Dockerfile").write_text(
        DOCKERFILE.format(
            base=DEFAULT_IMAGE, dist=spec.dist, version=spec.version, dest=spec.source_dir_in_image
        )
    )
    return ctx


def build_image(spec: PackageSpec, *, force: bool = False, client=None) -> str:
    from agentrl.sandbox.images import build_dockerfile

    return build_dockerfile(spec.image, build_context(spec), force=force, client=client)


def build_images(*, force: bool = False, names: list[str] | None = None) -> list[str]:
    """Build (or reuse) the image of every package; called by `agentrl sandbox build`."""
    return [build_image(PACKAGES[name], force=force) for name in (names or list(PACKAGES))]


def ensure_image(spec: PackageSpec) -> str:
    """The package's image, built first if this Docker engine does not have it yet.

    Building downloads the pinned sdist once (into the cache); `agentrl sandbox build` does the
    same ahead of time. Episodes never download anything: they only use built images.
    """
    unpacked(spec)  # the host side (sources, hidden tests) may be missing even when the image is not
    if image_present(spec):
        return spec.image
    import sys

    print(
        f"[python-repair] image {spec.image} not found: building it now (downloads {spec.dist}=={spec.version} "
        "from the package index once; `agentrl sandbox build` builds every image ahead of time)",
        file=sys.stderr,
        flush=True,
    )
    return build_image(spec)


def image_present(spec: PackageSpec, client=None) -> bool:
    import docker
    import docker.errors

    client = client or docker.from_env()
    try:
        client.images.get(spec.image)
    except docker.errors.ImageNotFound:
        return False
    return True


# Every staged file and directory gets this modification (and access) time: a time that differs
# between files would point at the one the task rewrote (the bug-location-metadata attack).
STAGED_MTIME = 1_700_000_000

# Root's half (it alone reads the 0700 pristine copy): copy it to a staging directory with the
# task's files written over it, readable by the agent.
_STAGE_PRIVILEGED = r"""
import json, os, shutil, sys
src, dst = sys.argv[1], sys.argv[2]
shutil.copytree(src, dst, symlinks=True)
for rel, content in json.loads(sys.stdin.read()).items():
    target = os.path.normpath(os.path.join(dst, rel))
    if not target.startswith(dst + "/"):
        sys.exit("task file outside the package: " + rel)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8") as f:
        f.write(content)
for root, dirs, files in os.walk(dst):
    os.chmod(root, 0o755)
    for name in files:
        path = os.path.join(root, name)
        if not os.path.islink(path):
            os.chmod(path, 0o755 if os.stat(path).st_mode & 0o111 else 0o644)
"""

# The agent's half: create the workspace tree in sorted path order, each file given the one
# mtime as it is made, so inode numbers and change times follow the paths, never which file the
# task rewrote. On one CPU: tmpfs hands out inode numbers in per-CPU batches.
_STAGE_AGENT = r"""
import os, shutil, sys
src, dst, stamp = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
except (AttributeError, OSError):
    pass
rels = []
for root, dirs, files in os.walk(src):
    for name in dirs + files:
        rels.append(os.path.relpath(os.path.join(root, name), src))
made = []
for rel in sorted(rels):
    s, d = os.path.join(src, rel), os.path.join(dst, rel)
    if os.path.islink(s):
        os.symlink(os.readlink(s), d)
        continue
    if os.path.isdir(s):
        os.mkdir(d, 0o755)
        made.append(d)
    else:
        shutil.copyfile(s, d)
        os.chmod(d, os.stat(s).st_mode & 0o777)
        os.utime(d, (stamp, stamp))
for d in sorted(made, key=lambda p: p.count("/"), reverse=True) + [dst]:
    os.utime(d, (stamp, stamp))
"""


def stage_source(sandbox, source_dir: str, files: Mapping[str, str] | None = None) -> None:
    """Copy the image's root-only pristine source into the agent's workspace, with `files`
    (workspace-relative path -> text; the task's mutant) written over it.

    Root (privileged, no capabilities) can read its 0700 copy but cannot write the agent's
    workspace; the agent can write the workspace but cannot read the copy. So root stages the
    package (task files included) in a fresh directory in /tmp, the agent copies that into
    /workspace, and root removes it. This runs at reset, before the agent has any process in
    the sandbox. No file metadata points at the task's files: they are staged with the rest,
    created in path order, and every mtime is `STAGED_MTIME`.
    """
    from agentrl.sandbox.base import SandboxError

    stage = f"/tmp/.agentrl-pristine-{uuid.uuid4().hex[:12]}"
    steps = [
        (["python3", "-I", "-c", _STAGE_PRIVILEGED, source_dir, stage], True, json.dumps(dict(files or {}))),
        (["python3", "-I", "-c", _STAGE_AGENT, stage, sandbox.workdir, str(STAGED_MTIME)], False, None),
        (["rm", "-rf", stage], True, None),
    ]
    for argv, privileged, stdin in steps:
        res = sandbox.exec(argv, timeout=120, privileged=privileged, stdin=stdin)
        if not res.ok:
            raise SandboxError(
                f"staging the package source {source_dir} into {sandbox.workdir} failed at {argv[:2] + argv[3:]} "
                f"(exit {res.exit_code}): {res.stderr.strip()[-500:]}; is the image built from this "
                "version of agentrl (`agentrl sandbox build`)?"
            )
