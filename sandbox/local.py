"""`local`: plain subprocesses in a temporary directory. NO ISOLATION: trusted tests only.

Use it to test environments and verifiers fast, on code you wrote yourself. An agent's
commands run as you, on your machine, with your network, and can read and write anything
you can. Choosing it logs a warning once per process. Its `capabilities` promise nothing, so a
verifier that needs isolation, a protected directory or a verifier identity refuses it.

What it does:
- `workdir` (default "/workspace") and relative paths map to a fresh temporary directory;
  `PROTECTED_DIR` ("/verifier") and "/tmp" map to sibling temporary directories. Commands run
  with the workspace as their working directory, `HOME` there and `TMPDIR` at the sandbox's
  /tmp, so a command that says "/workspace/x" literally does NOT reach it: use relative
  paths. Other absolute paths are refused by the file methods (there is no file system of
  its own to map them to).
- `image` is accepted and ignored (commands run on the host's own programs).
- Per-exec timeout kills the whole process tree: each exec starts a new session (killpg),
  and every process carries an environment marker, so children that left the session with
  `setsid` are found in /proc and killed too (a process that scrubs its environment escapes:
  that is why this backend is for trusted code).
- stdout/stderr are capped as on every backend (`agentrl.sandbox.process`).
- No memory, CPU, pids, disk or network limit is enforced; `privileged` and `as_verifier`
  change nothing but which paths `write_file`/`copy_in` accept (there is one user).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Unpack

from agentrl.sandbox.base import (
    PROTECTED_DIR,
    Capabilities,
    ExecRequest,
    ExecResult,
    SandboxBase,
    SandboxSpec,
    SpecFields,
)
from agentrl.sandbox.executor import Pipes
from agentrl.sandbox.hostfs import HostView, Mount
from agentrl.sandbox.process import kill_group, kill_marked, run_capped

log = logging.getLogger(__name__)

# The environment markers every local process inherits: how escaped children are found.
SANDBOX_MARKER = "AGENTRL_SANDBOX_ID"
EXEC_MARKER = "AGENTRL_EXEC_ID"

_warned = False

__all__ = ["LocalSandbox"]


class LocalSandbox(SandboxBase):
    """Plain subprocesses in a temporary directory. No isolation whatsoever: trusted tests only."""

    backend = "local"
    # Nothing is isolated; only what follows from running host processes until close().
    capabilities = Capabilities(background_processes=True)

    def __init__(self, spec: SandboxSpec | None = None, **fields: Unpack[SpecFields]) -> None:
        super().__init__(spec, **fields)
        global _warned
        if not _warned:
            _warned = True
            msg = (
                "agentrl sandbox backend 'local' has NO isolation whatsoever: commands run as you, "
                "on this machine, with its network. Use it for trusted tests only; use 'docker' or "
                "'bwrap' for agents."
            )
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        self._root = Path(tempfile.mkdtemp(prefix=f"agentrl-{self.id}-"))
        self.host_workdir = self._root / "workspace"
        self.host_protected = self._root / "verifier"
        self.host_tmp = self._root / "tmp"
        for d in (self.host_workdir, self.host_protected, self.host_tmp):
            d.mkdir()
        self.files = HostView(
            [
                Mount(self.workdir, self.host_workdir, agent_writable=True, privileged_writable=True),
                Mount(PROTECTED_DIR, self.host_protected, agent_writable=False, privileged_writable=True),
                Mount("/tmp", self.host_tmp, agent_writable=True, privileged_writable=True),
            ],
            self.workdir,
        )
        self._exec_ids = itertools.count()

    def _env(self) -> dict[str, str]:
        """What every command starts with: the host's PATH, this sandbox's home and temp, its settings."""
        return {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "HOME": str(self.host_workdir),
            "TMPDIR": str(self.host_tmp),
            "LANG": "C.UTF-8",
            **self.env,
        }

    def _exec(self, request: ExecRequest) -> ExecResult:
        # One user, no isolation: the request's identity changes nothing here.
        exec_id = f"{self.id}-{next(self._exec_ids)}"
        full_env = {**self._env(), **request.env, SANDBOX_MARKER: self.id, EXEC_MARKER: exec_id}

        def kill_tree(proc: subprocess.Popen[bytes]) -> None:
            kill_group(proc)
            kill_marked(EXEC_MARKER, exec_id)

        return run_capped(
            request.argv,
            cwd=str(self.host_workdir),
            env=full_env,
            stdin=request.stdin,
            timeout=request.timeout,
            output_limit=request.output_limit,
            kill_tree=kill_tree,
        )

    def attach(self, argv: Sequence[str]) -> Pipes:
        """`argv` as a host process in the workspace, its pipes held (`SandboxBase.attach`)."""
        self._check_open()
        proc = subprocess.Popen(
            list(argv),
            cwd=str(self.host_workdir),
            env={**self._env(), SANDBOX_MARKER: self.id},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        return Pipes(proc)

    def kill_agent_processes(self) -> None:
        kill_marked(SANDBOX_MARKER, self.id)

    def alive(self) -> bool:
        return not self._closed and self.host_workdir.is_dir()

    def _close(self) -> None:
        self.kill_agent_processes()
        shutil.rmtree(self._root, ignore_errors=True)
