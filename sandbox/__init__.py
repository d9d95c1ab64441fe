"""Container backends for agent tool calls: `docker` (default), `bwrap` (daemonless), `local` (trusted tests only).

from agentrl.sandbox import open_sandbox, Limits
with open_sandbox("docker", limits=Limits(memory_mb=512)) as sb:
    print(sb.exec("python3 -c 'print(6*7)'").stdout)
"""

from agentrl.sandbox.base import (
    BACKENDS,
    DEFAULT_IMAGE,
    DEFAULT_WORKDIR,
    PROTECTED_DIR,
    EngineUnavailable,
    ExecResult,
    FileTooLargeError,
    Limits,
    NotRegularFileError,
    Sandbox,
    SandboxDead,
    SandboxError,
    SandboxPathError,
    open_sandbox,
)


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
    "EngineUnavailable",
    "ExecResult",
    "FileTooLargeError",
    "Limits",
    "NotRegularFileError",
    "Sandbox",
    "SandboxDead",
    "SandboxError",
    "SandboxPathError",
    "install_exit_handlers",
    "open_sandbox",
]
