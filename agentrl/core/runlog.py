"""Quiet consoles: engine logs go to a file in the run directory, library progress bars stay off.

A training run's console is ours: a progress bar and a handful of lines. vLLM's engine logs (start-up,
KV cache sizes, deprecation notes), its Python warnings, transformers' "Loading weights" bars and
PyTorch's C++ warnings would bury them, so `quiet_libraries(log_file)` sends vLLM's logger to
`log_file` (in the engine's own processes too: they read VLLM_LOGGING_CONFIG_PATH) and turns the
rest off. `agentrl --debug` leaves everything as the libraries set it.

A pipeline of stages (the demo) goes one step further: `console_to_file` sends the whole process's
output, children included, to a log in the run directory, and `Stage` prints one line per stage on
the console with its progress, elapsed time and ETA.
"""

from __future__ import annotations

import contextlib
import json
import logging
import logging.config
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO


def debug_mode() -> bool:
    return os.environ.get("AGENTRL_DEBUG", "") not in ("", "0")


def vllm_file_logging(log_file: Path) -> dict:
    """A `logging.config.dictConfig` that sends every `vllm` record of INFO and above to `log_file`."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "vllm": {
                "format": "%(levelname)s %(asctime)s [%(process)d %(filename)s:%(lineno)d] %(message)s",
                "datefmt": "%m-%d %H:%M:%S",
            }
        },
        "handlers": {
            "vllm": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "formatter": "vllm",
                "level": "INFO",
            }
        },
        "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
    }


def quiet_libraries(log_file: Path | None) -> None:
    """Route vLLM's logs to `log_file` (None: leave them) and silence library progress bars and
    deprecation chatter. Idempotent; a no-op in debug mode."""
    if debug_mode():
        return
    if log_file is not None:
        log_file = Path(log_file).resolve()
        log_file.parent.mkdir(parents=True, exist_ok=True)
        config = vllm_file_logging(log_file)
        config_path = log_file.with_name(".vllm-logging.json")
        config_path.write_text(json.dumps(config))
        # Read by vLLM at import and by every engine process it spawns (they inherit the environment).
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
        os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
        # Now as well: vLLM may already be imported (and configured), and a record logged while it
        # imports, before it configures its logger, would reach Python's last-resort stderr handler.
        logging.config.dictConfig(config)
    # vLLM's own deprecation warnings about torch APIs are not the user's to act on: here, and in
    # the engine processes it spawns (PYTHONWARNINGS names modules exactly).
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"vllm(\.|$)")
    engine_filter = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    current = os.environ.get("PYTHONWARNINGS", "")
    if engine_filter not in current:
        os.environ["PYTHONWARNINGS"] = f"{current},{engine_filter}" if current else engine_filter
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars
    except Exception:  # pragma: no cover - transformers is a dependency
        pass


@contextlib.contextmanager
def console_to_file(log_file: Path) -> Iterator[TextIO]:
    """Send this process's stdout and stderr, at the file-descriptor level, to `log_file`; yield a
    stream on the original console.

    Everything the libraries print (vLLM's engine logs, torch's C++ warnings, progress bars) and
    every child process (torchrun and its ranks, SFT, measurements: they inherit descriptors 1 and 2)
    then writes to the log, and only what is written to the yielded stream reaches the terminal.
    The descriptors are restored on exit, also on an exception. In debug mode (`agentrl --debug`)
    nothing is redirected and the stream is `sys.stdout`.
    """
    if debug_mode():
        yield sys.stdout
        return
    log_file = Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    try:
        yield console
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for d in saved:
            os.close(d)
        console.close()


def fmt_duration(seconds: float) -> str:
    """`75` -> "1m15s", `3725` -> "1h02m", `9` -> "9s"."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta(elapsed: float, done: int, total: int) -> float | None:
    """Seconds left at the pace so far (None before the first unit of work is done)."""
    if done <= 0 or total <= 0:
        return None
    return elapsed * max(total - done, 0) / done


# -> (done, total, unit): "step 1/4"; total 0: not countable, and `unit` is the latest milestone instead
Progress = Callable[[], tuple[int, int, str]]


class Stage:
    """One stage line on the console, repeated when its progress moves (and every `heartbeat` seconds
    while it does not), with the elapsed time and an ETA at the pace so far:

        [demo] 2/3 GRPO: step 1/4, 2m10s, ETA 6m30s

    `progress()` is polled from a background thread every `poll` seconds; it reads the stage's own
    files (metrics rows, episodes written), so the stage itself needs no hook.
    """

    def __init__(
        self,
        console: TextIO,
        label: str,
        progress: Progress | None = None,
        *,
        prefix: str = "[demo]",
        poll: float = 2.0,
        heartbeat: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.console, self.label, self.progress, self.prefix = console, label, progress, prefix
        self.poll, self.heartbeat, self.clock = poll, heartbeat, clock
        self.t0 = clock()
        self.last: tuple[int, int, str] | None = None
        self.last_print = self.t0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def line(self) -> str:
        elapsed = self.clock() - self.t0
        parts = [f"{self.prefix} {self.label}:"]
        state = self._read()
        if state is not None and state[1] > 0:
            done, total, unit = state
            parts.append(f"{unit} {done}/{total},")
            left = eta(elapsed, done, total)
            parts.append(fmt_duration(elapsed) + (f", ETA {fmt_duration(left)}" if left is not None else ""))
        else:
            if state is not None and state[2]:  # not countable: the stage's latest milestone instead
                parts.append(f"{state[2]},")
            parts.append(fmt_duration(elapsed))
        return " ".join(parts)

    def _read(self) -> tuple[int, int, str] | None:
        if self.progress is None:
            return None
        try:
            return self.progress()
        except Exception:  # a progress file being written or not there yet: no count this time
            return None

    def tick(self) -> None:
        """Print the line if the progress moved or the heartbeat is due."""
        key = self._read()
        now = self.clock()
        if key != self.last or now - self.last_print >= self.heartbeat:
            self.last = key
            self.last_print = now
            self.say(self.line())

    def say(self, msg: str) -> None:
        with contextlib.suppress(ValueError, OSError):  # a console closed under us: nothing to tell
            print(msg, file=self.console, flush=True)

    def __enter__(self) -> Stage:
        self.t0 = self.last_print = self.clock()
        self.tick()
        self._thread = threading.Thread(target=self._run, name=f"stage-{self.label}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            self.tick()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_type is None:
            self.tick()  # the final count (e.g. the last step), which the poll may not have seen yet
        took = fmt_duration(self.clock() - self.t0)
        self.say(
            f"{self.prefix} {self.label}: {'done in ' + took if exc_type is None else 'stopped after ' + took}"
        )


def count_lines(*paths: Path) -> int:
    """Lines in the files that exist among `paths` (rows of a metrics or episodes JSONL)."""
    n = 0
    for p in paths:
        if p.is_file():
            with p.open("rb") as f:
                n += sum(1 for _ in f)
    return n


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a text file ("" when there is none)."""
    if not Path(path).is_file():
        return ""
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
