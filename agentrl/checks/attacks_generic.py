"""The generic attacks of the audit's library, for any env by the tools and the verifier it has
(`submit-without-work`, `answer-hedging`, `answer-flood`, `state-rc-and-path`, `parallel-guesses`,
`nested-json`, `many-calls-per-step`): `agentrl.checks.attacks` registers them.
"""

from __future__ import annotations

import re
import time
from typing import Any

from agentrl.checks.attack_base import (
    NOT_ANSWER_DEPENDENT,
    Outcome,
    Play,
    needs,
    probe_answers,
    tool_names,
    verifier_names,
    verifier_parts,
)
from agentrl.checks.attack_common import _Base, _shell, _workdir, _write
from agentrl.core.task import Task
from agentrl.verifiers import (
    AutoVerifier,
    CompositeVerifier,
    ExactMatchVerifier,
    HiddenTestsVerifier,
    NumericVerifier,
    RegexVerifier,
    StateVerifier,
    ToolUsedVerifier,
)


class NestedJson(_Base):
    name = "nested-json"
    description = "A tool call whose arguments nest 1,000 levels deep (well under the size cap)."
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        return True if tool_names(env) else "the env has no tools"

    def play(self, env: Any, task: Task) -> Outcome:
        from agentrl.checks.attack_base import render_calls

        play = Play(env, task)
        tool = sorted(t for t in tool_names(env) if t != "submit")[:1] or ["submit"]
        text = render_calls(env, [(tool[0], {"x": "AGENTRL_NEST"})]).replace(
            '"AGENTRL_NEST"', "[" * 1000 + "]" * 1000
        )
        obs = play.send(text)  # an exception here is the finding (the audit records it)
        said = " ".join(str(m.get("content", ""))[:100] for m in obs)
        return Outcome(evidence=f"env.step answered: {said[:200]}", exploited=False)


class ManyCallsPerStep(_Base):
    name = "many-calls-per-step"
    description = (
        "24 tool calls in one message (each sleeps 0.2 s); a step must not run more "
        "than the env's max_tool_calls_per_step (8 when it declares none)."
    )

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        tool = "bash" if "bash" in tool_names(env) else "python"
        calls = [
            (
                tool,
                {"command": f"sleep 0.2; echo ran-{i}"}
                if tool == "bash"
                else {"code": f"import time; time.sleep(0.2); print('ran-{i}')"},
            )
            for i in range(24)
        ]
        t0 = time.perf_counter()
        outs = play.calls(calls)
        took = time.perf_counter() - t0
        ran = len(set(re.findall(r"\bran-(\d+)\b", "\n".join(outs))))
        limit = getattr(env, "max_tool_calls_per_step", None) or 8
        return Outcome(
            evidence=f"{ran} of 24 calls ran in one step ({took:.1f}s; limit {limit})", exploited=ran > limit
        )


class ParallelGuesses(_Base):
    name = "parallel-guesses"
    description = "The game: every number of the range guessed in one message."
    tools = ("guess",)
    any_tool = ()

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        low, high = int(task.metadata.get("low", 1)), int(task.metadata.get("high", 100))
        play.calls([("guess", {"number": n}) for n in range(low, high + 1)])
        if not play.done:
            play.calls([("guess", {"number": n}) for n in range(high, low - 1, -1)])
        out = play.outcome(f"{high - low + 1} guesses per message")
        won_fast = bool(out.passed) and play.turns <= 2
        return Outcome(
            out.reward,
            out.verdict,
            f"{out.evidence}; won in {play.turns} turn(s): {won_fast}",
            exploited=won_fast,
        )


class SubmitWithoutWork(_Base):
    name = "submit-without-work"
    description = "Submit at once ('done', or nothing for answer tasks): must score 0."
    tools = ("submit",)
    any_tool = ()

    def play(self, env: Any, task: Task) -> Outcome:
        play = Play(env, task)
        play.submit("" if task.answer is not None else "done")
        out = play.outcome("submitted without doing anything")
        return Outcome(
            out.reward, out.verdict, out.evidence, exploited=out.passed or bool(out.reward), passed=out.passed
        )


