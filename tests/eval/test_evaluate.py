"""pass@k evaluation: budget control, resumability (SIGINT and restart through the real CLI), reports.

The models are tiny random initialisations: they score 0 on every environment, which is all the
tests need. What is checked is what the evaluation asks of each policy (tasks, seeds, limits), what
it writes, and that a restart never redoes an episode. The estimator itself is tested in
tests/eval/test_passk.py (hand values and brute-force k-subset enumeration).

Most tests use `agentrl/guess-number-v0` (no sandbox); the two-checkpoint report runs on
`agentrl/calc-v0` in Docker sandboxes, the env users evaluate on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agentrl.eval.evaluate import (
    EpisodeRecord,
    EvalConfig,
    EvalError,
    checkpoint_fingerprint,
    default_ks,
    episode_seed,
    evaluate,
    evaluate_policy,
    make_budget,
    model_names,
    read_episodes,
)
from agentrl.kit.tiny_model import init_tiny
from agentrl.rollout.config import RolloutConfig
from agentrl.rollout.policy import Generation, SamplingConfig, VLLMPolicy
from agentrl.rollout.trajectory import Trajectory
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

GUESS = "agentrl/guess-number-v0"
# Small enough for this loaded CPU box: 2 turns of at most 8 tokens per episode.
FAST_ROLLOUT = dict(max_tokens_per_turn=8, max_total_tokens=1024)


def record(task_index: int, sample: int) -> EpisodeRecord:
    traj = Trajectory(
        task_id=f"t{task_index}",
        group_id="g",
        token_ids=[1, 2],
        loss_mask=[0, 1],
        behavior_logprobs=[0.0, -0.5],
        prompt_len=1,
        reward=float(sample == 0),
        passed=sample == 0,
        finish_reason="submitted",
        policy_version=0,
    )
    return EpisodeRecord(task_index, sample, episode_seed(0, task_index, sample), traj)


# --- no engine ----------------------------------------------------------------------------------------


def test_episode_seed_depends_on_its_key_only():
    seeds = {(i, j): episode_seed(7, i, j) for i in range(20) for j in range(20)}
    assert len(set(seeds.values())) == 400  # distinct episodes, distinct seeds
    assert all(0 <= s < 2**31 for s in seeds.values())
    assert episode_seed(7, 3, 5) == seeds[(3, 5)]  # reproducible: same key, same seed
    assert episode_seed(8, 3, 5) != seeds[(3, 5)]


def test_config_errors_say_the_fix():
    with pytest.raises(ValueError, match="pass@8 needs at least 8 samples per task but samples=4"):
        EvalConfig(env=GUESS, models=["m"], samples=4, ks=[1, 8])
    with pytest.raises(ValueError, match="1 names for 2 models"):
        EvalConfig(env=GUESS, models=["a", "b"], names=["x"], ks=[1])
    with pytest.raises(ValueError, match="positive"):
        EvalConfig(env=GUESS, models=["a"], ks=[0])


def test_former_field_names_and_group_size_are_refused_with_the_new_name():
    """One name per setting: `n` and `num_tasks` are `samples` and `tasks`, said so rather than accepted."""
    with pytest.raises(ValueError, match="'n' is now called 'samples'; 'num_tasks' is now called 'tasks'"):
        EvalConfig(env=GUESS, models=["m"], n=4, num_tasks=3)
    # Each episode of an evaluation is its own rollout: a group size would mean nothing.
    for rollout in ({"group_size": 4}, RolloutConfig(group_size=4)):
        with pytest.raises(ValueError, match="group_size is not an evaluation setting.*set `samples`"):
            EvalConfig(env=GUESS, models=["m"], rollout=rollout)
    cfg = EvalConfig(env=GUESS, models=["m"], samples=4, ks=[1, 4], tasks=3, rollout=RolloutConfig(top_p=0.9))
    assert (cfg.samples, cfg.tasks, cfg.rollout.top_p) == (4, 3, 0.9)


def test_model_names_are_distinct():
    assert model_names(["/r/sft/final", "/r/grpo/final"]) == ["sft-final", "grpo-final"]
    assert model_names(["/r/warm start", "/r/trained"]) == ["warm_start", "trained"]


def test_partial_last_line_is_cut_and_a_damaged_line_is_an_error(tmp_path):
    path = tmp_path / "episodes.jsonl"
    good = record(0, 0).to_json() + "\n" + record(0, 1).to_json() + "\n"
    path.write_text(good + record(1, 0).to_json()[:40])  # a kill mid-write
    got = read_episodes(path)
    assert sorted(got) == [(0, 0), (0, 1)]
    assert path.read_text() == good  # cut, so the next append starts on a fresh line
    path.write_text(record(0, 0).to_json() + "\n{not json\n" + record(0, 1).to_json() + "\n")
    with pytest.raises(EvalError, match=r"episodes.jsonl:2 is not a valid episode record.*--force"):
        read_episodes(path)


def test_checkpoint_fingerprint_follows_content_not_path(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "model.safetensors").write_bytes(bytes(range(256)) * 20_000)
    b = tmp_path / "b"
    b.mkdir()
    for p in a.iterdir():
        (b / p.name).write_bytes(p.read_bytes())
    (b / "train.log").write_text("not part of the checkpoint")
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    data = bytearray((b / "model.safetensors").read_bytes())
    data[len(data) // 2] ^= 1  # one weight byte in the middle changed: a retrained checkpoint
    (b / "model.safetensors").write_bytes(bytes(data))
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)


def test_budget_resolves_the_task_list_and_turn_limit():
    budget, tasks = make_budget(EvalConfig(env=GUESS, models=["m"], samples=2, ks=[1], tasks=3, split="test"))
    assert budget.task_ids == ["guess-number/test/0", "guess-number/test/1", "guess-number/test/2"]
    assert [t.id for t in tasks] == budget.task_ids
    assert budget.max_turns == 12  # the registered limit, recorded: the budget states what ran


def test_a_path_without_a_checkpoint_is_refused_before_anything_runs(tmp_path):
    with pytest.raises(EvalError, match=r"is not a checkpoint directory \(no config.json\)"):
        evaluate(EvalConfig(env=GUESS, models=[str(tmp_path)], samples=1, ks=[1], out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


def test_default_ks():
    assert default_ks(4) == [1, 2, 4] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]


# --- one vLLM engine for the module -------------------------------------------------------------------


class RecordingPolicy:
    """The module's engine, recording every request a model's evaluation makes."""

    def __init__(self, inner: VLLMPolicy, log: list[tuple[tuple[int, ...], SamplingConfig]]):
        self.inner, self.log = inner, log
        self.tokenizer = inner.tokenizer

    @property
    def version(self) -> int:
        return self.inner.version

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        self.log.append((tuple(prompt_ids), sampling))
        return await self.inner.generate(prompt_ids, sampling)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):  # noqa: F811
    p = VLLMPolicy(tiny_model_dir, in_process=True, dtype="float32", max_model_len=1024, cpu_threads=1)
    yield p
    p.close()


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_tiny(tmp_path_factory.getbasetemp() / "tiny-qwen2-seed1", seed=1)


@pytest.fixture(scope="module")
def two_model_run(engine, tiny_model_dir, second_model, tmp_path_factory):  # noqa: F811
    """One evaluation of two checkpoints; each model's requests go through the shared engine, recorded.

    Sharing one engine keeps the module to one vLLM start; what is checked here is what the
    evaluation asks of each model (tasks, seeds, limits), not what the model answers.
    """
    out = tmp_path_factory.mktemp("eval-two")
    requests: dict[str, list] = {}

    def factory(path: str) -> RecordingPolicy:
        requests[Path(path).name] = []
        return RecordingPolicy(engine, requests[Path(path).name])

    cfg = EvalConfig(
        env=GUESS,
        models=[str(tiny_model_dir), str(second_model)],
        names=["before", "after"],
        samples=2,
        ks=[1, 2],
        tasks=2,
        max_turns=2,
        rollout=RolloutConfig(temperature=0.7, top_p=0.9, concurrency=4, **FAST_ROLLOUT),
        out=str(out),
        progress=False,
    )
    summaries = evaluate(cfg, policy_factory=factory)
    return cfg, out, summaries, requests


@pytest.mark.vllm
@pytest.mark.slow
def test_budget_control_same_tasks_seeds_and_limits_for_every_model(two_model_run):
    cfg, out, summaries, requests = two_model_run
    before, after = (read_episodes(out / name / "episodes.jsonl") for name in ("before", "after"))
    assert sorted(before) == sorted(after) == [(i, j) for i in range(2) for j in range(2)]
    for key in before:
        assert before[key].seed == after[key].seed == episode_seed(cfg.seed, *key)
        assert before[key].trajectory.task_id == after[key].trajectory.task_id
        assert before[key].trajectory.turns <= 2 and after[key].trajectory.turns <= 2
    # Every request of either model: same sampling settings, and turn-1 prompts with the same seeds.
    asked = {name: reqs for name, reqs in requests.items()}
    assert len(asked) == 2
    for reqs in asked.values():
        assert {(s.temperature, s.top_p) for _, s in reqs} == {(0.7, 0.9)}
        assert all(s.max_tokens <= 8 for _, s in reqs)
    # A first turn's prompt extends no other prompt the model was sent (later turns extend earlier ones).
    first_turns = [
        sorted(
            (prompt, s.seed)
            for prompt, s in reqs
            if not any(len(q) < len(prompt) and prompt[: len(q)] == q for q, _ in reqs)
        )
        for reqs in asked.values()
    ]
    assert first_turns[0] == first_turns[1] and len(first_turns[0]) == 4  # 2 tasks x 2 samples
    # The budget is recorded in the run directory and in the summary.
    recorded = json.loads((out / "eval_config.json").read_text())["budget"]
    summary = json.loads((out / "summary.json").read_text())
    for budget in (recorded, summary["budget"]):
        assert budget["temperature"] == 0.7 and budget["top_p"] == 0.9 and budget["max_turns"] == 2
        assert budget["max_tokens_per_turn"] == 8 and budget["n"] == 2 and budget["seed"] == 0
    assert summary["task_ids"] == ["guess-number/test/0", "guess-number/test/1"]
    assert [m["model"] for m in summary["models"]] == ["before", "after"]
    assert [s.model for s in summaries] == ["before", "after"]
    assert [p.k for p in summaries[0].pass_at] == [1, 2]
    for name in ("pass_at_k.png", "task_scatter.png", "paired_diff.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Budget (identical for every model)" in (out / "report.md").read_text()
    # The second model against the first, pair by pair (the same 4 episodes).
    (paired,) = summary["paired"]
    assert (paired["baseline"], paired["model"], paired["episodes"], paired["num_tasks"]) == (
        "before",
        "after",
        4,
        2,
    )
    assert paired["verdict"] in (out / "report.md").read_text()


@pytest.mark.vllm
@pytest.mark.slow
def test_rerun_with_everything_done_runs_nothing_and_a_changed_budget_is_refused(two_model_run):
    cfg, out, _, _ = two_model_run
    lines = (out / "before" / "episodes.jsonl").read_text()

    def no_policy(path: str):
        raise AssertionError("a finished evaluation must not start an engine")

    again = evaluate(cfg, policy_factory=no_policy)
    assert (out / "before" / "episodes.jsonl").read_text() == lines
    assert [s.pass_at_dict() for s in again]  # the summary is rebuilt from disk
    with pytest.raises(EvalError, match=r"temperature: recorded 0.7, now 1.0.*new --out, or --force"):
        evaluate(
            cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"temperature": 1.0})}),
            policy_factory=no_policy,
        )
    assert (out / "before" / "episodes.jsonl").read_text() == lines  # refused, and nothing lost


@pytest.mark.vllm
@pytest.mark.slow
def test_evaluate_policy_in_training(engine):
    s = evaluate_policy(
        engine,
        GUESS,
        split="validation",
        num_tasks=2,
        samples=2,
        rollout=RolloutConfig(concurrency=4, **FAST_ROLLOUT),
        env_kwargs={"max_turns": 2},
        model_name="step-3",
    )
    assert s.model == "step-3" and s.num_tasks == 2 and s.samples_per_task == 2
    assert [p.k for p in s.pass_at] == [1, 2]
    assert set(s.task_pass_rate) == {"guess-number/validation/0", "guess-number/validation/1"}
    assert s.mean_turns <= 2


# --- the real CLI in a subprocess ----------------------------------------------------------------------


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentrl.cli", "eval", *args, "--no-progress"]


@pytest.mark.vllm
@pytest.mark.docker
@pytest.mark.slow
def test_calc_two_checkpoints_sigint_restart_then_summary_and_plots(
    tiny_model_dir,  # noqa: F811
    second_model,
    tmp_path,
):
    """A user's whole evaluation through the real CLI: two checkpoints on calc-v0, interrupted, resumed, reported.

    One test for two properties (resume; the two-model report) because each CLI run starts Python,
    vLLM and an engine per model: on this shared CPU box that is most of a minute per run.
    """
    out = tmp_path / "calc"
    args = _cli(
        "--env", "agentrl/calc-v0", "--model", str(tiny_model_dir), "--model", str(second_model),
        "--name", "warm-start", "--name", "trained", "--n", "2", "--k", "1,2", "--tasks", "2",
        "--max-turns", "2", "--max-tokens-per-turn", "8", "--max-total-tokens", "1024",
        "--concurrency", "2", "--out", str(out),
    )  # fmt: skip
    files = {name: out / name / "episodes.jsonl" for name in ("warm-start", "trained")}

    def lines() -> int:
        return sum(p.read_text().count("\n") for p in files.values() if p.exists())

    # 1. Interrupt with SIGINT once the first episode is on disk.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # SIGINT back to its default in the child: a suite started in the background by a script inherits
    # it ignored, and then the Ctrl-C below would never reach the evaluation.
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 300
        while lines() < 1:
            assert proc.poll() is None, f"the eval ended before it was interrupted:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "no episode was written in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "run the same command again to continue" in output
    assert "Task exception was never retrieved" not in output  # the interrupt came from the loop, not a task
    first = {name: p.read_text() if p.exists() else "" for name, p in files.items()}
    # Every line written is whole, and the interrupt landed mid-evaluation.
    written = {name: [EpisodeRecord.from_json(x) for x in text.splitlines()] for name, text in first.items()}
    assert 1 <= sum(map(len, written.values())) < 8
    assert not (out / "summary.json").exists()

    # 2. The same command again: only the missing episodes run.
    res = subprocess.run(args, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    for name, path in files.items():
        k = len(written[name])
        assert f"{name}: {k} of 4 episodes already done, {4 - k} to run" in res.stderr
        final = path.read_text()
        assert final.startswith(first[name])  # finished episodes kept byte for byte, not rerun
        keys = [EpisodeRecord.from_json(x).key for x in final.splitlines()]
        assert sorted(keys) == [(i, j) for i in range(2) for j in range(2)]  # each episode exactly once

    # 3. The two-model summary, plots and report.
    assert "warm-start: pass@1" in res.stdout and "trained: pass@1" in res.stdout
    assert "trained vs warm-start: " in res.stdout and "McNemar exact" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env"] == "agentrl/calc-v0" and summary["budget"]["max_turns"] == 2
    assert [m["model"] for m in summary["models"]] == ["warm-start", "trained"]
    for m in summary["models"]:
        assert m["num_tasks"] == 2 and m["samples_per_task"] == 2
        assert [p["k"] for p in m["pass_at"]] == [1, 2]
        assert sum(m["finish_reasons"].values()) == 4 and len(m["task_pass_rate"]) == 2
        assert m["wall_s"] > 0
    for name in ("pass_at_k.png", "task_scatter.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "| warm-start |" in report and "| trained |" in report


@pytest.mark.slow
def test_cli_refuses_a_changed_budget_without_traceback(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "eval_config.json").write_text(json.dumps({"budget": {"env": GUESS, "temperature": 0.5}}))
    model = tmp_path / "model"
    model.mkdir()
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ):  # refused before any engine loads them
        (model / name).write_text("{}")
    args = _cli(
        "--env", GUESS, "--model", str(model), "--n", "1", "--k", "1", "--tasks", "1", "--out", str(out)
    )  # fmt: skip
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "different budget" in res.stderr and "--force" in res.stderr
