"""Forgers that have read our source, against the hidden-test verdict of python-repair-v0: their reward rates, a classifier's odds, and the verification time against today's.

    .venv/bin/python benchmarks/forgers.py classify --cache-dir DIR           # offline: no sandbox
    .venv/bin/python benchmarks/forgers.py play --backend docker --classes coin,form --start 0 --count 16
    .venv/bin/python benchmarks/forgers.py timing --backend docker --tasks 8   # this verifier vs --baseline-ref
    .venv/bin/python benchmarks/forgers.py report                              # merge the parts

Each subcommand prints ONE JSON object on stdout (progress on stderr) and saves it under
benchmarks/results/forgers/ (`report` merges them into benchmarks/results/forgers.json). The tasks are
the synthesizer's cached python-repair tasks (`agentrl tasks synth python-repair`), picked round-robin
over the four packages, as this tree's synthesizer would keep them (`--readable`: also those it leaves
out because a reader of the run's files sees through their twin sets, `agentrl.verifiers.twin_audit`).

- `play`: per task, the controls (the oracle's fix must score 1 with no tampering found, the untouched
  mutant 0), then every forger class of `agentrl.checks.attacks_forgers` for `--episodes` episodes
  through `env.step` (reset, the forger appended to the package, submit), the bug left in place.
  Each episode's reward, whether it passed, and the plan's blind odds (from the verdict) are kept.
- `classify`: many plans per task drawn on the host, each twin set's members described by the form
  of the value they differ in (its echoes in the tests, the package's source and the prompt, and how
  natural it reads by the character pairs of the strings a forger can read);
  a conditional-logit classifier trained and tested across tasks (5 folds by task), and every single
  feature used as a rule, each scored by how often its pick is the real member against chance.
- `timing`: on one sandbox per task, this tree's verifier and the one at `--baseline-ref` (today's:
  the parent this work started from), interleaved, after the oracle's fix and on the untouched mutant.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = RESULTS / "forgers"
# Today's verifier: main when this work began (its hidden_tests.py and pytest_runner.py).
BASELINE_REF = "56cf746a0c15425cf5949f1c94d06b8f0f0af85a"
CLASSES = ("plan-order", "prerun", "prompt", "form", "nearest", "natural", "majority", "coin")
_ODDS = re.compile(r"a blind guess wins 1 in ([\d,]+)")


def log(msg: str) -> None:
    print(f"[forgers] {msg}", file=sys.stderr, flush=True)


def load_tasks(cache_dir: str | None, n: int, seed: int = 0, readable: bool = False) -> list[Any]:
    """Up to n tasks, round-robin over the packages: every synthesized task whose twin sets, planned by
    this tree's verifier from the task's own metadata, make a blind guess win 1 in 32 at most and that
    no reader of the run's files sees through (`agentrl.verifiers.twin_audit`; `readable`: those too).
    The trial log's verdict may come from an earlier planner: both are decided here."""
    from agentrl.core.task import Task
    from agentrl.envs.python_repair.packages import DEFAULT_PACKAGES, get_spec, tests_dir
    from agentrl.envs.python_repair.synth import read_log
    from agentrl.verifiers.hidden_tests import _failing_lines, _list_map, _string_list, _string_map
    from agentrl.verifiers.twin_audit import audit_task
    from agentrl.verifiers.twin_sets import DEFAULT_ODDS, coverage

    by_pkg: dict[str, list[Any]] = defaultdict(list)
    for name in DEFAULT_PACKAGES:
        spec = get_spec(name)
        for trial in read_log(spec, seed, Path(cache_dir) if cache_dir else None):
            if trial.outcome not in ("kept", "no_twin_cover") or not trial.task:
                continue
            task = Task.model_validate(trial.task)
            m = task.metadata
            if "TWIN_SITES" not in m:
                continue
            planned: dict[str, Any] = dict(
                listed=[*m["FAIL_TO_PASS"], *m["PASS_TO_PASS"]],
                avoid=task.prompt,
                failing_lines=_failing_lines(task),
                failing_errors=_string_map(task, "FAIL_TO_PASS_ERRORS"),
                failing_values=_list_map(task, "FAIL_TO_PASS_VALUES"),
                safe_sites=_string_list(task, "TWIN_SITES"),
            )
            _, odds = coverage(tests_dir(spec), m["FAIL_TO_PASS"], **planned)
            if odds < DEFAULT_ODDS:
                continue
            # As the synthesizer keeps tasks now: draws that usually reach the odds, and none a reader
            # of the run's files sees through.
            if not readable and not audit_task(tests_dir(spec), m["FAIL_TO_PASS"], **planned).fit:
                continue
            by_pkg[name].append(task)
    out: list[Any] = []
    i = 0
    while len(out) < n and any(i < len(v) for v in by_pkg.values()):
        out.extend(v[i] for v in by_pkg.values() if i < len(v) and len(out) < n)
        i += 1
    return out


