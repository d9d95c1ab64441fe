"""The sandbox contract every backend implements, what the built-in backends share, and the factory.

A sandbox is an isolated place where an agent's tool calls run: a fresh file system with a
writable workspace, resource limits, and per-command timeouts. Everything above this layer
(environments, tools, verifiers) talks to the `Sandbox` protocol only, never to a backend, and
asks a sandbox's `capabilities` (`agentrl.sandbox.spec.Capabilities`) what it promises, never
its backend's name.

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
  A backend that has it says so in `capabilities.verifier_identity`.

What the built-in backends share lives here, once: `SandboxBase` turns the protocol's calls
into checked requests with their defaults resolved (`ExecRequest`: argv, timeout, output cap,
identity), bounds reads (`Limits.read_limit_bytes`), owns the context manager and the
idempotent `close`; `CappedOutput` keeps a stream up to its cap and adds the truncation note;
`signal_exit` maps "killed by signal N" reported as 128+N to -N. A backend supplies `_exec`
(run one request), `_close`, a `FileAccess` for the file methods, `kill_agent_processes` and
`alive`. The host-side process runner shared by `local` and `bwrap` is
`agentrl.sandbox.process`; their host-side file access is `agentrl.sandbox.hostfs`.
"""

from __future__ import annotations

import errno
import os
import signal
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypedDict, Unpack, runtime_checkable

from agentrl.core.plugins import Plugins
from agentrl.sandbox.spec import (
    DEFAULT_IMAGE,
    DEFAULT_READ_LIMIT_BYTES,
    DEFAULT_WORKDIR,
    NO_CAPABILITIES,
    PROTECTED_DIR,
    Capabilities,
    Limits,
    SandboxSpec,
    SpecFields,
    capabilities_of,
    check_string_map,
)

__all__ = [
    "AGENT_UID",
    "AGENT_USER",
    "BACKENDS",
    "DEFAULT_IMAGE",
    "DEFAULT_READ_LIMIT_BYTES",
    "DEFAULT_WORKDIR",
    "KILLED",
    "NO_CAPABILITIES",
    "PROTECTED_DIR",
    "TRUNCATION_NOTE",
    "VERIFIER_UID",
    "VERIFIER_USER",
    "Capabilities",
    "CappedOutput",
    "Command",
    "EngineUnavailable",
    "ExecOptions",
    "ExecRequest",
    "ExecResult",
    "FileAccess",
    "FileTooLargeError",
    "Identity",
    "Limits",
    "NotRegularFileError",
    "Sandbox",
    "SandboxBase",
    "SandboxDead",
    "SandboxError",
    "SandboxPathError",
    "SandboxSpec",
    "SpecFields",
    "backend_capabilities",
    "backend_class",
    "capabilities_of",
    "open_sandbox",
    "read_limit",
    "signal_exit",
]

AGENT_UID = 1000
AGENT_USER = "agent"
# Runs the agent's code on the verifier's behalf (see the module docstring); never root.
VERIFIER_UID = 2000
VERIFIER_USER = "verifier"
# The protocol's exit code of a command killed on its deadline (as `subprocess` reports SIGKILL).
KILLED = -signal.SIGKILL
# Appended to a stream that hit its cap, so a model reading it knows it saw only the start.
TRUNCATION_NOTE = "\n[agentrl: output truncated, {n} bytes dropped]"


# --------------------------------------------------------------------------------------
# Results and errors
# --------------------------------------------------------------------------------------


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

    @classmethod
    def captured(
        cls, exit_code: int, stdout: CappedOutput, stderr: CappedOutput, *, timed_out: bool, duration_s: float
    ) -> ExecResult:
        """The result of a command whose streams were capped while read; a timed-out one reads `KILLED`."""
        return cls(
            exit_code=KILLED if timed_out and exit_code >= 0 else exit_code,
            stdout=stdout.text(),
            stderr=stderr.text(),
            timed_out=timed_out,
            duration_s=duration_s,
            truncated=bool(stdout.dropped or stderr.dropped),
        )


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
        return str(self.strerror)


