#!/usr/bin/env bash
# Install everything, then run lint, type checks and the whole test suite (unit, api, e2e).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
echo "[test] ruff"; "$PY" -m ruff check services trainer tests bench plugsearch
echo "[test] mypy"; "$PY" -m mypy
echo "[test] pytest"
set +e
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests"; exit 0; fi
exit "$rc"