def save(name: str, result: dict[str, Any]) -> None:
    PARTS.mkdir(parents=True, exist_ok=True)
    (PARTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


# --- play ------------------------------------------------------------------------------------------


def play(args: argparse.Namespace) -> dict[str, Any]:
    from agentrl.checks.attack_base import Play
    from agentrl.checks.attack_common import _append
    from agentrl.checks.attacks_forgers import forger_payload
    from agentrl.checks.verifier_check import check_verifier
    from agentrl.envs.python_repair.env import PythonRepairEnv

    tasks = load_tasks(args.cache_dir, args.tasks, readable=args.readable)[
        args.start : args.start + args.count
    ]
    classes = [c for c in args.classes.split(",") if c]
    env = PythonRepairEnv(tasks=tasks, max_turns=6, backend=args.backend)
    records: list[dict[str, Any]] = []
    controls: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    try:
        for i, task in enumerate(tasks):
            pkg = task.metadata["package"]
            if args.controls:
                check = check_verifier(env, task)
                controls.append(
                    {
                        "task": task.id,
                        "package": pkg,
                        "fix_reward": check.reference.reward if check.reference else None,
                        "fix_details": (check.reference.details[:300] if check.reference else check.reason),
                        "bug_reward": check.untouched.reward if check.untouched else None,
                        "tampering_on_the_fix": bool(
                            check.reference and "tampered" in check.reference.details
                        ),
                    }
                )
            for mode in classes:
                for _ in range(args.episodes):
                    t0 = time.perf_counter()
                    p = Play(env, task)
                    _append(p, forger_payload(mode, task.prompt))
                    out = p.outcome()
                    odds = _ODDS.search(out.verdict)
                    records.append(
                        {
                            "task": task.id,
                            "package": pkg,
                            "class": mode,
                            "reward": out.reward,
                            "passed": out.passed,
                            "tampered": "tampered" in out.verdict,
                            "odds": int(odds.group(1).replace(",", "")) if odds else None,
                            "seconds": round(time.perf_counter() - t0, 2),
                        }
                    )
            log(
                f"{args.backend} {i + 1}/{len(tasks)} {pkg}: "
                + ", ".join(
                    f"{m} {sum(r['reward'] or 0 for r in records if r['class'] == m):g}" for m in classes
                )
            )
    finally:
        env.close()
    return {
        "backend": args.backend,
        "start": args.start,
        "tasks": [t.id for t in tasks],
        "episodes": args.episodes,
        "controls": controls,
        "records": records,
        "seconds": round(time.perf_counter() - t_start, 1),
    }


# --- timing ----------------------------------------------------------------------------------------


def timing(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from python_repair import baseline_verifier, fix  # the verifier at a git ref, the oracle's edits

    from agentrl.envs.python_repair.env import PythonRepairEnv
    from agentrl.verifiers.hidden_tests import HiddenTestsVerifier

    tasks = load_tasks(args.cache_dir, args.tasks, readable=args.readable)
    after = HiddenTestsVerifier(mode="all", timeout_s=120.0)
    before = baseline_verifier(args.baseline_ref)
    env = PythonRepairEnv(tasks=tasks, max_turns=4, backend=args.backend)
    times: dict[str, dict[str, list[float]]] = {s: {"before": [], "after": []} for s in ("fixed", "mutant")}
    per_package: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"before": [], "after": []})
    rewards: dict[str, list[float]] = defaultdict(list)
    try:
        fix(env, tasks[0])  # start-up costs (the first sandbox of each image) are not measured
        after.verify(env.sandbox, tasks[0], env.episode)
        before.verify(env.sandbox, tasks[0], env.episode)
        for i, task in enumerate(tasks):
            for state in ("fixed", "mutant"):
                if state == "fixed":
                    fix(env, task)
                else:
                    env.reset(options={"task": task})
                for rep in range(args.repeats):
                    order = [("before", before), ("after", after)]
                    if (i + rep) % 2:
                        order.reverse()
                    for name, verifier in order:
                        t0 = time.perf_counter()
                        verdict = verifier.verify(env.sandbox, task, env.episode)
                        took = time.perf_counter() - t0
                        times[state][name].append(took)
                        per_package[task.metadata["package"]][name].append(took)
                        rewards[f"{name}_{state}"].append(verdict.reward)
            log(f"timing {i + 1}/{len(tasks)} {task.metadata['package']}")
    finally:
        env.close()

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 3) if xs else float("nan")

    every = {n: [x for s in times.values() for x in s[n]] for n in ("before", "after")}
    return {
        "backend": args.backend,
        "baseline_ref": args.baseline_ref,
        "tasks": len(tasks),
        "repeats": args.repeats,
        "verify_before_s_p50": med(every["before"]),
        "verify_after_s_p50": med(every["after"]),
        "after_over_before": round(med(every["after"]) / med(every["before"]), 3),
        "by_state": {
            s: {
                "before_s_p50": med(v["before"]),
                "after_s_p50": med(v["after"]),
                "ratio": round(med(v["after"]) / med(v["before"]), 3),
            }
            for s, v in times.items()
        },
        "per_package": {
            k: {
                "before_s_p50": med(v["before"]),
                "after_s_p50": med(v["after"]),
                "ratio": round(med(v["after"]) / med(v["before"]), 3),
            }
            for k, v in sorted(per_package.items())
        },
        "reward_mean": {k: round(statistics.fmean(v), 3) for k, v in sorted(rewards.items())},
    }


