"""`benchmarks/forgers.py report`: the rates of the forger classes over every played part, with what chance
alone would give (a class whose signal is gone plays like a coin with a perfect pair detector)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "forgers.py"


@pytest.fixture(scope="module")
def forgers():
    spec = importlib.util.spec_from_file_location("forgers_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_chance_tail_is_the_poisson_binomial_one(forgers) -> None:
    assert forgers._tail(0, [0.3, 0.5]) == 1.0
    assert forgers._tail(1, [1 / 82] * 32) == pytest.approx(1 - (1 - 1 / 82) ** 32)
    assert forgers._tail(2, [0.5, 0.5]) == pytest.approx(0.25)
    assert forgers._tail(2, [0.2, 0.5, 0.5]) == pytest.approx(0.2 * 0.75 + 0.8 * 0.25)


def test_the_upper_bound_of_a_rate_is_clopper_pearson(forgers) -> None:
    assert forgers._upper_95(0, 32) == pytest.approx(1 - 0.05 ** (1 / 32))
    bound = forgers._upper_95(1, 32)  # at the bound, seeing 1 win or fewer has probability 5%
    assert sum(math.comb(32, k) * bound**k * (1 - bound) ** (32 - k) for k in range(2)) == pytest.approx(0.05)
    assert forgers._upper_95(5, 5) == 1.0


def test_report_merges_every_part_of_a_backend_and_says_what_chance_gives(
    forgers, tmp_path, monkeypatch
) -> None:
    parts = tmp_path / "forgers"
    parts.mkdir()

    def part(name: str, wins: int, episodes: int, controls: bool) -> None:
        records = [
            {"task": f"t{i % 4}", "package": "parse", "class": "coin", "reward": float(i < wins),
             "passed": i < wins, "tampered": False, "odds": 32}
            for i in range(episodes)
        ]  # fmt: skip
        ctrl = [
            {"task": f"t{i}", "package": "parse", "fix_reward": 1.0, "bug_reward": 0.0, "tampering_on_the_fix": False}
            for i in range(4)
        ] if controls else []  # fmt: skip
        (parts / f"{name}.json").write_text(json.dumps({"records": records, "controls": ctrl}))

    part("play-docker-a", 1, 8, controls=True)
    part("play-docker-b", 0, 24, controls=False)
    monkeypatch.setattr(forgers, "PARTS", parts)
    monkeypatch.setattr(forgers, "RESULTS", tmp_path)
    out = forgers.report(None)
    coin = out["docker"]["forgers"]["coin"]
    assert (coin["episodes"], coin["tasks"], coin["wins"]) == (32, 4, 1)
    assert coin["expected_blind_wins"] == 1.0
    assert coin["p_blind_guesses_win_as_often"] == pytest.approx(1 - (31 / 32) ** 32, abs=1e-4)
    assert coin["reward_rate_upper_95"] == pytest.approx(forgers._upper_95(1, 32), abs=1e-4)
    assert out["docker"]["controls"]["fix_scored_1"] == 4 and "bwrap" not in out
    assert json.loads((tmp_path / "forgers.json").read_text()) == out
