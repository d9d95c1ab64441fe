"""The sandbox contract every backend implements, and the factory that opens one.

A sandbox is an isolated place where an agent's tool calls run: a fresh file system with a
writable workspace, resource limits, and per-command timeouts. Everything above this layer
(environments, tools, verifiers) talks to the `Sandbox` protocol only, never to a backend.

Three identities exist inside every sandbox:
- the agent (non-root, uid 1000 where the backend can switch users): runs every `exec` by
  default and owns the workspace;
- privileged (the sandbox's own root): `exec(..., privileged=True)` and
  `copy_in(..., privileged=True)` can write `PROTECTED_DIR`, which the agent can never write,
  and see what the image keeps root-only (e.g. a pristine copy of the source). Environments
  use it to stage a task; nothing of the agent's ever runs with it;
- the verifier identity (`exec(..., as_verifier=True)`): what runs the agent's code on the
  verifier's behalf (the hidden tests import it). Unprivileged: it reads the workspace and
  `PROTECTED_DIR`, writes neither (only a scratch /tmp), and sees nothing root-only. So a
  workspace symlink into a root-only directory leads nowhere, whoever follows it: a
  privileged helper never imports or runs what the agent wrote (no confused deputy).
  docker: uid 2000. bwrap (one uid only): a mount view with the workspace and
  `PROTECTED_DIR` read-only, a fresh /tmp, and the image's root-only paths masked.
  Backends say what they support in their `capabilities`.
"""

from __future__ import annotations

import errno
import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_IMAGE = "agentrl/base:bookworm"
DEFAULT_WORKDIR = "/workspace"
# Root-owned and unwritable by the agent: verifiers copy hidden tests here after the episode.
PROTECTED_DIR = "/verifier"
AGENT_UID = 1000
AGENT_USER = "agent"
# Runs the agent's code on the verifier's behalf (see the module docstring); never root.
VERIFIER_UID = 2000
VERIFIER_USER = "verifier"
# `Limits.read_limit_bytes`' default: far above any source file or test report, far below what
# would hurt the host when 32 episodes read at once.
DEFAULT_READ_LIMIT_BYTES = 16 * 1024 * 1024


