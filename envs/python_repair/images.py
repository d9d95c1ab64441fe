"""One sandbox image per package: the base image plus the package's pristine source at /opt/src/<name>.

The source directory is root-only (mode 0700). The agent (uid 1000) can never read it: were it
readable, `diff -r /opt/src/toolz /workspace/toolz` would point at the planted bug. The
environment copies it into the workspace at reset through a root-owned staging copy (see
`env.stage_source`). The build context is written into the cache from the unpacked sdist, so
`build_dockerfile`'s recipe hash covers the source itself: the image is rebuilt only when the
pinned sdist or this recipe changes.
"""

from __future__ import annotations

import shutil
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


_STAGE = "/tmp/.agentrl-pristine"


def stage_source(sandbox, source_dir: str) -> None:
    """Copy the image's root-only pristine source into the agent's workspace.

    Root (privileged, no capabilities) can read its 0700 copy but cannot write the agent's
    workspace; the agent can write the workspace but cannot read the copy. So root copies it to
    a readable place in /tmp, the agent copies that into /workspace, and root removes it. This
    runs at reset, before the agent has any process in the sandbox.
    """
    from agentrl.sandbox.base import SandboxError

    steps = [
        (f"rm -rf {_STAGE} && cp -r {source_dir} {_STAGE} && chmod -R a+rX {_STAGE}", True),
        (f"cp -r {_STAGE}/. {sandbox.workdir}/", False),
        (f"rm -rf {_STAGE}", True),
    ]
    for cmd, privileged in steps:
        res = sandbox.exec(["/bin/sh", "-c", cmd], timeout=120, privileged=privileged)
        if not res.ok:
            raise SandboxError(
                f"staging the package source {source_dir} into {sandbox.workdir} failed at {cmd!r} "
                f"(exit {res.exit_code}): {res.stderr.strip()[-500:]}; is the image built from this "
                "version of agentrl (`agentrl sandbox build`)?"
            )
