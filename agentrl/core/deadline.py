"""Calling a function with a deadline on a thread of its own: what tools (`agentrl.env.tools.run_tool`)
and verifiers (`agentrl.verifiers.run_verifier`) share to bound a call that may never return.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DeadlineExceeded(TimeoutError):
    """`call_with_deadline`'s call overran: a `TimeoutError` of its own, never one the call raised."""


class ThreadLimitReached(RuntimeError):
    """No thread could be started for a call with a deadline (the process's thread limit is full,
    typically of abandoned calls that never returned)."""


def call_with_deadline(
    fn: Callable[..., Any], /, *args: Any, timeout_s: float, name: str = "deadline"
) -> Any:
    """`fn(*args)` on a thread of its own, waited for at most `timeout_s` seconds: its result, or the
    exception it raised (raised here, with its traceback). Past the deadline, `DeadlineExceeded`.

    An overrunning call is abandoned, not stopped (Python cannot stop a thread): it is left to
    finish, and what it returns or raises then is dropped. The thread is a daemon, so an abandoned
    one never keeps the process from exiting (a `ThreadPoolExecutor`'s workers are joined at exit:
    one stuck in `time.sleep(3600)` would hang the command that started it for an hour).
    """
    box: list[tuple[bool, Any]] = []
    done = threading.Event()

    def target() -> None:
        try:
            box.append((True, fn(*args)))
        except BaseException as exc:  # handed to the caller, whatever it is
            box.append((False, exc))
        finally:
            done.set()

    try:
        threading.Thread(target=target, name=name, daemon=True).start()
    except RuntimeError as exc:  # "can't start new thread": too many abandoned calls still running
        raise ThreadLimitReached(f"{name} could not start a thread ({exc})") from None
    if not done.wait(min(timeout_s, threading.TIMEOUT_MAX)):  # inf: no deadline (wait() refuses inf)
        raise DeadlineExceeded(f"{name} did not return within {timeout_s:g}s")
    ok, value = box[0]
    if not ok:
        raise value
    return value
