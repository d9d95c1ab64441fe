"""The resident executor: one small process per sandbox that runs the agent's commands as its children.

This file runs *inside* the sandbox, sent over the channel at start (nothing of it is written to
the sandbox's disk, so there is no file to replace), under the image's own `python3` with `-I -S`:
the standard library only, one thread, Python 3.6 or later. The host side is
`agentrl.sandbox.executor`, which also imports the framing below from here (one definition).

Channel: the executor's stdin carries requests, its stdout replies; the backend holds both open
(docker: the attached stdio of one `docker exec`; bwrap: two pipes). Start-up, in this order:

1. the executor makes itself non-dumpable (`PR_SET_DUMPABLE` 0), so that a process of the same uid
   (the agent's) can neither ptrace it, read its memory, nor open its `/proc/<pid>/fd` (the
   channel's pipes) or `/proc/<pid>/environ`; it refuses to start where that fails;
2. it writes `HELLO`, unframed, carrying no secret;
3. the host sends the per-sandbox secret nonce (16 raw bytes), then frames only.

Every frame, both ways, is `MAGIC, nonce, request id, body length` then the body: a JSON header and
raw blobs (a command's stdin, stdout and stderr; a file's bytes) whose lengths the header gives.
A command's output is a blob inside its reply, counted by length, so whatever it prints cannot
frame anything; a frame with a wrong magic or nonce ends the executor (requests) or marks it
tampered with (replies, on the host).

Commands: argv (a shell string is already `/bin/sh -c` on the host side), environment (the
executor's own, as the sandbox gave it, plus the request's and a marker), working directory,
stdin, a deadline, an output cap per stream. Each starts with `posix_spawn` (no Python runs in
the child; the program is found on the command's own PATH, as execvp would), in a new session,
its OOM score raised above the executor's (the kernel's OOM killer takes a command first). On its
deadline its process group is stopped and killed, then every process carrying its marker,
descending from one, or orphaned since it started (re-parented to PID 1), until a scan finds
none; the reply says `timed_out`. Once a command exits, background children still holding its pipes get
`DRAIN_AFTER_EXIT_S` to flush, then the pipes are closed. Exit status: the code, or -N for
signal N. Output past the cap is read and counted, never kept.

With `reap` (bwrap, where nothing outlives its exec) the executor is PID 1 of the sandbox's pid
namespace: the agent cannot signal it (the kernel drops SIGKILL/SIGSTOP sent to a namespace's init
from inside), it reaps every orphan, and whatever an exec leaves behind dies with it: its marked
processes and their descendants, and every process but the executor once no other exec runs.

Files: `read` opens a regular file only (a device, FIFO or socket is refused without a byte read;
`stat` before `open`, `fstat` after) and reads at most `limit` bytes; `write` never writes
through what is there (the old entry is unlinked, the new one created exclusively, no symlink
followed at the last component) and sets the requested mode.
"""

import contextlib
import errno
import json
import os
import select
import signal
import stat
import struct
import sys
import time

MAGIC = b"AGX1"
NONCE_BYTES = 16
# magic, nonce, request id, body length
HEADER = struct.Struct(">4s16sQI")
META_LEN = struct.Struct(">I")
HELLO = b"AGENTRL-EXECUTOR-HELLO\n"
REFUSED = b"AGENTRL-EXECUTOR-REFUSED "
# One frame's body at most: a file read is bounded by the host's read limit, stdin by the caller.
MAX_BODY = 1 << 30
DRAIN_AFTER_EXIT_S = 0.2
DRAIN_AFTER_KILL_S = 3.0
SWEEP_ROUNDS = 200
# Signals a command starts with at their defaults (Python ignores SIGPIPE and SIGXFSZ; SIGCHLD and
# SIGINT have handlers here).
RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD, signal.SIGINT)
CHUNK = 1 << 16


class FrameError(Exception):
    """A frame that is not ours: a wrong magic or nonce, or a length past `MAX_BODY`."""


def encode(nonce, req_id, meta, blobs=()):
    """One frame: `meta` (a JSON object) and `blobs` (bytes) under `req_id`."""
    meta = dict(meta)
    meta["blobs"] = [len(b) for b in blobs]
    head = json.dumps(meta, separators=(",", ":")).encode()
    size = META_LEN.size + len(head) + sum(len(b) for b in blobs)
    if size > MAX_BODY:
        raise FrameError(f"a frame of {size} bytes is over the limit of {MAX_BODY}")
    return b"".join([HEADER.pack(MAGIC, nonce, req_id, size), META_LEN.pack(len(head)), head, *list(blobs)])


