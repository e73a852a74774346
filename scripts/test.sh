#!/usr/bin/env bash
# Install everything from the lock into the project's virtualenv (scripts/install.sh --all), then run lint, type
# checks, the documentation site's strict build (a broken link fails) and the whole test suite (unit, api, e2e)
# with it. PLUGSEARCH_VENV picks the virtualenv (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --all
VENV=${PLUGSEARCH_VENV:-.venv}
PY=$VENV/bin/python
# the suite starts the stack's console scripts (plugsearch-*) by name: the virtualenv's come first
export PATH="$(cd "$VENV/bin" && pwd):$PATH"
echo "[test] ruff"; "$PY" -m ruff check plugsearch tests bench
echo "[test] mypy"; "$PY" -m mypy
echo "[test] docs"; "$PY" -m mkdocs build --strict --site-dir var/site   # var/ is git-ignored
echo "[test] pytest ($("$PY" -c 'import sys; print(sys.prefix)'))"
set +e
"$PY" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "[test] pytest collected no tests"; exit 0; fi
exit "$rc"
