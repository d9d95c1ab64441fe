"""Where and how the episodes' sandboxes run: `SandboxSettings`, the `sandbox:` section of `agentrl train`.

Environment variables override the fields, here and nowhere else: each, when set and not empty,
wins over the config's value and the default where the settings are read (`current()`), so a run's
recorded config holds what its file said:

| variable                             | field                                       |
|--------------------------------------|---------------------------------------------|
| `AGENTRL_DOCKER_HOSTS`               | `docker_hosts` (addresses, comma-separated) |
| `AGENTRL_POOL_SIZE`                  | `pool_size`                                 |
| `AGENTRL_POOL_WORKERS`               | `pool_workers`                              |
| `AGENTRL_POOL_RECYCLE`               | `pool_recycle`                              |
| `AGENTRL_DOCKER_TIMEOUT_S`           | `docker_timeout_s`                          |
| `AGENTRL_DOCKER_MAX_LIFECYCLE_CALLS` | `docker_max_lifecycle_calls`                |

The process-wide warm pools (`agentrl.sandbox.pool`, `agentrl.sandbox.hosts`) and the Docker
engine clients (`agentrl.sandbox.engine`) read `current()`: the settings `configure()` was given
(`agentrl train` gives its config's section), else the defaults, with the overrides on top.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from agentrl.core.errors import UserError

ENV_OVERRIDES: dict[str, str] = {
    "docker_hosts": "AGENTRL_DOCKER_HOSTS",
    "pool_size": "AGENTRL_POOL_SIZE",
    "pool_workers": "AGENTRL_POOL_WORKERS",
    "pool_recycle": "AGENTRL_POOL_RECYCLE",
    "docker_timeout_s": "AGENTRL_DOCKER_TIMEOUT_S",
    "docker_max_lifecycle_calls": "AGENTRL_DOCKER_MAX_LIFECYCLE_CALLS",
}
"""Field -> the environment variable that overrides it."""


_SCHEMES = ("unix://", "tcp://", "ssh://", "npipe://", "http://", "https://")


@dataclass(frozen=True)
class DockerHost:
    """One Docker engine: its address and, for TCP with TLS, where its certificates are."""

    url: str
    """Engine address: unix:///var/run/docker.sock, tcp://host:2376, ssh://user@host."""
    cert_path: str | None = None
    """Folder with ca.pem, cert.pem and key.pem: talk TLS to this engine (None: no TLS of its own)."""
    tls_verify: bool = True
    """With `cert_path`: check the engine's certificate against ca.pem."""

    @classmethod
    def parse(cls, entry: str | Mapping[str, Any] | DockerHost) -> DockerHost:
        if isinstance(entry, DockerHost):
            return entry
        if isinstance(entry, Mapping):
            unknown = sorted(set(entry) - {"url", "cert_path", "tls_verify"})
            if unknown or "url" not in entry:
                raise ValueError(
                    f"docker host {dict(entry)!r}: expected a mapping with url (and optionally cert_path, "
                    f"tls_verify){f'; unknown keys {unknown}' if unknown else ''}"
                )
            host = cls(str(entry["url"]), entry.get("cert_path"), bool(entry.get("tls_verify", True)))
        elif isinstance(entry, str):
            host = cls(entry.strip())
        else:
            raise ValueError(f"docker host {entry!r}: expected an address string like tcp://host:2376")
        if not host.url.startswith(_SCHEMES):
            raise ValueError(
                f"docker host {host.url!r} has no scheme; write it as unix:///path/docker.sock, "
                "tcp://host:2376 or ssh://user@host"
            )
        if host.cert_path is not None and not os.path.isdir(host.cert_path):
            raise ValueError(
                f"docker host {host.url}: cert_path {host.cert_path!r} is not a folder (it must hold "
                "ca.pem, cert.pem and key.pem)"
            )
        return host


class SandboxSettingsError(UserError, ValueError):
    """Sandbox settings that do not validate (a bad override in the environment): one line, with the fix."""