class Parser:
    """Splits a byte stream into frames, checking each header's magic and nonce."""

    def __init__(self, nonce, max_body=MAX_BODY):
        self.nonce = nonce
        self.max_body = max_body
        self.buf = bytearray()

    def feed(self, data):
        """The frames `data` completes, as (request id, meta, blobs); raises FrameError."""
        self.buf += data
        frames = []
        while len(self.buf) >= HEADER.size:
            magic, nonce, req_id, size = HEADER.unpack_from(self.buf)
            if magic != MAGIC or nonce != self.nonce:
                raise FrameError("a frame with a wrong magic or nonce")
            if size > self.max_body or size < META_LEN.size:
                raise FrameError(f"a frame body of {size} bytes")
            end = HEADER.size + size
            if len(self.buf) < end:
                break
            body = memoryview(bytes(self.buf[HEADER.size : end]))
            del self.buf[:end]
            (head_len,) = META_LEN.unpack_from(body)
            try:
                meta = json.loads(bytes(body[META_LEN.size : META_LEN.size + head_len]))
                lengths = [int(n) for n in meta.pop("blobs", [])]
            except (ValueError, TypeError, AttributeError) as exc:
                raise FrameError(f"a frame whose header does not parse: {exc}") from exc
            blobs, at = [], META_LEN.size + head_len
            for n in lengths:
                if n < 0 or at + n > len(body):
                    raise FrameError("a frame whose blobs overrun it")
                blobs.append(bytes(body[at : at + n]))
                at += n
            frames.append((req_id, meta, blobs))
        return frames


# --- the process table ---------------------------------------------------------------------


def _stat(pid):
    """(state, ppid, start ticks, uid) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            st = f.read()
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    rest = st[st.rindex(b")") + 2 :].split()
    return rest[0], int(rest[1]), int(rest[19]), uid


def _environ(pid):
    """A process's environment entries; read through any thread (a leader that exited has none)."""
    where = [f"/proc/{pid}"]
    with contextlib.suppress(OSError):
        where += [f"/proc/{pid}/task/{t}" for t in os.listdir(f"/proc/{pid}/task")]
    for w in where:
        try:
            with open(w + "/environ", "rb") as f:
                data = f.read()
        except OSError:
            continue
        if data:
            return data.split(b"\0")
    return []


def _threads(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def uptime_ticks():
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK")


def own_start_ticks():
    return _stat(os.getpid())[2]


def exec_tree(marker, since_ticks, spare):
    """The processes of a command: of this uid's, those carrying `marker`, orphans of PID 1
    started since `since_ticks` (None: none), and every descendant of either; never `spare`."""
    me, uid = os.getpid(), os.getuid()
    procs = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        pid = int(d)
        if pid in spare or pid == me:
            continue
        info = _stat(pid)
        if info is None or info[3] != uid:
            continue
        state, ppid, start, _ = info
        if state == b"Z" and _threads(pid) < 2:
            continue  # a zombie; one whose leader exited forks on in its other threads
        procs[pid] = (ppid, start)
    hit = set()
    for pid, (ppid, start) in procs.items():
        if (since_ticks is not None and ppid == 1 and start >= since_ticks) or (
            marker is not None and marker in _environ(pid)
        ):
            hit.add(pid)
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _) in procs.items():
            if pid not in hit and ppid in hit:
                hit.add(pid)
                grew = True
    return hit


def stop_and_kill(pids):
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)


# --- commands ------------------------------------------------------------------------------


class Command:
    """One running command: its pipes, what it printed (capped), its deadline and its end."""

    def __init__(self, req_id, pid, marker, deadline, cap, out_fd, err_fd, in_fd, stdin):
        self.req_id = req_id
        self.pid = pid
        self.marker = marker
        self.started = time.monotonic()
        self.since_ticks = uptime_ticks() - os.sysconf("SC_CLK_TCK")  # a tick's slack, and one more
        self.deadline = deadline
        self.cap = cap
        self.out = {out_fd: bytearray(), err_fd: bytearray()}
        self.dropped = {out_fd: 0, err_fd: 0}
        self.order = (out_fd, err_fd)
        self.in_fd = in_fd
        self.stdin = memoryview(stdin) if stdin else memoryview(b"")
        self.status = None  # the exit code once reaped: code, or -N for signal N
        self.ended_at = None
        self.timed_out = False
        self.drain_until = None

    def feed(self, fd, data):
        room = max(self.cap - len(self.out[fd]), 0)
        if len(data) > room:
            self.dropped[fd] += len(data) - room
            data = data[:room]
        self.out[fd] += data


