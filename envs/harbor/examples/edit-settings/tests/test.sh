#!/bin/bash
# Reward 1 when [server] has debug = false and port = 8080 and nothing else changed.
mkdir -p /logs/verifier
python3 - <<'PY'
import configparser
c = configparser.ConfigParser()
ok = False
try:
    c.read("/app/settings.ini")
    s, d = c["server"], c["database"]
    ok = (
        s.get("debug", "").strip().lower() == "false"
        and s.get("port", "").strip() == "8080"
        and s.get("host", "").strip() == "0.0.0.0"
        and d.get("url") == "sqlite:///data.db"
        and d.get("pool") == "4"
    )
except Exception as exc:
    print("settings.ini is not readable:", exc)
print("ok" if ok else "not ok")
open("/logs/verifier/reward.txt", "w").write("1\n" if ok else "0\n")
PY
