"""How a training run stops before its last step: Ctrl-C, or steps that have nothing to learn from.

- `Sigint`: Ctrl-C stops the rollout in flight at once, or lets an update finish; the trainer then
  saves a checkpoint and raises `TrainingInterrupted` (a third Ctrl-C quits without saving).
- `StopUninformative`: several steps in a row without an informative group (`stop_uninformative_after`);
  `no_update_reason` says what kind (episodes that all failed or all passed; that the agent, the episode
  timeout or the environment broke), `stop_advice` what to do about it, with the first error's text. The trainer saves and raises
  `TrainingStopped`, or, when every group passed, ends the run as a finished one.
- `EngineLost`: the rollout engine died (its process killed, out of memory) and a push found it gone:
  the trainer saves the step just trained and raises `TrainingStopped`, saying how to resume.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from agentrl.core.errors import UserError, one_line
from agentrl.core.interrupt import interrupt
from agentrl.eval.failures import failures
from agentrl.rollout.trajectory import Trajectory
from agentrl.verifiers.base import verifier_failed


def _log(msg: str) -> None:
    tqdm.write(f"[train] {msg}", file=sys.stderr)  # below the progress bar, as the trainer's lines


def no_update_reason(metrics: dict[str, float]) -> tuple[str, str]:
    """(kind, words) for a step without an informative group: all-fail, all-pass, env-error or mixed."""
    fail = int(metrics.get("batch/all_fail_groups", 0))
    ok = int(metrics.get("batch/all_pass_groups", 0))
    broken = int(metrics.get("batch/untrainable_trajectories", 0))
    if fail and not ok:
        return "all-fail", f"all {fail} groups failed (reward 0 everywhere)"
    if ok and not fail:
        return "all-pass", f"all {ok} groups passed"
    if not ok and not fail:
        agent = int(metrics.get("rollout/agent_errors", 0))
        timeouts = int(metrics.get("rollout/timeouts", 0))
        if agent and agent >= timeouts and 2 * agent >= broken:
            return (
                "agent-error",
                f"no usable episode ({broken} untrainable: {agent} ended in an error of the agent)",
            )
        if timeouts and 2 * timeouts >= broken:
            return (
                "timeout",
                f"no usable episode ({broken} untrainable: {timeouts} ran past the episode timeout)",
            )
        return "env-error", f"no usable episode ({broken} ended in environment errors or timeouts)"
    return "mixed", f"every group was all-pass ({ok}) or all-fail ({fail})"


STOP_ADVICE = {
    "all-fail": "every episode failed: the policy cannot solve these tasks yet. Warm-start it first (SFT on "
    "demonstrations: `agentrl demos {env} --n 256 --out demos.jsonl`, then `agentrl sft`), or use easier tasks",
    "all-pass": "every episode passed: the policy already solves these tasks; train on harder ones",
    "env-error": "every episode ended in an environment error or timeout; run `agentrl env check {env}` "
    "and look at the trajectories' `error` field",
    "agent-error": "every episode ended in an error of the agent (agent_error), not of the environment: "
    "`agentrl env check {env}` plays the environment without your agent. Fix the agent",
    "timeout": "every episode ran past rollout.episode_timeout_s: raise it, or look for an agent that waits "
    "forever (a blocking call, a request never answered)",
    "mixed": "every task was either always solved or never: none is in the learnability band. Use tasks of "
    "graded difficulty, or warm-start the policy first",
}


def stop_advice(kind: str, env: str, trajectories: Sequence[Trajectory]) -> str:
    """What to do after steps of `kind` (`STOP_ADVICE`), unless the verdicts of the last batch's
    episodes say the verifier itself failed (crashed, overran its deadline): then the rewards said
    nothing about the policy, and the failure (its exception and file:line) is what to fix."""
    advice = STOP_ADVICE[kind].format(env=env)
    if kind in ("agent-error", "timeout", "env-error"):
        failed = failures(trajectories)
        if failed is not None and failed.first_error:
            advice += f"; the first {failed.first_reason}: {failed.first_error}"
        return advice
    broken = [t for t in trajectories if verifier_failed(t.verdict_details)]
    if not broken:
        return advice
    reason, count = Counter(t.verdict_details for t in broken).most_common(1)[0]
    reason = one_line(reason)
    if len(reason) > 500:  # an exception's message can be a page long; the file:line is at its end
        reason = f"{reason[:300]} ... {reason[-150:]}"
    said = f"{'most often: ' if count < len(broken) else ''}{reason}"
    if len(broken) == len(trajectories):
        return (
            f"the verifier failed on every episode ({len(broken)} of the last batch), so no reward said anything "
            f"about the policy: {said}. Fix that first (`agentrl verifier check {env}` runs the verifier on the "
            "oracle's solution)"
        )
    return f"{advice} (the verifier failed on {len(broken)} of the last batch's {len(trajectories)} episodes: {said})"


class Sigint:
    """Ctrl-C during training. While episodes are being generated it stops them at once (each releases
    its sandbox; the batch in flight is discarded); during an update, a weight push or a save it only
    asks to stop after it, so a checkpoint is always taken at a step boundary. Only rank 0 listens; the
    other ranks follow its decision (an `INTERRUPTED` payload), since Ctrl-C reaches every process of
    the terminal."""

    def __init__(self, listen: bool):
        self.requested = 0
        self.interruptible = False
        self.previous: Any = None
        self.listen = listen

    def __enter__(self) -> Sigint:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.getsignal(signal.SIGINT)
            # A process started with Ctrl-C ignored (nohup, a background job) keeps ignoring it.
            listen = self.listen and self.previous is not signal.SIG_IGN
            signal.signal(signal.SIGINT, self._handle if listen else signal.SIG_IGN)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested += 1
        if self.interruptible or self.requested >= 3:  # a third Ctrl-C gives up on saving
            interrupt()  # from the rollout's event loop, outside its episodes' tasks
            return
        if self.requested == 1:
            _log(
                "Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C twice more to quit without saving)"
            )

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator[None]:
        self.interruptible = True
        try:
            if self.requested:  # asked during the previous update: stop before generating more
                raise KeyboardInterrupt
            yield
        finally:
            self.interruptible = False


INTERRUPTED = "__agentrl_interrupted__"
"""What rank 0 broadcasts instead of a batch when Ctrl-C stopped its rollout: every rank stops."""


ENGINE_OUT_OF_DATE = "__agentrl_engine_out_of_date__"
"""What rank 0 broadcasts, with the reason, instead of a batch the engine sampled from an older policy."""


def check_engine_versions(trajectories: list[Trajectory], pushed: int, mode: str) -> str | None:
    """Why this batch was not sampled from the policy the trainer last pushed (version `pushed`), or None.

    Each trajectory records the weight (or adapter) versions its tokens were sampled with, as the engine
    reported them per request. Synchronous training samples every batch after the push: each token must carry
    `pushed`. Asynchronous training may sample with older versions (its staleness bound drops or corrects
    them), never a newer one. A LoRA engine that kept an old adapter, or a push that reached one engine of
    several, is caught here instead of training on another policy's samples for the rest of the run.
    """
    if pushed < 0 or not trajectories:
        return None
    lo = min(t.policy_version for t in trajectories)
    hi = max(
        t.policy_version_max if t.policy_version_max is not None else t.policy_version for t in trajectories
    )
    if hi > pushed or (mode == "sync" and lo != pushed):
        return (
            f"the engine sampled this batch with policy version(s) {lo}..{hi}, but the trainer's newest push is "
            f"version {pushed}: the engine is not running the newest weights or adapter. Check the engine log "
            "for a failed weight or adapter load; a resume starts from the last checkpoint"
        )
    return None


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after a checkpoint was saved; the message says how to continue."""


class TrainingStopped(UserError):
    """Training stopped because nothing could be learned (no informative group for several steps)."""

    collective = True  # every rank raises it together (see agentrl.train.distributed.run_rank)


class StopUninformative(Exception):
    """Raised on every rank at once when rank 0 finds no informative group in the last steps."""

    def __init__(self, kind: str, advice: str, step: int):
        super().__init__(kind)
        self.kind, self.advice, self.step = kind, advice, step


class EngineLost(Exception):
    """Raised on every rank at once when rank 0 found the rollout engine dead while pushing weights."""

    def __init__(self, why: str, step: int):
        super().__init__(why)
        self.why, self.step = why, step


def engine_dead(exc: BaseException) -> bool:
    """Whether `exc` says the rollout engine itself is gone (vLLM's engine process died; a Ray engine
    that died), not that a request or a push was wrong."""
    return type(exc).__name__ == "EngineDeadError" or getattr(exc, "finish_reason", None) == "engine_error"
