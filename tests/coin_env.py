"""A test environment where a random policy succeeds about half the time: GRPO gets informative groups.

Imported by id `tests.coin_env:test/Coin-v0` (the module registers on import), also from the
trainer's torchrun subprocesses. The agent is rewarded when its first message has an even number
of characters: no skill, pure chance, exactly what a wiring test of the training loop needs.
"""

from __future__ import annotations

import random
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
        return Verdict(float(ok), ok, f"first message has {len(first)} characters")


class CoinTasks:
    def generate(self, index: int, split: str = "train") -> Task:
        return Task(id=f"coin/{split}/{index}", prompt=f"Say anything. ({index})", split=split)


class CoinEnv(ToolEnv):
    def __init__(self, **kw):
        kw.setdefault("max_turns", 1)
        super().__init__(tasks=CoinTasks(), tools=["submit"], verifier=EvenLength(), **kw)


agentrl.register(
    "test/Coin-v0", "tests.coin_env:CoinEnv", max_turns=1, description="random-policy wiring test"
)


class CoinBoxEnv(ToolEnv):
    """The coin env with a python tool: every episode runs in a docker sandbox of the warm pool."""

    def __init__(self, **kw):
        kw.setdefault("max_turns", 1)
        super().__init__(tasks=CoinTasks(), tools=["python", "submit"], verifier=EvenLength(), **kw)


agentrl.register(
    "test/CoinBox-v0", "tests.coin_env:CoinBoxEnv", max_turns=1, description="coin env in docker sandboxes"
)


agentrl.register(
    "test/CoinHarness-v0",
    "agentrl.gateway:HarnessEnv",
    env="test/Coin-v0",
    agent="agentrl.gateway:tool_loop_agent",
    description="the coin env played by an openai-SDK harness through the gateway",
)


class PickTasks:
    """Name one of two words, the one the prompt asks for: a model that learns the call but not yet the
    reading of the prompt picks right half the time."""

    WORDS = ("left", "right")

    def generate(self, index: int, split: str = "train") -> Task:
        word = self.WORDS[random.Random(f"{split}/{index}").randrange(2)]
        return Task(
            id=f"pick/{split}/{index}",
            prompt=f"Submit the word {word}. ({index})",
            answer=word,
            split=split,
        )


class PickEnv(ToolEnv):
    """One turn, one tool (`submit`), an exact-match answer and an oracle that submits it: a plugin env
    unlike calc (no python tool, no arithmetic) for the warm start."""

    def __init__(self, **kw):
        from agentrl.env.agents import AnswerOracle

        kw.setdefault("max_turns", 1)
        super().__init__(
            tasks=PickTasks(), tools=["submit"], verifier="exact-match", oracle=AnswerOracle, **kw
        )


agentrl.register("test/Pick-v0", "tests.coin_env:PickEnv", max_turns=1, description="pick the word asked for")

agentrl.register(
    "test/PickHarness-v0",
    "agentrl.gateway:HarnessEnv",
    env="test/Pick-v0",
    agent="agentrl.gateway:tool_loop_agent",
    description="the pick env played by an openai-SDK harness (the checks run on the pick env)",
)


class SplitSpyTasks(CoinTasks):
    """The coin tasks, recording every split a task is made for: one line per call in the file named by
    AGENTRL_SPLIT_LOG (the trainer's processes inherit it), so a test sees which splits a run touched."""

    def generate(self, index: int, split: str = "train") -> Task:
        import os

        log = os.environ.get("AGENTRL_SPLIT_LOG")
        if log:
            with open(log, "a") as f:
                f.write(f"{split}\n")
        return super().generate(index, split)


class SplitSpyEnv(ToolEnv):
    def __init__(self, **kw):
        kw.setdefault("max_turns", 1)
        super().__init__(tasks=SplitSpyTasks(), tools=["submit"], verifier=EvenLength(), **kw)


agentrl.register(
    "test/SplitSpy-v0", "tests.coin_env:SplitSpyEnv", max_turns=1, description="coin env that logs its splits"
)