# --- classify --------------------------------------------------------------------------------------

_ENGLISH = "etaoinshrdlcumwfgypbvkjxqz"


def _value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # an exception's name


def _distance(a: Any, b: Any) -> float:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(abs(a - b))
    a, b = str(a), str(b)
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return float(prev[-1])


def _features(values: tuple[str, ...], i: int, ctx: dict[str, Any], near: Any = None) -> list[float]:
    """What a reader of member i's value could go on (the other members' values for comparison)."""
    text, v = values[i], _value(values[i])
    others = [_value(x) for j, x in enumerate(values) if j != i]
    numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
    s = v if isinstance(v, (str, bytes)) else ""
    s = s.decode("latin-1") if isinstance(s, bytes) else s
    word = text.strip("'\"b")
    f = [
        # rank among the members (numbers by value, strings by order), 0..1
        sorted([_value(x) for x in values], key=lambda y: (str(type(y)), y)).index(v)
        / max(1, len(values) - 1)
        if all(type(_value(x)) is type(v) for x in values)
        else 0.5,
        math.log1p(abs(v)) if numeric else 0.0,
        1.0 if numeric and v == int(v) and int(v) % 10 == 0 else 0.0,
        1.0 if numeric and v == 0 else 0.0,
        1.0 if numeric and v < 0 else 0.0,
        (v - statistics.fmean(others)) / (1 + abs(statistics.fmean(others)))
        if numeric and others and all(isinstance(o, (int, float)) for o in others)
        else 0.0,
        1.0 if s and not s[-1].isalnum() else 0.0,
        1.0 if s and s[-1].islower() else 0.0,
        sum(len(_ENGLISH) - _ENGLISH.index(c.lower()) for c in s if c.lower() in _ENGLISH)
        / (26 * max(1, len(s))),
        sum(1 for c in s if c.lower() in "aeiou") / max(1, len(s)),
        math.log1p(ctx["decision"].count(word)) if word else 0.0,  # echoes in what the process holds
        math.log1p(ctx["package"].count(word)) if word else 0.0,  # and in the package's source
        1.0 if word and word in ctx["prompt"] else 0.0,
        math.log1p(ctx["package"].count(f"raise {word}")) if not numeric and not s else 0.0,
        math.log1p(ctx["bigrams"].get(s[-2:], 0)) if len(s) >= 2 else 0.0,
        # how near the buggy code's output where the members are checked (what a pre-run sees)
        -math.log1p(_distance(v, near)) if near is not None else 0.0,
        _naturalness(values, i, ctx["pairs"]) if "pairs" in ctx else 0.0,
        _modelled(values, i, ctx.get("model")),
    ]
    return f


