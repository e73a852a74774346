#!/usr/bin/env bash
# Install everything the stack and its tests need, idempotently (fast when already installed).
# CPU PyTorch first, so nothing later pulls the CUDA build; then the project with all extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] redis-server (apt)"
    (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
      || echo "[install] redis-server not installed: the stack falls back to the in-process cache"
  else
    echo "[install] redis-server missing and apt unavailable: the stack uses the in-process cache"
  fi
fi

# The search playground's browser test drives Debian's chromium (Playwright never downloads a browser here).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
    && ! command -v google-chrome >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] chromium (apt, for the playground's browser test)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "[install] chromium not installed: the playground's browser test will be skipped"
  else
    echo "[install] chromium missing and apt unavailable: the playground's browser test will be skipped"
  fi
fi

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "[install] CPU PyTorch 2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi

# llama-cpp-python compiles from source (a few minutes the first time; pip caches the wheel).
echo "[install] plugsearch and its extras"
"$PY" -m pip install -q -e ".[all]"
