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
    ExecResult,
    Limits,
    Sandbox,
    SandboxDead,
    SandboxError,
    open_sandbox,
)

__all__ = [
    "BACKENDS",
    "DEFAULT_IMAGE",
    "DEFAULT_WORKDIR",
    "PROTECTED_DIR",
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxDead",
    "SandboxError",
    "open_sandbox",
]
