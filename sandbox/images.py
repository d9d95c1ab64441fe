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

    def digest(self, mirror: str | None) -> str:
        blob = json.dumps(
            {
                "suite": self.suite,
                "variant": self.variant,
                "include": sorted(self.include),
                "mirror": mirror or "debootstrap's default",
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
    "mcp-servers": "agentrl.env.mcp.images:build_images",
}


def _log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


def apt_mirror(etc_apt: Path = Path("/etc/apt")) -> str | None:
    """The Debian mirror apt on this machine already uses (deb822 or one-line sources); None when apt names
    none, and debootstrap then uses its own default mirror."""
    candidates = [etc_apt / "sources.list.d/debian.sources", etc_apt / "sources.list"]
    candidates += (
        sorted((etc_apt / "sources.list.d").glob("*")) if (etc_apt / "sources.list.d").exists() else []
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
    return None


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
        source = mirror or "debootstrap's default mirror"
        _log(f"debootstrap {recipe.suite} ({recipe.variant}, +{','.join(recipe.include)}) from {source}")
        cmd = [
            "debootstrap",
            f"--variant={recipe.variant}",
            f"--include={','.join(recipe.include)}",
            recipe.suite,
            str(root),
            *([mirror] if mirror else []),
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


# --- task images: a task's own Dockerfile, offline ----------------------------------------------
#
# Tasks in the field's formats (Harbor task directories, SWE-bench-style instances) bring their own
# Dockerfile, `FROM` an image of a public registry. Each `FROM` name is resolved in this order:
#
#   1. the image is on this engine already: used as written;
#   2. a registry answers (`registry="auto"`): pulled, then used as written;
#   3. a `FROM` mapping matches the name (`DEFAULT_FROM_MAP`, then the caller's): the mapped image,
#      one built here (`agentrl sandbox build`), stands in for it;
#   4. otherwise: an `ImageBuildError` naming the image and the mapping that would build it.
#
# The resolved Dockerfile, every file of the build context and the resolved base images' ids make
# the recipe hash; the image is tagged `<repo>:<hash>` and reused while the hash holds. agentrl's
# own layer (`AGENTRL_LAYER`) is appended to every such Dockerfile: it makes the image a sandbox
# image (the agent's user, /verifier, Harbor's /tests and /logs paths, a pruned git history, a copy
# of the workdir to seed the workspace with).

import fnmatch  # noqa: E402
import io  # noqa: E402
import tarfile  # noqa: E402
import threading  # noqa: E402
from collections.abc import Mapping  # noqa: E402

from agentrl.core.errors import UserError  # noqa: E402

DEFAULT_FROM_MAP: dict[str, str] = {
    # Debian bookworm and what is built on it: the base image is Debian bookworm (minbase) with
    # python3, pytest, sqlite3 and procps; a Dockerfile's own `RUN apt-get install` adds the rest
    # (Debian's mirror is reachable where PyPI is).
    "debian:*": DEFAULT_IMAGE,
    "python:3*": DEFAULT_IMAGE,
    "buildpack-deps:*": DEFAULT_IMAGE,
    "ubuntu:*": DEFAULT_IMAGE,
    # Terminal-Bench's base images (Debian/Ubuntu with python and tmux).
    "ghcr.io/laude-institute/t-bench/*": DEFAULT_IMAGE,
}
"""`FROM` names (fnmatch patterns, tried in order) and the image built here that stands in for each
when it is neither on this engine nor pullable. docs/ENVIRONMENTS.md lists them; a task set adds its
own (`from_map=` of the Harbor and SWE-bench environments)."""

AGENTRL_LAYER_SCRIPT = r"""#!/bin/sh
# agentrl's layer, run once as root at the end of a task image's build (sandbox/images.py).
set -e
base_commit="$1"
w="$(pwd)"
case "$w" in /|/tmp|/tmp/*|/proc|/proc/*|/dev|/dev/*|/sys|/sys/*|/verifier|/verifier/*) w="" ;; esac
mkdir -p /opt/agentrl /verifier
chmod 755 /opt/agentrl /verifier
printf '%s' "$w" > /opt/agentrl/workdir
# The agent's user (uid 1000) and the verifier's (uid 2000), where the image has none.
grep -q '^[^:]*:[^:]*:1000:' /etc/passwd || echo "agent:x:1000:1000:agent:${w:-/tmp}:/bin/sh" >> /etc/passwd
grep -q '^[^:]*:[^:]*:1000:' /etc/group || echo "agent:x:1000:" >> /etc/group
grep -q '^[^:]*:[^:]*:2000:' /etc/passwd || echo "verifier:x:2000:2000:verifier:/tmp:/bin/sh" >> /etc/passwd
# Harbor's paths: the tests and the verifier's logs exist only under /verifier, which only root
# writes, and only after the episode; a solution is unpacked under /tmp by the oracle.
rm -rf /tests /logs /solution
ln -s /verifier/tests /tests
ln -s /verifier/logs /logs
ln -s /tmp/.agentrl-solution /solution
GIT="git -c safe.directory=*"
if [ -n "$base_commit" ]; then
    [ -n "$w" ] || { echo "agentrl: a base commit needs a WORKDIR (the repository)" >&2; exit 3; }
    $GIT -C "$w" -c advice.detachedHead=false checkout -q -f "$base_commit"
fi
# No answer in the history: every repository keeps HEAD and its ancestors, nothing else (no other
# branch, tag or remote, no reflog, no packed ref, no stash, no dangling or alternate object).
prune_repo() {
    g="$1"; r="$(dirname "$g")"
    [ -d "$g" ] || return 0   # a gitfile (worktree, submodule) points elsewhere
    if ! command -v git >/dev/null 2>&1; then
        rm -rf "$g"; echo "agentrl: removed $g (no git in the image to prune it with)"; return 0
    fi
    if ! head="$($GIT --git-dir="$g" rev-parse -q --verify 'HEAD^{commit}')"; then
        rm -rf "$g"; echo "agentrl: removed $g (no commit at HEAD)"; return 0
    fi
    branch="$($GIT --git-dir="$g" symbolic-ref -q HEAD || true)"
    $GIT --git-dir="$g" for-each-ref --format='delete %(refname)' | $GIT --git-dir="$g" update-ref --stdin
    if [ -n "$branch" ]; then $GIT --git-dir="$g" update-ref "$branch" "$head"; fi
    rm -rf "$g/logs" "$g/packed-refs" "$g/FETCH_HEAD" "$g/ORIG_HEAD" "$g/MERGE_HEAD" "$g/CHERRY_PICK_HEAD" \
        "$g/REVERT_HEAD" "$g/BISECT_LOG" "$g/AUTO_MERGE" "$g/refs/original" "$g/modules" "$g/worktrees" "$g/rr-cache"
    $GIT --git-dir="$g" --work-tree="$r" reset -q
    # -a without -l: objects HEAD borrows from an alternate are copied in before it is cut off.
    $GIT --git-dir="$g" repack -a -d -q
    rm -f "$g/objects/info/alternates" "$g/objects/info/http-alternates"
    $GIT --git-dir="$g" prune --expire=now
    echo "agentrl: pruned $g to $head and its ancestors"
}
if [ "$AGENTRL_KEEP_GIT_HISTORY" != 1 ]; then
    find / -xdev -name .git -not -path '/proc/*' 2>/dev/null | while read -r g; do prune_repo "$g"; done
fi
# The workspace is a fresh tmpfs mounted over the workdir: it starts as a copy of this.
rm -rf /opt/agentrl/seed
mkdir -p /opt/agentrl/seed
if [ -n "$w" ] && [ -d "$w" ]; then cp -a "$w"/. /opt/agentrl/seed/; fi
chmod -R a+rX /opt/agentrl/seed
"""

AGENTRL_LAYER = (
    "\n# --- agentrl's layer (sandbox/images.py): the agent's user, /verifier, a pruned git history,"
    " the workspace's seed\n"
    "USER root\n"
    "COPY agentrl-layer.sh /opt/agentrl/layer.sh\n"
    "RUN AGENTRL_KEEP_GIT_HISTORY={keep} /bin/sh /opt/agentrl/layer.sh {base_commit}\n"
)


class ImageBuildError(UserError):
    """A task image could not be built: its Dockerfile failed, timed out, or names an image that is
    neither here, nor pullable, nor mapped."""


_FROM = re.compile(r"^(\s*FROM\s+)((?:--\S+\s+)*)(\S+)(.*)$", re.IGNORECASE | re.MULTILINE)
_registry_down: str | None = None  # why the last pull failed: no second try per process
_registry_lock = threading.Lock()
_build_slots: threading.BoundedSemaphore | None = None
_tag_locks: dict[str, threading.Lock] = {}
_tag_locks_guard = threading.Lock()
DEFAULT_BUILD_CONCURRENCY = 2


def build_concurrency() -> int:
    """Task image builds at once in this process: `AGENTRL_IMAGE_BUILDS`, else 2 (a build is a
    CPU- and disk-heavy job for the engine, shared with every running sandbox)."""
    value = os.environ.get("AGENTRL_IMAGE_BUILDS", "")
    return max(1, int(value)) if value.strip().isdigit() else DEFAULT_BUILD_CONCURRENCY


def _slots() -> threading.BoundedSemaphore:
    global _build_slots
    with _tag_locks_guard:
        if _build_slots is None:
            _build_slots = threading.BoundedSemaphore(build_concurrency())
        return _build_slots


def _tag_lock(tag: str) -> threading.Lock:
    with _tag_locks_guard:
        return _tag_locks.setdefault(tag, threading.Lock())


@dataclass(frozen=True)
class FromResolution:
    """What one `FROM` line named, what was built from, and why."""

    written: str
    used: str
    how: str
    """`local` (on this engine), `pulled`, `mapped` (a stand-in from the mapping), `stage` (an
    earlier stage of the same Dockerfile) or `scratch`."""


def resolve_from(
    name: str, *, client, from_map: Mapping[str, str] | None = None, registry: str = "auto"
) -> FromResolution:
    """The image to build `FROM name` on (the order is this section's comment)."""
    import docker.errors

    global _registry_down
    if name == "scratch" or "$" in name:  # nothing to resolve (a build ARG names it at build time)
        return FromResolution(name, name, "scratch" if name == "scratch" else "local")
    try:
        client.images.get(name)
        return FromResolution(name, name, "local")
    except docker.errors.ImageNotFound:
        pass
    why = _registry_down if registry == "auto" else "registry look-ups are off (registry='off')"
    if registry == "auto" and why is None:
        with _registry_lock:
            try:
                client.images.pull(name)
                return FromResolution(name, name, "pulled")
            except docker.errors.APIError as exc:
                why = str(getattr(exc, "explanation", None) or exc).strip()
                if "not found" not in why.lower() and "manifest unknown" not in why.lower():
                    _registry_down = why  # unreachable, not merely unknown: do not ask again
    mapping = {**DEFAULT_FROM_MAP, **dict(from_map or {})}
    # The caller's entries first: a task set's own mapping wins over the defaults.
    for pattern in [*dict(from_map or {}), *DEFAULT_FROM_MAP]:
        if fnmatch.fnmatchcase(name, pattern):
            target = mapping[pattern]
            try:
                client.images.get(target)
            except docker.errors.ImageNotFound:
                raise ImageBuildError(
                    f"FROM {name} stands for {target} here (mapping {pattern!r}), which is not built on this "
                    "engine: run `agentrl sandbox build`"
                ) from None
            return FromResolution(name, target, "mapped")
    raise ImageBuildError(
        f"FROM {name}: the image is not on this Docker engine, no registry could give it ({why}), and no "
        f"FROM mapping matches it; map it to an image built here, e.g. from_map={{{name!r}: "
        f"{DEFAULT_IMAGE!r}}} (docs/ENVIRONMENTS.md, 'Images'), or build/load {name} on this engine"
    )


def resolve_dockerfile(
    text: str, *, client, from_map: Mapping[str, str] | None = None, registry: str = "auto"
) -> tuple[str, list[FromResolution]]:
    """The Dockerfile with every `FROM` resolved, and what each became."""
    stages: set[str] = set()
    resolved: list[FromResolution] = []

    def one(m: re.Match) -> str:
        head, flags, name, rest = m.group(1), m.group(2), m.group(3), m.group(4)
        alias = re.search(r"\bAS\s+(\S+)", rest, re.IGNORECASE)
        if name.lower() in stages:
            r = FromResolution(name, name, "stage")
        else:
            r = resolve_from(name, client=client, from_map=from_map, registry=registry)
        if alias:
            stages.add(alias.group(1).lower())
        resolved.append(r)
        return f"{head}{flags}{r.used}{rest}"

    return _FROM.sub(one, text), resolved


def _context_tar(context: Path, extra: Mapping[str, bytes]) -> tuple[bytes, str]:
    """The build context as a tar (the task's files, then `extra`), and the hash of its contents."""
    h = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(context.rglob("*")) if context.is_dir() else []:
            rel = str(p.relative_to(context))
            if rel in extra:
                continue
            info = tar.gettarinfo(str(p), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0  # the hash and the layer cache follow the contents, not the checkout time
            h.update(rel.encode() + b"\0" + str(info.mode).encode() + b"\0")
            if p.is_symlink():
                h.update(os.readlink(p).encode())
                tar.addfile(info)
            elif p.is_file():
                data = p.read_bytes()
                h.update(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
        for rel, data in sorted(extra.items()):
            info = tarfile.TarInfo(rel)
            info.size, info.mode = len(data), 0o755
            h.update(rel.encode() + b"\0" + data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), h.hexdigest()


def _lock_file(tag: str):
    """A file lock per image tag, across processes: one build of a recipe at a time."""
    import fcntl

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "agentrl" / "image-locks"
    root.mkdir(parents=True, exist_ok=True)
    f = open(root / (re.sub(r"[^A-Za-z0-9_.-]", "_", tag) + ".lock"), "w")  # noqa: SIM115 - held by the caller
    fcntl.flock(f, fcntl.LOCK_EX)
    return f


def build_task_image(
    context: str | Path,
    *,
    repo: str,
    dockerfile: str | None = None,
    from_map: Mapping[str, str] | None = None,
    registry: str = "auto",
    timeout_s: float = 600.0,
    base_commit: str | None = None,
    keep_git_history: bool = False,
    what: str = "",
    force: bool = False,
    client=None,
) -> str:
    """Build (or reuse) a task's image from its Dockerfile with agentrl's layer on top; its tag.

    `context`: the build context (Harbor's `environment/`); `dockerfile`: the Dockerfile's text
    (default: `context/Dockerfile`). `repo`: the image name, tagged with the recipe hash.
    `base_commit`: checked out in the workdir before the history is pruned (SWE-bench's
    base_commit). `keep_git_history=True` skips the pruning: only to measure the leak it closes.
    Build concurrency is bounded (`build_concurrency()`); one recipe is built once at a time,
    across processes. A failing build is an `ImageBuildError` with the failing step and its output.
    """
    import docker

    client = client or docker.from_env()
    context = Path(context)
    label = what or str(context)
    if dockerfile is None:
        path = context / "Dockerfile"
        if not path.is_file():
            raise ImageBuildError(f"{label}: no Dockerfile at {path}")
        dockerfile = path.read_text()
    if base_commit is not None and not re.fullmatch(r"[0-9a-fA-F]{7,64}", base_commit):
        raise ImageBuildError(f"{label}: base_commit {base_commit!r} is not a commit sha")
    text, froms = resolve_dockerfile(dockerfile, client=client, from_map=from_map, registry=registry)
    text = (
        text.rstrip("\n")
        + "\n"
        + AGENTRL_LAYER.format(keep=int(keep_git_history), base_commit=base_commit or "")
    )
    extra = {"Dockerfile.agentrl": text.encode(), "agentrl-layer.sh": AGENTRL_LAYER_SCRIPT.encode()}
    blob, digest = _context_tar(context, extra)
    ids = [
        client.images.get(r.used).id
        for r in froms
        if r.how in ("local", "pulled", "mapped") and "$" not in r.used
    ]
    recipe = hashlib.sha256((digest + "\0" + "\0".join(ids)).encode()).hexdigest()[:16]
    tag = f"{repo}:{recipe}"
    with _tag_lock(tag):
        if not force and image_recipe_hash(client, tag) == recipe:
            return tag
        lock = _lock_file(tag)
        try:
            if not force and image_recipe_hash(client, tag) == recipe:
                return tag
            with _slots():
                _run_build(client, blob, tag, recipe, froms, label, timeout_s)
        finally:
            lock.close()
    return tag


def _run_build(
    client, blob: bytes, tag: str, recipe: str, froms: list[FromResolution], label: str, timeout_s: float
) -> None:
    import docker.errors

    t0 = time.monotonic()
    mapped = [f"{r.written} -> {r.used}" for r in froms if r.how == "mapped"]
    _log(f"building {tag} for {label}" + (f" (FROM {', '.join(mapped)})" if mapped else ""))
    lines: list[str] = []
    step = ""
    try:
        stream = client.api.build(
            fileobj=io.BytesIO(blob),
            custom_context=True,
            dockerfile="Dockerfile.agentrl",
            tag=tag,
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
            labels={
                RECIPE_LABEL: recipe,
                "agentrl.kind": "task",
                "agentrl.from": json.dumps([r.__dict__ for r in froms]),
            },
            timeout=max(1, int(timeout_s)),  # the socket's: a silent step past it ends the read
        )
        for chunk in stream:
            if "stream" in chunk:
                for ln in str(chunk["stream"]).splitlines():
                    if ln.startswith("Step "):
                        step = ln
                    if ln.strip():
                        lines = [*lines[-30:], ln]
            if "error" in chunk or "errorDetail" in chunk:
                detail = chunk.get("errorDetail", {}).get("message") or chunk.get("error")
                raise ImageBuildError(
                    f"{label}: the Dockerfile failed at {step or 'its start'}: {str(detail).strip()}; "
                    f"last output: {' | '.join(lines[-8:])}"
                )
            if time.monotonic() - t0 > timeout_s:
                raise ImageBuildError(
                    f"{label}: the image build passed its build_timeout_sec ({timeout_s:g}s) at {step}; "
                    "raise the task's [environment].build_timeout_sec or build it ahead of time"
                )
    except docker.errors.APIError as exc:
        raise ImageBuildError(
            f"{label}: the Docker engine refused the build: {exc.explanation or exc}"
        ) from None
    except OSError as exc:  # the socket's timeout (requests' errors are OSErrors too)
        raise ImageBuildError(
            f"{label}: the image build passed its build_timeout_sec ({timeout_s:g}s) at {step or 'its start'} ({exc})"
        ) from None
    _log(f"built {tag} in {time.monotonic() - t0:.0f}s")


def image_workdir(tag: str, client=None) -> str:
    """The workdir a task image's layer recorded (empty: none; the workspace is then the default)."""
    import docker

    client = client or docker.from_env()
    return str((client.images.get(tag).attrs.get("Config") or {}).get("WorkingDir") or "")
