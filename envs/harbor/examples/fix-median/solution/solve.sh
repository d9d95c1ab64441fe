#!/bin/bash
set -e
python3 - <<'PY'
path = "/app/stats.py"
text = open(path).read()
text = text.replace(
    "    return ordered[n // 2]\n",
    "    if n % 2:\n        return ordered[n // 2]\n    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2\n",
)
open(path, "w").write(text)
PY
