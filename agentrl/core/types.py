"""The types every stage shares, each defined once: messages, splits, how an episode ends, the step
record and the verifier's verdict. The environment contract that `agentrl.make` returns (`AgentEnv`)
is in `agentrl.env.protocols`, with the stage that implements it.

    env: AgentEnv = agentrl.make("agentrl/calc-v0")
    obs, info = env.reset(seed=0)                  # obs: list[Message]
    obs, reward, terminated, truncated, info = env.step(text)
    env.episode                                    # the typed record: counts, finish reason, verdict

Gymnasium's `info` dict stays what Gymnasium expects (a `dict`); its keys are declared here, by
`StepInfo`, whose `as_dict()` the environment returns. agentrl's own stages never read `info`: they
read `env.episode` (an `agentrl.core.episode.Episode`), the typed running record of the episode.

This module imports nothing of agentrl, so any module may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")


class Message(TypedDict):
    """One chat message, as observations hold them and chat templates render them."""

    role: Role
    content: str
    name: NotRequired[str]
    """A tool message's tool (or `error` for a format error the environment reports)."""
    tool_call_id: NotRequired[str]
    """A tool message's answer to this call id (the parser's `ToolCall.id`)."""


Split = Literal["train", "validation", "test"]
SPLITS: tuple[Split, ...] = ("train", "validation", "test")

FinishReason = Literal[
    "submitted", "max_turns", "max_tokens", "timeout", "env_error", "engine_error", "agent_error"
]
"""How an episode ended: `submitted` (the agent called a terminal tool, or a harness agent returned:
`terminated`), `max_turns` (the environment's turn limit), `max_tokens` (the rollout's context budget),
`timeout` (the rollout's wall-clock limit), `env_error` (the environment or its sandbox failed),
`engine_error` (the rollout engine serving it died, `agentrl.rollout.ray_policy`) or `agent_error` (a
harness agent raised, `agentrl.gateway.harness`); all but `submitted` are `truncated`. `timeout`,
`env_error`, `engine_error` and `agent_error` episodes say nothing reliable about the policy and are not
trained on."""

CallStatus = Literal["ran", "invalid_arguments", "unknown_tool", "not_run"]
"""What became of one tool call: `ran` (the tool was invoked with valid arguments, whatever it then
returned), `invalid_arguments` (refused by the tool's schema: nothing happened), `unknown_tool`, or
`not_run` (past the per-step call limit or time budget, or after `submit` in the same message)."""


@dataclass(frozen=True)
class Verdict:
    """A verifier's score of one episode (`agentrl.verifiers`: `verify(sandbox, task, episode)`)."""

    reward: float
    passed: bool
    details: str = ""
    """Why: what failed, or why the verifier could not run (a deadline, a crash, a missing capability)."""
    duration_s: float = 0.0
    """How long the verifier took."""
    judged: bool = True
    """False when the verifier could not score the episode (a judge that failed or answered out of format):
    the reward is 0 in the record, and the episode is kept but not trained on, as an environment failure is."""


@dataclass(frozen=True)
class StepInfo:
    """What one `step` reports: this step's tool calls, the episode's counts so far and, once the
    episode is over, how it ended. `as_dict()` is Gymnasium's `info` (these field names as keys;
    `verdict` and `error` only when set)."""

    step_tool_calls: int = 0
    """Tool calls this message dispatched (run, or refused for bad arguments or an unknown name)."""
    step_tool_calls_not_run: int = 0
    """Calls of this message past the per-step limit or time budget: not run, the model is told."""
    step_tool_errors: int = 0
    """Errors this step: format errors, tool errors, calls over the limit."""
    step_tool_timeouts: int = 0
    """Commands of this step killed at their timeout."""
    turns: int = 0
    tool_calls: int = 0
    tool_calls_not_run: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    format_errors: int = 0
    tools_used: dict[str, int] = field(default_factory=dict)
    """Calls that ran, per tool, over the episode."""
    finish_reason: FinishReason | None = None
    """None while the episode runs."""
    verdict: Verdict | None = None
    """The verifier's verdict, on the step that ended the episode."""
    error: str | None = None
    """What went wrong, when the environment ended the episode (`env_error`)."""

    def as_dict(self) -> dict[str, Any]:
        """Gymnasium's `info` dict."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("verdict", "error")}
        if self.verdict is not None:
            out["verdict"] = self.verdict
        if self.error is not None:
            out["error"] = self.error
        return out
