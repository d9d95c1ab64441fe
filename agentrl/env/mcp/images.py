"""The sandbox image with MCP servers installed: the base image plus reference servers from the package index.

    agentrl sandbox build                     # builds agentrl/mcp-servers:latest with the others
    ensure_image()                            # the tag, built first when this engine lacks it

A stdio MCP server runs inside the episode's sandbox, so the sandbox's image must hold it. The sandbox
has no network, so the servers are installed at image build time, on the host: `pip install --target`
for the image's interpreter (CPython 3.11 on Debian bookworm, manylinux wheels: the host's python may be
another version), one directory per server (`/opt/agentrl-mcp/<name>`, so two servers may pin
different versions of the `mcp` SDK), copied into a layer on top of the base image. Each console
script gets a wrapper on the image's PATH (`/usr/local/bin/mcp-server-sqlite`) that runs it with the
image's python and that directory alone on its path. Nothing is fetched when an episode runs.

The servers are the reference servers of the Model Context Protocol project, pinned: `mcp-server-sqlite`
(its last release asks for `mcp>=1.6` and fails on the 2.x SDK, so it keeps `mcp==1.30.0`) and
`mcp-server-time`. The image is labelled with a hash of this recipe and rebuilt only when it changes.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import DEFAULT_IMAGE

IMAGE = "agentrl/mcp-servers:latest"
"""The image every built-in MCP server is installed in (a task names it as its `image`)."""
INSTALL_ROOT = "/opt/agentrl-mcp"
# The image's interpreter, which the wheels are chosen for (the base image is Debian bookworm's python3).
IMAGE_PYTHON = "3.11"
# Bumped by hand when the Dockerfile or the wrappers change in a way the recipe hash cannot see.
_REVISION = 2


@dataclass(frozen=True)
class ServerPackage:
    """One MCP server from the package index, and the requirements it is installed with."""

    name: str
    """Its directory under `INSTALL_ROOT`."""
    requirements: tuple[str, ...]
    """pip requirement strings: the server pinned, and whatever of its dependencies must be."""
    scripts: tuple[str, ...]
    """The console scripts that get a wrapper on the image's PATH."""


SERVERS: dict[str, ServerPackage] = {
    s.name: s
    for s in (
        ServerPackage("sqlite", ("mcp-server-sqlite==2025.4.25", "mcp==1.30.0"), ("mcp-server-sqlite",)),
        ServerPackage("time", ("mcp-server-time==2026.10.19", "mcp==2.3.0"), ("mcp-server-time",)),
    )
}

_WRAPPER = """#!/bin/sh
# {script} from {requirements}, installed by agentrl (agentrl.env.mcp.images)
PYTHONPATH={site} exec /usr/bin/python3 {site}/bin/{script} "$@"
"""

DOCKERFILE = f"""FROM {{base}}
LABEL agentrl.kind=mcp-servers
COPY opt/ {INSTALL_ROOT}/
COPY bin/ /usr/local/bin/
# Bytecode compiled by the image's own python: the root file system is read-only in a sandbox, so a
# server would otherwise compile its whole dependency tree in memory at every start (seconds, each episode).
RUN python3 -m compileall -q {INSTALL_ROOT} > /dev/null; chmod -R a+rX,go-w {INSTALL_ROOT} && chmod 0755 /usr/local/bin/mcp-*
"""


def recipe_digest(servers: dict[str, ServerPackage] | None = None, base: str = DEFAULT_IMAGE) -> str:
    blob = json.dumps(
        {
            "servers": {n: [list(s.requirements), list(s.scripts)] for n, s in (servers or SERVERS).items()},
            "base": base,
            "python": IMAGE_PYTHON,
            "machine": platform.machine(),
            "revision": _REVISION,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _wheel_platforms() -> list[str]:
    """manylinux tags bookworm's glibc (2.36) runs, for this machine's architecture."""
    arch = platform.machine()
    return [f"manylinux_2_{v}_{arch}" for v in (36, 34, 31, 28, 27, 24, 17)] + [f"manylinux2014_{arch}"]


def _pip_install(package: ServerPackage, site: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    cmd += ["--no-warn-script-location", "--no-compile", "--target", str(site), "--only-binary=:all:"]
    cmd += [
        "--python-version",
        IMAGE_PYTHON,
        "--implementation",
        "cp",
        "--abi",
        "cp" + IMAGE_PYTHON.replace(".", ""),
    ]
    for tag in _wheel_platforms():
        cmd += ["--platform", tag]
    proc = subprocess.run([*cmd, *package.requirements], capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "is ignored: it is neither" not in ln]
        raise RuntimeError(
            f"pip could not install {' '.join(package.requirements)} for the MCP image (exit {proc.returncode}): "
            + "\n".join(errors)[-1500:]
            + "\nThe package index must be reachable when images are built (`agentrl sandbox build`)."
        )
    missing = [s for s in package.scripts if not (site / "bin" / s).is_file()]
    if missing:
        raise RuntimeError(f"{package.requirements[0]} installed no console script {missing}")
    for script in (site / "bin").iterdir():  # their first line names the host's python: the image's
        data = script.read_bytes()
        if data.startswith(b"#!"):
            script.write_bytes(b"#!/usr/bin/python3\n" + data.split(b"\n", 1)[1])


def build_context(
    directory: Path, servers: dict[str, ServerPackage] | None = None, base: str = DEFAULT_IMAGE
) -> Path:
    """Write the build context (every server installed into its own directory) under `directory`."""
    servers = servers or SERVERS
    (directory / "bin").mkdir(parents=True, exist_ok=True)
    for package in servers.values():
        site = directory / "opt" / package.name
        _pip_install(package, site)
        for script in package.scripts:
            wrapper = directory / "bin" / script
            wrapper.write_text(
                _WRAPPER.format(
                    script=script,
                    site=f"{INSTALL_ROOT}/{package.name}",
                    requirements=" ".join(package.requirements),
                )
            )
            wrapper.chmod(0o755)
    (directory / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    return directory


def build_image(*, force: bool = False, client=None, tag: str = IMAGE) -> str:
    """Build (or reuse) the MCP servers image; returns its tag."""
    import docker

    from agentrl.sandbox.images import RECIPE_LABEL, image_recipe_hash

    client = client or docker.from_env()
    digest = recipe_digest()
    if not force and image_recipe_hash(client, tag) == digest:
        print(f"[images] {tag} up to date (recipe {digest})", file=sys.stderr, flush=True)
        return tag
    names = ", ".join(p.requirements[0] for p in SERVERS.values())
    print(
        f"[images] building {tag}: {DEFAULT_IMAGE} + {names} (from the package index)",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="agentrl-mcp-image-") as tmp:
        context = build_context(Path(tmp))
        client.images.build(path=str(context), tag=tag, pull=False, rm=True, labels={RECIPE_LABEL: digest})
        shutil.rmtree(context / "opt", ignore_errors=True)
    return tag


def build_images(*, force: bool = False) -> list[str]:
    """What `agentrl sandbox build` calls (`agentrl.sandbox.images.IMAGE_BUILDERS`)."""
    return [build_image(force=force)]


def ensure_image(client=None) -> str:
    """The MCP servers image, built first when this Docker engine does not have it at this recipe."""
    import docker

    from agentrl.sandbox.images import image_recipe_hash

    client = client or docker.from_env()
    if image_recipe_hash(client, IMAGE) == recipe_digest():
        return IMAGE
    return build_image(client=client)
