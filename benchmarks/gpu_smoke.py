"""The first thing to run on a GPU machine: every GPU check of the project in one call, one JSON out.

    make gpu-smoke                                           # on the GPU machine (../shared/gpu/README.md)
    PYTHONPATH=/tmp/site python3 -P benchmarks/gpu_smoke.py --out $OUT/gpu_smoke.json
    .venv/bin/python benchmarks/gpu_smoke.py --tiny          # CPU: the same steps and JSON, tiny (CI runs it)

Three steps, each in its own process, each bounded by a timeout, the JSON rewritten after each one (a
run cut short still leaves what it measured):

1. `gpu_tests`: `pytest -m gpu` over the test modules that hold gpu tests (`-m "gpu and not vllm"` where
   vLLM is not installed: the tests that need vLLM's CUDA build are then listed as not run), every test's
   outcome and duration. On a CPU every test skips.
2. `train_gpu`: `benchmarks/train_gpu.py` (its whole JSON is kept): throughput, MFU and peak memory of
   the GRPO step against a plain PyTorch loop, Qwen2.5-0.5B and -1.5B shapes (`--tiny`: the tiny model),
   on an agentic batch and on a GRPO-shaped one (groups sharing a 1,000-token prompt).
3. `agentrl_train`: a short `agentrl train` on the tiny model (built here) and the coin environment of
   the tests (no sandbox), the vLLM engine colocated with the trainer: it sleeps through each update and
   takes the weights by CUDA IPC. Its per-step times from metrics.jsonl, and the GPU's peak memory
   (`nvidia-smi`, polled). Needs vLLM; without it the step says so and its numbers stay null.

`numbers` holds every number this run produced under a stable name (null when it was not measured), and
`gpu_numbers` names, with a line each, what a run on a GPU produces: the same names, shapes 0.5B and 1.5B.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GPU_SHAPES = ("0.5B", "1.5B")
TINY_SHAPES = ("tiny",)

# Every number, its name in `numbers`, and what it is. `{shape}` stands for each train_gpu shape.
NUMBERS: dict[str, str] = {
    "gpu_tests/passed": "gpu-marked tests that passed",
    "gpu_tests/failed": "gpu-marked tests that failed (or errored)",
    "gpu_tests/skipped": "gpu-marked tests that skipped (no GPU, or one GPU for a two-GPU test)",
    "gpu_tests/not_run_without_vllm": "gpu-marked tests left out because vLLM is not installed",
    "train_gpu/{shape}/ours/tokens_per_s": "GRPO step throughput at the defaults (real tokens per second)",
    "train_gpu/{shape}/ours/mfu": "model FLOPs utilisation of that step (null without a known peak: CPU)",
    "train_gpu/{shape}/ours/peak_memory_gib": "peak memory of that step",
    "train_gpu/{shape}/plain/tokens_per_s": "a plain PyTorch loop on the same batch",
    "train_gpu/{shape}/speedup_vs_plain": "ours / plain tokens per second",
    "train_gpu/{shape}/activation_checkpointing_memory_cut": "peak memory saved by activation checkpointing",
    "train_gpu/{shape}/long_fits": "8,192-token trajectories at the defaults ran without running out of memory",
    "train_gpu/{shape}/ours_compile_off/tokens_per_s": "ours with eager decoder layers (null where the "
    "defaults do not compile them: CPU)",
    "train_gpu/{shape}/grpo/ours/tokens_per_s": "GRPO-shaped batch (groups of 8 sharing a 1,000-token prompt): "
    "trained tokens per second at the defaults, every episode counted whole",
    "train_gpu/{shape}/grpo/ours/computed_tokens_per_s": "the positions the model ran per second (a shared "
    "prompt once)",
    "train_gpu/{shape}/grpo/ours/mfu": "MFU of that step, over the FLOPs it computed",
    "train_gpu/{shape}/grpo/trained_speedup_vs_plain": "ours / plain trained tokens per second on that batch",
    "train_gpu/{shape}/grpo/speedup_from_sharing": "ours / ours with share_prefix off on that batch",
    "agentrl_train/steps": "training steps that finished",
    "agentrl_train/wall_s": "the whole `agentrl train`, start-up included",
    "agentrl_train/step_s_median": "median step (rollout + update + push)",
    "agentrl_train/wait_for_batch_s_median": "median rollout time of a step",
    "agentrl_train/train_s_median": "median update time of a step",
    "agentrl_train/weight_sync_s_median": "median wake + push + wake of a step (CUDA IPC on a GPU)",
    "agentrl_train/policy_version": "the engine's weight version at the end (one per step)",
    "agentrl_train/peak_gpu_memory_gib": "peak memory used on GPU 0 during the run, trainer and engine (nvidia-smi)",
}


def number_names(shapes: tuple[str, ...]) -> list[str]:
    """The names in `numbers` for a run over these train_gpu shapes."""
    names: list[str] = []
    for key in NUMBERS:
        names += [key.format(shape=s) for s in shapes] if "{shape}" in key else [key]
    return names


def gpu_numbers() -> dict[str, str]:
    """What a GPU run produces: every name, with its line."""
    out: dict[str, str] = {}
    for key, what in NUMBERS.items():
        for name in [key.format(shape=s) for s in GPU_SHAPES] if "{shape}" in key else [key]:
            out[name] = what
    return out


def python_cmd() -> list[str]:
    """This interpreter, with -P when we were started with it (the GPU machine keeps the checkout off sys.path)."""
    return [sys.executable, *(["-P"] if sys.flags.safe_path else [])]


_PROBE = """
import importlib.util, json, platform
import torch
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
       "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "vllm": None}