def _use_gated_tool(play: Play) -> None:
    """Pass a tool-used gate honestly (a real call), so that only the answer's format is tested."""
    for gate in getattr(play.env.verifier, "_gates", []) or []:
        tool = getattr(gate, "tool", None)
        if tool == "python":
            play.call("python", code="print(1)")
        elif tool == "bash":
            play.call("bash", command="echo 1")


def _wrong(answer: str) -> str:
    try:
        return str(int(float(answer)) + 7)
    except ValueError:
        return "x" + answer


# The built-in answer verifiers: by name as before (a name in the env's verifier means the env
# scores answers), and by type (one built under another name).
_ANSWER_VERIFIERS = {"exact-match", "numeric", "regex", "auto"}
_ANSWER_TYPES = (ExactMatchVerifier, NumericVerifier, RegexVerifier, AutoVerifier)
# Built-ins that never read the submitted answer (a composite only adds up its parts). By exact
# type: a subclass may override `verify`.
_ANSWER_BLIND = (HiddenTestsVerifier, StateVerifier, ToolUsedVerifier, CompositeVerifier)


def _unrelated(answer: str) -> str:
    """A wrong answer that shares nothing with the right one: `_wrong`'s 'xParis' still contains
    'Paris', which tells a lenient verifier from a strict one nothing."""
    key = answer.strip().casefold()
    return next((c for c in ("none", "0", "?", "-") if c not in key and key not in c), "none")


def _reads_answer(env: Any) -> bool | None:
    """True: a built-in answer verifier is part of the env's verifier. False: every part is a
    built-in that never reads the answer. None: a verifier this library does not know (a plugin's,
    the user's own), which `_AnswerAttack.play` then asks by probing (`agentrl.checks.attack_base.probe_answers`)."""
    parts = verifier_parts(env)
    if any(str(getattr(v, "name", "")) in _ANSWER_VERIFIERS or type(v) in _ANSWER_TYPES for v in parts):
        return True
    if parts and all(type(v) in _ANSWER_BLIND for v in parts):
        return False
    return None


def _takes_answer(env: Any) -> bool:
    """Whether the env's submit tool has an `answer` argument (what `Play.submit` sends)."""
    tool = (getattr(getattr(env, "toolbox", None), "tools", None) or {}).get("submit")
    parameters = getattr(tool, "parameters", None)
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties is None or "answer" in properties  # no schema to read: the episodes will tell


class _AnswerAttack(_Base):
    """An attack on how the verifier reads the submitted answer: it applies when the env's submit
    tool carries an answer and the verdict depends on that answer. The verifier is judged by what it
    does, not by its name: the built-ins are known, and for any other verifier the first episode of
    each task also scores its end state with the right answer, an unrelated one and an empty one; a
    verdict that does not move has no answer to attack, and the attack is not applicable with that
    as its evidence."""

    tools = ("submit",)
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        ok = needs(env, tools=("submit",))
        if ok is not True:
            return ok
        if not _takes_answer(env):
            return "the env's submit tool takes no answer"
        if _reads_answer(env) is False:
            return f"{NOT_ANSWER_DEPENDENT} ({', '.join(sorted(verifier_names(env)))} never read it)"
        return True

    def submissions(self, task: Task, answer: str) -> list[str]:  # pragma: no cover - subclasses
        raise NotImplementedError

    def judge(self, task: Task, answer: str, outcomes: list[Outcome]) -> Outcome:  # pragma: no cover
        raise NotImplementedError

    def play(self, env: Any, task: Task) -> Outcome:
        if task.answer is None:
            return Outcome(
                evidence="the task has no reference answer to build the attack from", applicable=False
            )
        # A built-in answer verifier reads the answer, except `auto` on a task it scores by state:
        # only those tasks and unknown verifiers need the probe.
        probe_first = not (_reads_answer(env) and task.check_command is None)
        outcomes: list[Outcome] = []
        for submission in self.submissions(task, task.answer):
            if not probe_first or outcomes:
                outcomes.append(self.episode(env, task, submission))
                continue
            # The empty submission too: a verifier that takes any non-empty answer reads it.
            with probe_answers(env, [task.answer, _unrelated(task.answer), ""]) as probe:
                outcomes.append(self.episode(env, task, submission))
            if probe is not None and probe.depends is False:
                return Outcome(evidence=probe.evidence, applicable=False)
        return self.judge(task, task.answer, outcomes)

    def episode(self, env: Any, task: Task, submission: str) -> Outcome:
        play = Play(env, task)
        _use_gated_tool(play)
        play.submit(submission)
        return play.outcome()


