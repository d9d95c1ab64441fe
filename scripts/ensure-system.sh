#!/usr/bin/env bash
# System pieces the sandboxes need: a Docker engine that answers, debootstrap (offline base
# images) and bubblewrap (the daemonless backend). When something is missing and we are root
# on Debian, install it and start dockerd; otherwise say what to do. Idempotent.
set -euo pipefail
log() { printf '[system] %s\n' "$*" >&2; }

missing=()
# An engine that already answers (a local one, or DOCKER_HOST) needs no dockerd here.
if ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null 2>&1; then missing+=(docker.io); fi
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
  else
    log "missing: ${missing[*]}. Install them (Debian/Ubuntu: sudo apt-get install ${missing[*]}) and run this again."
    exit 1
  fi
fi

if docker info >/dev/null 2>&1; then log "docker engine answers"; exit 0; fi
if [ "$(id -u)" != "0" ]; then
  log "no Docker engine answers and we are not root. Start one (e.g. 'sudo systemctl start docker')"
  log "or add yourself to the docker group, then run this again."
  exit 1
fi
log "starting dockerd (log: /var/log/agentrl-dockerd.log)"
# setsid + nohup: the daemon must outlive this script and the make/pytest that called it.
setsid nohup dockerd >/var/log/agentrl-dockerd.log 2>&1 < /dev/null &
for _ in $(seq 1 90); do
  if docker info >/dev/null 2>&1; then log "docker engine answers"; exit 0; fi
  sleep 1
done
log "dockerd did not answer within 90 s; its log (/var/log/agentrl-dockerd.log) ends with:"
tail -n 20 /var/log/agentrl-dockerd.log >&2 || true
exit 1
