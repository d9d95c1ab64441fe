"""`agentrl/calc-v0`: arithmetic and word problems; the agent computes with the `python` tool, then submits.

Small enough for a tiny model to learn: the skill is to copy the right expression into a
python call and copy the printed number into `submit`. The reward is the numeric match,
gated on having called `python` (the task says to compute, not to guess).
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import Field

from agentrl.core.task import Task, split_rng_seed
from agentrl.core.types import Message, Split
from agentrl.env.agents import ScriptedOracle, first_number, last_tool_output
from agentrl.env.settings import ToolEnvSettings
from agentrl.env.tool_env import ToolEnv
from agentrl.verifiers import Verifier, get

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena"]

# (template, expression over a, b, c) — expressions are valid Python; the generator picks
# operands so results are non-negative integers.
WORD_PROBLEMS: list[tuple[str, str]] = [
    (
        "A farmer plants {a} rows of {b} apple trees. {c} trees die. How many trees are left?",
        "{a} * {b} - {c}",
    ),
    (
        "{name} buys {a} packs of {b} cards and gives away {c} cards. How many cards does {name} have now?",
        "{a} * {b} - {c}",
    ),
    (
        "A train travels {a} km per hour for {b} hours, then {c} km more. How many km does it travel in total?",
        "{a} * {b} + {c}",
    ),
    (
        "A school has {a} classes with {b} students each and {c} teachers. How many people are there in total?",
        "{a} * {b} + {c}",
    ),
    ("A shop had {c} apples and sold {a} bags of {b} apples. How many apples are left?", "{c} - {a} * {b}"),
    (
        "{name} saves {a} coins a week for {b} weeks and then spends {c}. How many coins are left?",
        "{a} * {b} - {c}",
    ),
    (
        "There are {a} boxes with {b} pens each. The pens are shared equally among {c} people. "
        "How many pens does each person get (whole pens)?",
        "({a} * {b}) // {c}",
    ),
]


class CalcTaskGenerator:
    """Task `index` of `split` is a pure function of (seed, split, index)."""

    def __init__(self, seed: int = 0, word_fraction: float = 0.5):
        self.seed = seed
        self.word_fraction = word_fraction

    def generate(self, index: int, split: Split = "train") -> Task:
        rng = random.Random(split_rng_seed(self.seed, split, index))
        if rng.random() < self.word_fraction:
            template, expr_t = rng.choice(WORD_PROBLEMS)
            a, b = rng.randint(2, 40), rng.randint(2, 60)
            c = (
                rng.randint(a * b + 1, a * b + 500)
                if expr_t.startswith("{c} -")
                else rng.randint(1, a * b - 1)
            )
            if "//" in expr_t:
                c = rng.randint(2, 9)
            expression = expr_t.format(a=a, b=b, c=c)
            question = template.format(a=a, b=b, c=c, name=rng.choice(NAMES))
            kind = "word"
        else:
            n_ops = rng.randint(1, 3)
            expression = str(rng.randint(2, 999))
            for _ in range(n_ops):
                op = rng.choice(["+", "-", "*"])
                operand = rng.randint(2, 99) if op == "*" else rng.randint(2, 999)
                expression = (
                    f"({expression}) {op} {operand}"
                    if op == "*" and n_ops > 1
                    else f"{expression} {op} {operand}"
                )
            question = f"What is {expression}?"
            kind = "arithmetic"
        answer = eval(expression, {"__builtins__": {}})  # our own generated arithmetic, never model text
        prompt = f"{question}\nUse the python tool to compute the answer, then submit just the number."
        return Task(
            id=f"calc/{split}/{index}",
            prompt=prompt,
            answer=str(answer),
            split=split,
            metadata={"kind": kind, "expression": expression},
        )


class CalcOracle(ScriptedOracle):
    """Compute the stored expression with python, submit what it printed."""

    def act(self, observation: list[Message]) -> str:
        out = last_tool_output(observation)
        if not out:
            return self.call("python", code=f"print({self.task.metadata['expression']})")
        return self.call("submit", answer=first_number(out))


class CalcSettings(ToolEnvSettings):
    """calc-v0's settings: ToolEnv's, with its own tools, verifier and turn limit, and `require_python`."""

    tools: list[Any] | None = Field(
        default_factory=lambda: ["python", "submit"],
        description="The tools the agent calls (@agentrl.tool functions or built-in names).",
    )
    verifier: Any = Field(
        None,
        description="How an episode is scored: a verifier's name, (name, kwargs) or a Verifier. None: the "
        "numeric match, gated on having called python when require_python.",
    )
    max_turns: int = Field(
        4,
        ge=1,
        description="Most assistant messages per episode: a python call and a submit, and two to spare.",
    )
    require_python: bool = Field(
        True,
        description="Score 0 unless python ran (the default verifier's tool-used gate): the task says to "
        "compute, not to guess.",
    )


class CalcEnv(ToolEnv):
    settings_model = CalcSettings
    task_generator = CalcTaskGenerator
    instructions = (
        "You are a careful assistant that solves math problems. Compute with the python tool, "
        "then call submit with only the final number."
    )

    def make_verifier(self) -> Verifier:
        if self.settings.verifier is not None:
            return super().make_verifier()
        gates = ["tool-used"] if self.settings.require_python else []
        return get("composite", parts=[("numeric", 1.0)], gates=gates)

    def oracle(self, task: Task) -> CalcOracle:
        return CalcOracle(task, self.parser)
