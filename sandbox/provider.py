"""Where an environment's sandboxes come from: one object that owns placement, reuse and clean-up.

    provider = SandboxProvider("docker")             # or "bwrap", "local", an installed plugin's name
    sb = provider.acquire(image="agentrl/base:bookworm", limits=Limits(memory_mb=512))
    ...                                              # the episode
    provider.release(sb)                             # reset and handed out again, or closed

An environment (`ToolEnv`) asks a provider for each episode's sandbox and gives it back; it never
asks which backend it has. What the provider decides, from the backend's `capabilities`:

- placement: a backend whose sandboxes can be placed on several engines (`host_placement`: docker,
  with `sandbox.docker_hosts` / AGENTRL_DOCKER_HOSTS set) takes them from the process-wide
  `HostPool` (the least-loaded engine); otherwise from the process-wide warm `SandboxPool`; with
  `pooled=False`, each sandbox is started on `acquire` and closed on `release`;
- reuse: `release` hands a sandbox back to what lent it, which resets and keeps it warm where the
  backend can be reset (docker), or closes it;
- clean-up: a backend whose sandboxes outlive this process (`outlives_process`: docker containers
  belong to the engine) gets the SIGTERM/SIGINT handlers that remove them (`install_exit_handlers`,
  called from the main thread, where signal handlers can be set); the reaper removes what a killed
  run left behind (`agentrl.sandbox.reaper`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Unpack

from agentrl.sandbox.base import Sandbox, SandboxSpec, SpecFields, backend_capabilities, open_sandbox
from agentrl.sandbox.spec import Capabilities

__all__ = ["SandboxProvider"]


class SandboxProvider:
    """The sandboxes of one backend, placed, reused and cleaned up as its capabilities allow (see the module)."""

    def __init__(self, backend: str = "docker", *, pooled: bool = True) -> None:
        self.backend = backend
        self.pooled = pooled
        # Known before any sandbox opens; an unknown backend is a one-line error here.
        self.capabilities: Capabilities = backend_capabilities(backend)
        self._lenders: weakref.WeakKeyDictionary[Sandbox, Any] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def install_exit_handlers(self) -> bool:
        """From the main thread: the signal handlers that remove this process's sandboxes, for a backend
        whose sandboxes outlive it (so that sandboxes opened later on worker threads are covered too).
        Returns whether they are installed (False for a backend that does not need them)."""
        if not self.capabilities.outlives_process:
            return False
        from agentrl.sandbox.reaper import install_signal_handlers

        return install_signal_handlers()

    def acquire(self, spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]) -> Sandbox:
        """A started sandbox for one episode (a spec, its fields as keywords, or both); `release` ends it."""
        lender = self._lender()
        if lender is None:
            return open_sandbox(self.backend, spec, **fields)
        sandbox = lender.acquire(SandboxSpec.of(spec, **fields))
        with self._lock:
            self._lenders[sandbox] = lender
        return sandbox

    def release(self, sandbox: Sandbox) -> None:
        """End an episode's use of `sandbox`: back to what lent it (reset and kept warm, or closed), or closed."""
        with self._lock:
            lender = self._lenders.pop(sandbox, None)
        if lender is None:
            sandbox.close()
        else:
            lender.release(sandbox)

    def __repr__(self) -> str:
        return f"SandboxProvider({self.backend!r}, pooled={self.pooled})"

    def _lender(self) -> Any:
        """The process-wide supply this provider takes sandboxes from now, as something with
        `acquire(spec)` and `release(sandbox)`; None: start each one."""
        if not self.pooled:
            return None
        if self.capabilities.host_placement:
            from agentrl.sandbox.hosts import default_host_pool

            # sandbox.docker_hosts / AGENTRL_DOCKER_HOSTS: placed on the least-loaded engine.
            if (hosts := default_host_pool()) is not None:
                return hosts
        from agentrl.sandbox.pool import get_default_pool

        return _BackendPool(get_default_pool(), self.backend)


class _BackendPool:
    """The process-wide pool, for one backend: `acquire(spec)` as a `HostPool` takes it."""

    def __init__(self, pool: Any, backend: str) -> None:
        self.pool, self.backend = pool, backend

    def acquire(self, spec: SandboxSpec) -> Sandbox:
        return self.pool.acquire(self.backend, spec)

    def release(self, sandbox: Sandbox) -> None:
        self.pool.release(sandbox)
