"""The judge against a real model: the kit's tiny checkpoint served by vLLM's OpenAI server on this machine
(random weights, the only model offline: a real endpoint and a useless judge).

- The judge attacks of the audit, free and constrained (benchmarks/judge_audit.py, two tasks here): whatever
  the model writes, a verdict is a judged score in [0, 1] or not judged (reward 0, masked), an empty answer
  scores 0, and a free tiny model's ramble is never read as a score.
- A judged env trained end to end: two GRPO steps on `test/SupportJudge-v0`, every reward from the judge
  (constrained, so a random model's replies are in format), weights pushed after each update.
"""

from __future__ import annotations

import pytest

from benchmarks.judge_audit import JUDGE_ATTACKS, audit
from tests.fixtures_model import tiny_model_dir  # noqa: F401  (pytest fixture)
from tests.train.test_trainer import coin_config, run

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def judge_url(tiny_model_dir):  # noqa: F811
    from agentrl.kit.judge_server import serve_judge

    with serve_judge(tiny_model_dir) as url:
        yield url


def test_judge_attacks_against_a_real_model_free_and_constrained(judge_url):
    free, constrained = audit(judge_url, 2, False), audit(judge_url, 2, True)
    for mode in (free, constrained):
        rows = mode["attacks"]
        assert set(rows) == set(JUDGE_ATTACKS) and all(
            r["errors"] == 0 and r["episodes"] == 2 for r in rows.values()
        )
        assert rows["judge-empty"]["exploited"] == 0 and rows["judge-empty"]["mean_reward"] == 0.0
        assert all(0.0 <= r["mean_reward"] <= 1.0 for r in rows.values())
    # A free random model never writes `SCORES <nonce>` and its scores: nothing it says pays.
    assert all(
        r["judged"] == 0 and r["exploited"] == 0 for n, r in free["attacks"].items() if n != "judge-empty"
    )
    # Constrained, every reply is in format: each attack's episode got a judged score, but the overlong one,
    # whose 8,000 characters shown overflow this judge's 2,048-token context: refused, not judged, paid nothing.
    rows = constrained["attacks"]
    assert all(r["judged"] == 2 for n, r in rows.items() if n != "judge-overlong")
    assert rows["judge-overlong"]["judged"] == 0 and rows["judge-overlong"]["mean_reward"] == 0.0


def test_grpo_on_a_judged_env_with_a_tiny_local_judge(judge_url, tiny_model_dir, tmp_path):  # noqa: F811
    env = "tests.verifiers.judge_env:test/SupportJudge-v0"
    cfg = coin_config(
        str(tiny_model_dir), tmp_path / "run", steps=2, lr=1e-4, env=env, env_kwargs={"judge_url": judge_url}
    )
    rows = run(cfg, 1)
    assert [r["step"] for r in rows] == [1, 2] and [r["policy/version"] for r in rows] == [1.0, 2.0]
    trained = [r for r in rows if "losses/policy_loss" in r]
    assert trained and all(r["batch/action_tokens"] > 0 for r in trained)
    assert all(r.get("rollout/env_errors", 0.0) == 0.0 for r in rows)
