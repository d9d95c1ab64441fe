"""`agentrl/guess-number-v0`: a stateful multi-turn game; find a secret number from higher/lower feedback.

The game lives in the environment, not in a sandbox: the agent's only tool is `guess`, one
guess per turn (`max_tool_calls_per_step=1`), and the feedback depends on the whole history of
the episode. A correct guess ends the episode
(the guess is the submission); the turn limit leaves room for a binary search and little more.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from agentrl.core.task import Task, split_rng_seed
from agentrl.core.types import Message, Split
from agentrl.env.agents import ScriptedOracle, last_tool_output
from agentrl.env.parsers import HERMES, ToolCallParser
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.tool_env import ToolEnv
from agentrl.env.tools import ToolContext, ToolOutcome, tool


@dataclass
class GameState:
    secret: int
    low: int
    high: int
    guesses: int = 0


@tool(needs_sandbox=False)
def guess(ctx: ToolContext, number: int) -> ToolOutcome:
    """Guess the secret number. The answer is 'higher', 'lower' or 'correct'.

    Args:
        number: Your guess, an integer within the announced range.
    """
    state: GameState = ctx.state
    state.guesses += 1
    if not state.low <= number <= state.high:
        return ToolOutcome(f"Error: {number} is outside the range {state.low}..{state.high}.", is_error=True)
    if number == state.secret:
        return ToolOutcome(f"correct: the secret number is {number}.", terminal=True, submission=str(number))
    return ToolOutcome("higher" if state.secret > number else "lower")


class GuessNumberTaskGenerator:
    def __init__(self, seed: int = 0, max_high: int = 1000):
        self.seed = seed
        self.max_high = max_high

    def generate(self, index: int, split: Split = "train") -> Task:
        rng = random.Random(split_rng_seed(self.seed, split, index))
        high = rng.choice([h for h in (16, 64, 100, 500, 1000) if h <= self.max_high])
        secret = rng.randint(1, high)
        return Task(
            id=f"guess-number/{split}/{index}",
            answer=str(secret),
            split=split,
            prompt=f"I am thinking of an integer between 1 and {high} (inclusive). Find it with the guess tool. "
            "After each guess I say whether the secret is higher or lower.",
            metadata={"low": 1, "high": high},
        )


class BinarySearchOracle(ScriptedOracle):
    def __init__(self, task: Task, parser: ToolCallParser = HERMES):
        super().__init__(task, parser)
        self.low, self.high = task.metadata["low"], task.metadata["high"]
        self.last: int | None = None

    def act(self, observation: list[Message]) -> str:
        feedback = last_tool_output(observation)
        if self.last is not None:
            if re.match(r"\s*higher", feedback):
                self.low = self.last + 1
            elif re.match(r"\s*lower", feedback):
                self.high = self.last - 1
        self.last = (self.low + self.high) // 2
        return self.call("guess", number=self.last)


class GuessNumberSettings(ToolEnvSettings):
    """guess-number-v0's settings: ToolEnv's, with the game's tool, one guess per turn and its turn limit."""

    tools: list[Any] | None = Field(
        default_factory=lambda: [guess], description="The tools the agent calls: the game's guess."
    )
    max_turns: int = Field(
        math.ceil(math.log2(1000)) + 2,
        ge=1,
        description="Most assistant messages per episode: a binary search over the largest range (1..1000), "
        "and two to spare.",
    )
    max_tool_calls_per_step: int | None = Field(
        1,
        description="Guesses one message runs: the feedback is the game, and with parallel calls 100 "
        "guesses in one message would win in two turns whatever the strategy.",
    )


class GuessNumberEnv(ToolEnv):
    instructions = "You are playing a number-guessing game. Use the guess tool; think like a binary search."
    settings_model = GuessNumberSettings
    # One guess per turn (see GuessNumberSettings), also when a caller passes None.
    default_max_tool_calls_per_step = 1
    task_generator = GuessNumberTaskGenerator

    def initial_state(self, task: Task) -> GameState:
        return GameState(secret=int(task.answer or 0), low=task.metadata["low"], high=task.metadata["high"])

    def oracle(self, task: Task) -> BinarySearchOracle:
        return BinarySearchOracle(task, self.parser)
