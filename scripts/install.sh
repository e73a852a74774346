#!/usr/bin/env bash
# Install everything the stack and its tests need into the project's virtualenv, from the lock: the exact,
# hash-checked versions in requirements/ (see README "Dependencies and the lock"), never whatever PyPI has
# today. Idempotent: a stamp in the virtualenv (keyed by the lock files, pyproject.toml and this script)
# skips pip when nothing changed.
#
#   PLUGSEARCH_VENV  the virtualenv (default .venv in the repository); created when missing
#   PYTHON           the interpreter it is created from (default python3; 3.11 or newer)
#   PLUGSEARCH_REQUIREMENTS  the lock's folder (default requirements; scripts/upgrade-lock.sh tries another)
#   TORCH_INDEX_URL  where the CPU torch comes from (default: pip's configured index and find-links)
#
# Order: CPU PyTorch alone first (requirements/torch.txt, --no-deps: from a local CPU wheel, or PyTorch's CPU
# index), so that nothing pulls the CUDA build; then every other package from
# requirements/all.txt with --require-hashes; then the project itself, editable, without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PLUGSEARCH_VENV:-.venv}
PY=${PYTHON:-python3}
REQ=${PLUGSEARCH_REQUIREMENTS:-requirements}
LOCK=$REQ/all.txt

apt_get() {
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null)
}

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] redis-server (apt)"
    apt_get redis-server || echo "[install] redis-server not installed: the stack falls back to the in-process cache"
  else
    echo "[install] redis-server missing and apt unavailable: the stack uses the in-process cache"
  fi
fi

# The search playground's browser test drives Debian's chromium (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] chromium (apt, for the playground's browser test)"
    apt_get chromium || echo "[install] chromium not installed: the playground's browser test will be skipped"
  else
    echo "[install] chromium missing and apt unavailable: the playground's browser test will be skipped"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] new virtualenv $VENV ($("$PY" --version 2>&1))"
  if ! "$PY" -m venv "$VENV" 2>/dev/null; then
    # Debian's python3 keeps venv (ensurepip) in a package of its own
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      rm -rf "$VENV"
      apt_get python3-venv
      "$PY" -m venv "$VENV"
    else
      echo "[install] $PY -m venv failed (Debian: apt-get install python3-venv)" >&2
      exit 1
    fi
  fi
fi
VPY=$VENV/bin/python

stamp=$VENV/.plugsearch-lock
want=$(cat "$REQ"/torch.txt "$LOCK" pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/plugsearch-stack" ]; then
  echo "[install] $VENV already matches the lock ($want)"
  exit 0
fi

# (a pip configuration with several indexes warns about every one that lacks a package: noise, dropped here)
pip_cmd() {
  echo "[install] + pip $*"
  "$VPY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
start=$(date +%s)
pip_cmd install -q --no-deps -r "$REQ/torch.txt" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# llama-cpp-python compiles from source the first time (minutes); pip's wheel cache keeps the result.
pip_cmd install -q --require-hashes -r "$LOCK"
pip_cmd install -q --no-deps --no-build-isolation -e .  # built with the locked setuptools
pip_cmd check
echo "$want" > "$stamp"
echo "[install] $VENV: $("$VPY" -m pip list --format=freeze 2>/dev/null | wc -l) packages from $LOCK" \
  "(torch $("$VPY" -c 'import torch; print(torch.__version__)'), $(( $(date +%s) - start )) s)"