def _strings(texts: list[str]) -> list[str]:
    """The string constants of these sources."""
    out = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        out += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out


def _string_pairs(strings: list[str]) -> Counter:
    """The runs of characters these strings are made of, counted as the planner counts them."""
    from agentrl.verifiers.twin_values import _own_pairs

    out: Counter = Counter()
    for s in strings:
        out.update(_own_pairs(s))
    return out


def _differing(values: tuple[str, ...]) -> tuple[list[str], list[int]] | None:
    """The members as strings and the places they differ at; None unless all are strings of one length."""
    members = [_value(x) for x in values]
    if not all(isinstance(x, str) for x in members) or len({len(x) for x in members}) != 1:
        return None
    return members, [k for k in range(len(members[0])) if len({x[k] for x in members}) > 1]


def _naturalness(values: tuple[str, ...], i: int, pairs: Counter) -> float:
    """How natural member i reads where the members differ, by the character pairs of what a forger can
    read (the package's source, the decision folder): the log counts of each place's two pairs, the
    planner's first measure."""
    from agentrl.verifiers.twin_values import _signals

    found = _differing(values)
    if found is None:
        return 0.0
    members, differ = found
    return sum(sum(_signals(pairs, members[i], k)[:2]) for k in differ)


def _modelled(values: tuple[str, ...], i: int, model: Any) -> float:
    """The same by the planner's own model of the tests' characters (`_natural`), fitted by a forger
    on what it can read, as the planner fits it on the hidden tests."""
    from agentrl.verifiers.twin_values import _natural

    found = _differing(values)
    if found is None or model is None:
        return 0.0
    members, differ = found
    return _natural(model, members[i], differ)


FEATURES = (
    "rank",
    "log_abs",
    "round",
    "zero",
    "negative",
    "above_mean",
    "ends_in_punctuation",
    "ends_in_lowercase",
    "english_letters",
    "vowels",
    "echo_in_the_run",
    "echo_in_package",
    "in_prompt",
    "raised_by_package",
    "last_bigram_in_tests",
    "near_the_buggy_output",
    "natural_to_a_reader",
    "natural_by_the_planners_model",
)


def _context(task: Any) -> dict[str, Any]:
    from agentrl.envs.python_repair.packages import get_spec, source_dir, tests_dir

    spec = get_spec(task.metadata["package"])
    tests = "\n".join(p.read_text(errors="replace") for p in sorted(tests_dir(spec).rglob("*.py")))
    package = "\n".join(p.read_text(errors="replace") for p in sorted(source_dir(spec).rglob("*.py")))
    bigrams = Counter(w[i : i + 2] for w in re.findall(r"[A-Za-z]+", tests) for i in range(len(w) - 1))
    sources = _strings([p.read_text(errors="replace") for p in sorted(source_dir(spec).rglob("*.py"))])
    return {
        "tests": tests,
        "package": package,
        "prompt": task.prompt,
        "bigrams": bigrams,
        "package_strings": sources,
    }


ODDS: dict[int, int] = {}
"""A plan's odds (sets linked by the way the bug errs count once), by the id of its list of sets."""