class SandboxSettings(BaseModel):
    """Where the episodes' sandboxes run, how many are kept warm, and how long the Docker engine may take."""

    model_config = ConfigDict(extra="forbid")

    docker_hosts: list[str | dict[str, Any]] = Field(
        default_factory=list,
        description="Docker engines the episodes' sandboxes run on, each with its own warm pool; each sandbox "
        "goes to the engine with the fewest out. An entry is an address (unix:///var/run/docker.sock, "
        "tcp://node2:2376, ssh://user@node3) or {url, cert_path, tls_verify} for TLS (cert_path: a folder "
        "with ca.pem, cert.pem, key.pem). Empty: the one engine of DOCKER_HOST, else the local socket. "
        "`agentrl sandbox reap --host URL` cleans one up after a crash. Override: AGENTRL_DOCKER_HOSTS "
        "(addresses, comma-separated).",
    )
    pool_size: int = Field(
        4,
        ge=0,
        description="Warm sandboxes kept ready per configuration (image, limits, environment), per engine; "
        "0: every episode starts its own. Override: AGENTRL_POOL_SIZE.",
    )
    pool_workers: int = Field(
        2,
        ge=1,
        description="Sandboxes the warm pool starts at once in the background, per engine (each start costs "
        "the engine CPU). Override: AGENTRL_POOL_WORKERS.",
    )
    pool_recycle: bool = Field(
        True,
        description="Reset a docker sandbox after its episode (every process killed, its writable mounts and IPC "
        "objects emptied, from the host) and hand it out again, instead of removing it and starting a new "
        "container. Off: one container per episode. Override: AGENTRL_POOL_RECYCLE (1/0).",
    )
    docker_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Deadline of one Docker API call, in seconds; past it, or when the engine refuses, a health "
        "check says whether the engine stopped answering. Override: AGENTRL_DOCKER_TIMEOUT_S.",
    )
    docker_max_lifecycle_calls: int = Field(
        4,
        ge=1,
        description="Container create/start/remove calls in flight at once per engine (the rest queue): under "
        "many at once Docker 20.10 can deadlock. Override: AGENTRL_DOCKER_MAX_LIFECYCLE_CALLS.",
    )

    @field_validator("docker_hosts")
    @classmethod
    def _hosts_parse(cls, hosts: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        urls = [DockerHost.parse(h).url for h in hosts]  # a bad entry: its one-line reason
        if len(set(urls)) != len(urls):
            raise ValueError(f"an engine is named twice: {urls}")
        return hosts

    def with_overrides(self) -> SandboxSettings:
        """These settings with the environment variables of `ENV_OVERRIDES` that are set on top
        (a `SandboxSettingsError` naming the variable when one does not validate)."""
        found = {}
        for name, var in ENV_OVERRIDES.items():
            raw = os.environ.get(var, "").strip()
            if raw:
                found[name] = _parse_override(name, var, raw)
        if not found:
            return self
        try:
            return type(self).model_validate({**dict(self), **found})
        except ValidationError as exc:
            problems = "; ".join(str(e.get("ctx", {}).get("error", e.get("msg"))) for e in exc.errors())
            names = ", ".join(ENV_OVERRIDES[name] for name in found)
            raise SandboxSettingsError(f"invalid sandbox settings from {names}: {problems}") from None


def _parse_override(name: str, var: str, raw: str) -> Any:
    """The value of `var` as the field `name` takes it, or a ValueError naming the variable."""
    if name == "docker_hosts":
        return [u.strip() for u in raw.split(",") if u.strip()]
    try:
        return _adapter(name).validate_python(raw)
    except ValidationError as exc:
        why = exc.errors()[0].get("msg", "invalid")
        raise SandboxSettingsError(f"{var}={raw!r}: {why[0].lower()}{why[1:]}; fix it or unset it") from None


@functools.cache
def _adapter(name: str) -> TypeAdapter[Any]:
    """The validator of one field alone, its constraints included (built once: building is slow)."""
    field = SandboxSettings.model_fields[name]
    if not field.metadata:  # no constraints: Annotated needs at least one
        return TypeAdapter(field.annotation)
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)])


_configured: SandboxSettings | None = None
_lock = threading.Lock()


def configure(settings: SandboxSettings | None) -> None:
    """Make `settings` this process's sandbox settings (None: back to the defaults).

    The overrides in the environment are checked now, so that a bad one stops a run before its
    first episode. The warm pools already running keep their size; a change of `docker_hosts`
    replaces the hosts' pool at its next use."""
    global _configured
    if settings is not None:
        settings.with_overrides()
    with _lock:
        _configured = settings


def current() -> SandboxSettings:
    """This process's sandbox settings: the configured ones (else the defaults), with the
    environment's overrides on top, read afresh at each call."""
    return (_configured or _DEFAULTS).with_overrides()


_DEFAULTS = SandboxSettings()
