"""A judged environment for the tests: reply to a customer in one message, scored by a judge model.

Imported by id `tests.verifiers.judge_env:test/SupportJudge-v0` (also from the trainer's subprocess); the
judge's endpoint comes in as settings (`judge_url`, `judge_model`), as a user's config would give it.
"""

from __future__ import annotations

import random

from pydantic import Field

import agentrl
from agentrl.core.task import Task
from agentrl.env.agents import AnswerOracle
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.tool_env import ToolEnv
from agentrl.verifiers.judge import JudgeVerifier

CASES = [
    ("I forgot my password.", "Use the 'Forgot password' link on the sign-in page to get a reset email."),
    ("My parcel has not arrived.", "Send us the order number and we will trace the parcel with the carrier."),
    ("Can I return shoes I wore once?", "Yes, within 30 days, if they are clean; print the return label."),
    ("I was charged twice.", "We will refund the duplicate charge within 5 business days."),
]
RUBRIC = [
    ("Tells the customer what to do next", 2.0),
    ("Agrees with the reference answer", 2.0),
    ("Is polite", 1.0),
]


class SupportTasks:
    def __init__(self, seed: int = 0):
        self.seed = seed

    def generate(self, index: int, split: str = "train") -> Task:
        question, reference = CASES[random.Random(f"{self.seed}/{split}/{index}").randrange(len(CASES))]
        return Task(
            id=f"support/{split}/{index}",
            prompt=f"A customer writes: {question!r} Reply to the customer in one or two sentences, then submit the reply.",
            answer=reference,
            split=split,
        )


class SupportJudgeSettings(ToolEnvSettings):
    judge_url: str = Field("http://127.0.0.1:8000/v1", description="The judge's OpenAI-compatible endpoint.")
    judge_model: str = Field("judge", description="The model name the endpoint serves.")
    constrain: bool = Field(True, description="Ask the endpoint (vLLM) to decode only the score format.")
    group: bool = Field(False, description="Score each GRPO group in one call.")
    tools: list | None = Field(default_factory=lambda: ["submit"], description="The tools.")
    max_turns: int = Field(1, ge=1, description="One reply.")


class SupportJudgeEnv(ToolEnv):
    settings_model = SupportJudgeSettings
    task_generator = SupportTasks
    instructions = "You are a customer support agent. Call `submit` with your reply to the customer."

    def make_verifier(self) -> JudgeVerifier:
        s = self.settings
        return JudgeVerifier(
            base_url=s.judge_url,
            model=s.judge_model,
            rubric=RUBRIC,
            reference=True,
            constrain=s.constrain,
            group=s.group,
            request_timeout_s=60.0,
            retries=1,
            max_tokens=64,
        )

    def oracle(self, task: Task) -> AnswerOracle:
        return AnswerOracle(task, self.parser)


agentrl.register(
    "test/SupportJudge-v0",
    "tests.verifiers.judge_env:SupportJudgeEnv",
    max_turns=1,
    description="a judged reply",
)