class AnswerHedging(_AnswerAttack):
    name = "answer-hedging"
    description = (
        "Two answers in one submission, the right one first and then last: a verifier must not take either."
    )

    def submissions(self, task: Task, answer: str) -> list[str]:
        wrong = _wrong(answer)
        return [f"{answer} or {wrong}", f"{wrong} or {answer}"]

    def judge(self, task: Task, answer: str, outcomes: list[Outcome]) -> Outcome:
        a, b = outcomes
        wrong = _wrong(answer)
        return Outcome(
            min(a.reward or 0, b.reward or 0),  # a hedge pays only if it scores in both orders
            f"{a.verdict} | {b.verdict}",
            f"'{answer} or {wrong}': {a.reward}; '{wrong} or {answer}': {b.reward}",
            exploited=a.passed and b.passed,
        )


class AnswerFlood(_AnswerAttack):
    name = "answer-flood"
    description = "A thousand candidate answers in one submission, the right one among them (not last)."

    @staticmethod
    def _candidates(answer: str) -> tuple[list[str], int]:
        candidates = [str(i) for i in range(-10, 990) if str(i) != answer.strip()]
        at = len(candidates) // 2
        candidates.insert(at, answer.strip())
        return candidates, at

    def submissions(self, task: Task, answer: str) -> list[str]:
        return [" ".join(self._candidates(answer)[0])]

    def judge(self, task: Task, answer: str, outcomes: list[Outcome]) -> Outcome:
        (out,) = outcomes
        candidates, at = self._candidates(answer)
        return Outcome(
            out.reward,
            out.verdict,
            f"{len(candidates)} candidates, the answer at position {at}",
            exploited=out.passed,
        )


class StateRcAndPath(_Base):
    name = "state-rc-and-path"
    description = (
        "State checks: a .sqliterc that prints the expected state, a fake sqlite3 first on PATH "
        "from .bashrc/.profile, without changing the database."
    )
    tools = ("bash", "submit")
    any_tool = ()

    def applies_to(self, env: Any) -> bool | str:
        ok = needs(env, tools=self.tools)
        if ok is not True:
            return ok
        return True if verifier_names(env) & {"state", "auto"} else "the env has no state verifier"

    def play(self, env: Any, task: Task) -> Outcome:
        if task.check_command is None or task.answer is None:
            return Outcome(evidence="this task is not checked by state", applicable=False)
        play = Play(env, task)
        ws = _workdir(play)
        lines = "\n".join(f".print {line}" for line in task.answer.splitlines())
        _write(play, f"{ws}/.sqliterc", f"{lines}\n.exit\n")
        fake = "#!/bin/sh\ncat <<'EOF'\n" + task.answer + "\nEOF\n"
        _write(play, f"{ws}/bin/sqlite3", fake)
        _write(play, f"{ws}/.bashrc", f"export PATH={ws}/bin:$PATH\n")
        _write(play, f"{ws}/.profile", f"export PATH={ws}/bin:$PATH\n")
        _shell(play, f"chmod +x {ws}/bin/sqlite3")
        return play.outcome("expected state printed by .sqliterc and a fake sqlite3 on PATH")
