"""`Episode`: what happened in one environment episode, as the verifier and the logs see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentrl.core.types import CallStatus, FinishReason, Message, Verdict


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call the model made, and what became of it."""

    name: str
    status: CallStatus
    is_error: bool = False
    timed_out: bool = False
    duration_s: float = 0.0

    @property
    def ran(self) -> bool:
        return self.status == "ran"


@dataclass
class Episode:
    """Running record of one episode; the environment updates it every step. The typed record the
    stages read (rollout, evaluation, the checks): never Gymnasium's `info` dict."""

    task_id: str
    messages: list[Message] = field(default_factory=list)
    submission: str | None = None
    turns: int = 0
    tool_calls: int = 0
    """Tool calls dispatched (run, or refused for bad arguments or an unknown name)."""
    tool_errors: int = 0
    tool_timeouts: int = 0
    format_errors: int = 0
    calls: list[ToolCallRecord] = field(default_factory=list)
    """Every tool call of the episode in order, with what became of it (gates read this)."""
    finish_reason: FinishReason | None = None
    """None while the episode runs."""
    error: str | None = None
    """What went wrong, when the environment ended the episode (`env_error`)."""
    verdict: Verdict | None = None
    """The verifier's verdict, once the episode is over."""

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def tools_used(self) -> dict[str, int]:
        """Calls that ran, per tool. A call refused for its arguments, or never run, does not count:
        a gate like "used python" must not be passed by a call that did nothing."""
        used: dict[str, int] = {}
        for call in self.calls:
            if call.ran:
                used[call.name] = used.get(call.name, 0) + 1
        return used

    def calls_ran(self, tool: str) -> int:
        """How many calls of `tool` actually ran."""
        return sum(1 for call in self.calls if call.ran and call.name == tool)

    @property
    def tool_calls_not_run(self) -> int:
        return sum(1 for call in self.calls if call.status == "not_run")

    def stats(self) -> dict[str, Any]:
        """The counters, for `info` and logs."""
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_calls_not_run": self.tool_calls_not_run,
            "tool_errors": self.tool_errors,
            "tool_timeouts": self.tool_timeouts,
            "format_errors": self.format_errors,
            "tools_used": self.tools_used,
            "finish_reason": self.finish_reason,
        }