class Limits(BaseModel):
    """Resource limits of one sandbox. Frozen and hashable: a warm pool is keyed by it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    memory_mb: int = Field(
        1024, gt=0, description="Memory cap for everything in the sandbox, in MiB (no swap)."
    )
    cpus: float = Field(1.0, gt=0, description="CPU quota, in cores.")
    pids: int = Field(256, gt=0, description="Most processes/threads alive at once (stops fork bombs).")
    disk_mb: int = Field(
        512, gt=0, description="Size cap of the writable workspace and of /tmp, in MiB each."
    )
    network: bool = Field(False, description="Allow network access. Off by default: no egress at all.")
    exec_timeout_s: float = Field(30.0, gt=0, description="Default per-exec wall-clock timeout, in seconds.")
    output_limit_bytes: int = Field(
        64 * 1024,
        gt=0,
        description="Cap on each of stdout and stderr per exec; the rest is dropped and `truncated` set.",
    )
    read_limit_bytes: int = Field(
        DEFAULT_READ_LIMIT_BYTES,
        gt=0,
        description=(
            "Largest file `read_file` returns, in bytes (unless the caller passes `max_bytes`); a larger "
            "one raises `FileTooLargeError`, so no path the agent names can make the host read without bound."
        ),
    )


@dataclass(frozen=True)
class ExecResult:
    """What one command did. `exit_code` is -9 (or the signal's negative) when it was killed."""

    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    duration_s: float
    truncated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxError(RuntimeError):
    """A sandbox could not do what was asked (not: the command inside failed)."""


class SandboxDead(SandboxError):
    """The sandbox itself is gone (container removed, OOM-killed init, daemon lost)."""


class EngineUnavailable(SandboxDead):
    """The container engine behind the sandbox stopped answering (frozen, deadlocked or down).

    A `SandboxDead`: nothing more can run in the sandbox, so the episode ends with `env_error`;
    the message says what to do about the engine.
    """


class SandboxPathError(SandboxError, PermissionError):
    """A file method was given a path the sandbox must not reach (an escape, or a read-only place)."""


class NotRegularFileError(SandboxPathError):
    """A path names a device, FIFO or socket (or a symlink to one): sandboxes read and write
    regular files only, so `/dev/zero` or a planted FIFO can neither flood nor hang the reader."""


class FileTooLargeError(SandboxError, OSError):
    """A file holds more than the read limit (`Limits.read_limit_bytes`, or the caller's `max_bytes`)."""

    def __init__(self, path: str, limit: int, where: str = "") -> None:
        message = (
            f"{path} holds more than {limit} bytes, the read limit{f' of {where}' if where else ''}; "
            "read it in parts (e.g. `head -c`/`sed -n` in an exec), pass a larger max_bytes, or "
            "truncate=True for its first bytes"
        )
        super().__init__(message)
        self.errno = errno.EFBIG
        self.strerror = message
        self.filename = path
        self.path = path
        self.limit = limit

    def __str__(self) -> str:
        return self.strerror


Command = str | Sequence[str]


@runtime_checkable
class Sandbox(Protocol):
    """One isolated, single-use place to run an agent's commands. Use as a context manager."""

    backend: str
    id: str
    workdir: str
    limits: Limits

    def exec(
        self,
        cmd: Command,
        *,
        timeout: float | None = None,
        stdin: str | bytes | None = None,
        env: Mapping[str, str] | None = None,
        privileged: bool = False,
        as_verifier: bool = False,
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run `cmd` (argv list, or a string run by `/bin/sh -c`) in `workdir`.

        Never raises for what the command does (non-zero exit, timeout, huge output); raises
        `SandboxDead` only when the sandbox itself is gone. On timeout the command's whole
        process tree is killed. `as_verifier` runs it as the verifier identity (see the module
        docstring; not together with `privileged`). `output_limit` replaces
        `limits.output_limit_bytes` for this command only (a verifier reading its own results
        needs a different cap than the agent's commands).
        """
        ...

    def write_file(
        self, path: str, data: str | bytes, *, mode: int = 0o644, privileged: bool = False
    ) -> None:
        """Write a file (relative paths are under `workdir`), creating parent directories."""
        ...

    def read_file(self, path: str, *, max_bytes: int | None = None, truncate: bool = False) -> bytes:
        """Read a regular file's bytes (relative paths are under `workdir`).

        Bounded whatever the path names: a symlink is judged by what it points to, inside the
        sandbox; a device, FIFO or socket raises `NotRegularFileError` (never read, never waited
        on); more than `max_bytes` (default `limits.read_limit_bytes`) raises `FileTooLargeError`,
        or with `truncate=True` returns the first `max_bytes`. `FileNotFoundError` when it does
        not exist, `IsADirectoryError` for a directory.
        """
        ...

    def copy_in(self, host_path: str | Path, path: str, *, privileged: bool = False) -> None:
        """Copy a host file or directory tree to `path` inside the sandbox."""
        ...

    def kill_agent_processes(self) -> None:
        """Kill every process the agent started (verifiers call this before they run)."""
        ...

    def alive(self) -> bool:
        """Whether the sandbox still exists and can run commands."""
        ...

    def close(self) -> None:
        """Destroy the sandbox and everything in it. Safe to call twice."""
        ...

    def __enter__(self) -> Sandbox: ...

    def __exit__(self, *exc: object) -> None: ...


# Backends register lazily by module path: importing the docker SDK or probing bwrap costs
# nothing until that backend is asked for.
BACKENDS: dict[str, str] = {
    "docker": "agentrl.sandbox.docker:DockerSandbox",
    "bwrap": "agentrl.sandbox.bwrap:BwrapSandbox",
    "local": "agentrl.sandbox.local:LocalSandbox",
}


def read_limit(limits: Limits, max_bytes: int | None) -> int:
    """The byte limit of one `read_file`: the caller's `max_bytes`, else the sandbox's."""
    if max_bytes is None:
        return limits.read_limit_bytes
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return max_bytes


def backend_class(name: str) -> type:
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; expected one of {sorted(BACKENDS)}")
    module, _, attr = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def open_sandbox(
    backend: str = "docker",
    *,
    image: str = DEFAULT_IMAGE,
    limits: Limits | None = None,
    workdir: str = DEFAULT_WORKDIR,
    env: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> Sandbox:
    """Start a fresh sandbox on `backend` ("docker", "bwrap" or "local") and return it started.

    `labels` are recorded on the sandbox (docker: container labels) next to the run id, so a
    reaper can find what a crashed run left behind.
    """
    cls = backend_class(backend)
    return cls(
        image=image,
        limits=limits or Limits(),
        workdir=workdir,
        env=dict(env or {}),
        labels=dict(labels or {}),
    )
