"""The in-sandbox end of a harness command's link to its gateway session (standard library only).

Sent over the stdin of one attached process in the sandbox (`agentrl.gateway.relay`), it

- listens on the sandbox's own loopback (127.0.0.1, a free port): the sandbox has no network, and this
  socket is the only way out, to the gateway session and nothing else;
- starts the harness command as its child, in a session of its own, with `OPENAI_BASE_URL` (and the
  other variables the host names) set to `http://127.0.0.1:<port>/s/<token>/v1`;
- carries each connection to the host over its own stdin and stdout, in frames of
  `kind (1 byte), connection (4), length (4), payload`; the host connects each one to the gateway;
- forwards the command's output (stdout and stderr together) and, once it exits, its exit code.

Its stdout carries frames only: the command's output never reaches it unframed, so nothing the command
prints can pose as a frame. EOF on stdin (the host gave up on the episode) kills the command's group.

The command and everything it starts run as the relay's own uid (the agent's), so the relay keeps them out:

- it makes itself non-dumpable (`PR_SET_DUMPABLE` 0) before it reads its settings or starts the command:
  a process of the same uid can then neither ptrace it, read its memory, nor open its descriptors
  through `/proc/<pid>/fd` (its stdio: the link to the host, which a forged frame would ride); it refuses
  to run where that fails;
- the command gets none of the relay's descriptors (stdin from /dev/null, its output a pipe of its own);
- its exit status is the command's (128 + N when a signal N ended it), which the host reads from the
  relay's process (docker's record of the exec, bwrap's exit), not only from the `EXIT` frame: a frame
  and a process that disagree mean the relay was tampered with, and the episode is not trained on.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading

HEADER = struct.Struct(">BII")
OPEN, DATA, CLOSE, OUT, EXIT = 1, 2, 3, 4, 5
CHUNK = 1 << 16


def read_exact(stream, n):
    buf = b""
    while len(buf) < n:
        part = stream.read(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def non_dumpable():
    """PR_SET_DUMPABLE 0 (and a name for `ps`); False where it cannot be done."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(4, 0, 0, 0, 0) != 0 or libc.prctl(3, 0, 0, 0, 0) != 0:
            return False
        libc.prctl(15, b"agentrl-relay", 0, 0, 0)
        return True
    except (ImportError, OSError, AttributeError):
        return False


def exit_status(code):
    """The relay's own exit status for the command's: its code, or 128 + N for signal N."""
    return 128 - code if code < 0 else code & 0xFF


class Link:
    """The host's end of things, over this process's stdio: frames out (one writer at a time), the gateway's
    replies in, and the command's connections to the session, by number."""

    def __init__(self, inp, out):
        self.inp, self.out = inp, out
        self.out_lock = threading.Lock()
        self.conns = {}
        self.lock = threading.Lock()
        self.child = None

    def send(self, kind, conn, payload=b""):
        with self.out_lock:
            self.out.write(HEADER.pack(kind, conn, len(payload)) + payload)
            self.out.flush()

    def give_up(self, message, status):
        """Say why on the command's output, report `status` as its exit, and exit with it."""
        self.send(OUT, 0, message.encode())
        self.send(EXIT, 0, str(status).encode())
        self.out.flush()
        os._exit(status)

    def kill_group(self):
        with contextlib.suppress(OSError):
            os.killpg(self.child.pid, signal.SIGKILL)

    def upstream(self, conn_id, sock):
        # What the command sends on one connection, to the host.
        try:
            while True:
                data = sock.recv(CHUNK)
                if not data:
                    break
                self.send(DATA, conn_id, data)
        except OSError:
            pass
        self.send(CLOSE, conn_id)

    def accept(self, server):
        next_id = 0
        while True:
            try:
                sock, _ = server.accept()
            except OSError:
                return
            next_id += 1
            with self.lock:
                self.conns[next_id] = sock
            self.send(OPEN, next_id)
            threading.Thread(target=self.upstream, args=(next_id, sock), daemon=True).start()

    def downstream(self):
        # The gateway's replies, from the host; EOF: the host ended the episode.
        while True:
            head = read_exact(self.inp, HEADER.size)
            if head is None:
                self.kill_group()
                os._exit(0)
            kind, conn_id, size = HEADER.unpack(head)
            payload = read_exact(self.inp, size) if size else b""
            with self.lock:
                sock = self.conns.get(conn_id)
                if kind == CLOSE:
                    self.conns.pop(conn_id, None)
            if sock is None:
                continue
            try:
                if kind == DATA:
                    sock.sendall(payload)
                elif kind == CLOSE:
                    sock.shutdown(socket.SHUT_RDWR)
                    sock.close()
            except OSError:
                pass

    def output(self):
        while True:
            data = self.child.stdout.read1(CHUNK)
            if not data:
                return
            self.send(OUT, 0, data)


def read_settings(inp):
    """The host's settings (argv, env, cwd, path, url_vars): a length, then JSON; None at EOF."""
    head = read_exact(inp, 4)
    if head is None:
        return None
    return json.loads(read_exact(inp, struct.unpack(">I", head)[0]))


def start_command(link, cfg, url):
    """The harness command, in a session of its own, with the session's URL in its environment."""
    env = dict(os.environ)  # the sandbox's own (PATH, its settings), then the harness's
    env.update(cfg["env"])
    for name in cfg["url_vars"]:
        env[name] = url
    try:
        return subprocess.Popen(
            cfg["argv"],
            env=env,
            cwd=cfg["cwd"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        link.give_up(f"could not start {cfg['argv']!r}: {exc}\n", 127)


def main():
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    safe = non_dumpable()
    link = Link(inp, out)
    cfg = read_settings(inp)
    if cfg is None:
        return
    if not safe:
        link.give_up(
            "agentrl relay: cannot make itself non-dumpable (prctl); refusing to run the command\n", 126
        )
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    url = f"http://127.0.0.1:{server.getsockname()[1]}{cfg['path']}"
    link.child = child = start_command(link, cfg, url)
    threading.Thread(target=link.accept, args=(server,), daemon=True).start()
    threading.Thread(target=link.downstream, daemon=True).start()
    pump = threading.Thread(target=link.output, daemon=True)
    pump.start()
    code = child.wait()
    link.kill_group()  # what it left running in the background ends with it
    pump.join(timeout=2)
    link.send(EXIT, 0, str(code).encode())
    out.flush()
    # The host takes the command's status from this process's own exit, not from the frame alone.
    os._exit(exit_status(code))


if __name__ == "__main__":  # run as `python3 -c <this source>`; never on import
    main()
