"""Sandbox images built offline: no registry is reachable, so nothing is ever pulled.

Base images come from `debootstrap` (using the Debian mirror apt is already configured with)
and are loaded with `docker import`. Environment images are Dockerfiles `FROM` a base image.
Every image carries a label with the hash of its recipe; an image whose tag exists with the
same hash is reused, so a second build costs one `docker inspect`.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import AGENT_UID, AGENT_USER, DEFAULT_IMAGE, DEFAULT_WORKDIR, PROTECTED_DIR

RECIPE_LABEL = "agentrl.recipe"
IMAGES_DIR = Path(__file__).parent / "images"


@dataclass(frozen=True)
class BaseRecipe:
    """A debootstrap recipe for one base image."""

    tag: str
    suite: str = "bookworm"
    variant: str = "minbase"
    # python3-pytest: hidden-test verifiers; sqlite3: the SQL environment; procps: ps/pkill.
    include: tuple[str, ...] = ("python3", "python3-pytest", "sqlite3", "procps")
    # Bumped by hand when the post-processing below changes in a way the hash cannot see.
    revision: int = 1

    def digest(self, mirror: str) -> str:
        blob = json.dumps(
            {
                "suite": self.suite,
                "variant": self.variant,
                "include": sorted(self.include),
                "mirror": mirror,
                "revision": self.revision,
                "uid": AGENT_UID,
                "user": AGENT_USER,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


BASE_RECIPES: dict[str, BaseRecipe] = {DEFAULT_IMAGE: BaseRecipe(tag=DEFAULT_IMAGE)}

# Images whose build context has to be prepared first (sources downloaded from a package index,
# say) have a builder function instead of a folder under `images/`: "module:function", called
# as `fn(force=...) -> list[str]` after the Dockerfile images, imported only when it runs.
IMAGE_BUILDERS: dict[str, str] = {
    "python-repair": "agentrl.envs.python_repair.images:build_images",
    # Reference MCP servers (pip-installed for the image's python at build time), for envs whose tools
    # come from a server started inside the sandbox.
    "mcp-servers": "agentrl.mcp.images:build_images",
}


def _log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def apt_mirror() -> str:
    """The Debian mirror apt on this machine already uses (deb822 or one-line sources)."""
    candidates = [Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list")]
    candidates += (
        sorted(Path("/etc/apt/sources.list.d").glob("*")) if Path("/etc/apt/sources.list.d").exists() else []
    )
    for path in candidates:
        if not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for uri in re.findall(r"^URIs:\s*(\S+)", text, flags=re.M) + re.findall(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)", text, flags=re.M
        ):
            if "debian-security" in uri or "debian" not in uri:
                continue
            return uri.rstrip("/")
    return "http://deb.debian.org/debian"


def image_recipe_hash(client, tag: str) -> str | None:
    import docker.errors

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return (image.labels or {}).get(RECIPE_LABEL)


def _finish_rootfs(root: Path) -> None:
    """Add the agent user, the workspace and the protected verifier directory."""
    with open(root / "etc/passwd", "a") as f:
        f.write(f"{AGENT_USER}:x:{AGENT_UID}:{AGENT_UID}:agent:{DEFAULT_WORKDIR}:/bin/bash\n")
    with open(root / "etc/group", "a") as f:
        f.write(f"{AGENT_USER}:x:{AGENT_UID}:\n")
    ws = root / DEFAULT_WORKDIR.lstrip("/")
    ws.mkdir(parents=True, exist_ok=True)
    os.chown(ws, AGENT_UID, AGENT_UID)
    vd = root / PROTECTED_DIR.lstrip("/")
    vd.mkdir(parents=True, exist_ok=True)
    vd.chmod(0o755)
    # Keep the image small: apt caches and docs are never needed in a sandbox.
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
        p = root / sub
        if p.exists():
            shutil.rmtree(p, ignore_errors=True)
            p.mkdir(parents=True, exist_ok=True)


def build_base(recipe: BaseRecipe, *, force: bool = False, client=None) -> str:
    """Build (or reuse) one base image; returns its tag."""
    import docker

    client = client or docker.from_env()
    mirror = apt_mirror()
    digest = recipe.digest(mirror)
    if not force and image_recipe_hash(client, recipe.tag) == digest:
        _log(f"{recipe.tag} up to date (recipe {digest})")
        return recipe.tag
    if shutil.which("debootstrap") is None:
        raise RuntimeError(
            "debootstrap is not installed: run scripts/ensure-system.sh (or apt-get install debootstrap)"
        )
    if os.geteuid() != 0:
        raise RuntimeError(
            "building a base image with debootstrap needs root; run `sudo agentrl sandbox build --base`"
        )
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="agentrl-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        _log(f"debootstrap {recipe.suite} ({recipe.variant}, +{','.join(recipe.include)}) from {mirror}")
        cmd = [
            "debootstrap",
            f"--variant={recipe.variant}",
            f"--include={','.join(recipe.include)}",
            recipe.suite,
            str(root),
            mirror,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        _finish_rootfs(root)
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(tarball), "."], check=True)
        repo, _, tag = recipe.tag.partition(":")
        changes = [
            f"LABEL {RECIPE_LABEL}={digest}",
            "LABEL agentrl.kind=base",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "ENV LANG=C.UTF-8",
            f"WORKDIR {DEFAULT_WORKDIR}",
            'CMD ["/bin/sh"]',
        ]
        client.api.import_image_from_file(str(tarball), repository=repo, tag=tag or "latest", changes=changes)
    _log(f"built {recipe.tag} in {time.time() - t0:.0f}s (recipe {digest})")
    return recipe.tag


def build_dockerfile(tag: str, context: str | Path, *, force: bool = False, client=None) -> str:
    """Build an environment image from a Dockerfile on top of a base image, cached by recipe hash.

    The hash covers every file in the build context, so editing the Dockerfile or anything it
    copies rebuilds the image; nothing else does.
    """
    import docker

    client = client or docker.from_env()
    context = Path(context)
    if not (context / "Dockerfile").is_file():
        raise FileNotFoundError(f"no Dockerfile in {context}")
    h = hashlib.sha256()
    for p in sorted(context.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(context)).encode())
            h.update(p.read_bytes())
    digest = h.hexdigest()[:16]
    if not force and image_recipe_hash(client, tag) == digest:
        _log(f"{tag} up to date (recipe {digest})")
        return tag
    t0 = time.time()
    # pull=False: there is no registry; the FROM image must be one of ours, built first.
    client.images.build(path=str(context), tag=tag, pull=False, rm=True, labels={RECIPE_LABEL: digest})
    _log(f"built {tag} in {time.time() - t0:.0f}s (recipe {digest})")
    return tag


def build_all(*, base: bool = True, envs: bool = True, force: bool = False) -> list[str]:
    """Build every base image, then every environment image found under `images/`."""
    built: list[str] = []
    if base:
        for recipe in BASE_RECIPES.values():
            built.append(build_base(recipe, force=force))
    if envs:
        for dockerfile in sorted(IMAGES_DIR.glob("*/Dockerfile")):
            built.append(
                build_dockerfile(f"agentrl/{dockerfile.parent.name}:latest", dockerfile.parent, force=force)
            )
        for name, target in IMAGE_BUILDERS.items():
            module, _, attr = target.partition(":")
            _log(f"building the {name} images")
            built.extend(getattr(importlib.import_module(module), attr)(force=force))
    return built
