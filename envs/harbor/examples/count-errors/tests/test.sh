#!/bin/bash
# Reward 1 when /app/report.txt is exactly the expected counts.
mkdir -p /logs/verifier
if diff <(sed -e 's/[[:space:]]*$//' /app/report.txt 2>/dev/null) /tests/expected.txt; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
