"""Container backends for agent tool calls: `docker` (default), `bwrap` (daemonless), `local` (trusted tests only).

from agentrl.sandbox import open_sandbox, Limits, SandboxSpec
with open_sandbox("docker", limits=Limits(memory_mb=512)) as sb:
    print(sb.exec("python3 -c 'print(6*7)'").stdout)
spec = SandboxSpec(limits=Limits(memory_mb=512), env={"LANG": "C"})   # the same settings, as one object
with open_sandbox("bwrap", spec) as sb:
    assert sb.capabilities.verifier_identity   # ask what a sandbox promises, never its backend's name

Modules: `spec` (SandboxSpec, Limits, Capabilities), `base` (the protocol, errors, the factory and
the pieces every backend shares), `process` (the host process runner of local and bwrap),
`hostfs` (their host-side file access), one module per backend (`docker`, `bwrap`, `local`; bwrap's root file system in `rootfs`, its host-side
cgroups and tmpfs holder in `hostlimits`),
`executor` and `executor_inside` (the resident executor the agent's commands run through),
`pool` (warm sandboxes), `provider` (where an environment's sandboxes come from: placement, reuse,
clean-up, decided by a backend's capabilities), `engine` and `reaper` (the Docker engine, and what a crashed run left),
`settings` (SandboxSettings: Docker hosts, pool size, engine timeouts, their AGENTRL_ overrides),
`hostkill` (killing a sandbox's processes from the host, through its cgroup),
`images` (offline image builds), `doctor` (which backends work here).
"""

from agentrl.sandbox.base import (
    BACKENDS,
    DEFAULT_IMAGE,
    DEFAULT_WORKDIR,
    PROTECTED_DIR,
    Capabilities,
    EngineUnavailable,
    ExecResult,
    FileTooLargeError,
    Limits,
    NotRegularFileError,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxPathError,
    SandboxSpec,
    backend_capabilities,
    capabilities_of,
    open_sandbox,
)
from agentrl.sandbox.provider import SandboxProvider


def install_exit_handlers() -> bool:
    """Install, from the main thread, the SIGTERM/SIGINT handlers that remove this process's docker
    containers whichever thread opened them; returns False off the main thread. agentrl's CLI,
    `ToolEnv`, `rollout.collect` and `SandboxPool` call it; call it yourself when your program opens
    sandboxes only from its own worker threads."""
    from agentrl.sandbox.reaper import install_signal_handlers

    return install_signal_handlers()


__all__ = [
    "BACKENDS",
    "DEFAULT_IMAGE",
    "DEFAULT_WORKDIR",
    "PROTECTED_DIR",
    "Capabilities",
    "EngineUnavailable",
    "ExecResult",
    "FileTooLargeError",
    "Limits",
    "NotRegularFileError",
    "Sandbox",
    "SandboxDead",
    "SandboxError",
    "SandboxPathError",
    "SandboxProvider",
    "SandboxSpec",
    "backend_capabilities",
    "capabilities_of",
    "install_exit_handlers",
    "open_sandbox",
]
