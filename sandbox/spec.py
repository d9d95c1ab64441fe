"""What a sandbox is asked to be (`SandboxSpec`, `Limits`) and what a backend can promise (`Capabilities`).

    from agentrl.sandbox import SandboxSpec, Limits, open_sandbox
    spec = SandboxSpec(image="agentrl/base:bookworm", limits=Limits(memory_mb=512), env={"LANG": "C"})
    with open_sandbox("docker", spec) as sb: ...

A `SandboxSpec` is the one place the settings of a sandbox (image, limits, workdir, env, labels,
executor) are declared, defaulted and checked. Backends and the warm pool take a spec; the keyword
form `open_sandbox(backend, image=..., limits=...)` builds one. A spec is frozen and hashable: the
pool keys its warm sandboxes by (backend, spec).
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from agentrl.core.task import DEFAULT_IMAGE

DEFAULT_WORKDIR = "/workspace"
# Root-owned and unwritable by the agent: verifiers copy hidden tests here after the episode.
PROTECTED_DIR = "/verifier"
# Places a workspace cannot be: the sandbox's own /tmp and PROTECTED_DIR, and the kernel's
# file systems (every backend mounts its own /proc and /dev; docker and bwrap bind /tmp apart).
RESERVED_DIRS = ("/proc", "/dev", "/sys", "/tmp", PROTECTED_DIR)
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


class FrozenMap(Mapping[str, str]):
    """A read-only, hashable str -> str mapping (a spec's env and labels), ordered by key."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, str] | None = None) -> None:
        self._items = dict(sorted(dict(items or {}).items()))

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and self._items == dict(other.items())

    def __repr__(self) -> str:
        return repr(self._items)

    def __reduce__(self) -> tuple[type[FrozenMap], tuple[dict[str, str]]]:
        return FrozenMap, (self._items,)


_EMPTY = FrozenMap()


def check_string_map(value: Any, what: str) -> FrozenMap:
    """`value` (None: empty) as a `FrozenMap`, or a ValueError naming the entry that is not a str -> str."""
    if value is None:
        return _EMPTY
    if isinstance(value, FrozenMap):
        return value  # checked when it was made
    if not isinstance(value, Mapping):
        raise ValueError(f"{what} must be a mapping of strings to strings, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise ValueError(
                f"{what} has an invalid name {key!r}: expected a non-empty string without '=' or NUL"
            )
        if not isinstance(item, str) or "\0" in item:
            raise ValueError(f"{what}[{key!r}] must be a string without NUL, got {item!r}")
    return FrozenMap(value)


def check_workdir(workdir: Any) -> str:
    """The normalised workdir, or a ValueError saying what a workdir may be."""
    if not isinstance(workdir, str) or not workdir.startswith("/"):
        raise ValueError(
            f"workdir must be an absolute sandbox path like {DEFAULT_WORKDIR!r}, got {workdir!r}"
        )
    normal = posixpath.normpath(workdir)
    if normal.startswith("//"):  # POSIX keeps a leading "//"; it names "/" all the same
        normal = "/" + normal.lstrip("/")
    reserved = next((d for d in RESERVED_DIRS if normal == d or normal.startswith(d + "/")), None)
    if normal == "/" or reserved is not None:
        raise ValueError(
            f"workdir {workdir!r} is {'the root' if normal == '/' else reserved if normal == reserved else f'inside {reserved}'}; it must be a "
            f"directory of its own like {DEFAULT_WORKDIR!r}, not '/' nor under {', '.join(RESERVED_DIRS)}"
        )
    return normal


@dataclass(frozen=True)
class SandboxSpec:
    """Everything that makes two sandboxes interchangeable, checked once, here.

    Frozen and hashable (env and labels are read-only mappings). `dataclasses.replace(spec, ...)`
    or `spec.replace(...)` derives another.
    """

    image: str = DEFAULT_IMAGE
    """Container image (docker; bwrap exports its root file system). `local` records and ignores it."""
    limits: Limits = field(default_factory=Limits)
    """Resource limits; a mapping of `Limits` fields is accepted."""
    workdir: str = DEFAULT_WORKDIR
    """The agent's writable workspace and every exec's working directory; absolute, not under /tmp or /verifier."""
    env: Mapping[str, str] = field(default_factory=FrozenMap)
    """Environment variables every exec starts with (an exec's own `env` adds to them)."""
    labels: Mapping[str, str] = field(default_factory=FrozenMap)
    """Recorded on the sandbox (docker: container labels) next to the run id, for the reaper and for you."""
    executor: bool = True
    """Run the agent's commands (and, on docker, its file reads and writes) through a resident
    executor inside the sandbox: a fork per command instead of a fresh `docker exec` or bwrap
    (`agentrl.sandbox.executor`). Off: every command starts from scratch. Privileged and verifier
    commands never use it. An image without python3 runs without one."""

    def __post_init__(self) -> None:
        if not isinstance(self.image, str) or not self.image.strip():
            raise ValueError(
                f"image must be a non-empty image name like {DEFAULT_IMAGE!r}, got {self.image!r}"
            )
        limits = self.limits
        if limits is None:
            limits = Limits()
        elif isinstance(limits, Mapping):
            limits = Limits(**limits)
        elif not isinstance(limits, Limits):
            raise ValueError(
                f"limits must be a Limits (or a mapping of its fields), got {type(limits).__name__}"
            )
        object.__setattr__(self, "limits", limits)
        object.__setattr__(self, "workdir", check_workdir(self.workdir))
        object.__setattr__(self, "env", check_string_map(self.env, "env"))
        object.__setattr__(self, "labels", check_string_map(self.labels, "labels"))
        if not isinstance(self.executor, bool):
            raise ValueError(f"executor must be True or False, got {self.executor!r}")

    @classmethod
    def of(cls, spec: SandboxSpec | None = None, **fields: Any) -> SandboxSpec:
        """`spec` (default: the defaults) with the given fields replaced; a field given as None keeps its value.

        How the keyword form `open_sandbox(backend, image=..., limits=...)` becomes a spec.
        """
        given = {k: v for k, v in fields.items() if v is not None}
        unknown = sorted(given.keys() - _SPEC_FIELD_SET)
        if unknown:
            raise TypeError(f"unknown sandbox setting(s) {unknown}; a SandboxSpec has {list(SPEC_FIELDS)}")
        if spec is None:
            return cls(**given)
        if not isinstance(spec, SandboxSpec):
            raise TypeError(f"spec must be a SandboxSpec, got {type(spec).__name__}")
        return dataclasses.replace(spec, **given) if given else spec

    def replace(self, **changes: Any) -> SandboxSpec:
        """A copy with `changes` applied (checked like a new spec)."""
        return dataclasses.replace(self, **changes)


SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SandboxSpec))
_SPEC_FIELD_SET = frozenset(SPEC_FIELDS)


