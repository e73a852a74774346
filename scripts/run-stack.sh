#!/usr/bin/env bash
# Install what is missing into the project's virtualenv, from the lock (scripts/install.sh: skipped in a
# second when the virtualenv already matches it), then start the whole local stack (Redis, llama.cpp +
# SmolLM2, retriever, generator, judge, searcher) and wait until `POST /search` answers. Extra arguments go
# to plugsearch-stack. PLUGSEARCH_VENV picks the virtualenv (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${PLUGSEARCH_VENV:-.venv}
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
exec "$VENV/bin/plugsearch-stack" "$@"
