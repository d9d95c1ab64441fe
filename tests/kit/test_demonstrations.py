"""Oracle demonstrations through the rollout engine: the ids and mask the RL trainer would see, and SFT on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

import agentrl
from agentrl.cli import app
from agentrl.env.agents import run_episode
from agentrl.kit.demonstrations import generate_demos
from agentrl.rollout.masker import ChatMasker
from agentrl.rollout.trajectory import Trajectory, load_trajectories
from agentrl.train.sft import SFTConfig, masked_nll_sum
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)

ENV = "agentrl/calc-v0"


def runs(t: Trajectory) -> list[tuple[int, list[int]]]:
    """Maximal runs of equal mask value: (mask, ids)."""
    out: list[tuple[int, list[int]]] = []
    for tok, m in zip(t.token_ids, t.loss_mask, strict=True):
        if out and out[-1][0] == m:
            out[-1][1].append(tok)
        else:
            out.append((m, [tok]))
    return out


@pytest.fixture(scope="module")
def masker(tiny_model_dir: Path) -> ChatMasker:  # noqa: F811
    return ChatMasker(AutoTokenizer.from_pretrained(tiny_model_dir))


@pytest.fixture(scope="module")
def demos(masker: ChatMasker, tmp_path_factory: pytest.TempPathFactory) -> list[Trajectory]:
    out = tmp_path_factory.mktemp("demos") / "demos.jsonl"
    trajectories, stats = generate_demos(ENV, 8, out, masker, backend="local")
    assert stats.episodes == stats.passed == 8 and stats.drifted == 0
    assert load_trajectories(out) == trajectories  # what is saved is what was rolled out
    return trajectories


def test_mask_one_ids_are_exactly_the_oracles_messages_plus_end_of_turn(
    demos: list[Trajectory], masker: ChatMasker
):
    env = agentrl.make(ENV, backend="local", use_pool=False)
    try:
        for t in demos:
            # The oracle replayed on the same task by the plain episode loop, no tokenizer involved.
            task = env.tasks.get(int(t.task_id.rsplit("/", 1)[1]), "train")
            run_episode(env, env.oracle(task), options={"task": task})
            expected = [m["content"] for m in env.episode.messages if m["role"] == "assistant"]
            sampled = [ids for m, ids in runs(t) if m == 1]
            assert [masker.decode(ids) for ids in sampled] == [text + "<|im_end|>" for text in expected]
            # Canonical tokenization, one end-of-turn id each: what a model trained on them learns to sample.
            assert sampled == [[*masker.encode(text), masker.end_of_turn_id] for text in expected]
            assert t.behavior_logprobs == [0.0] * len(t.token_ids)
    finally:
        env.close()


def test_mask_zero_ids_are_the_prompt_and_the_tool_results(demos: list[Trajectory], masker: ChatMasker):
    for t in demos:
        pieces = runs(t)
        assert [m for m, _ in pieces] == [0, 1, 0, 1]  # prompt, python call, tool result, submit
        prompt, observation = masker.decode(pieces[0][1]), masker.decode(pieces[2][1])
        assert prompt == masker.render(t.messages[:2], add_generation_prompt=True)
        assert len(pieces[0][1]) == t.prompt_len
        tool_result = t.messages[3]
        assert tool_result["role"] == "tool"
        # The turn close the model did not sample, the tool result, the next generation prompt.
        assert observation.startswith("\n") and tool_result["content"] in observation
        assert observation.endswith(masker.generation_prompt)
        # The whole sequence is the template's rendering of the conversation (the drift check agrees).
        full = masker.render(t.messages, add_generation_prompt=False)
        assert full.startswith(masker.decode(t.token_ids))
        assert t.drift is not None and not t.drift.drifted


def test_kinds_filter_and_a_filter_that_matches_nothing(masker: ChatMasker, tmp_path: Path):
    trajectories, stats = generate_demos(ENV, 3, tmp_path / "w.jsonl", masker, kinds=["word"])
    assert stats.kinds == {"word": 3} and stats.passed == 3
    with pytest.raises(ValueError, match="have a kind in"):
        generate_demos(ENV, 1, tmp_path / "x.jsonl", masker, kinds=["no-such-kind"])


@pytest.mark.slow
def test_sft_on_demos_lowers_their_loss(
    demos: list[Trajectory],
    tiny_model_dir: Path,  # noqa: F811
    tmp_path: Path,
):
    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in demos))
    cfg = SFTConfig(
        model=str(tiny_model_dir),
        data=str(data),
        out=str(tmp_path / "sft"),
        epochs=1,  # 2 steps of 4
        lr=3e-3,
        batch_size=4,
        micro_batch_size=4,
        warmup_steps=1,
    )
    # One thread: two spin-wait on each other on a loaded 2-core box (see agentrl.kit.warm_start._sft).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "agentrl.train.sft", cfg.model_dump_json()], env=env, check=True)

    def mean_nll(model_dir: str | Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            nll, n = masked_nll_sum(model, demos, pad_id=0, device=torch.device("cpu"))
        return float(nll) / n

    before, after = mean_nll(tiny_model_dir), mean_nll(cfg.out)
    assert after < 0.9 * before, (before, after)


def test_cli_demos_writes_trajectories(tiny_model_dir: Path, tmp_path: Path):  # noqa: F811
    out = tmp_path / "d.jsonl"
    args = ["demos", ENV, "--n", "2", "--out", str(out), "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(app, [*args, "--split", "validation"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)
    assert stats["episodes"] == stats["passed"] == 2
    assert [t.split for t in load_trajectories(out)] == ["validation", "validation"]
    bad = CliRunner().invoke(app, [*args, "--split", "dev"])
    assert bad.exit_code != 0 and "unknown split 'dev'" in bad.output


def test_demos_through_a_harness_are_the_oracle_in_the_agents_own_prompt_token_exact(
    masker: ChatMasker, tmp_path: Path
):
    """The user's agent plays the demonstrations: its system prompt and its tool schemas render the
    prompt, the oracle's message is what the model is taught to sample, ids as the gateway records."""
    from agentrl.env.parsers import get_parser
    from agentrl.gateway.session import tools_in_system
    from tests.own_agent import SUBMIT, SYSTEM

    out = tmp_path / "own.jsonl"
    trajectories, stats = generate_demos("tests.own_agent:test/PickOwnAgent-v0", 4, out, masker)
    assert stats.episodes == stats.passed == stats.trajectories == 4 and stats.first_failure == ""
    assert load_trajectories(out) == trajectories
    pick = agentrl.task_source("test/Pick-v0")
    # The agent's tools written into its system message as the environment writes tools (the native prompt's form).
    block = get_parser("hermes").system_block([SUBMIT])
    for i, t in enumerate(trajectories):
        task = pick.get(i, "train")
        assert t.task_id == task.id and t.passed and t.branches == 1 and t.finish_reason == "submitted"
        prompt = masker.start(
            tools_in_system(
                [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Request: {task.prompt}"},
                ],
                block,
            )
        )
        assert t.token_ids[: t.prompt_len] == prompt.token_ids  # the agent's prompt, not the environment's
        assert "Hand in the word you were asked for." in masker.decode(t.token_ids[: t.prompt_len])
        ((mask, sampled),) = [r for r in runs(t) if r[0] == 1]
        oracle = agentrl.AnswerOracle(task).act([])
        assert sampled == [*masker.encode(oracle), masker.end_of_turn_id]
        assert all(lp == 0.0 for lp in t.behavior_logprobs)


def test_cli_demos_that_all_fail_exit_1_and_say_why(tiny_model_dir: Path, tmp_path: Path):  # noqa: F811
    """An agent whose tools are not the oracle's: every demonstration fails; the command says why and
    exits 1 instead of writing a useless file and exiting 0."""
    out = tmp_path / "d.jsonl"
    args = ["demos", "tests.own_agent:test/PickOwnTools-v0", "--n", "2", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--model", str(tiny_model_dir)])
    assert result.exit_code == 1, result.output
    assert "the oracle failed every one of the 2 episodes" in result.stderr
    assert "tool 'submit' was not offered to you (the tools you have: answer)" in result.stderr
