"""`Episode`: what happened in one environment episode, as the verifier and the logs see it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["submitted", "max_turns", "max_tokens", "timeout", "env_error"]


@dataclass
class Episode:
    """Running record of one episode; the environment updates it every step."""

    task_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    submission: str | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    format_errors: int = 0
    tools_used: dict[str, int] = field(default_factory=dict)
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def stats(self) -> dict[str, Any]:
        """The counters, for `info` and logs."""
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_timeouts": self.tool_timeouts,
            "format_errors": self.format_errors,
            "tools_used": dict(self.tools_used),
            "finish_reason": self.finish_reason,
        }
