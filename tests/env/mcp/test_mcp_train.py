"""An environment built from a real MCP server, trained for two GRPO steps and evaluated with pass@k, on docker.

Every episode of the run starts `mcp-server-sqlite` in its own docker sandbox (from the warm pool) and
the policy reads the server's tools in its system prompt; vLLM samples, the trainer updates, the weights
are pushed, and `agentrl eval` reports pass@k of the trained checkpoint on `agentrl/sqlite-mcp-v0` itself.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from agentrl.cli import app
from agentrl.rollout.trajectory import Trajectory
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)
from tests.train.test_trainer import coin_config, run

ENV = "tests.env.mcp.mcp_coin_env:test/SqliteMCPCoin-v0"


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_on_an_mcp_env_in_docker_then_pass_at_k(tiny_model_dir, tmp_path):  # noqa: F811
    cfg = coin_config(str(tiny_model_dir), tmp_path / "run", steps=2, lr=1e-4, env=ENV)
    # The server's five tool schemas make a prompt of about 590 tokens: room for them and the reply.
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"max_total_tokens": 1024})})
    rows = run(cfg, 1)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["policy/version"] for r in rows] == [1.0, 2.0]  # weights reached vLLM after each update
    trained = [r for r in rows if "losses/policy_loss" in r]
    assert trained and all(r["batch/action_tokens"] > 0 for r in trained)
    for r in rows:  # every episode started its server and ended by the policy's doing, not the env's
        assert r.get("rollout/env_errors", 0.0) == 0.0, r
        assert r["batch/mixed_groups"] + r["batch/all_fail_groups"] > 0, r  # the policy wrote: no empty turns
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()

    out = tmp_path / "eval"
    args = [
        "eval",
        "--env",
        "agentrl/sqlite-mcp-v0",
        "--model",
        str(tmp_path / "run" / "final"),
        "--tasks",
        "2",
    ]
    args += ["--samples", "2", "--k", "1,2", "--max-turns", "2", "--max-tokens-per-turn", "12"]
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    (model,) = json.loads(next(out.rglob("summary.json")).read_text())["models"]
    assert [p["k"] for p in model["pass_at"]] == [1, 2] and model["samples_per_task"] == 2
    assert model["finish_reasons"].get("env_error", 0) == 0, model["finish_reasons"]
    lines = next(out.rglob("episodes.jsonl")).read_text().splitlines()
    episodes = [Trajectory.from_dict(json.loads(line)["trajectory"]) for line in lines]
    assert len(episodes) == 4
    for t in episodes:  # the tools the policy was shown are the server's
        assert t.messages[0]["role"] == "system" and '"name": "read_query"' in t.messages[0]["content"]