if importlib.util.find_spec("vllm") is not None:
    try:
        import vllm
        env["vllm"] = vllm.__version__
    except Exception as exc:
        env["vllm_error"] = f"{type(exc).__name__}: {exc}"
try:
    import transformers
    env["transformers"] = transformers.__version__
except Exception:
    pass
print(json.dumps(env))
"""


def environment(hide_gpus: bool) -> dict[str, Any]:
    """Versions, GPUs and whether vLLM imports, probed in a child: this process must hold no CUDA context,
    or the memory the steps report would include it."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if hide_gpus else None
    proc = subprocess.run([*python_cmd(), "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env)
    if proc.returncode != 0:
        return {
            "python": platform.python_version(),
            "error": proc.stderr[-2000:],
            "vllm": None,
            "device": "unknown",
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_step(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one step's command; its exit status, wall time and the tail of its output."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = None
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")) + (
            f"\n[gpu_smoke] timed out after {timeout:.0f} s"
        )
    return {
        "command": cmd,
        "returncode": rc,
        "ok": rc == 0,
        "wall_s": round(time.perf_counter() - t0, 1),
        "stdout": out,
        "stderr_tail": err[-3000:],
    }


# --- 1. the gpu tests ----------------------------------------------------------------------------------


def gpu_tests(has_vllm: bool, timeout: float, work: Path) -> dict[str, Any]:
    marker = "gpu" if has_vllm else "gpu and not vllm"
    report = work / "gpu_tests.xml"
    target = gpu_test_files()
    cmd = [*python_cmd(), "-m", "pytest", "-m", marker, *target, "-q", "-p", "no:cacheprovider",
           f"--junitxml={report}"]  # fmt: skip
    step = run_step(cmd, timeout)
    tests: dict[str, dict[str, Any]] = {}
    if report.exists():
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                elif child.tag == "skipped":
                    outcome = "skipped"
            tests[name] = {"outcome": outcome, "duration_s": round(float(case.get("time", 0.0)), 2)}
    step["tests"] = tests
    for outcome in ("passed", "failed", "skipped"):
        step[outcome] = sum(1 for t in tests.values() if t["outcome"] == outcome)
    # 0: all passed; 5: nothing collected for the marker. Anything else is a failure (1) or a crash.
    step["ok"] = step["returncode"] in (0, 5) and step["failed"] == 0
    step["not_run_without_vllm"] = None if has_vllm else _vllm_gpu_tests(target, timeout)
    step["stdout"] = step["stdout"][-3000:]
    return step


def gpu_test_files() -> list[str]:
    """The test modules that hold gpu-marked tests. Collecting only these keeps a module that imports a
    package the GPU machine lacks (the gateway's `openai`, the task sources' `datasets`) from stopping
    the whole collection there."""
    found = [
        path.relative_to(ROOT).as_posix()
        for path in sorted((ROOT / "tests").rglob("test_*.py"))
        if "mark.gpu" in path.read_text(encoding="utf-8")
    ]
    return found or ["tests"]


def _vllm_gpu_tests(target: list[str], timeout: float) -> int | None:
    """How many gpu tests need vLLM (collected, not run)."""
    cmd = [
        *python_cmd(),
        "-m",
        "pytest",
        "-m",
        "gpu and vllm",
        *target,
        "-q",
        "--collect-only",
        "-p",
        "no:cacheprovider",
    ]
    step = run_step(cmd, timeout)
    for line in reversed(step["stdout"].splitlines()):
        if "selected" in line or "collected" in line:
            digits = [int(w) for w in line.replace("/", " ").split() if w.isdigit()]
            return digits[0] if digits else None
    return None


# --- 2. benchmarks/train_gpu.py ------------------------------------------------------------------------


def train_gpu(tiny: bool, shapes: tuple[str, ...], timeout: float, work: Path) -> dict[str, Any]:
    out_file = work / "train_gpu.json"
    cmd = [
        *python_cmd(),
        str(ROOT / "benchmarks" / "train_gpu.py"),
        "--shapes",
        ",".join(shapes),
        "--out",
        str(out_file),
    ]
    if tiny:  # the CI budget: one timed step on a small batch
        cmd += ["--tiny", "--steps", "1", "--warmup", "0", "--trajectories", "8", "--long-trajectories", "2",
                "--long-len", "256"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if tiny else None
    step = run_step(cmd, timeout, env)
    step["result"] = json.loads(out_file.read_text()) if out_file.exists() else None
    step["ok"] = step["ok"] and step["result"] is not None
    del step["stdout"]  # the same JSON as `result`
    return step


# --- 3. a short agentrl train with a colocated engine ------------------------------------------------


class GpuMemoryPoller:
    """Peak `memory.used` of GPU 0 (MiB), polled from nvidia-smi while a run goes on; None without it."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self.available = shutil.which("nvidia-smi") is not None

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            with contextlib.suppress(Exception):
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
                    capture_output=True, text=True, timeout=10,
                )  # fmt: skip
                used = float(out.stdout.strip().splitlines()[0])
                self.peak_mib = used if self.peak_mib is None else max(self.peak_mib, used)

    def __enter__(self) -> GpuMemoryPoller:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.available:
            self._thread.join(timeout=15)


def agentrl_train(tiny: bool, has_vllm: bool, steps: int, timeout: float, work: Path) -> dict[str, Any]:
    if not has_vllm:
        return {"ok": None, "skipped": "vLLM is not installed here: the rollout engine cannot start"}
    from agentrl.kit.tiny_model import init_tiny

    model = init_tiny(work / "tiny-qwen2", seed=0)
    out = work / "run"
    config = work / "train.json"
    config.write_text(
        json.dumps(
            {
                "env": "tests.coin_env:test/Coin-v0",  # a random policy wins about half its episodes: updates happen
                "model": str(model),
                "out": str(out),
                "steps": steps,
                "checkpoint_every": 0,
                "stop_uninformative_after": 0,
                "rollout": {
                    "group_size": 4,
                    "max_tokens_per_turn": 12,
                    "max_total_tokens": 512,
                    "concurrency": 8,
                },
                "curriculum": {"batch_groups": 2, "max_gen_factor": 3.0},
                "optim": {"lr": 1e-4, "micro_batch_size": 4},
            }
        )
    )
    # The coin env lives in tests/: the checkout goes last on the path, after the installed package.
    path = os.environ.get("PYTHONPATH", "")
    env = {
        **os.environ,
        "PYTHONPATH": f"{path}{os.pathsep}{ROOT}" if path else str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    if tiny:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [*python_cmd(), "-m", "agentrl.cli", "train", str(config)]
    with GpuMemoryPoller() as poller:
        step = run_step(cmd, timeout, env)
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    keep = ("step", "time/step_s", "time/wait_for_batch_s", "time/train_s", "time/weight_sync_s", "policy/version",
            "charts/reward_mean", "losses/policy_loss")  # fmt: skip
    step["metrics"] = [{k: r[k] for k in keep if k in r} for r in rows]
    step["peak_gpu_memory_gib"] = None if poller.peak_mib is None else round(poller.peak_mib / 1024, 2)
    step["ok"] = step["ok"] and len(rows) == steps
    step["stdout"] = step["stdout"][-2000:]
    return step


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return round(statistics.median(values), 3) if values else None


def collect_numbers(result: dict[str, Any], shapes: tuple[str, ...]) -> dict[str, Any]:
    """Every name of `number_names(shapes)`, from the steps that ran (null where nothing was measured)."""
    numbers: dict[str, Any] = dict.fromkeys(number_names(shapes))
    steps = result["steps"]
    tests = steps.get("gpu_tests") or {}
    for outcome in ("passed", "failed", "skipped", "not_run_without_vllm"):
        numbers[f"gpu_tests/{outcome}"] = tests.get(outcome)
    bench = ((steps.get("train_gpu") or {}).get("result") or {}).get("shapes", {})
    for shape in shapes:
        r = bench.get(shape) or {}
        variants = r.get("variants", {})
        ours, plain = variants.get("ours", {}), variants.get("plain", {})
        numbers[f"train_gpu/{shape}/ours/tokens_per_s"] = ours.get("tokens_per_s")
        numbers[f"train_gpu/{shape}/ours/mfu"] = ours.get("mfu")
        numbers[f"train_gpu/{shape}/ours/peak_memory_gib"] = ours.get("peak_memory_gib")
        numbers[f"train_gpu/{shape}/plain/tokens_per_s"] = plain.get("tokens_per_s")
        numbers[f"train_gpu/{shape}/speedup_vs_plain"] = r.get("speedup_vs_plain")
        numbers[f"train_gpu/{shape}/activation_checkpointing_memory_cut"] = r.get(
            "activation_checkpointing_memory_cut"
        )
        numbers[f"train_gpu/{shape}/long_fits"] = (r.get("long") or {}).get("ok")
        numbers[f"train_gpu/{shape}/ours_compile_off/tokens_per_s"] = variants.get(
            "ours_compile_off", {}
        ).get("tokens_per_s")
        grpo = r.get("grpo") or {}
        grpo_ours = grpo.get("variants", {}).get("ours", {})
        numbers[f"train_gpu/{shape}/grpo/ours/tokens_per_s"] = grpo_ours.get("tokens_per_s")
        numbers[f"train_gpu/{shape}/grpo/ours/computed_tokens_per_s"] = grpo_ours.get("computed_tokens_per_s")
        numbers[f"train_gpu/{shape}/grpo/ours/mfu"] = grpo_ours.get("mfu")
        numbers[f"train_gpu/{shape}/grpo/trained_speedup_vs_plain"] = grpo.get("trained_speedup_vs_plain")
        numbers[f"train_gpu/{shape}/grpo/speedup_from_sharing"] = grpo.get("speedup_from_sharing")
    run = steps.get("agentrl_train") or {}
    rows = run.get("metrics") or []
    numbers["agentrl_train/steps"] = len(rows) if "metrics" in run else None
    numbers["agentrl_train/wall_s"] = run.get("wall_s")
    numbers["agentrl_train/step_s_median"] = median_of(rows, "time/step_s")
    numbers["agentrl_train/wait_for_batch_s_median"] = median_of(rows, "time/wait_for_batch_s")
    numbers["agentrl_train/train_s_median"] = median_of(rows, "time/train_s")
    numbers["agentrl_train/weight_sync_s_median"] = median_of(rows, "time/weight_sync_s")
    numbers["agentrl_train/policy_version"] = rows[-1].get("policy/version") if rows else None
    numbers["agentrl_train/peak_gpu_memory_gib"] = run.get("peak_gpu_memory_gib")
    return numbers


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="CPU/CI: the tiny model, tiny budgets, GPUs hidden.")
    ap.add_argument("--out", default=None, help="Write the JSON here too (rewritten after every step).")
    ap.add_argument(
        "--only", default="gpu_tests,train_gpu,agentrl_train", help="Steps to run, comma-separated."
    )
    ap.add_argument("--shapes", default=None, help="train_gpu shapes (default: 0.5B,1.5B; tiny with --tiny).")
    ap.add_argument(
        "--train-steps", type=int, default=None, help="Steps of agentrl train (default: 5; 2 with --tiny)."
    )
    ap.add_argument("--timeout", type=float, default=1200.0, help="Seconds each step may take.")
    args = ap.parse_args()
    tiny = args.tiny
    shapes = (
        tuple(s.strip() for s in args.shapes.split(","))
        if args.shapes
        else (TINY_SHAPES if tiny else GPU_SHAPES)
    )
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    unknown = only - {"gpu_tests", "train_gpu", "agentrl_train"}
    if unknown:
        ap.error(f"unknown step(s) {sorted(unknown)}; choose from gpu_tests, train_gpu, agentrl_train")
    env = environment(hide_gpus=tiny)
    has_vllm = env["vllm"] is not None
    result: dict[str, Any] = {
        "benchmark": "gpu_smoke",
        "mode": "tiny" if tiny else "gpu",
        "device": "cpu" if tiny else env["device"],
        "environment": env,
        "steps": {},
        "numbers": {},
        "gpu_numbers": gpu_numbers(),
    }

    def write() -> None:
        result["numbers"] = collect_numbers(result, shapes)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="gpu-smoke-") as tmp:
        work = Path(tmp)
        if "gpu_tests" in only:
            result["steps"]["gpu_tests"] = gpu_tests(has_vllm, args.timeout, work)
            write()
        if "train_gpu" in only:
            result["steps"]["train_gpu"] = train_gpu(tiny, shapes, args.timeout, work)
            write()
        if "agentrl_train" in only:
            steps = args.train_steps or (2 if tiny else 5)
            result["steps"]["agentrl_train"] = agentrl_train(tiny, has_vllm, steps, args.timeout, work)
        write()
    print(json.dumps(result, indent=2))
    return 0 if all(s.get("ok") is not False for s in result["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
