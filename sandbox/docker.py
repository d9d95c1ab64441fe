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
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import io
import logging
import posixpath
import select
import socket
import struct
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn, Unpack

from agentrl.sandbox import reaper
from agentrl.sandbox.base import (
    AGENT_UID,
    KILLED,
    PROTECTED_DIR,
    VERIFIER_UID,
    Capabilities,
    CappedOutput,
    EngineUnavailable,
    ExecRequest,
    ExecResult,
    Identity,
    NotRegularFileError,
    SandboxBase,
    SandboxDead,
    SandboxError,
    SandboxPathError,
    SandboxSpec,
    SpecFields,
    signal_exit,
)
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

AGENT_USER = f"{AGENT_UID}:{AGENT_UID}"
ROOT_USER = "0:0"
# Neither root nor the agent: it reads the agent's (world-readable) workspace, cannot read the
# image's root-only files, and cannot write the workspace (0755, uid 1000) or /verifier (root's).
VERIFIER_USER = f"{VERIFIER_UID}:{VERIFIER_UID}"
_USERS: dict[Identity, str] = {"agent": AGENT_USER, "privileged": ROOT_USER, "verifier": VERIFIER_USER}
# Every exec's processes inherit `EXEC_MARKER` (value: a fresh uuid per exec); on timeout the
# killer finds the command's whole tree by it, including children that left its session.
# Set on the keep-alive process only, so that no killer ever picks it.
KEEPALIVE_MARKER = "AGENTRL_KEEPALIVE"
KEEPALIVE_ENTRY = f"{KEEPALIVE_MARKER}=1".encode()
LABEL_CREATED_AT = reaper.LABEL_CREATED_AT

_READ_CHUNK = 256 * 1024
_STDIN_CHUNK = 64 * 1024
# After a timeout kill, how long to wait for the output stream to close before giving up on it.
_DRAIN_AFTER_KILL_S = 3.0
# Bound on file transfers (ours, not the agent's commands).
_INTERNAL_TIMEOUT_S = 60.0
_OCI_EXEC_FAILED = "OCI runtime exec failed"

# The in-container fallback of `_kill_tree` (the host cannot reach the container's cgroup).
# Runs inside the container, as the user of the timed-out exec (only that user may signal its
# processes: root here has no CAP_KILL). It stops, then kills, every process that carries the
# exec's marker, every descendant of one, and every orphan (re-parented to PID 1) that started
# during the exec: the last catches daemons that also scrubbed their environment (`env -i`).
# It repeats until a scan finds nothing, so processes forked during a round die in the next.
# A process whose leader thread exited reads as a zombie, but forks on in its other threads:
# it counts as alive, and its environment is read through one of them.
_KILLER = r"""
import os, signal, sys, time
marker = ("AGENTRL_EXEC=" + sys.argv[1]).encode()
keep = b"AGENTRL_KEEPALIVE=1"
hz = os.sysconf("SC_CLK_TCK")
with open("/proc/uptime") as f:
    since = (float(f.read().split()[0]) - float(sys.argv[2]) - 1.0) * hz
me, uid = os.getpid(), os.getuid()

def scan():
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in (1, me):
            continue
        try:
            if os.stat("/proc/" + d).st_uid != uid:
                continue
            with open("/proc/" + d + "/stat", "rb") as f:
                st = f.read()
            rest = st[st.rindex(b")") + 2:].split()
            tasks = os.listdir("/proc/" + d + "/task")
            if rest[0] == b"Z" and len(tasks) < 2:
                continue
            env = []
            for where in ["/proc/" + d] + ["/proc/" + d + "/task/" + t for t in tasks]:
                try:
                    with open(where + "/environ", "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if data:
                    env = data.split(b"\0")
                    break
            if keep in env:
                continue
            procs[int(d)] = (int(rest[1]), int(rest[19]), marker in env)
        except (OSError, ValueError, IndexError):
            pass
    hit = {p for p, (pp, t, m) in procs.items() if m or (pp == 1 and t >= since)}
    grew = True
    while grew:
        grew = False
        for p, (pp, t, m) in procs.items():
            if p not in hit and pp in hit:
                hit.add(p)
                grew = True
    return hit

for _ in range(200):
    hit = scan()
    if not hit:
        sys.exit(0)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in hit:
            try:
                os.kill(p, sig)
            except OSError:
                pass
    time.sleep(0.005)
sys.exit(1)
"""

