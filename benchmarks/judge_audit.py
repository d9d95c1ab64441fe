"""The judge attacks (`agentrl.checks.attacks_judge`) against a real judge model; prints one JSON object.

    python benchmarks/judge_audit.py --tasks 4 --out benchmarks/results/judge_audit.json

The judge is a checkpoint served by vLLM's OpenAI server on this machine (`agentrl.kit.judge_server`). With
no network the only model here is the tiny Qwen2-architecture one the kit builds (random weights): it is a
real model behind a real endpoint, and a useless judge. So the rates say what the mechanics do with a model
that does not follow instructions, not how a capable judge resists injection. Two modes are measured:

- `free`: the judge writes what it likes; a reply out of the score format is not judged (masked).
- `constrained`: vLLM decodes only the score format (`constrain=True`), so every reply is judged and the
  scores are whatever the model puts in them.

Per attack and mode: how many episodes were judged, how many exploited (the trick scored more than a plain
non-answer on the same task), the mean reward. The env is `tests/verifiers/judge_env.py`'s support env.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JUDGE_ATTACKS = [
    "judge-instruction",
    "judge-format-imitation",
    "judge-overlong",
    "judge-empty",
    "judge-rubric-echo",
]


def audit(url: str, tasks: int, constrain: bool) -> dict:
    from agentrl.checks.audit import run_audit
    from tests.verifiers.judge_env import SupportJudgeEnv

    env = SupportJudgeEnv(judge_url=url, constrain=constrain, backend="local", use_pool=False)
    try:
        t0 = time.perf_counter()
        report = run_audit(env, tasks=tasks, only=JUDGE_ATTACKS)
        seconds = time.perf_counter() - t0
    finally:
        env.close()
    rows = {}
    for name in JUDGE_ATTACKS:
        found = [f for f in report.findings if f.attack == name]
        judged = [
            f for f in found if "not judged: masked" not in f.evidence and "not judged" not in f.verdict
        ]
        rows[name] = {
            "episodes": len(found),
            "judged": len(judged),
            "exploited": sum(f.status == "exploited" for f in found),
            "errors": sum(f.status == "error" for f in found),
            "mean_reward": round(sum(f.reward or 0.0 for f in found) / max(len(found), 1), 4),
            "evidence": [f.evidence for f in found][:2],
        }
    controls = [
        {"task": c.task_id, "ok": c.ok, "oracle": c.reference_reward, "untouched": c.untouched_reward}
        for c in report.controls
    ]
    return {"constrain": constrain, "seconds": round(seconds, 1), "attacks": rows, "controls": controls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint to serve as the judge (default: the kit's tiny model)")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    from agentrl.kit.judge_server import serve_judge

    model = args.model
    if model is None:
        from agentrl.kit.tiny_model import init_tiny

        model = str(init_tiny(Path(os.environ.get("TMPDIR", "/tmp")) / "agentrl-judge-tiny", seed=0))
    t0 = time.perf_counter()
    with serve_judge(model) as url:
        start_s = time.perf_counter() - t0
        modes = [audit(url, args.tasks, constrain) for constrain in (False, True)]
    result = {
        "benchmark": "judge_audit",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores ({platform.processor() or 'cpu'})",
        "judge": f"{model} served by vLLM's OpenAI server (tiny random-weight Qwen2: the only model offline)",
        "tasks": args.tasks,
        "server_start_s": round(start_s, 1),
        "modes": modes,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