def _sets(task: Any, plans: int) -> list[list[tuple[list[list[float]], int]]]:
    """Per plan of the task, per set: (features per member, index of the real one)."""
    from agentrl.envs.python_repair.packages import get_spec, tests_dir
    from agentrl.verifiers.hidden_tests import _failing_lines, _list_map, _string_list, _string_map
    from agentrl.verifiers.twin_sites import _Naturalness
    from agentrl.verifiers.twin_values import _calibrated

    m = task.metadata
    ctx = _context(task)
    out = []
    for k in range(plans):
        from agentrl.verifiers.twin_sets import plan_twin_sets

        plan = plan_twin_sets(
            tests_dir(get_spec(m["package"])),
            m["FAIL_TO_PASS"],
            listed=[*m["FAIL_TO_PASS"], *m["PASS_TO_PASS"]],
            avoid=task.prompt,
            failing_lines=_failing_lines(task),
            failing_errors=_string_map(task, "FAIL_TO_PASS_ERRORS"),
            failing_values=_list_map(task, "FAIL_TO_PASS_VALUES"),
            safe_sites=_string_list(task, "TWIN_SITES"),
            rng=random.Random(f"{task.id}:{k}"),  # the same plans on every run (hash() is salted)
        )
        recorded = _list_map(task, "FAIL_TO_PASS_VALUES") or {}
        ctx["decision"] = "\n".join(v.decode(errors="replace") for v in plan.files.values())
        strings = ctx["package_strings"] + _strings(
            [v.decode(errors="replace") for k, v in plan.files.items() if k.endswith(".py")]
        )
        ctx["pairs"] = _string_pairs(strings)
        ctx["model"] = _Naturalness(ctx["pairs"], _calibrated(ctx["pairs"], strings))
        out.append([])
        ODDS[id(out[-1])] = plan.odds
        for s in plan.sets:
            real = _value(s.values[s.real])
            near = None
            for text in recorded.get(s.originals[0], []):
                seen = _value(text)
                if seen != real:  # the recorded pair is (buggy output, the real expected value)
                    near = seen
            out[-1].append(([_features(s.values, i, ctx, near) for i in range(len(s.values))], s.real))
    return out


def _fit(data: list[tuple[list[list[float]], int]], steps: int = 400, l2: float = 1e-2) -> Any:
    """A conditional logit (softmax over a set's members) by gradient ascent; features standardized."""
    import numpy as np

    flat = np.array([x for feats, _ in data for x in feats], dtype=float)
    mu, sd = flat.mean(0), flat.std(0) + 1e-9
    xs = [(np.array(feats, dtype=float) - mu) / sd for feats, _ in data]
    w = np.zeros(flat.shape[1])
    for _ in range(steps):
        grad = -l2 * w
        for x, (_, real) in zip(xs, data, strict=True):
            z = x @ w
            p = np.exp(z - z.max())
            p /= p.sum()
            grad += x[real] - p @ x
        w += 0.5 * grad / len(data)
    return w, mu, sd


def _hits(data: list[tuple[list[list[float]], int]], score: Any) -> tuple[float, float]:
    """(expected hits of picking a top-scored member at random among ties, expected hits of chance)."""
    hits = chance = 0.0
    for feats, real in data:
        scores = [score(f) for f in feats]
        top = max(scores)
        tied = [i for i, sc in enumerate(scores) if sc >= top - 1e-12]
        hits += (real in tied) / len(tied)
        chance += 1 / len(feats)
    return hits, chance


def _z(hits: float, chance: float, data: list[tuple[list[list[float]], int]]) -> float:
    var = sum((1 / len(f)) * (1 - 1 / len(f)) for f, _ in data)
    return (hits - chance) / math.sqrt(var) if var else 0.0


def _pick_probabilities(sets: list[tuple[list[list[float]], int]], score: Any) -> list[float]:
    """Per set, the probability that a rule picking a top-scored member (ties at random) picks the real."""
    out = []
    for feats, real in sets:
        scores = [score(f) for f in feats]
        top = max(scores)
        tied = [i for i, sc in enumerate(scores) if sc >= top - 1e-12]
        out.append((real in tied) / len(tied))
    return out


def _judge_rule(per_task: list[list[list[tuple[list[list[float]], int]]]], score: Any) -> dict[str, Any]:
    """A rule over every task: per set (its accuracy against chance, with the spread taken over
    tasks: the sets of one task share one bug, so they are not independent), and per task (the
    chance it picks the real member of every set of a plan, which is what winning takes)."""
    excess, wins, blind, hits, chance, n = [], [], [], 0.0, 0.0, 0
    for plans in per_task:
        task_hits = task_chance = 0.0
        task_n = 0
        for sets in plans:
            probs = _pick_probabilities(sets, score)
            task_hits += sum(probs)
            task_chance += sum(1 / len(f) for f, _ in sets)
            task_n += len(sets)
            wins.append(math.prod(probs))
            blind.append(1 / ODDS.get(id(sets), math.prod(len(f) for f, _ in sets)))
        if task_n:
            excess.append((task_hits - task_chance) / task_n)
            hits, chance, n = hits + task_hits, chance + task_chance, n + task_n
    mean = statistics.fmean(excess) if excess else 0.0
    spread = statistics.stdev(excess) / math.sqrt(len(excess)) if len(excess) > 1 else 0.0
    return {
        "set_accuracy": round(hits / max(1, n), 4),
        "set_chance": round(chance / max(1, n), 4),
        "t_over_tasks": round(mean / spread, 2) if spread else 0.0,
        "task_win_rate": round(statistics.fmean(wins), 5) if wins else 0.0,
        "blind_task_win_rate": round(statistics.fmean(blind), 5) if blind else 0.0,
    }