class Executor:
    def __init__(self, nonce, reap, oom_adj, oom_fd):
        self.parser = Parser(nonce)
        self.nonce = nonce
        self.reap = reap
        self.pid1 = os.getpid() == 1
        self.commands = {}  # pid -> Command
        self.by_fd = {}  # output or stdin fd -> Command
        self.outbox = bytearray()
        self.env = dict(os.environ)
        self.closing = False
        self.cwd = os.getcwd()
        self.devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self.oom_fd = oom_fd
        try:
            self.base_oom = self.oom_now = int(os.pread(oom_fd, 16, 0))
            self.oom_adj = max(self.base_oom, min(oom_adj, 1000))
        except (OSError, ValueError, TypeError):
            self.oom_fd = None
            self.base_oom = self.oom_now = self.oom_adj = 0

    # -- the channel --

    def reply(self, req_id, meta, blobs=()):
        self.outbox += encode(self.nonce, req_id, meta, blobs)
        self.flush()

    def flush(self):
        while self.outbox:
            try:
                n = os.write(1, self.outbox[: 1 << 20])
            except BlockingIOError:
                return
            except OSError:
                self.outbox.clear()
                self.closing = True
                return
            del self.outbox[:n]

    def handle(self, req_id, meta, blobs):
        try:
            self.dispatch(req_id, meta, blobs)
        except Exception as exc:  # a request we could not serve is answered, never fatal
            self.reply(req_id, {"error": "internal", "message": f"{type(exc).__name__}: {exc}"})

    def dispatch(self, req_id, meta, blobs):
        op = meta.get("op")
        if op == "run":
            self.run(req_id, meta, blobs[0] if blobs else None)
        elif op == "read":
            self.reply(req_id, *read_file(meta["path"], int(meta["limit"])))
        elif op == "write":
            self.reply(req_id, write_file(meta["path"], blobs[0] if blobs else b"", int(meta["mode"])))
        elif op == "ping":
            self.reply(
                req_id, {"pid": os.getpid(), "start": own_start_ticks(), "running": len(self.commands)}
            )
        else:
            self.reply(req_id, {"error": "unknown-op", "message": f"unknown op {op!r}"})

    # -- running --

    def run(self, req_id, meta, stdin):
        argv = [str(a) for a in meta["argv"]]
        env = dict(self.env)
        env.update(meta.get("env") or {})
        marker = meta["marker"]
        key, _, value = marker.partition("=")
        env[key] = value
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        in_r, in_w = os.pipe() if stdin is not None else (-1, -1)
        try:
            pid, failure = self.spawn(argv, env, meta.get("cwd") or "/", in_r, out_w, err_w)
        finally:
            for fd in (out_w, err_w, in_r):
                if fd >= 0:
                    os.close(fd)
        if pid is None:
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    os.close(fd)
            code, why = failure
            meta = {"exit": code, "timed_out": False, "dropped": [0, 0], "duration": 0.0}
            self.reply(req_id, meta, [b"", why.encode(errors="replace") + b"\n"])
            return
        cmd = Command(
            req_id,
            pid,
            marker.encode(),
            time.monotonic() + float(meta["timeout"]),
            int(meta["cap"]),
            out_r,
            err_r,
            in_w,
            stdin,
        )
        self.commands[pid] = cmd
        for fd in (out_r, err_r):
            os.set_blocking(fd, False)
            self.by_fd[fd] = cmd
        if in_w >= 0:
            if cmd.stdin:
                os.set_blocking(in_w, False)
                self.by_fd[in_w] = cmd
            else:
                os.close(in_w)
                cmd.in_fd = -1

    def spawn(self, argv, env, cwd, in_r, out_w, err_w):
        """Start `argv` in a session of its own with the pipes as its 0/1/2: (pid, None), or
        (None, (exit code, message)) when it could not start (127: no such program, 126: not
        runnable, or no process to be had)."""
        if cwd != self.cwd:
            try:
                os.chdir(cwd)  # one thread: the children inherit it, nothing else sees it
            except OSError as exc:
                return None, (126, f"agentrl: cannot enter {cwd}: {exc.strerror}")
            self.cwd = cwd
        path = resolve(argv[0], env.get("PATH", os.defpath))
        if isinstance(path, OSError):
            missing = path.errno in (errno.ENOENT, errno.ENOTDIR)
            why = "executable file not found in $PATH" if missing and "/" not in argv[0] else path.strerror
            return None, (127 if missing else 126, f"exec: {argv[0]!r}: {why}")
        if in_r < 0:
            in_r = self.devnull
        self.set_oom(self.oom_adj)
        try:
            if not hasattr(os, "posix_spawn"):
                return _fork_exec(path, argv, env, in_r, out_w, err_w), None
            actions = [
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ]
            pid = os.posix_spawn(
                path, argv, env, file_actions=actions, setsid=True, setsigdef=RESET_SIGNALS, setsigmask=()
            )
            return pid, None
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.ENOMEM):
                # A full process table (the pids limit reached, by the agent's own processes).
                return None, (126, f"agentrl: the command could not start: {exc.strerror}")
            missing = exc.errno in (errno.ENOENT, errno.ENOTDIR)
            return None, (127 if missing else 126, f"exec: {argv[0]!r}: {exc.strerror or exc}")
        finally:
            self.set_oom(self.base_oom)

    def set_oom(self, value):
        """The OOM score this process has (and its next child inherits): a command's is raised, so
        the kernel's OOM killer takes a command before the executor."""
        if self.oom_fd is None or value == self.oom_now:
            return
        try:
            os.pwrite(self.oom_fd, str(value).encode(), 0)
            self.oom_now = value
        except OSError:
            self.oom_fd = None  # not ours to change here: every child then keeps our score

    def write_stdin(self, cmd):
        try:
            n = os.write(cmd.in_fd, cmd.stdin[:CHUNK])
            cmd.stdin = cmd.stdin[n:]
        except BlockingIOError:
            return
        except OSError:
            cmd.stdin = memoryview(b"")  # it stopped reading: the rest is dropped
        if not cmd.stdin:
            self.close_fd(cmd.in_fd)
            cmd.in_fd = -1

    def read_output(self, fd):
        cmd = self.by_fd[fd]
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            cmd.feed(fd, data)
        else:
            self.close_fd(fd)

    def close_fd(self, fd):
        self.by_fd.pop(fd, None)
        with contextlib.suppress(OSError):
            os.close(fd)

    def open_fds(self, cmd):
        return [fd for fd in cmd.order if fd in self.by_fd]

    def reap_children(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            cmd = self.commands.get(pid)
            if cmd is not None and cmd.ended_at is None:
                if cmd.status is None:
                    cmd.status = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                cmd.ended_at = time.monotonic()

    def kill(self, cmd):
        """A command past its deadline: its group, then everything of it a scan finds."""
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            with contextlib.suppress(OSError):
                os.killpg(cmd.pid, sig)
        if self.pid1 and len(self.commands) == 1:
            self.kill_all_but_me()
            return
        spare = self.other_groups(cmd)
        for _ in range(SWEEP_ROUNDS):
            hit = exec_tree(cmd.marker, cmd.since_ticks, spare)
            if not hit:
                return
            stop_and_kill(hit)
            time.sleep(0.005)

    def other_groups(self, cmd):
        """The direct children of the other running commands: never a scan's pick for this one."""
        return {pid for pid in self.commands if pid != cmd.pid}

    def kill_all_but_me(self):
        """As PID 1 of the sandbox's pid namespace: every other process there is the agent's."""
        for _ in range(SWEEP_ROUNDS):
            try:
                os.kill(-1, signal.SIGSTOP)
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return
            self.reap_children()
            if not any(d.isdigit() and d != "1" for d in os.listdir("/proc")):
                return
            time.sleep(0.002)

    def leftovers(self, cmd):
        """`reap`: what a finished command left running dies with it."""
        if self.pid1 and len(self.commands) == 1:
            self.kill_all_but_me()
            return
        with contextlib.suppress(OSError):
            os.killpg(cmd.pid, signal.SIGKILL)
        spare = self.other_groups(cmd)
        for _ in range(SWEEP_ROUNDS):
            hit = exec_tree(cmd.marker, None, spare)
            if not hit:
                return
            stop_and_kill(hit)
            time.sleep(0.002)

    def finish(self, cmd):
        for fd in (*cmd.order, cmd.in_fd):
            if fd >= 0 and fd in self.by_fd:
                self.close_fd(fd)
        if self.reap and not cmd.timed_out:
            self.leftovers(cmd)
        del self.commands[cmd.pid]
        out, err = cmd.order
        meta = {
            "exit": cmd.status,
            "timed_out": cmd.timed_out,
            "dropped": [cmd.dropped[out], cmd.dropped[err]],
            "duration": time.monotonic() - cmd.started,
        }
        self.reply(cmd.req_id, meta, [bytes(cmd.out[out]), bytes(cmd.out[err])])

    def step(self, now):
        """Deadlines, drains and ends of every running command; the next time to look again."""
        wake = None
        for cmd in list(self.commands.values()):
            if not cmd.timed_out and cmd.ended_at is None and now >= cmd.deadline:
                cmd.timed_out = True
                self.kill(cmd)
                self.reap_children()
                cmd.drain_until = time.monotonic() + DRAIN_AFTER_KILL_S
            if cmd.ended_at is not None and cmd.drain_until is None:
                cmd.drain_until = cmd.ended_at + DRAIN_AFTER_EXIT_S
            if cmd.ended_at is not None and not self.open_fds(cmd):
                self.finish(cmd)
                continue
            over = cmd.drain_until is not None and now >= cmd.drain_until
            if over and (cmd.timed_out or cmd.ended_at is not None):
                self.finish(cmd)  # a killed one not reaped yet reads as killed (status None)
                continue
            for t in (None if cmd.timed_out or cmd.ended_at is not None else cmd.deadline, cmd.drain_until):
                if t is not None:
                    wake = t if wake is None else min(wake, t)
        return wake

    def shutdown(self):
        for cmd in list(self.commands.values()):
            with contextlib.suppress(OSError):
                os.killpg(cmd.pid, signal.SIGKILL)

    def loop(self, wake_r):
        poller = select.poll()
        inbound = True
        while True:
            if self.closing and not self.outbox:
                self.shutdown()
                return
            wake = self.step(time.monotonic())
            watched = {}
            if inbound and not self.closing:
                watched[0] = select.POLLIN
            watched[wake_r] = select.POLLIN
            if self.outbox:
                watched[1] = select.POLLOUT
            for fd, cmd in self.by_fd.items():
                watched[fd] = select.POLLOUT if fd == cmd.in_fd else select.POLLIN
            poller = select.poll()
            for fd, mask in watched.items():
                poller.register(fd, mask)
            timeout = None if wake is None else max(0, int((wake - time.monotonic()) * 1000) + 1)
            try:
                events = poller.poll(timeout)
            except InterruptedError:
                continue
            for fd, _ in events:
                if fd == 0:
                    try:
                        data = os.read(0, 1 << 20)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        inbound = False
                        self.closing = True  # the host went away: nothing more to serve
                        continue
                    for req_id, meta, blobs in self.parser.feed(data):
                        self.handle(req_id, meta, blobs)
                elif fd == wake_r:
                    with contextlib.suppress(OSError):
                        os.read(wake_r, 4096)
                    self.reap_children()
                elif fd == 1:
                    self.flush()
                elif fd in self.by_fd:
                    cmd = self.by_fd[fd]
                    if fd == cmd.in_fd:
                        self.write_stdin(cmd)
                    else:
                        self.read_output(fd)
            self.reap_children()


def _fork_exec(path, argv, env, in_r, out_w, err_w):
    """`spawn` where os.posix_spawn is missing (Python < 3.8): fork, then exec in the child."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        for sig in RESET_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.execve(path, argv, env)
    except BaseException:
        pass
    os._exit(127)


def resolve(name, search_path):
    """The program `name` names, searched on `search_path` as execvp does; an OSError if none."""
    if "/" in name:
        return name if os.access(name, os.X_OK) and not os.path.isdir(name) else _os_error(name)
    denied = None
    for d in search_path.split(":"):
        candidate = os.path.join(d or ".", name)
        if os.path.isfile(candidate):
            if os.access(candidate, os.X_OK):
                return candidate
            denied = candidate
    return (
        OSError(errno.EACCES, "Permission denied", denied) if denied else OSError(errno.ENOENT, "not found")
    )


def _os_error(path):
    if not os.path.exists(path):
        return OSError(errno.ENOENT, "No such file or directory", path)
    return OSError(errno.EACCES, "Permission denied", path)


# --- files ---------------------------------------------------------------------------------


def _error(kind, exc):
    return {
        "error": kind,
        "errno": getattr(exc, "errno", 0) or 0,
        "message": getattr(exc, "strerror", None) or str(exc),
    }


def read_file(path, limit):
    """(meta, blobs): at most `limit` bytes of a regular file, or what kept it from being read."""
    try:
        st = os.stat(path)  # follows symlinks: a link is judged by its target
    except (FileNotFoundError, NotADirectoryError) as exc:
        return _error("missing", exc), []
    except PermissionError as exc:
        return _error("permission", exc), []
    except OSError as exc:
        return _error("missing" if exc.errno == errno.ELOOP else "other", exc), []
    if stat.S_ISDIR(st.st_mode):
        return {"error": "directory", "errno": errno.EISDIR, "message": "Is a directory"}, []
    if not stat.S_ISREG(st.st_mode):
        return {"error": "special", "errno": 0, "message": "not a regular file"}, []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except PermissionError as exc:
        return _error("permission", exc), []
    except (FileNotFoundError, NotADirectoryError) as exc:
        return _error("missing", exc), []
    except OSError as exc:
        return _error("special" if exc.errno == errno.ENXIO else "other", exc), []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped between the stat and the open
            return {"error": "special", "errno": 0, "message": "not a regular file"}, []
        chunks, left = [], limit
        while left > 0:
            data = os.read(fd, min(left, 1 << 20))
            if not data:
                break
            chunks.append(data)
            left -= len(data)
        return {"ok": True}, [b"".join(chunks)]
    except OSError as exc:
        return _error("permission" if exc.errno == errno.EACCES else "other", exc), []
    finally:
        os.close(fd)


def write_file(path, data, mode):
    """Create `path` afresh with `data` and `mode`, its parent directories first."""
    try:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                return {"error": "exists", "errno": errno.EEXIST, "message": "File exists (a directory)"}
            os.unlink(path)  # never write through the old entry (a link, a file shared by a hard link)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode & 0o7777)
        finally:
            os.close(fd)
    except OSError as exc:
        return _error("os", exc)
    return {"ok": True}


# --- start-up ------------------------------------------------------------------------------


def _refuse(why):
    os.write(1, REFUSED + why.encode(errors="replace") + b"\n")
    sys.exit(3)


def _read_exactly(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            sys.exit(0)
        data += chunk
    return data


def main():
    # Nothing inherited beyond the channel and stderr (a runtime's stray descriptor would reach
    # every command otherwise).
    os.closerange(3, 1 << 16)
    # Opened while this process is still dumpable: after, its /proc files are root's.
    try:
        oom_fd = os.open("/proc/self/oom_score_adj", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        oom_fd = None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_dumpable, pr_get_dumpable = 4, 3
        if libc.prctl(pr_set_dumpable, 0, 0, 0, 0) != 0 or libc.prctl(pr_get_dumpable, 0, 0, 0, 0) != 0:
            _refuse("prctl(PR_SET_DUMPABLE, 0) failed")
        libc.prctl(15, b"agentrl-exec", 0, 0, 0)  # PR_SET_NAME: what `ps -o comm` and `top` show
    except (ImportError, OSError, AttributeError) as exc:
        _refuse(f"cannot make this process non-dumpable ({exc})")
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    try:
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    except TypeError:  # Python < 3.7
        signal.set_wakeup_fd(wake_w)
    os.write(1, HELLO)
    nonce = _read_exactly(NONCE_BYTES)
    parser = Parser(nonce)
    frames = []
    while not frames:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(0)
        frames = parser.feed(chunk)
    req_id, config, _ = frames[0]
    ex = Executor(nonce, bool(config.get("reap")), int(config.get("oom_adj") or 0), oom_fd)
    ex.parser = parser
    os.set_blocking(0, False)
    os.set_blocking(1, False)
    ex.reply(
        req_id,
        {
            "pid": os.getpid(),
            "start": own_start_ticks(),
            "python": "{}.{}.{}".format(*sys.version_info[:3]),
        },
    )
    for req_id, meta, blobs in frames[1:]:
        ex.handle(req_id, meta, blobs)
    try:
        ex.loop(wake_r)
    except FrameError:
        ex.shutdown()
        sys.exit(2)


if __name__ == "__main__":
    main()
