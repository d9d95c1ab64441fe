"""`agentrl sandbox doctor`: which sandbox backends work on this machine, and why the others do not.

Each check runs the real thing (ping the engine, start a trial bwrap) rather than guessing
from versions, and every failure says the fix.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from agentrl.sandbox.base import DEFAULT_IMAGE


@dataclass(frozen=True)
class BackendReport:
    """One backend's verdict: `ok` when `open_sandbox(backend)` should work here."""

    backend: str
    ok: bool
    detail: str


def check_docker(image: str = DEFAULT_IMAGE) -> BackendReport:
    try:
        import docker
        import docker.errors
    except ImportError as exc:
        return BackendReport(
            "docker", False, f"the docker SDK is not importable ({exc}): `pip install docker`"
        )
    try:
        client = docker.from_env(timeout=10)
        client.ping()
    except Exception as exc:
        return BackendReport(
            "docker",
            False,
            f"no Docker engine answers ({exc}); start one (`make setup` starts dockerd on this kind of machine)",
        )
    try:
        img = client.images.get(image)
    except docker.errors.ImageNotFound:
        return BackendReport(
            "docker",
            False,
            f"engine up, but base image {image} is missing: run `agentrl sandbox build` (or `make setup`)",
        )
    except Exception as exc:
        return BackendReport("docker", False, f"engine up, but inspecting {image} failed: {exc}")
    version = client.version().get("Version", "?")
    return BackendReport("docker", True, f"engine {version}, image {image} ({img.short_id.split(':')[-1]})")


def _userns_problem() -> str | None:
    """Why unprivileged user namespaces are off, or None when the kernel allows them."""
    knobs = {
        "/proc/sys/user/max_user_namespaces": lambda v: v == "0",
        "/proc/sys/kernel/unprivileged_userns_clone": lambda v: v == "0",
        "/proc/sys/kernel/apparmor_restrict_unprivileged_userns": lambda v: v == "1",
    }
    for path, is_off in knobs.items():
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if is_off(value):
            return f"user namespaces are disabled ({path} = {value}); an administrator must allow them"
    return None


def check_bwrap(image: str = DEFAULT_IMAGE) -> BackendReport:
    path = shutil.which("bwrap")
    if path is None:
        return BackendReport(
            "bwrap", False, "bubblewrap is not installed: `apt-get install bubblewrap` (or `make setup`)"
        )
    version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.strip() or "bwrap"
    if problem := _userns_problem():
        return BackendReport("bwrap", False, f"{version}: {problem}")
    trial = subprocess.run(
        [path, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "true"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if trial.returncode != 0:
        return BackendReport(
            "bwrap",
            False,
            f"{version}: a trial `bwrap --unshare-all true` failed (exit {trial.returncode}): "
            f"{trial.stderr.strip()}; the kernel or a security module refuses namespaces to this user",
        )
    if shutil.which("nsenter") is None:
        # Not fatal: sandboxes still work, but the disk cap falls back to a per-file limit.
        version += " (no nsenter: disk capped per file only; install util-linux)"
    from agentrl.sandbox.bwrap import ROOTFS_ENV, SandboxError, cached_rootfs, find_rootfs

    if os.environ.get(ROOTFS_ENV):
        try:
            rootfs = find_rootfs(image)
        except SandboxError as exc:
            return BackendReport("bwrap", False, f"{version} works, but {exc}")
        return BackendReport(
            "bwrap", True, f"{version}, user namespaces allowed, rootfs {rootfs} (${ROOTFS_ENV})"
        )
    if (cached := cached_rootfs(image)) is not None:
        return BackendReport(
            "bwrap", True, f"{version}, user namespaces allowed, rootfs {cached} (cached export)"
        )
    # Not exported yet: the doctor does not write 150 MB on its own; say whether it can be.
    docker_report = check_docker(image)
    if docker_report.ok:
        return BackendReport(
            "bwrap",
            True,
            f"{version}, user namespaces allowed; the rootfs of {image} is exported from Docker on first use (seconds)",
        )
    return BackendReport(
        "bwrap",
        False,
        f"{version} works, but there is no root file system for {image}: no cached export, no {ROOTFS_ENV}, and "
        f"Docker cannot provide one ({docker_report.detail}); set {ROOTFS_ENV} to an exported image "
        f"(`python -m agentrl.sandbox.bwrap export {image} DEST` where Docker runs)",
    )


def check_local() -> BackendReport:
    return BackendReport("local", True, "always available; no isolation: trusted tests only")


def diagnose(image: str = DEFAULT_IMAGE) -> list[BackendReport]:
    """Check every backend; never raises (a crash in one check becomes that backend's report)."""
    reports = []
    for name, check in (("docker", check_docker), ("bwrap", check_bwrap)):
        try:
            reports.append(check(image))
        except Exception as exc:  # a doctor that crashes helps nobody
            reports.append(BackendReport(name, False, f"check crashed: {type(exc).__name__}: {exc}"))
    reports.append(check_local())
    return reports
