"""The new user's path, end to end, with real parts: their own package (an environment over a fixed
JSONL dataset and a verifier plugin, registered by entry points) pip-installed, then `env check`,
`verifier check`, a warm start (oracle demonstrations, SFT), `train`, `eval`: every command exits 0.

Tiny budgets: the point is the path, not the learning. Docker runs every episode's sandbox (the
env has a python tool), vLLM every rollout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ROOT = Path(__file__).resolve().parents[1]
AGENTRL = str(ROOT / ".venv/bin/agentrl")
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "tiger",
    "maple",
    "lemon",
    "ocean",
    "pearl",
    "tulip",
    "amber",
    "cedar",
    "olive",
    "piano",
    "quartz",
]

PACKAGE = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=70.1"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "mylab-words"
        version = "0.1.0"
        [project.entry-points."agentrl.envs"]
        mylab = "mylab_words:register_envs"
        [project.entry-points."agentrl.verifiers"]
        fuzzy-answer = "mylab_words.verify:FuzzyAnswer"
        [tool.setuptools]
        packages = ["mylab_words"]
        [tool.setuptools.package-data]
        mylab_words = ["*.jsonl"]
    """,
    "mylab_words/__init__.py": '''
        """mylab's word tasks: an environment over a fixed JSONL dataset, no subclass needed."""
        from pathlib import Path

        import agentrl

        TASKS = Path(__file__).with_name("tasks.jsonl")


        def register_envs():
            agentrl.register(
                "mylab/Words-v0",
                "agentrl:ToolEnv",
                tasks=str(TASKS),                 # loaded on first use, split by each row's "split"
                tools=["python", "submit"],
                verifier="fuzzy-answer",          # the plugin below, found by its entry point
                oracle=agentrl.AnswerOracle,      # submits task.answer: env check, demos, verifier check
                max_turns=2,
                description="Submit the word the task names.",
            )
    ''',
    "mylab_words/verify.py": '''
        """Partial credit for a near miss: similarity of the submission (or, failing one, half that of
        the last message) to the answer; a pass is the exact word."""
        import difflib
        from dataclasses import dataclass

        from agentrl.verifiers import Verdict


        @dataclass
        class FuzzyAnswer:
            name: str = "fuzzy-answer"

            def verify(self, sandbox, task, episode):
                said = [m["content"] for m in episode.messages if m["role"] == "assistant"]
                got, weight = (episode.submission, 1.0) if episode.submission else (said[-1] if said else "", 0.5)
                score = difflib.SequenceMatcher(None, got.strip().lower(), task.answer).ratio()
                return Verdict(round(weight * score, 3), weight * score == 1.0, f"similarity {score:.2f}")
    ''',
}


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package pip-installed into a private site directory (entry points included)."""
    root = tmp_path_factory.mktemp("mylab")
    for name, text in PACKAGE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    rows = [
        {"id": f"words/{i}", "prompt": f"Submit the word {w}.", "answer": w, "split": "test" if i % 5 == 4 else "train"}
        for i, w in enumerate(WORDS)
    ]  # fmt: skip
    (root / "mylab_words" / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    site = tmp_path_factory.mktemp("site")
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
    ]
    subprocess.run([*pip, str(root)], check=True, capture_output=True)
    return site


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_own_package_to_trained_checkpoint_every_command_exits_0(installed, tiny_model_dir, tmp_path):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": str(installed), "OMP_NUM_THREADS": "1"}
    transcript: list[str] = []

    def agentrl(*args: str) -> subprocess.CompletedProcess:
        res = subprocess.run(
            [AGENTRL, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        transcript.append(f"$ agentrl {' '.join(args)}  -> exit {res.returncode}")
        assert res.returncode == 0, "\n".join(transcript) + "\n" + res.stderr[-4000:]
        assert "Traceback" not in res.stderr
        return res

    assert "mylab/Words-v0" in agentrl("envs", "list").stdout
    assert "fuzzy-answer" in agentrl("verifier", "list").stdout
    assert "oracle solved 2/2 tasks" in agentrl("env", "check", "mylab/Words-v0", "--tasks", "2").stdout
    assert "kept 2 of 2 tasks" in agentrl("verifier", "check", "mylab/Words-v0", "--tasks", "2").stdout

    # Warm start: the oracle's demonstrations, then masked SFT on them.
    agentrl("demos", "mylab/Words-v0", "--n", "12", "--out", "demos.jsonl", "--model", str(tiny_model_dir))
    agentrl("sft", "--model", str(tiny_model_dir), "--data", "demos.jsonl", "--out", "sft", "--epochs", "1",
            "--batch-size", "6")  # fmt: skip

    (tmp_path / "grpo.yaml").write_text(
        "env: mylab/Words-v0\nmodel: sft\nout: grpo\nsteps: 2\n"
        "rollout: {group_size: 4, max_tokens_per_turn: 16, max_total_tokens: 1024, concurrency: 8}\n"
        "curriculum: {batch_groups: 2}\noptim: {lr: 1.0e-4, micro_batch_size: 4}\n"
    )
    trained = agentrl("train", "grpo.yaml")
    assert trained.stdout.strip().endswith("grpo/final")
    # Our own lines only: a progress bar, a start line, a line per step, the closing line.
    ours = [
        x for x in trained.stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")
    ]
    assert all(x.startswith("[train]") for x in ours), ours
    assert len(ours) <= 5, ours
    metrics = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and any("losses/policy_loss" in m for m in metrics)
    for name in ("training.png", "engine.log", "final/model.safetensors", "checkpoint-2/model.safetensors"):
        assert (tmp_path / "grpo" / name).exists(), name

    res = agentrl("eval", "--env", "mylab/Words-v0", "--model", "sft", "--model", "grpo/final", "--n", "2",
                  "--k", "1,2", "--tasks", "3", "--out", "eval", "--no-progress")  # fmt: skip
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert [m["model"] for m in summary["models"]] == ["sft", "final"]
    assert summary["task_ids"] == ["words/4", "words/9", "words/14"]  # the held-out rows of the JSONL
    assert "report: eval/report.md" in res.stdout
    print("\n".join(transcript))


def _guide() -> tuple[str, str, list[list[str]]]:
    """docs/AGENTS.md's "Warm-start your own agent": the agent's module, the training config, and the
    `agentrl` command lines, as written there."""
    import shlex

    from tests.test_readme import block, blocks

    (config,) = [text for page, text in blocks("yaml") if "# wordbot.yaml" in text]
    (commands,) = [text for page, text in blocks("bash") if "mylab.wordbot:mylab/WordBot-v0" in text]
    lines = [shlex.split(line, comments=True) for line in commands.replace("\\\n", " ").splitlines()]
    return block("# mylab/wordbot.py"), config, [argv for argv in lines if argv]


@pytest.mark.vllm
@pytest.mark.slow
def test_own_agent_warm_started_through_its_harness_into_the_band_trained_and_evaluated(tmp_path):
    """The new user's path with an agent of their own: its own system prompt and tool schema, registered
    in a module of the current directory (no PYTHONPATH), warm-started through the harness until its
    held-out pass@1 is in the band, two GRPO steps, pass@k: docs/AGENTS.md's lines, as written there."""
    module, config, commands = _guide()
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "wordbot.py").write_text(module)
    (tmp_path / "wordbot.yaml").write_text(config)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    transcript: list[str] = []
    results = []
    for argv in commands:
        assert argv[0] == "agentrl", argv
        res = subprocess.run(
            [AGENTRL, *argv[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3000
        )
        transcript.append(f"$ {' '.join(argv)}  -> exit {res.returncode}")
        assert res.returncode == 0, "\n".join(transcript) + "\n" + res.stderr[-4000:]
        assert "Traceback" not in res.stderr
        results.append(res)
    init, demos, warm, train, evaluated = results

    # Demonstrations in the agent's own prompt: its system prompt and its description of `submit`.
    stats = json.loads(demos.stdout)
    assert stats["episodes"] == stats["passed"] == 4
    first = json.loads((tmp_path / "demos.jsonl").read_text().splitlines()[0])
    assert first["messages"][0]["content"].startswith("You are WordBot.")

    # The warm start from the checkpoint: the checkpoint measured first, SFT rounds until held-out pass@1 is in the band.
    shown = json.loads(warm.stdout)
    rounds = shown["rounds"]
    assert rounds[0]["round"] == 0 and rounds[0]["sft_steps"] == 0
    assert 0.2 <= shown["pass_at_1"] <= 0.8 and rounds[-1]["pass_at_1"] == shown["pass_at_1"], rounds
    assert all(r["pass_at_1"] < 0.2 for r in rounds[:-1]) and shown["advice"] is None

    # Two GRPO steps on the harness env, then pass@k of both checkpoints through the agent.
    metrics = [json.loads(x) for x in (tmp_path / "runs/wordbot/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    summary = json.loads((tmp_path / "runs/eval/summary.json").read_text())
    assert [m["model"] for m in summary["models"]] == ["warm", "grpo"]
    for m in summary["models"]:
        assert [p["k"] for p in m["pass_at"]] == [1, 2, 4]
        assert set(m["finish_reasons"]) <= {"submitted", "max_turns"}  # no agent error, no timeout
    assert "warm: pass@1" in evaluated.stdout and "grpo: pass@1" in evaluated.stdout
    print("\n".join(transcript))


@pytest.mark.vllm
@pytest.mark.slow
def test_training_an_agent_that_raises_says_so_names_it_and_keeps_the_episodes(tiny_model_dir, tmp_path):  # noqa: F811
    """Every episode `agent_error`: the first step says so with the agent's own exception, the stop names
    an error of the agent (not the environment's), the command exits 2, and the run keeps the episodes."""
    module, _, _ = _guide()
    (tmp_path / "mylab").mkdir()
    (tmp_path / "mylab" / "__init__.py").write_text("")
    (tmp_path / "mylab" / "wordbot.py").write_text(module)
    (tmp_path / "mylab" / "broken.py").write_text(
        "import agentrl\nimport mylab.wordbot\n\n\n"
        "async def broken_bot(client, task):\n"
        '    raise ConnectionError("my agent\'s own backend is down")\n\n\n'
        "agentrl.register('mylab/Broken-v0', 'agentrl.gateway:HarnessEnv', env='mylab/Pick-v0', agent=broken_bot)\n"
    )
    (tmp_path / "broken.yaml").write_text(
        f"env: mylab.broken:mylab/Broken-v0\nmodel: {tiny_model_dir}\nout: runs/broken\nsteps: 3\n"
        "stop_uninformative_after: 1\nrollout: {group_size: 2, max_tokens_per_turn: 16}\n"
        "curriculum: {batch_groups: 1}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [AGENTRL, "train", "broken.yaml"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 2, res.stderr[-4000:]
    err = " ".join(res.stderr.split())
    assert "episodes ended outside the policy's control (agent_error" in err
    assert "the agent raised ConnectionError: my agent's own backend is down" in err
    assert "an error of the agent (agent_error), not of the environment" in err
    kept = (tmp_path / "runs/broken/failed_episodes.jsonl").read_text().splitlines()
    assert kept and all("my agent's own backend is down" in json.loads(x)["error"] for x in kept)