# --------------------------------------------------------------------------------------
# The protocol
# --------------------------------------------------------------------------------------

Command = str | Sequence[str]
Identity = Literal["agent", "privileged", "verifier"]


@runtime_checkable
class Sandbox(Protocol):
    """One isolated, single-use place to run an agent's commands. Use as a context manager."""

    backend: str
    id: str
    workdir: str
    limits: Limits
    spec: SandboxSpec
    capabilities: Capabilities
    """What this sandbox promises (isolation, a protected dir, a verifier identity, ...); ask it,
    not `backend`."""

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


# --------------------------------------------------------------------------------------
# What the built-in backends share
# --------------------------------------------------------------------------------------


def as_argv(cmd: Command) -> tuple[str, ...]:
    """An argv from the protocol's `cmd`: a string runs under `/bin/sh -c`; paths become strings."""
    if isinstance(cmd, str):
        return ("/bin/sh", "-c", cmd)
    if isinstance(cmd, bytes) or not isinstance(cmd, Sequence):
        raise ValueError(f"cmd must be a shell string or a non-empty list of strings, got {cmd!r}")
    argv = tuple(os.fspath(a) if isinstance(a, os.PathLike) else a for a in cmd)
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"cmd must be a shell string or a non-empty list of strings, got {cmd!r}")
    return argv


class ExecOptions(TypedDict, total=False):
    """`Sandbox.exec`'s keyword arguments; the protocol's `exec` says what each does."""

    timeout: float | None
    stdin: str | bytes | None
    env: Mapping[str, str] | None
    privileged: bool
    as_verifier: bool
    output_limit: int | None


@dataclass(frozen=True)
class ExecRequest:
    """One `exec` call, checked, with every default resolved: what a backend's `_exec` runs."""

    argv: tuple[str, ...]
    timeout: float
    """Seconds; the sandbox's `limits.exec_timeout_s` unless the call gave one."""
    stdin: bytes | None
    env: Mapping[str, str]
    """The call's own variables (on top of the sandbox's `spec.env`)."""
    identity: Identity
    output_limit: int
    """Bytes kept of each of stdout and stderr."""

    @classmethod
    def make(cls, cmd: Command, limits: Limits, options: ExecOptions) -> ExecRequest:
        """The request of `exec(cmd, **options)` on a sandbox with `limits`, or a clear error."""
        unknown = sorted(set(options) - ExecOptions.__optional_keys__)
        if unknown:
            raise TypeError(
                f"exec() got unknown keyword(s) {unknown}; it takes {sorted(ExecOptions.__optional_keys__)}"
            )
        privileged, as_verifier = options.get("privileged", False), options.get("as_verifier", False)
        if privileged and as_verifier:
            raise ValueError("privileged and as_verifier are two different identities; pick one")
        timeout = options.get("timeout")
        timeout = limits.exec_timeout_s if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        output_limit = options.get("output_limit")
        output_limit = limits.output_limit_bytes if output_limit is None else output_limit
        if output_limit < 1:
            raise ValueError(f"output_limit must be >= 1 byte, got {output_limit}")
        stdin = options.get("stdin")
        return cls(
            argv=as_argv(cmd),
            timeout=float(timeout),
            stdin=stdin.encode() if isinstance(stdin, str) else None if stdin is None else bytes(stdin),
            env=check_string_map(options.get("env"), "the exec's env"),
            identity="privileged" if privileged else "verifier" if as_verifier else "agent",
            output_limit=output_limit,
        )


class CappedOutput:
    """One output stream, kept up to `cap` bytes while it is read; the rest is counted, not kept
    (100 MB of output costs no memory)."""

    __slots__ = ("cap", "data", "dropped")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.data = bytearray()
        self.dropped = 0

    def feed(self, chunk: bytes | memoryview) -> None:
        room = max(self.cap - len(self.data), 0)
        if len(chunk) > room:
            self.dropped += len(chunk) - room
            chunk = chunk[:room]
        self.data += chunk

    def text(self) -> str:
        """The kept bytes as text, with the truncation note when anything was dropped."""
        text = self.data.decode("utf-8", errors="replace")
        return text + TRUNCATION_NOTE.format(n=self.dropped) if self.dropped else text


