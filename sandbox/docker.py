"""The default sandbox backend: one Docker container per sandbox, through the docker SDK.

How a command runs: the agent's commands (and its `read_file`/`write_file`) go through the
sandbox's resident executor (`agentrl.sandbox.executor`): one `docker exec` as the agent, started
with the container, whose attached stdio stays open as its channel; each command is its child
(a few ms, against tens for a fresh `docker exec`). `privileged` and `as_verifier` commands, and
every command with `SandboxSpec.executor=False` or an image without python3, are one fresh
`docker exec` each. The agent can kill the executor (same uid) but not read or write its channel
or memory (it is non-dumpable); a killed, replaced or frozen executor makes the sandbox raise
`SandboxDead` (`check_intact`, `kill_agent_processes` and every later agent command say so), and
`kill_agent_processes` kills it with the agent's other processes (the next agent command starts
a new one).

What it covers:
- no network (`network_mode="none"`) unless `Limits.network`;
- memory (no swap), CPU and pids limits from `Limits`; the OOM killer and the pids cgroup act
  inside the container, never on the host;
- every capability dropped and `no-new-privileges`: setuid binaries, `su`, user namespaces
  and file capabilities give nothing;
- a read-only root file system; the agent (uid 1000) can write only its workspace and /tmp,
  both size-capped tmpfs, plus /dev/shm (Docker's default, counted in the memory cap);
- `/verifier` (`PROTECTED_DIR`) is a root-owned tmpfs: only `privileged=True` can write it;
- per-exec timeouts that kill the command's whole process tree, daemonized children too (the
  executor stops and kills the command's process group and every process of it a /proc scan
  finds, at the deadline; when its reply is late, the host-side kill below runs); the
  kill runs from the host (`agentrl.sandbox.hostkill`: the container's cgroup frozen, then its
  processes signalled), so a fork bomb holding every pid of the pids limit cannot delay it. An
  engine on another machine leaves only killers inside the container, which such a bomb can
  starve: past a few seconds the container is killed and the sandbox raises `SandboxDead`;
- stdout/stderr capped while they stream (inside the container, by the executor), so a 100 MB
  print never reaches host memory;
- `read_file` reads regular files only, in the container as the agent, at most
  `Limits.read_limit_bytes` (`/dev/zero`, a FIFO, a link to either: refused, nothing read);
- engine trouble is named (`agentrl.sandbox.engine`): create/start/remove bounded in concurrency,
  a timed-out or refused call health-checked and raised as `EngineUnavailable` in words; a start
  that fails removes its created container; a container killed from outside during an exec
  (`docker kill`/`stop`) raises `SandboxDead` instead of returning exit -9.

What it does not cover: kernel exploits (containers share the host kernel; use gVisor or VMs
for hostile code at scale), CPU time beyond the quota, and covert channels between sandboxes.

Users: PID 1 (docker-init and a `sleep` keep-alive) runs as root without capabilities, so the
agent can neither signal it nor take the container down by killing its own processes. Every
`exec` runs as the agent (uid 1000) unless `privileged=True`, which means root inside the
container, still with no capabilities: it can write `/verifier` because it owns it, nothing
more (it cannot write the agent's workspace, whose tmpfs root is 0755 and owned by uid 1000).
`as_verifier=True` runs as uid 2000, which owns nothing: it reads what is world-readable (the
workspace as the agent left it, the hidden tests), writes only /tmp, and cannot read the
image's root-only files, whatever symlink the agent planted.

Its parts: the exec stream read off docker's socket (`agentrl.sandbox.docker_stream`), the container's
users and the killers of a timed-out command's processes (`agentrl.sandbox.docker_procs`), and the
files, written and read inside the container (`agentrl.sandbox.docker_files`).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import IO, Any, Literal, NoReturn, Unpack

from agentrl.sandbox import reaper
from agentrl.sandbox.base import (
    AGENT_UID,
    KILLED,
    PROTECTED_DIR,
    Capabilities,
    EngineUnavailable,
    ExecRequest,
    ExecResult,
    Identity,
    SandboxBase,
    SandboxDead,
    SandboxError,
    SandboxSpec,
    SpecFields,
    signal_exit,
)
from agentrl.sandbox.docker_files import ContainerFiles
from agentrl.sandbox.docker_procs import (
    AGENT_USER,
    KEEPALIVE_ENTRY,
    KEEPALIVE_MARKER,
    KILL_ALL_OF_UID,
    KILLER,
    ROOT_USER,
    VERIFIER_USER,
    exec_tree,
)
from agentrl.sandbox.docker_stream import Demux, Raw, buffered_prefix, close_stream, pump, stdin_chunks
from agentrl.sandbox.engine import Engine, is_engine_failure
from agentrl.sandbox.engine import engine as engine_for
from agentrl.sandbox.executor import (
    EXEC_MARKER,
    DockerStream,
    ExecutorLost,
    ExecutorSlot,
    ExecutorUnavailable,
    ResidentExecutor,
    launch_argv,
)
from agentrl.sandbox.hostkill import CLK_TCK, CgroupView, Proc, host_gid, host_uid, uptime_ticks
from agentrl.sandbox.recycle import MountState, drop_sysv_ipc, reset_mounts

log = logging.getLogger(__name__)

_USERS: dict[Identity, str] = {"agent": AGENT_USER, "privileged": ROOT_USER, "verifier": VERIFIER_USER}
LABEL_CREATED_AT = reaper.LABEL_CREATED_AT

# After a timeout kill, how long to wait for the output stream to close before giving up on it.
_DRAIN_AFTER_KILL_S = 3.0
_OCI_EXEC_FAILED = "OCI runtime exec failed"


# How long an exec killed by SIGKILL waits to learn whether its whole container was stopped.
_STOP_CHECK_S = 0.5
# The same when the resident executor's channel closed: was it the container's end, or tampering?
_EXECUTOR_STOP_CHECK_S = 3.0

# The killers inside the container (used only when the host cannot reach the container's
# cgroup, e.g. a remote engine) are `docker exec`s: under a fork bomb each waits for a free pid
# for seconds or fails ("OCI runtime exec failed"). Past this budget the container is killed
# instead: a timeout stays a timeout plus a few seconds, and the sandbox says it is dead.
_IN_CONTAINER_KILL_S = 4.0
# One host-side freeze-and-kill pass: ample for pids_limit processes (milliseconds each round).
_HOST_KILL_S = 5.0


# --- the engine ----------------------------------------------------------------------------


def docker_client() -> Any:
    """The process-wide docker SDK client of the default engine (`DOCKER_HOST`); see `agentrl.sandbox.engine`."""
    return engine_for().client


# --- the sandbox ---------------------------------------------------------------------------


class DockerSandbox(SandboxBase):
    """One container, started in the constructor; use it as a context manager or call `close()`."""

    backend = "docker"
    capabilities = Capabilities(
        isolated=True,
        network_isolation=True,
        protected_dir=True,
        verifier_identity=True,
        separate_users=True,
        background_processes=True,
        resident_executor=True,
        engine_images=True,
        outlives_process=True,
        host_placement=True,
    )

    def __init__(
        self, spec: SandboxSpec | None = None, *, docker_host: str | None = None, **fields: Unpack[SpecFields]
    ) -> None:
        """docker_host: the engine to start it on (default DOCKER_HOST, else the local socket);
        `agentrl.sandbox.hosts.HostPool` picks one of `sandbox.docker_hosts` per sandbox."""
        super().__init__(spec, **fields)
        self.files = ContainerFiles(self)
        # Found at the first kill (`_host_cgroup`): None when this host cannot reach it.
        self._host_view: CgroupView | None = None
        self._host_resolved = False
        self._dead_why: str | None = None  # set when we killed the container ourselves
        # The resident executor the agent's commands run through (`agentrl.sandbox.executor`).
        self._executor = ExecutorSlot(self._start_executor, enabled=self.spec.executor)
        # First sandbox of this process: exit handlers for our containers, reap of dead runs.
        reaper.install_exit_handlers()
        if reaper.pending_removals():
            # Removals owed since the engine last failed: try them off this caller's path.
            threading.Thread(target=reaper.retry_deferred, name="agentrl-retry-removals", daemon=True).start()
        if reaper.exiting():
            raise SandboxError(
                "this process is shutting down (its sandboxes are being removed); no new sandbox starts"
            )
        self._engine: Engine = engine_for(docker_host)
        self.docker_host = self._engine.address
        client = self._engine.client
        self._api = client.api

        self.labels = self._labels()
        self.name = f"agentrl-{uuid.uuid4().hex[:12]}"
        self.id = self.name  # until the engine gives it an id
        self._cid: str = self._create(client)
        self.id = self._cid[:12]
        self._start()

    def _labels(self) -> dict[str, str]:
        """The caller's labels, kept as given (they may name the run: agentrl.run_id), and the ownership
        labels the reaper trusts (pid, host, start time, boot), which they cannot override."""
        owner = reaper.owner_labels()
        return {
            reaper.LABEL_RUN_ID: owner[reaper.LABEL_RUN_ID],
            LABEL_CREATED_AT: datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
            reaper.LABEL_ENGINE: self._engine.address,
            **self.spec.labels,
            **{k: v for k, v in owner.items() if k != reaper.LABEL_RUN_ID},
        }

    def _create(self, client: Any) -> str:
        """Create the container (not started); its id. Every failure leaves it removed, or owed."""
        import docker.errors

        image, workdir = self.image, self.workdir
        size = f"size={self.limits.disk_mb}m"
        # tmpfs mounts default to noexec; the agent runs its own scripts, so `exec` is explicit.
        # nosuid and nodev stay (Docker's defaults).
        tmpfs = {
            "/tmp": f"{size},mode=1777,exec",
            PROTECTED_DIR: f"{size},mode=0755,exec",
            workdir: f"{size},uid={AGENT_UID},gid={AGENT_UID},mode=0755,exec",
        }
        memory = f"{self.limits.memory_mb}m"
        # Registered by name before the create is sent: a create that times out on our side may
        # still complete on the engine's, and exit handlers must find that container too.
        reaper.register(self.name, self._engine.address, creating=True)
        try:
            with self._engine.lifecycle(f"creating container {self.name}"):
                container = client.containers.create(
                    image,
                    command=["env", f"{KEEPALIVE_MARKER}=1", "sleep", "infinity"],
                    name=self.name,
                    # docker-init as PID 1 reaps the zombies of daemonized agent processes.
                    init=True,
                    user=ROOT_USER,
                    working_dir=workdir,
                    environment=self.env,
                    labels=self.labels,
                    network_mode="bridge" if self.limits.network else "none",
                    mem_limit=memory,
                    memswap_limit=memory,  # equal to mem_limit: no swap
                    nano_cpus=int(self.limits.cpus * 1e9),
                    pids_limit=self.limits.pids,
                    cap_drop=["ALL"],
                    security_opt=["no-new-privileges"],
                    read_only=True,
                    tmpfs=tmpfs,
                )
        except docker.errors.ImageNotFound as exc:
            reaper.unregister(self.name)
            raise SandboxError(
                f"image {image!r} is not on this Docker engine; build it with `agentrl sandbox build` "
                "(images are built offline and never pulled)"
            ) from exc
        except docker.errors.APIError as exc:
            reaper.unregister(self.name)
            raise SandboxError(
                f"could not create a container from {image!r}: {exc.explanation or exc}"
            ) from exc
        except BaseException:
            # Timed out or interrupted: the engine may still create it. Owed, never forgotten.
            self._closed = True
            reaper.defer(self.name)
            raise
        reaper.created(self.name)
        return str(container.id)

    def _start(self) -> None:
        """Start the created container and its resident executor; a failure removes the container."""
        import docker.errors

        try:
            with self._engine.lifecycle(f"starting container {self.name}"):
                self._api.start(self._cid)
        except BaseException as exc:
            # Never leave a created-but-never-started container behind: remove it now (or, with
            # the engine down, leave it owed to the retry, the exit handlers and the reaper).
            with contextlib.suppress(Exception):
                self.close()
            if isinstance(exc, docker.errors.APIError):
                raise SandboxError(
                    f"container from {self.image!r} would not start: {exc.explanation or exc}"
                ) from exc
            raise
        try:
            self._executor.get()  # started with the sandbox, so a pool's warm one has it ready
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise

    # --- the resident executor -------------------------------------------------------------

    def _start_executor(self) -> ResidentExecutor:
        """One `docker exec` as the agent whose stdio stays attached: the executor's channel."""
        with self._docker_errors():
            exec_id = self._api.exec_create(
                self._cid, launch_argv(), stdin=True, user=AGENT_USER, workdir=self.workdir
            )["Id"]
            sio = self._api.exec_start(exec_id, socket=True)
        sio._sock.setblocking(False)
        executor = ResidentExecutor(
            DockerStream(sio, buffered_prefix(sio)), name=self.name, workdir=self.workdir
        )
        try:
            executor.start(reap=False)
        except ExecutorLost as exc:
            executor.close()
            raise ExecutorUnavailable(exc.why) from exc
        return executor

    def attach(self, argv: Sequence[str]) -> DockerStream:
        """`argv` as the agent in its own `docker exec`, its stdio attached (`SandboxBase.attach`)."""
        self._check_open()
        with self._docker_errors():
            exec_id = self._api.exec_create(
                self._cid, list(argv), stdin=True, user=AGENT_USER, workdir=self.workdir
            )["Id"]
            sio = self._api.exec_start(exec_id, socket=True)
        sio._sock.setblocking(False)
        return DockerStream(sio, buffered_prefix(sio), exit_status=lambda: self._exit_code(exec_id))

    def _agent_executor(self) -> ResidentExecutor | None:
        """The executor for an agent command or file (None: this sandbox runs without one)."""
        if self._dead_why is not None:
            self._dead(self._dead_why)
        try:
            return self._executor.get()
        except ExecutorLost as exc:
            self._executor_lost(exc)

    def _executor_lost(self, exc: ExecutorLost) -> NoReturn:
        if self._dead_why is not None:
            self._dead(self._dead_why)
        # The container's end takes its executor along; a loaded engine records it late, and the
        # episode is over either way, so this waits longer than a command's check does.
        if self._stopped_from_outside(_EXECUTOR_STOP_CHECK_S):
            self._dead("its container was killed or stopped from outside (docker kill/stop/rm)")
        raise SandboxDead(_tampered_message(self.id, exc.why))

    def _container_running(self) -> bool:
        try:
            return bool(self._api.inspect_container(self._cid)["State"]["Running"])
        except Exception:
            return False

    def _overdue(self, marker: str, elapsed_s: float) -> None:
        """An agent command's reply is late past its deadline: the host-side killers take its processes."""
        self._kill_tree(marker, AGENT_USER, elapsed_s)

    def check_intact(self) -> None:
        self._check_open()
        if self._dead_why is not None:
            self._dead(self._dead_why)
        if (problem := self._executor.problem()) is not None:
            raise SandboxDead(_tampered_message(self.id, problem))

    # --- commands --------------------------------------------------------------------------

    def _exec(self, request: ExecRequest) -> ExecResult:
        if request.identity == "agent" and (executor := self._agent_executor()) is not None:
            marker = uuid.uuid4().hex
            try:
                return executor.run(request, marker, lambda elapsed: self._overdue(marker, elapsed))
            except ExecutorLost as exc:
                self._executor_lost(exc)
        raw = self._run(
            list(request.argv),
            user=_USERS[request.identity],
            env=request.env,
            stdin=request.stdin,
            timeout=request.timeout,
            cap=request.output_limit,
        )
        if raw.exit_code == 128 + 9 and not raw.timed_out and self._stopped_from_outside():
            # SIGKILL can be the command's own fate (kill -9, the OOM killer) or the container's:
            # `docker kill`/`stop` kill PID 1 and the kernel then kills every exec. Only the
            # first is a result the model should read; the second ends the episode.
            self._dead(
                "its container was killed or stopped from outside (docker kill/stop) during the command"
            )
        exit_code = raw.exit_code
        if exit_code == 126 and raw.stdout.data.startswith(_OCI_EXEC_FAILED.encode()):
            # runc could not start the program; docker reports that as exit 126 with its error
            # on stdout. Say it the way a shell would: on stderr, 127 when there is no such program.
            raw.stderr.data[:] = raw.stdout.data.strip() + b"\n"
            raw.stdout.data.clear()
            if b"not found" in raw.stderr.data or b"no such file" in raw.stderr.data:
                exit_code = 127
        return ExecResult.captured(
            exit_code if raw.timed_out else signal_exit(exit_code),
            raw.stdout,
            raw.stderr,
            timed_out=raw.timed_out,
            duration_s=raw.duration_s,
        )

    def _run(
        self,
        argv: list[str],
        *,
        user: str,
        env: Mapping[str, str] | None,
        stdin: bytes | IO[bytes] | None,
        timeout: float,
        cap: int,
        kill_on_timeout: bool = True,
    ) -> Raw:
        """One docker exec: create, start (hijacked socket), inspect, the same three API calls
        as `Container.exec_run`. The deadline is kept by `poll` on that socket, so the fast
        path has no watcher thread and no extra round trip; only a timeout costs more."""
        if self._closed:
            raise SandboxDead(f"docker sandbox {self.id} was closed; open a new one")
        if self._dead_why is not None:
            self._dead(self._dead_why)
        marker = uuid.uuid4().hex
        environment = [f"{k}={v}" for k, v in (env or {}).items()]
        environment.append(f"{EXEC_MARKER}={marker}")
        start = time.monotonic()
        with self._docker_errors():
            exec_id = self._api.exec_create(
                self._cid,
                argv,
                stdin=stdin is not None,
                user=user,
                workdir=self.workdir,
                environment=environment,
            )["Id"]
            sio = self._api.exec_start(exec_id, socket=True)
        demux = Demux(cap)
        timed_out = False
        try:
            sock: socket.socket = sio._sock
            sock.setblocking(False)
            demux.feed(buffered_prefix(sio))
            eof = pump(sock, demux, stdin_chunks(stdin), start + timeout)
            if not eof:
                timed_out = True
                if kill_on_timeout:
                    self._kill_tree(marker, user, time.monotonic() - start)
                    pump(sock, demux, None, time.monotonic() + _DRAIN_AFTER_KILL_S)
        finally:
            close_stream(sio)
        return Raw(
            exit_code=KILLED if timed_out else self._exit_code(exec_id),
            stdout=demux.out[1],
            stderr=demux.out[2],
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
        )

    def _exit_code(self, exec_id: str) -> int:
        with self._docker_errors():
            # The stream can close a moment before the daemon records the exit code.
            for attempt in range(200):
                info = self._api.exec_inspect(exec_id)
                if not info["Running"] and info["ExitCode"] is not None:
                    return int(info["ExitCode"])
                time.sleep(0.001 * min(attempt + 1, 20))
        if not self.alive():
            raise SandboxDead(f"docker sandbox {self.id} died while running a command")
        raise SandboxError(f"docker never reported an exit code for exec {exec_id[:12]} in sandbox {self.id}")

    def _stopped_from_outside(self, wait_s: float = _STOP_CHECK_S) -> bool:
        """After an exec died of SIGKILL: did the container itself stop? The engine records a
        stop a few tens of milliseconds after the exec's stream ends, so wait for it, briefly."""
        import docker.errors

        try:
            self._api.wait(self._cid, timeout=wait_s, condition="not-running")
        except docker.errors.NotFound:
            return True
        except Exception:
            return False  # still running when the wait ran out: the command alone was killed
        return True

    def _internal(self, argv: list[str], user: str, *, timeout: float) -> Raw:
        """One of our own short commands (the killers): bounded, never killed on timeout itself."""
        return self._run(
            argv,
            user=user,
            env=None,
            stdin=None,
            timeout=timeout,
            cap=4096,
            kill_on_timeout=False,
        )

    def _host_cgroup(self) -> CgroupView | None:
        """The container's cgroup as this machine sees it, when the engine runs here and this
        process may freeze it and signal its processes; None otherwise (a remote engine, a
        rootless client): the killers then run inside the container."""
        if not self._host_resolved:
            try:
                pid = int(self._api.inspect_container(self._cid)["State"]["Pid"] or 0)
            except Exception:
                return None  # asked again next time: the engine may answer then
            self._host_view = CgroupView.of_process(pid, expect=self._cid) if pid > 0 else None
            self._host_resolved = True
        return self._host_view

    def _kill_tree(self, marker: str, user: str, elapsed_s: float) -> None:
        """Kill what a timed-out exec started: every process of its user that carries its marker,
        descends from one, or is an orphan (re-parented to PID 1) started during the exec.

        From the host when it can (nothing started in the container: a fork bomb holding every
        pid cannot delay it), else inside the container within `_IN_CONTAINER_KILL_S`, else the
        container is killed and the sandbox is dead."""
        host = self._host_cgroup()
        if host is not None and (uid := host_uid(host.init_pid, int(user.split(":")[0]))) is not None:
            since = uptime_ticks() - (elapsed_s + 1.0) * CLK_TCK
            needle = f"{EXEC_MARKER}={marker}".encode()
            if host.kill(
                lambda procs: exec_tree(procs, needle, uid, since, host.init_pid), timeout_s=_HOST_KILL_S
            ):
                return
            log.warning("sandbox %s: the host-side kill did not finish; killing from inside", self.id)
        deadline = time.monotonic() + _IN_CONTAINER_KILL_S
        raw = self._internal(
            ["python3", "-c", KILLER, marker, f"{elapsed_s:.3f}"], user, timeout=_IN_CONTAINER_KILL_S
        )
        if raw.exit_code == 0 and not raw.timed_out:
            return
        # The killer could not run (no python3 in the image, or no pid left for it) or could not
        # finish: every process of the exec's user goes, rather than the timed-out command staying.
        if user != ROOT_USER and self._kill_all_inside(user, deadline):
            return
        self._kill_container(
            f"a timed-out command's processes could not be killed within {_IN_CONTAINER_KILL_S:g}s"
        )

    def kill_agent_processes(self) -> None:
        """Kill every process of the agent's, the resident executor with them (the next agent
        command starts a new one). Raises `SandboxDead` afterwards when the executor had been
        killed, replaced or frozen from inside: the episode must not be scored."""
        problem = self._executor.problem() if not self._closed else None
        retired = self._executor.retire()
        try:
            self._kill_agent_processes()
        finally:
            if retired is not None:
                retired.close()
        if problem is not None:
            raise SandboxDead(_tampered_message(self.id, problem))

    def _kill_agent_processes(self) -> None:
        host = self._host_cgroup()
        if host is not None and (uid := host_uid(host.init_pid, AGENT_UID)) is not None:
            if host.kill(lambda procs: [p.pid for p in procs if p.uid == uid], timeout_s=_HOST_KILL_S):
                return
            log.warning("sandbox %s: the host-side kill did not finish; killing from inside", self.id)
        if not self._kill_all_inside(AGENT_USER, time.monotonic() + _IN_CONTAINER_KILL_S):
            self._kill_container(
                f"the agent's processes could not be killed within {_IN_CONTAINER_KILL_S:g}s"
            )

    def _kill_all_inside(self, user: str, deadline: float) -> bool:
        """Kill every process of `user` (never root) from inside the container, trying until `deadline`."""
        if user == AGENT_USER:
            self._executor.retire()  # it is one of them: its end is ours, not the agent's doing
        uid = user.split(":")[0]
        while (left := deadline - time.monotonic()) > 0:
            raw = self._internal(["/bin/sh", "-c", KILL_ALL_OF_UID, "agentrl-kill", uid], user, timeout=left)
            if raw.exit_code == 0 and not raw.timed_out:
                return True
            time.sleep(0.05)
        return False

    def _kill_container(self, why: str) -> NoReturn:
        """The last resort against what nothing started in the container can stop (a fork bomb
        holding every pid, seen from a host that cannot reach the container's cgroup)."""
        self._dead_why = (
            f"{why} (a fork bomb holding every pid of its pids limit?), so the container was killed"
        )
        with contextlib.suppress(Exception):
            self._api.kill(self._cid)
        self._dead(self._dead_why)

    # --- reuse -----------------------------------------------------------------------------

    def recycle(self) -> bool:
        """Make this container what a fresh one is, for another episode; False when it cannot be
        (the caller then closes it and starts a new one).

        From the host, with nothing of the episode left to take part: every process but PID 1 and
        the keep-alive is killed (the agent's, the resident executor, the verifier's, anything a
        privileged command left), the writable mounts are emptied and get their fresh mode and
        owner back, System V IPC objects are removed, and a new resident executor (a new secret)
        starts. Refused when the engine is not on this host (nothing inside may do the cleaning),
        the container is dead, or its executor was tampered with."""
        if self._closed or self._dead_why is not None:
            return self._not_reused("it is closed or dead")
        host = self._host_cgroup()
        if host is None:
            return self._not_reused("its engine's cgroups are out of this host's reach")
        if (problem := self._executor.problem()) is not None:
            return self._not_reused(f"its executor cannot be trusted ({problem})")
        init = host.init_pid
        uids = {i: u for i in (0, AGENT_UID) if (u := host_uid(init, i)) is not None}
        gids = {i: g for i in (0, AGENT_UID) if (g := host_gid(init, i)) is not None}
        if len(uids) < 2 or len(gids) < 2:
            return self._not_reused("its user namespace does not map root and the agent")
        root = uids[0]

        def everything_but_init(procs: list[Proc]) -> list[int]:
            # Only we start root processes, and the keep-alive is the one of them PID 1 started.
            return [
                p.pid
                for p in procs
                if not (p.uid == root and p.ppid == init and KEEPALIVE_ENTRY in p.environ())
            ]

        retired = self._executor.retire()
        try:
            if not host.kill(everything_but_init, timeout_s=_HOST_KILL_S):
                return self._not_reused("its processes could not all be killed")
        finally:
            if retired is not None:
                retired.close()
        # The mounts are reached through PID 1's /proc entry: it must still be this container's (a
        # container that ended frees its pid, and the host may give it to a process of its own).
        if init not in host.pids():
            return self._not_reused("its container is gone")
        try:
            reset_mounts(init, self._writable_mounts(), uids, gids)
            drop_sysv_ipc(init)
        except OSError as exc:
            return self._not_reused(str(exc))
        try:
            self._executor.get()
        except ExecutorLost as exc:
            return self._not_reused(f"its new executor was lost ({exc.why})")
        return self.alive() or self._not_reused("it did not answer after the reset")

    def _not_reused(self, why: str) -> bool:
        log.info("docker sandbox %s is not reused: %s", self.id, why)
        return False

    def _writable_mounts(self) -> list[MountState]:
        """Every place an episode can write, as a fresh container has it (the root file system is
        read-only; /etc/hosts, /etc/hostname and /etc/resolv.conf are read-only binds)."""
        return [
            MountState("/tmp", 0o1777, 0, 0),
            MountState(PROTECTED_DIR, 0o755, 0, 0),
            MountState(self.workdir, 0o755, AGENT_UID, AGENT_UID),
            MountState("/dev/shm", 0o1777, 0, 0),
            MountState("/dev/mqueue", 0o1777, 0, 0),
        ]

    # --- life cycle ------------------------------------------------------------------------

    def _docker_errors(self) -> _DockerErrors:
        return _DockerErrors(self)

    def _dead(self, why: str) -> NoReturn:
        raise SandboxDead(f"docker sandbox {self.id} ({self.name}) is gone: {why}; open a new sandbox")

    def alive(self) -> bool:
        """Whether the container runs and its resident executor (if any) answers as itself."""
        if self._closed or not self._engine.healthy():
            return False  # an engine known to be down is not asked again (that costs a timeout)
        return self._container_running() and self._executor.problem() is None

    def _close(self) -> None:
        """Remove the container. With the engine down or hung, the removal is owed, not forgotten
        (`reaper.pending_removals()`): retried when the next sandbox opens, at exit, and, after
        this process ends, by the next start-up reap (the labels name it)."""
        retired = self._executor.retire()
        try:
            self._remove_container()
        finally:
            if retired is not None:
                retired.close()

    def _remove_container(self) -> None:
        import docker.errors

        try:
            with self._engine.lifecycle(f"removing container {self.name}"):
                self._api.remove_container(self.name, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if not (exc.status_code == 409 and "already in progress" in str(exc)):
                reaper.defer(self.name)
                raise SandboxError(
                    f"could not remove container {self.name}: {exc.explanation or exc}"
                ) from exc
        except EngineUnavailable as exc:
            reaper.defer(self.name)
            log.warning("container %s is owed a removal: %s", self.name, exc)
            return
        reaper.unregister(self.name)


def _tampered_message(sandbox_id: str, why: str) -> str:
    return (
        f"docker sandbox {sandbox_id}: its resident executor is gone: {why}; the agent's commands can no "
        "longer be trusted there, so the sandbox is given up (the episode is not scored)"
    )


class _DockerErrors:
    """Turns docker SDK and connection errors into `SandboxDead` / `SandboxError`, so none
    escapes `exec` raw."""

    def __init__(self, sandbox: DockerSandbox) -> None:
        self.sandbox = sandbox

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> Literal[False]:
        if exc is None:
            return False
        import docker.errors
        import requests

        if isinstance(exc, docker.errors.NotFound):
            self.sandbox._dead("its container no longer exists")
        if isinstance(exc, docker.errors.APIError) and exc.status_code == 409:
            self.sandbox._dead(f"its container is not running ({exc.explanation})")
        if isinstance(exc, EngineUnavailable):
            return False
        if is_engine_failure(exc):
            # Timed out or refused: a health check says whether the engine is down or just stuck.
            engine = self.sandbox._engine
            raise engine.failure(f"a command in sandbox {self.sandbox.id}", engine.describe(exc)) from exc
        if isinstance(exc, requests.exceptions.RequestException):
            self.sandbox._dead(f"the connection to the Docker engine broke ({type(exc).__name__}: {exc})")
        if isinstance(exc, docker.errors.DockerException):
            raise SandboxError(f"docker sandbox {self.sandbox.id}: {exc}") from exc
        return False
