"""The demo over several warm starts: does its GRPO recipe gain from each of them?

    python benchmarks/demo_seeds.py                                  # seeds 0-3 pinned, seed 0 native
    python benchmarks/demo_seeds.py --starts 0,1,2,3,4,0:native --out runs/demo_seeds
    python benchmarks/demo_seeds.py --set optim.lr=5e-5 --out runs/seeds-lr5e-5   # a recipe variant

A warm start is a seed and the CPU kernel paths it was built with (`pinned`, the demo's default; or
`native`, each library's own choice for this CPU, as a box without the pins builds it: another kernel
path, another model). For each, `agentrl demo --seed S --numerics N` runs in `--out/<seed>-<numerics>`
(a finished stage is reused, so an interrupted sweep continues) and its `demo.json` is read: the warm
start's and the selected model's pass@1 and pass@k on the test split, the paired verdict. One JSON
document on stdout (and `--out/demo_seeds.json`), a plot in `--out/demo_seeds.png`.

`--collect` runs nothing and reads the runs already there (an interrupted sweep, or runs made by hand with
`agentrl demo --out DIR/<seed>-<numerics>`). `--reuse-warm-starts DIR` links `DIR/ws-<n><seed>` (n: p or n) in as a run's warm start when it exists
and was built by the same recipe (the warm start checks its own hash), to sweep recipes over one set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_starts(text: str) -> list[tuple[int, str]]:
    starts = []
    for item in text.split(","):
        seed, _, numerics = item.strip().partition(":")
        numerics = numerics or "pinned"
        if numerics not in ("pinned", "native"):
            raise SystemExit(f"--starts: {item!r}: the kernel paths are pinned or native (e.g. 0:native)")
        starts.append((int(seed), numerics))
    return starts


def run_one(out: Path, seed: int, numerics: str, args: argparse.Namespace) -> dict:
    run_dir = out / f"{seed}-{numerics}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.reuse_warm_starts:
        prebuilt = Path(args.reuse_warm_starts) / f"ws-{numerics[0]}{seed}"
        if prebuilt.is_dir() and not (run_dir / "warm-start").exists():
            (run_dir / "warm-start").symlink_to(prebuilt.resolve())
    cmd = [
        str(ROOT / ".venv" / "bin" / "agentrl") if (ROOT / ".venv" / "bin" / "agentrl").exists() else "agentrl",
        "demo", "--out", str(run_dir), "--seed", str(seed), "--numerics", numerics, "--nproc", str(args.nproc),
    ]  # fmt: skip
    if args.eval_tasks:
        cmd += ["--eval-tasks", str(args.eval_tasks)]
    for item in args.set or []:
        cmd += ["--set", item]
    t0 = time.time()
    if args.collect:  # read what an earlier sweep left; a run without demo.json reads as failed
        rc = 0 if (run_dir / "demo.json").is_file() else 1
    else:
        with (run_dir / "console.txt").open("w") as console:
            rc = subprocess.run(
                cmd, stdout=console, stderr=subprocess.STDOUT, env=os.environ.copy()
            ).returncode
    if rc != 0 or not (run_dir / "demo.json").is_file():
        said = [
            line
            for line in (
                (run_dir / "console.txt").read_text() if (run_dir / "console.txt").is_file() else ""
            ).splitlines()
            if line.startswith("error:")
        ]
        row = {
            "seed": seed,
            "numerics": numerics,
            "error": f"agentrl demo {'left no demo.json' if args.collect else f'exited {rc}'}; see {run_dir}/console.txt",
            "said": said[-1][:400] if said else None,
        }
        # A warm start that never learned to call the tool (its SFT missed the copying transition): the
        # warm start's own check stops it, or GRPO finds no group with a success to learn from. Not a
        # verdict on the recipe, but counted.
        row["warm_start_never_learned"] = bool(
            said and ("every episode failed" in said[-1] or "did not learn to copy" in said[-1])
        )
        return row
    demo = json.loads((run_dir / "demo.json").read_text())
    paired = demo["paired"]
    k = max(int(key.split("@")[1]) for key in demo["eval"]["before"] if key.startswith("pass@"))
    return {
        "seed": seed,
        "numerics": numerics,
        "dir": str(run_dir),
        "wall_s": None if args.collect else round(time.time() - t0, 1),
        "demo_total_s": demo.get("total_s"),
        "selected_step": demo["train"].get("selected_step"),
        "validation": demo["train"].get("validation"),
        "tasks": demo["eval"]["tasks"],
        "samples": demo["eval"]["samples_per_task"],
        "warm_start": demo["eval"]["before"],
        "trained": demo["eval"]["after"],
        "gain_points": round(100 * paired["difference"], 1),
        "ci_points": [round(100 * paired["ci_low"], 1), round(100 * paired["ci_high"], 1)],
        "p_value": paired["p_value"],
        "significant": bool(paired["significant"]),
        f"pass@{k}_gain_points": round(100 * (demo["eval"]["after"][f"pass@{k}"] - demo["eval"]["before"][f"pass@{k}"]), 1),
        "discordant": [paired["b_only"], paired["a_only"], paired["episodes"]],
        "verdict": demo.get("verdict", paired["verdict"]),
    }  # fmt: skip


def summarize(rows: list[dict]) -> dict:
    done = [r for r in rows if "error" not in r]
    gains = [r["gain_points"] for r in done]
    kgain = next(
        (key for key in (done[0] if done else {}) if key.endswith("_gain_points") and key != "gain_points"),
        None,
    )
    return {
        "warm_starts": len(rows),
        "finished": len(done),
        "warm_starts_that_never_learned": sum(bool(r.get("warm_start_never_learned")) for r in rows),
        "gain_mean_points": round(statistics.mean(gains), 1) if gains else None,
        "gain_min_points": min(gains) if gains else None,
        "gain_max_points": max(gains) if gains else None,
        "better": sum(g > 0 for g in gains),
        "significant_better": sum(r["significant"] and r["gain_points"] > 0 for r in done),
        "significant_worse": sum(r["significant"] and r["gain_points"] < 0 for r in done),
        "pass@k_gain_mean_points": round(statistics.mean(r[kgain] for r in done), 1) if kgain and done else None,
        "warm_start_pass@1": [r["warm_start"]["pass@1"] for r in done],
        "trained_pass@1": [r["trained"]["pass@1"] for r in done],
    }  # fmt: skip


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "error" not in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['seed']}-{r['numerics'][0]}" for r in done]
    for i, r in enumerate(done):
        ax1.plot([0, 1], [r["warm_start"]["pass@1"], r["trained"]["pass@1"]], marker="o", label=labels[i])
    ax1.set_xticks([0, 1], ["warm start", "GRPO (selected)"])
    ax1.set_ylabel("test pass@1")
    ax1.set_title("each warm start, before and after")
    ax1.legend(fontsize=7)
    gains = [r["gain_points"] for r in done]
    lows = [r["gain_points"] - r["ci_points"][0] for r in done]
    highs = [r["ci_points"][1] - r["gain_points"] for r in done]
    ax2.errorbar(range(len(done)), gains, yerr=[lows, highs], fmt="o", capsize=4)
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xticks(range(len(done)), labels)
    ax2.set_ylabel("pass@1 gain, points (95% CI)")
    ax2.set_title("paired verdict per warm start")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--starts", default="0,1,2,3,0:native", help="seed[:pinned|native], comma-separated")
    ap.add_argument("--out", default="runs/demo_seeds")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--eval-tasks", type=int, default=None, help="test tasks (default: the demo's)")
    ap.add_argument("--set", action="append", help="a GRPO config override for every run (repeatable)")
    ap.add_argument(
        "--reuse-warm-starts", default=None, help="a folder of prebuilt ws-<p|n><seed> warm starts"
    )
    ap.add_argument(
        "--collect",
        action="store_true",
        help="run nothing: read the runs already in --out/<seed>-<numerics> (from this sweep or made by hand)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed, numerics in parse_starts(args.starts):
        rows.append(run_one(out, seed, numerics, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": _machine(),
        "recipe_overrides": args.set or [],
        "runs": rows,
        "summary": summarize(rows),
    }
    (out / "demo_seeds.json").write_text(json.dumps(result, indent=2))
    if any("error" not in r for r in rows):
        plot(rows, out / "demo_seeds.png")
    print(json.dumps(result, indent=2))
    return 0 if all("error" not in r for r in rows) else 1


def _machine() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores, {model or 'unknown CPU'}"


if __name__ == "__main__":
    sys.exit(main())