def signal_exit(code: int) -> int:
    """The protocol's exit code from a runtime that reports "killed by signal N" as 128+N (docker,
    bwrap): -N, as `subprocess` says. A program that itself exits 129..159 reads the same: such a
    runtime cannot tell the two apart."""
    return 128 - code if 128 < code < 160 else code


def read_limit(limits: Limits, max_bytes: int | None) -> int:
    """The byte limit of one `read_file`: the caller's `max_bytes`, else the sandbox's."""
    if max_bytes is None:
        return limits.read_limit_bytes
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return max_bytes


class FileAccess(Protocol):
    """How a backend reaches the sandbox's files (`SandboxBase`'s file methods call it).

    Paths are as the sandbox sees them (relative ones under the workdir). `local` and `bwrap`
    use `agentrl.sandbox.hostfs.HostView` (host side); docker works inside the container.
    """

    def write(self, path: str, data: bytes, *, mode: int, privileged: bool) -> None: ...

    def read(self, path: str, *, limit: int) -> bytes:
        """A regular file's first `limit + 1` bytes at most: one over tells "larger" apart."""
        ...

    def copy_in(self, host_path: Path, path: str, *, privileged: bool) -> None: ...

    def lost(self) -> str | None:
        """Why the sandbox's files are gone (deleted from outside), or None."""
        ...


