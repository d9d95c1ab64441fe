"""Sandbox images with a harness installed: an environment's image plus packages from the package index.

    harness_image("agentrl/python-repair-toolz", ["mini-swe-agent==2.4.6"])  # -> "agentrl/harness-<hash>"

The packages are installed on the host (`pip install --target`, with the host's index and cache: the
sandbox has no network) into a build context, and copied into a layer on top of the image at
`HARNESS_DIR`, readable by the agent. Their console scripts are rewritten to run the image's python, so
`PATH=HARNESS_DIR/bin` finds them. Nothing in the image changes for anyone else: the packages are seen
only by a command given `harness_env()` (`PYTHONPATH`, `PATH`), never by the verifier's python.

The image is tagged by a hash of the base image's id, the packages and this recipe, and labelled with it:
a second call costs one `docker inspect`. The image's python must be the host's minor version (compiled
wheels are the host's).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

HARNESS_DIR = "/opt/agentrl-harness"
_RECIPE_REVISION = 1
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_lock = threading.Lock()
_built: dict[tuple[str, tuple[str, ...]], str] = {}


def harness_env() -> dict[str, str]:
    """What a command needs to find the installed packages and their scripts."""
    return {"PYTHONPATH": HARNESS_DIR, "PATH": f"{HARNESS_DIR}/bin:{_SYSTEM_PATH}"}


def harness_image(base: str, packages: Sequence[str], *, client=None) -> str:
    """`base` with `packages` installed at `HARNESS_DIR` (built once; see the module docstring)."""
    packages = tuple(packages)
    if not packages:
        return base
    key = (base, packages)
    with _lock:  # episodes of one process reset concurrently: one build
        if key in _built:
            return _built[key]
        tag = _build(base, packages, client)
        _built[key] = tag
        return tag


def _build(base: str, packages: tuple[str, ...], client) -> str:
    import docker
    import docker.errors

    from agentrl.sandbox.base import SandboxError
    from agentrl.sandbox.images import RECIPE_LABEL, image_recipe_hash

    client = client or docker.from_env()
    try:
        base_id = client.images.get(base).id
    except docker.errors.ImageNotFound as exc:
        raise SandboxError(
            f"image {base!r} is not on this Docker engine; build it with `agentrl sandbox build` first"
        ) from exc
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    recipe = json.dumps(
        {"base": base_id, "packages": packages, "python": python, "revision": _RECIPE_REVISION},
        sort_keys=True,
    )
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]
    tag = f"agentrl/harness-{digest}"
    if image_recipe_hash(client, tag) == digest:
        return tag
    print(f"[harness] building {tag}: {base} + {' '.join(packages)}", file=sys.stderr, flush=True)
    theirs = client.containers.run(
        base,
        ["python3", "-c", "import sys; print(f'{sys.version_info.major}.{sys.version_info.minor}')"],
        remove=True,
        network_mode="none",
    )
    theirs = theirs.decode().strip()
    if theirs != python:
        raise SandboxError(
            f"{base} has python {theirs} and this host {python}: harness packages are installed with the host's "
            "pip, so the versions must match (run agentrl with a python of the image's version)"
        )
    with tempfile.TemporaryDirectory(prefix="agentrl-harness-") as tmp:
        site = Path(tmp) / "site"
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-warn-script-location",
                "--target",
                str(site),
                *packages,
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SandboxError(
                f"pip could not install {' '.join(packages)} for the harness image: {proc.stderr.strip()[-500:]}"
            )
        _rewrite_scripts(site / "bin")
        (Path(tmp) / "Dockerfile").write_text(
            f"FROM {base}\nCOPY site/ {HARNESS_DIR}/\nRUN chmod -R a+rX {HARNESS_DIR}\n"
        )
        client.images.build(path=tmp, tag=tag, pull=False, rm=True, labels={RECIPE_LABEL: digest})
    return tag


def _rewrite_scripts(bin_dir: Path) -> None:
    """Console scripts name the host's python in their first line: the image's instead."""
    if not bin_dir.is_dir():
        return
    for script in bin_dir.iterdir():
        if not script.is_file():
            continue
        data = script.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            script.write_bytes(b"#!/usr/bin/env python3\n" + data.split(b"\n", 1)[1])
