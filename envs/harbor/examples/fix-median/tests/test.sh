#!/bin/bash
# set -e: a failing test stops the script before it writes any reward (Harbor then has no
# reward file; agentrl scores that 0).
set -e
mkdir -p /logs/verifier
t="$(mktemp -d)"
cat > "$t/test_stats.py" <<'PY'
import stats


def test_odd():
    assert stats.median([3, 1, 2]) == 2


def test_even():
    assert stats.median([4, 1, 3, 2]) == 2.5


def test_mean():
    assert stats.mean([1, 2, 3]) == 2
PY
cd "$t"
PYTHONPATH=/app python3 -m pytest -q -p no:cacheprovider test_stats.py
echo 1 > /logs/verifier/reward.txt