class SandboxBase:
    """The `Sandbox` protocol's shared half: checked calls, defaults, read bounds, `with`, `close`.

    A backend sets `backend`, `capabilities` and `self.files` (a `FileAccess`), and implements
    `_exec(request)`, `_close()`, `kill_agent_processes()` and `alive()`.
    """

    backend: ClassVar[str]
    capabilities: ClassVar[Capabilities] = NO_CAPABILITIES

    def __init__(self, spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]) -> None:
        self.spec = SandboxSpec.of(spec, **fields)
        self.image = self.spec.image
        self.limits = self.spec.limits
        self.workdir = self.spec.workdir
        self.env = dict(self.spec.env)
        self.labels = dict(self.spec.labels)
        self.id = f"{self.backend}-{uuid.uuid4().hex[:12]}"
        self.files: FileAccess | None = None
        self._closed = False

    # -- the protocol -----------------------------------------------------------------------

    def exec(self, cmd: Command, **options: Unpack[ExecOptions]) -> ExecResult:
        """`Sandbox.exec`: the call checked, its defaults resolved (`ExecRequest`), then the backend's `_exec`."""
        request = ExecRequest.make(cmd, self.limits, options)
        self._check_open()
        return self._exec(request)

    def write_file(
        self, path: str, data: str | bytes, *, mode: int = 0o644, privileged: bool = False
    ) -> None:
        payload = data.encode() if isinstance(data, str) else bytes(data)
        self._open_files().write(path, payload, mode=mode, privileged=privileged)

    def read_file(self, path: str, *, max_bytes: int | None = None, truncate: bool = False) -> bytes:
        limit = read_limit(self.limits, max_bytes)
        data = self._open_files().read(path, limit=limit)
        if len(data) > limit:
            if not truncate:
                raise FileTooLargeError(path, limit, f"sandbox {self.id}")
            data = data[:limit]
        return data

    def copy_in(self, host_path: str | Path, path: str, *, privileged: bool = False) -> None:
        host_path = Path(host_path)
        if not host_path.exists() and not host_path.is_symlink():
            raise FileNotFoundError(
                errno.ENOENT, "copy_in: no such file or directory on the host", str(host_path)
            )
        self._open_files().copy_in(host_path, path, privileged=privileged)

    def close(self) -> None:
        """Destroy the sandbox and everything in it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self) -> SandboxBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"{type(self).__name__}(id={self.id!r}, image={self.image!r}, {state})"

    # -- for backends -----------------------------------------------------------------------

    def _exec(self, request: ExecRequest) -> ExecResult:
        """Run one checked request (the sandbox is open); never raise for what the command does."""
        raise NotImplementedError

    def _close(self) -> None:
        """Destroy everything the sandbox holds; called once, by `close`."""
        raise NotImplementedError

    def kill_agent_processes(self) -> None:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def attach(self, argv: Sequence[str]) -> Any:
        """Start `argv` in the sandbox as the agent, and hold its stdin, stdout and stderr open: a
        `Transport` (`agentrl.sandbox.executor`: `send`, `read_loop`, `close`). A long-lived link into
        the sandbox (a harness command's relay to its gateway session, `agentrl.gateway.relay`);
        `kill_agent_processes` and `close` end it. Closing the transport sends the process EOF."""
        raise SandboxError(
            f"the {self.backend} sandbox backend cannot attach a process; use the docker, bwrap or local backend"
        )

    @property
    def resident_executor(self) -> object | None:
        """The resident executor the agent's commands run through now (`agentrl.sandbox.executor`),
        or None (a backend without one, `SandboxSpec.executor=False`, none started yet)."""
        slot = getattr(self, "_executor", None)
        return getattr(slot, "current", None)

    def check_intact(self) -> None:
        """Raise `SandboxDead` when what ran the agent's commands can no longer be trusted: a
        resident executor (`agentrl.sandbox.executor`) killed, replaced or frozen from inside.
        `ToolEnv` asks before its verifier runs, so such an episode ends `env_error`, never with a
        reward. A backend without such a thing has nothing to check."""

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxDead(
                f"sandbox {self.id} is closed; open a new one with open_sandbox({self.backend!r})"
            )
        why = self.files.lost() if self.files is not None else None
        if why is not None:
            raise SandboxDead(f"sandbox {self.id} {why}")

    def _open_files(self) -> FileAccess:
        self._check_open()
        assert self.files is not None, f"{type(self).__name__} set no FileAccess"
        return self.files


# --------------------------------------------------------------------------------------
# Backends and the factory
# --------------------------------------------------------------------------------------

_PROTOCOL_METHODS = ("exec", "write_file", "read_file", "copy_in", "kill_agent_processes", "alive", "close")


def _sandbox_class(name: str, cls: Any) -> type:
    """A backend is a class whose instances follow the `Sandbox` protocol (a `SandboxBase` does)."""
    if not isinstance(cls, type):
        raise TypeError(f"expected a class whose instances are sandboxes, got {cls!r}")
    missing = [m for m in _PROTOCOL_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise TypeError(f"{cls.__qualname__} lacks the Sandbox methods {missing} (subclass SandboxBase)")
    return cls


# The backends by name: the built-ins, then the `agentrl.sandbox_backends` entry points of installed
# packages (name = "package.module:SandboxClass"). Each is imported when first asked for: importing
# the docker SDK or probing bwrap costs nothing until that backend is used.
BACKENDS: Plugins[type] = Plugins(
    "agentrl.sandbox_backends",
    "sandbox backend",
    builtins={
        "docker": "agentrl.sandbox.docker:DockerSandbox",
        "bwrap": "agentrl.sandbox.bwrap:BwrapSandbox",
        "local": "agentrl.sandbox.local:LocalSandbox",
    },
    on_load=_sandbox_class,
)


def backend_class(name: str) -> type:
    """The class of backend `name` (an unknown name: a one-line error naming the backends there are)."""
    return BACKENDS.get(name)


def backend_capabilities(name: str) -> Capabilities:
    """What every sandbox of backend `name` promises, known before one is opened."""
    return capabilities_of(backend_class(name))


def open_sandbox(
    backend: str = "docker", spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]
) -> Sandbox:
    """Start a fresh sandbox on `backend` ("docker", "bwrap", "local", or an installed plugin's) and return it started.

    Give a `SandboxSpec`, or its fields as keywords (`image=`, `limits=`, `workdir=`, `env=`,
    `labels=`), or both (the keywords replace the spec's fields). `labels` are recorded on the
    sandbox (docker: container labels) next to the run id, so a reaper can find what a crashed
    run left behind.
    """
    cls = backend_class(backend)
    return cls(SandboxSpec.of(spec, **fields))
