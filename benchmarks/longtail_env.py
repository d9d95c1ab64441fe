"""A benchmark environment with long-tailed episode times and chance-level rewards.

Each step first waits a Pareto-distributed time (most steps fast, a few very slow: the shape of
real tool latencies, test suites and compiles), then scores the message like `tests/coin_env`
(even length wins), so a random tiny policy still yields informative GRPO groups. Used by
`benchmarks/train.py` to compare synchronous and asynchronous training wall-clock.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import agentrl
from agentrl.core.task import Task
from agentrl.env.tool_env import ToolEnv
from agentrl.verifiers import Verdict


@dataclass
class EvenLength:
    name: str = "even-length"

    def verify(self, sandbox, task, episode):
        first = next((m["content"] for m in episode.messages if m["role"] == "assistant"), "")
        ok = len(first) % 2 == 0
        return Verdict(float(ok), ok, f"{len(first)} characters")


class Tasks:
    def generate(self, index: int, split: str = "train") -> Task:
        return Task(id=f"longtail/{split}/{index}", prompt=f"Say anything. ({index})", split=split)


class LongTailEnv(ToolEnv):
    def __init__(self, *, scale_s: float = 0.05, alpha: float = 1.3, cap_s: float = 3.0, **kw):
        kw.setdefault("max_turns", 1)
        super().__init__(tasks=Tasks(), tools=["submit"], verifier=EvenLength(), **kw)
        self.scale_s, self.alpha, self.cap_s = scale_s, alpha, cap_s
        self._rng = random.Random()

    def step(self, action: str):
        # Pareto(alpha) * scale: median ~1.7x scale, p99 ~35x scale at alpha 1.3 (capped).
        time.sleep(min(self.cap_s, self.scale_s * self._rng.paretovariate(self.alpha)))
        return super().step(action)


agentrl.register(
    "bench/LongTail-v0",
    "benchmarks.longtail_env:LongTailEnv",
    max_turns=1,
    description="long-tailed step latency, chance-level reward (benchmark)",
)