class SpecFields(TypedDict, total=False):
    """The keyword form of a `SandboxSpec` (`open_sandbox`, `SandboxPool.acquire`); None keeps the default."""

    image: str | None
    limits: Limits | Mapping[str, Any] | None
    workdir: str | None
    env: Mapping[str, str] | None
    labels: Mapping[str, str] | None
    executor: bool | None


@dataclass(frozen=True)
class Capabilities:
    """What a backend promises. Verifiers and environments ask these, never a backend's name.

    Every flag defaults to False: a sandbox that does not say is assumed to promise nothing.
    """

    isolated: bool = False
    """Commands run in their own root file system and process namespace: the host's files and
    processes are out of their reach (docker, bwrap; not local)."""
    network_isolation: bool = False
    """Commands have no network at all unless `Limits.network` (docker, bwrap)."""
    protected_dir: bool = False
    """`PROTECTED_DIR` exists at that path inside commands and only `privileged` writes can change it
    (docker, bwrap). A verifier that stages hidden tests there needs it."""
    verifier_identity: bool = False
    """`exec(as_verifier=True)` runs apart from the agent: it cannot write the workspace or
    `PROTECTED_DIR`, nor read the image's root-only files (docker: uid 2000; bwrap: a mount view)."""
    separate_users: bool = False
    """`privileged` commands run as another user (root) than the agent's, so file ownership and
    permission bits keep the agent out (docker; bwrap has one uid and masks paths instead)."""
    background_processes: bool = False
    """A process started in the background (`server &`) outlives the exec that started it, until
    the sandbox closes (docker, local; not bwrap, where each exec is its own pid namespace)."""
    resident_executor: bool = False
    """The agent's commands run through a resident executor inside the sandbox
    (`agentrl.sandbox.executor`), unless `SandboxSpec.executor` is off (docker, bwrap)."""
    engine_images: bool = False
    """`SandboxSpec.image` must be in the container engine the sandbox starts on: an environment that
    builds its own image builds it there first (docker; bwrap reads the image's exported root file
    system, local ignores the image)."""
    outlives_process: bool = False
    """A sandbox is not a child of the process that opened it (docker: a container of the engine), so a
    process killed without closing it leaves it running: signal handlers and the reaper remove it
    (`agentrl.sandbox.provider`, `agentrl.sandbox.reaper`)."""
    host_placement: bool = False
    """Sandboxes can be placed on several engines, local or remote (`sandbox.docker_hosts`): the
    provider puts each on the least-loaded one (docker)."""

    def lacking(self, *names: str) -> tuple[str, ...]:
        """Which of the named capabilities this sandbox does not have (unknown names raise)."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ValueError(f"unknown sandbox capabilities {unknown}; known: {sorted(known)}")
        return tuple(n for n in names if not getattr(self, n))


NO_CAPABILITIES = Capabilities()


def capabilities_of(sandbox: object) -> Capabilities:
    """A sandbox's `capabilities`; one that does not declare them (or declares something else) has none."""
    caps = getattr(sandbox, "capabilities", None)
    return caps if isinstance(caps, Capabilities) else NO_CAPABILITIES