# Only shell built-ins (no fork once it runs): `kill -9 -1` as uid $1 reaches exactly that
# user's processes (PID 1 and the keep-alive are root's; the kernel spares the caller). Its exit
# status cannot say whether any are left (root's processes count as found), so /proc is scanned
# for live processes of uid $1. Exit 1: some were still alive after every round. Never run as
# root: `kill -1` there would take the keep-alive, and the container, with it.
_KILL_ALL_OF_UID = """
n=0
while [ $n -lt 50 ]; do
  n=$((n+1))
  kill -9 -1 2>/dev/null
  left=0
  for d in /proc/[0-9]*; do
    [ "${d#/proc/}" = "$$" ] && continue
    state=
    while read -r key value rest; do
      case "$key" in
        State:) state=$value ;;
        Uid:) [ "$value" = "$1" ] && [ "$state" != Z ] && left=1; break ;;
      esac
    done < "$d/status" 2>/dev/null
  done
  [ $left = 0 ] && exit 0
done
exit 1
"""
# Reads a file for `read_file`, inside the container as the reading user: only a regular file
# (`[ -f ]` follows symlinks, so a link is judged by its target), at most $2 bytes of it, so
# /dev/zero, /dev/urandom, a FIFO or a socket can neither flood nor hang the host. For root,
# only a target that resolves inside PROTECTED_DIR. The file could be swapped for a FIFO
# between the test and `head`: then `head` blocks until the read's timeout, and still nothing
# unbounded reaches the host. Only sh built-ins and `head` (coreutils or busybox): any image.
_READ_SCRIPT = f"""
p=$1
if [ ! -e "$p" ]; then echo "agentrl-read: missing" >&2; exit 2; fi
if [ -d "$p" ]; then echo "agentrl-read: directory" >&2; exit 3; fi
if [ ! -f "$p" ]; then echo "agentrl-read: special" >&2; exit 4; fi
if [ "$3" = {ROOT_USER} ]; then
  case $(readlink -f -- "$p") in {PROTECTED_DIR}/*) ;; *) echo "agentrl-read: outside" >&2; exit 5 ;; esac
fi
exec head -c "$2" -- "$p"
"""
_READ_TIMEOUT_S = 30.0
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


# --- docker's multiplexed exec stream ------------------------------------------------------


class _Demux:
    """Splits docker's multiplexed stream (8-byte frame headers) into stdout and stderr,
    keeping at most `cap` bytes of each and counting the rest, so memory stays bounded."""

    def __init__(self, cap: int) -> None:
        self.out = {1: CappedOutput(cap), 2: CappedOutput(cap)}
        self._header = bytearray()
        self._left = 0  # bytes still to come in the current frame
        self._kind = 1

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        i, n = 0, len(view)
        while i < n:
            if self._left == 0:
                take = min(8 - len(self._header), n - i)
                self._header += view[i : i + take]
                i += take
                if len(self._header) < 8:
                    return
                kind, self._left = struct.unpack(">BxxxL", self._header)
                self._header.clear()
                self._kind = 2 if kind == 2 else 1
                continue
            take = min(self._left, n - i)
            self.out[self._kind].feed(view[i : i + take])
            i += take
            self._left -= take


@dataclass(frozen=True)
class _Raw:
    """An exec's outcome in bytes, before `ExecResult` decodes it. `exit_code` as docker says it."""

    exit_code: int
    stdout: CappedOutput
    stderr: CappedOutput
    timed_out: bool
    duration_s: float

    def err(self) -> str:
        return self.stderr.data.decode(errors="replace").strip()


def _chunks(stdin: bytes | IO[bytes] | None) -> Iterator[bytes] | None:
    if stdin is None:
        return None
    if isinstance(stdin, bytes | bytearray):
        view = memoryview(stdin)
        return (bytes(view[i : i + _STDIN_CHUNK]) for i in range(0, len(view), _STDIN_CHUNK))
    return iter(lambda: stdin.read(_STDIN_CHUNK), b"")