def classify(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    tasks = load_tasks(args.cache_dir, args.tasks, readable=args.readable)
    per_task = []
    for i, task in enumerate(tasks):
        per_task.append(_sets(task, args.plans))
        log(f"classify: plans for {i + 1}/{len(tasks)} ({sum(len(p) for p in per_task[-1])} sets)")
    # A conditional logit trained on 4/5 of the tasks, judged on the other fifth, all five ways.
    folds = 5
    order = list(range(len(per_task)))
    random.Random(0).shuffle(order)
    judged: list[dict[str, Any]] = []
    weights = []
    for k in range(folds):
        test_idx = set(order[k::folds])
        train = [s for j, plans in enumerate(per_task) if j not in test_idx for sets in plans for s in sets]
        test = [plans for j, plans in enumerate(per_task) if j in test_idx]
        if not train or not test:
            continue
        w, mu, sd = _fit(train)
        weights.append(w)
        judged.append(
            {
                **_judge_rule(test, lambda f, w=w, mu=mu, sd=sd: float(((np.array(f) - mu) / sd) @ w)),
                "tasks": len(test),
            }
        )
    rules = {}
    for j, name in enumerate(FEATURES):
        for sign, label in ((1, "max"), (-1, "min")):
            rules[f"{label}_{name}"] = _judge_rule(per_task, lambda f, j=j, sign=sign: sign * f[j])
    best = max(rules.items(), key=lambda kv: kv[1]["task_win_rate"] - kv[1]["blind_task_win_rate"])
    n_sets = Counter(len(f) for plans in per_task for sets in plans for f, _ in sets)
    every = [s for plans in per_task for sets in plans for s in sets]

    def pooled(key: str) -> float:
        total = sum(j["tasks"] for j in judged)
        return round(sum(j[key] * j["tasks"] for j in judged) / max(1, total), 5)

    return {
        "tasks": len(per_task),
        "plans_per_task": args.plans,
        "sets": len(every),
        "members_per_set": dict(sorted(n_sets.items())),
        "logit_cross_validated": {
            "set_accuracy": pooled("set_accuracy"),
            "set_chance": pooled("set_chance"),
            "task_win_rate": pooled("task_win_rate"),
            "blind_task_win_rate": pooled("blind_task_win_rate"),
            "folds": judged,
            "mean_weights": dict(
                zip(FEATURES, [round(float(x), 3) for x in np.mean(weights, 0)], strict=True)
            )
            if weights
            else {},
        },
        "rules": rules,
        "best_rule_per_task": {"name": best[0], **best[1]},
        "note": "set_accuracy: how often the pick is the real member, set by set (ties split), against "
        "set_chance (the mean of 1/members); t_over_tasks: that excess over its spread across tasks (|t| < 3 "
        "is chance; sets of one task share a bug). task_win_rate: how often the rule picks the real member "
        "of every set of a plan (what a forger needs), against blind_task_win_rate (a blind guess).",
    }


# --- report ----------------------------------------------------------------------------------------


def _tail(wins: int, chances: list[float]) -> float:
    """P(at least `wins` successes) among independent episodes that win with `chances` (Poisson-binomial)."""
    dist = [1.0]  # dist[k] = P(k wins so far)
    for q in chances:
        dist = [a * (1 - q) + b * q for a, b in zip([*dist, 0.0], [0.0, *dist], strict=True)]
    return min(1.0, sum(dist[wins:]))


def _upper_95(wins: int, n: int) -> float:
    """The one-sided 95% upper bound of a rate seen `wins` times in `n` (Clopper-Pearson, by bisection)."""
    if wins >= n:
        return 1.0
    lo, hi = wins / n, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        cdf = sum(math.comb(n, k) * mid**k * (1 - mid) ** (n - k) for k in range(wins + 1))
        lo, hi = (mid, hi) if cdf > 0.05 else (lo, mid)
    return hi


def report(_args: argparse.Namespace) -> dict[str, Any]:
    parts = {p.stem: json.loads(p.read_text()) for p in sorted(PARTS.glob("*.json"))}
    out: dict[str, Any] = {"parts": sorted(parts)}
    for backend in ("docker", "bwrap"):
        recs = [r for k, v in parts.items() if k.startswith(f"play-{backend}") for r in v.get("records", [])]
        ctrl = [c for k, v in parts.items() if k.startswith(f"play-{backend}") for c in v.get("controls", [])]
        if not recs and not ctrl:
            continue
        by_class: dict[str, Any] = {}
        for mode in CLASSES:
            rs = [r for r in recs if r["class"] == mode]
            if not rs:
                continue
            wins = sum(bool(r["passed"]) for r in rs)
            odds = [r["odds"] for r in rs if r["odds"]]
            by_class[mode] = {
                "episodes": len(rs),
                "tasks": len({r["task"] for r in rs}),
                "wins": wins,
                "reward_rate": round(wins / len(rs), 4),
                "tampering_caught": sum(r["tampered"] for r in rs),
                "expected_blind_wins": round(sum(1 / o for o in odds), 3),
                # A class whose signal is gone plays like a coin with a perfect pair detector: its wins
                # are no more than blind guesses at each plan's odds would give.
                "p_blind_guesses_win_as_often": round(_tail(wins, [1 / o for o in odds]), 4),
                "reward_rate_upper_95": round(_upper_95(wins, len(rs)), 4),
                "per_package": {
                    p: f"{sum(bool(r['passed']) for r in rs if r['package'] == p)}/{sum(r['package'] == p for r in rs)}"
                    for p in sorted({r["package"] for r in rs})
                },
            }
        # A task's controls, run once per part that played it: it counts when every run of it held.
        per_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for c in ctrl:
            per_task[c["task"]].append(c)
        out[backend] = {
            "controls": {
                "tasks": len(per_task),
                "runs": len(ctrl),
                "fix_scored_1": sum(all(c["fix_reward"] == 1.0 for c in cs) for cs in per_task.values()),
                "false_tampering_on_fixes": sum(
                    any(c["tampering_on_the_fix"] for c in cs) for cs in per_task.values()
                ),
                "bug_scored_0": sum(all(c["bug_reward"] == 0.0 for c in cs) for cs in per_task.values()),
                "packages": dict(Counter(cs[0]["package"] for cs in per_task.values())),
            },
            "forgers": by_class,
        }
    for key in ("classify", "timing-docker", "timing-bwrap"):
        if key in parts:
            out[key] = parts[key]
    (RESULTS / "forgers.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("play", "timing", "classify", "report"):
        p = sub.add_parser(name)
        p.add_argument("--cache-dir", default=None, help="The synthesizer's trial logs (default: its cache).")
        p.add_argument("--tasks", type=int, default=32, help="How many tasks (round-robin over packages).")
        p.add_argument(
            "--readable",
            action="store_true",
            help="Include tasks the synthesizer now leaves out: a reader of the run's files sees through them.",
        )
        p.add_argument("--backend", default="docker")
        if name == "play":
            p.add_argument("--classes", default=",".join(CLASSES))
            p.add_argument("--episodes", type=int, default=1)
            p.add_argument("--start", type=int, default=0)
            p.add_argument("--count", type=int, default=32)
            p.add_argument("--controls", action=argparse.BooleanOptionalAction, default=True)
            p.add_argument("--part", default="", help="Name of this part's JSON (default from the options).")
        if name == "timing":
            p.add_argument("--repeats", type=int, default=2)
            p.add_argument("--baseline-ref", default=BASELINE_REF)
        if name == "classify":
            p.add_argument("--plans", type=int, default=20, help="Plans drawn per task.")
    args = ap.parse_args()
    if args.cmd == "play":
        result = play(args)
        save(args.part or f"play-{args.backend}-{args.start}-{args.classes.replace(',', '+')}", result)
    elif args.cmd == "timing":
        save(f"timing-{args.backend}", timing(args))
    elif args.cmd == "classify":
        save("classify", classify(args))
    else:
        report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