def _buffered_prefix(sio: Any) -> bytes:
    """Bytes http.client already pulled off the socket while reading the 101 response headers.

    The SDK hands back the raw socket, which skips its buffered reader; a fast command's first
    output can sit in that buffer. The socket must already be non-blocking here.
    """
    try:
        fp = sio._response.raw._fp.fp
        peeked = fp.peek()
        return fp.read1(len(peeked)) if peeked else b""
    except (AttributeError, BlockingIOError, ValueError, OSError, TypeError):
        return b""


def _exec_tree(procs: list[Proc], needle: bytes, uid: int, since: float, init_pid: int) -> set[int]:
    """`_KILLER`'s choice, made on the host: of `uid`'s processes (the keep-alive never), those
    carrying the exec's marker `needle`, orphans of PID 1 started since `since` (clock ticks),
    and every descendant of either."""
    mine = {p.pid: p for p in procs if p.uid == uid and KEEPALIVE_ENTRY not in p.environ()}
    hit = {
        pid
        for pid, p in mine.items()
        if needle in p.environ() or (p.ppid == init_pid and p.start_ticks >= since)
    }
    grew = True
    while grew:
        grew = False
        for pid, p in mine.items():
            if pid not in hit and p.ppid in hit:
                hit.add(pid)
                grew = True
    return hit


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
        self.files = _ContainerFiles(self)
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
            DockerStream(sio, _buffered_prefix(sio)), name=self.name, workdir=self.workdir
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
        return DockerStream(sio, _buffered_prefix(sio), exit_status=lambda: self._exit_code(exec_id))

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
    ) -> _Raw:
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
        demux = _Demux(cap)
        timed_out = False
        try:
            sock: socket.socket = sio._sock
            sock.setblocking(False)
            demux.feed(_buffered_prefix(sio))
            eof = self._pump(sock, demux, _chunks(stdin), start + timeout)
            if not eof:
                timed_out = True
                if kill_on_timeout:
                    self._kill_tree(marker, user, time.monotonic() - start)
                    self._pump(sock, demux, None, time.monotonic() + _DRAIN_AFTER_KILL_S)
        finally:
            self._close_stream(sio)
        return _Raw(
            exit_code=KILLED if timed_out else self._exit_code(exec_id),
            stdout=demux.out[1],
            stderr=demux.out[2],
            timed_out=timed_out,
            duration_s=time.monotonic() - start,
        )

    @staticmethod
    def _close_stream(sio: Any) -> None:
        # The response wraps the same socket through a buffered reader: close it first (it
        # may fail on the hijacked stream), then our handle, then the socket itself, or the
        # file descriptor leaks.
        response = getattr(sio, "_response", None)
        if response is not None:
            with contextlib.suppress(Exception):
                response.close()
        with contextlib.suppress(Exception):
            sio.close()
        with contextlib.suppress(Exception):
            sio._sock.close()

    @staticmethod
    def _pump(sock: socket.socket, demux: _Demux, stdin: Iterator[bytes] | None, deadline: float) -> bool:
        """Feed stdin and read output until the stream ends (True) or the deadline passes (False).

        Writing and reading are interleaved: a command that prints while it reads a large
        stdin would otherwise deadlock against us.
        """
        poller = select.poll()
        pending = memoryview(b"")
        writing = stdin is not None
        while True:
            if writing and not pending:
                pending = memoryview(next(stdin, b""))  # type: ignore[arg-type]
                if not pending:
                    writing = False
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)  # the command sees EOF on stdin
            poller.register(sock, select.POLLIN | (select.POLLOUT if writing else 0))
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            events = poller.poll(left * 1000)
            if not events:
                continue
            mask = events[0][1]
            if writing and mask & select.POLLOUT:
                try:
                    pending = pending[sock.send(pending) :]
                except BlockingIOError:
                    pass
                except OSError:
                    # The command exited or closed stdin without reading it all: not our error.
                    writing, pending = False, memoryview(b"")
            if mask & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = sock.recv(_READ_CHUNK)
                except BlockingIOError:
                    continue
                except OSError:
                    return True  # connection reset: the exec (or the container) is gone
                if not data:
                    return True
                demux.feed(data)

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

    def _internal(self, argv: list[str], user: str, *, timeout: float) -> _Raw:
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
                lambda procs: _exec_tree(procs, needle, uid, since, host.init_pid), timeout_s=_HOST_KILL_S
            ):
                return
            log.warning("sandbox %s: the host-side kill did not finish; killing from inside", self.id)
        deadline = time.monotonic() + _IN_CONTAINER_KILL_S
        raw = self._internal(
            ["python3", "-c", _KILLER, marker, f"{elapsed_s:.3f}"], user, timeout=_IN_CONTAINER_KILL_S
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
            raw = self._internal(["/bin/sh", "-c", _KILL_ALL_OF_UID, "agentrl-kill", uid], user, timeout=left)
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
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


class _ContainerFiles:
    """The sandbox's `FileAccess`: every file operation runs inside the container, as the user it
    is for (the agent, or root for `privileged`), so the kernel's permission checks apply."""

    def __init__(self, sandbox: DockerSandbox) -> None:
        self.sandbox = sandbox

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.sandbox.workdir, str(path)))

    def lost(self) -> str | None:
        return None  # a container that went away says so at the next engine call

    def _executor(self, privileged: bool) -> ResidentExecutor | None:
        return None if privileged else self.sandbox._agent_executor()

    def write(self, path: str, data: bytes, *, mode: int, privileged: bool) -> None:
        target = self._path(path)
        if (executor := self._executor(privileged)) is not None:
            timeout = max(self.sandbox.limits.exec_timeout_s, _INTERNAL_TIMEOUT_S)
            try:
                reply = executor.write(target, data, mode, timeout)
            except ExecutorLost as exc:
                self.sandbox._executor_lost(exc)
            if "ok" not in reply:
                message = str(reply.get("message") or reply.get("error"))
                self._raise_write_error(f"{message}: {target}", target, privileged)
            return
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            info = tarfile.TarInfo(target.lstrip("/"))
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            info.uid = info.gid = 0 if privileged else AGENT_UID
            tar.addfile(info, io.BytesIO(data))
        self._untar(buf.getvalue(), target, privileged)

    def copy_in(self, host_path: Path, path: str, *, privileged: bool) -> None:
        target = self._path(path)
        uid = 0 if privileged else AGENT_UID

        def owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
            info.uid = info.gid = uid
            info.uname = info.gname = ""
            return info

        # Spooled: small trees stay in memory, a large dataset goes through a temporary file.
        with tempfile.SpooledTemporaryFile(max_size=16 * 1024 * 1024) as spool:
            with tarfile.open(fileobj=spool, mode="w", format=tarfile.PAX_FORMAT) as tar:
                tar.add(host_path, arcname=target.lstrip("/"), recursive=True, filter=owned)
            spool.seek(0)
            self._untar(spool, target, privileged)  # type: ignore[arg-type]

    def _untar(self, archive: bytes | IO[bytes], target: str, privileged: bool) -> None:
        """Extract a tar streamed into `tar -x` inside the container.

        `put_archive` (docker cp) writes to the container's root layer and cannot reach tmpfs
        mounts such as the workspace, so the archive goes through an exec's stdin instead.
        """
        limits = self.sandbox.limits
        raw = self.sandbox._run(
            # -p keeps the modes we set; -m skips mtimes (utime fails on dirs we do not own);
            # --no-overwrite-dir leaves existing directories such as the workspace as they are.
            ["tar", "-x", "-p", "-m", "--no-same-owner", "--no-overwrite-dir", "-C", "/", "-f", "-"],
            user=ROOT_USER if privileged else AGENT_USER,
            env=None,
            stdin=archive,
            timeout=max(limits.exec_timeout_s, _INTERNAL_TIMEOUT_S),
            cap=limits.output_limit_bytes,
        )
        if raw.timed_out:
            raise SandboxError(f"copying into {target} in sandbox {self.sandbox.id} timed out")
        if raw.exit_code != 0:
            lines = raw.err().splitlines()
            message = "; ".join(ln for ln in lines if "Exiting with failure status" not in ln)
            self._raise_write_error(message or f"tar exited {raw.exit_code}", target, privileged)

    def _raise_write_error(self, message: str, target: str, privileged: bool) -> NoReturn:
        if "No space left" in message or "Disk quota" in message:
            raise OSError(
                errno.ENOSPC,
                f"no space left writing {target} (the workspace and /tmp are capped at "
                f"{self.sandbox.limits.disk_mb} MiB each: raise Limits.disk_mb): {message}",
            )
        if any(
            s in message for s in ("Permission denied", "Read-only file system", "Operation not permitted")
        ):
            who = "root (privileged)" if privileged else "the agent"
            raise PermissionError(
                errno.EACCES,
                f"{who} cannot write {target}: {message}. The agent writes {self.sandbox.workdir} and /tmp; "
                f"privileged=True writes {PROTECTED_DIR}; the rest of the file system is read-only",
            )
        if "File exists" in message:
            # tar replaces an existing file by unlinking it first (never writing through a
            # symlink); that fails on the read-only root and where a directory is in the way.
            raise FileExistsError(
                errno.EEXIST,
                f"cannot replace what is already at {target} (a directory, or a file on the "
                f"read-only root): {message}",
            )
        raise SandboxError(f"could not write {target} in sandbox {self.sandbox.id}: {message}")

    def read(self, path: str, *, limit: int) -> bytes:
        target = self._path(path)
        where = f"sandbox {self.sandbox.id}"
        timeout = min(self.sandbox.limits.exec_timeout_s, _READ_TIMEOUT_S)
        message = ""
        # As the agent: it owns the workspace. Root is tried only for paths under
        # PROTECTED_DIR, where the agent cannot plant anything: reading an agent-chosen path
        # (say a symlink to a root-only file) as root would make us a confused deputy.
        users = [AGENT_USER]
        if target.startswith(PROTECTED_DIR + "/"):
            users.append(ROOT_USER)
        if (executor := self._executor(False)) is not None:
            try:
                reply, data = executor.read(target, limit + 1, timeout)
            except ExecutorLost as exc:
                self.sandbox._executor_lost(exc)
            if "ok" in reply:
                return data
            kind = reply.get("error")
            if ROOT_USER not in users or kind not in ("missing", "permission"):
                self._raise_read_error(str(kind), str(reply.get("message")), target, where)
            users = [ROOT_USER]  # the verifier's own path, which the agent may not even see into
        raw = None
        for user in users:
            raw = self.sandbox._run(
                ["/bin/sh", "-c", _READ_SCRIPT, "agentrl-read", target, str(limit + 1), user],
                user=user,
                env=None,
                stdin=None,
                timeout=timeout,
                # One byte over the limit tells "exactly at the limit" from "larger": never more.
                cap=limit + 1,
            )
            if raw.exit_code == 0 and not raw.timed_out:
                return bytes(raw.stdout.data)
            message = raw.err()
            # The agent may not even see into PROTECTED_DIR (then the file looks missing to it).
            if "Permission denied" not in message and "agentrl-read: missing" not in message:
                break
        assert raw is not None
        if raw.timed_out:
            message += f" (timed out after {timeout:g}s: was it swapped for a FIFO while being read?)"
        for kind in ("special", "outside", "missing", "directory"):
            if f"agentrl-read: {kind}" in message:
                self._raise_read_error(kind, message, target, where)
        if "No such file" in message or "Not a directory" in message:
            self._raise_read_error("missing", message, target, where)
        if "Is a directory" in message:
            self._raise_read_error("directory", message, target, where)
        if "Permission denied" in message:
            self._raise_read_error("permission", message, target, where)
        self._raise_read_error("other", message, target, where)

    @staticmethod
    def _raise_read_error(kind: str, message: str, target: str, where: str) -> NoReturn:
        """The error a read that failed for reason `kind` raises (the executor's kinds, and the
        read script's)."""
        if kind == "special":
            raise NotRegularFileError(
                f"{target} in {where} is not a regular file (a device, FIFO or socket); refused"
            )
        if kind == "outside":
            raise SandboxPathError(
                f"{target} in {where} resolves outside {PROTECTED_DIR}; refused (it is read as the agent)"
            )
        if kind == "missing":
            raise FileNotFoundError(errno.ENOENT, f"no such file in {where}", target)
        if kind == "directory":
            raise IsADirectoryError(errno.EISDIR, f"is a directory in {where}", target)
        if kind == "permission":
            raise PermissionError(errno.EACCES, f"unreadable in {where}", target)
        raise SandboxError(f"could not read {target} in {where}: {message}")
