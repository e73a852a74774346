#!/usr/bin/env bash
# Move the lock forward on purpose: resolve the newest versions pyproject.toml allows into a scratch folder,
# install them into a new scratch virtualenv, run the whole suite there (scripts/test.sh: ruff, mypy,
# pytest), and rewrite requirements/ only when it is green. Prints what changed either way; exits 1 (lock
# untouched) when the suite fails with the new versions, naming the failures.
#
#   bash scripts/upgrade-lock.sh           # ~20 min here: resolve, fresh install, whole suite
#
# Run it on purpose (monthly, for a security fix, or before a release), not in CI; commit the rewritten
# requirements/ with the line it prints. torch moves only by editing requirements/torch.txt (its CPU build
# comes from PyTorch's own index). PLUGSEARCH_UPGRADE_DIR moves the scratch folder (default var/upgrade-lock).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${PLUGSEARCH_UPGRADE_DIR:-var/upgrade-lock}
rm -rf "$WORK"
mkdir -p "$WORK/requirements"
cp requirements/torch.txt "$WORK/requirements/"
bash scripts/lock.sh --upgrade --out "$WORK/requirements"

changes=$WORK/changes.txt
python3 - requirements/all.txt "$WORK/requirements/all.txt" > "$changes" <<'PY'
import re
import sys

def pins(path):
    text = open(path).read()
    return {m[1].lower(): m[2] for m in re.finditer(r"(?m)^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", text)}

old, new = pins(sys.argv[1]), pins(sys.argv[2])
for name in sorted(old.keys() | new.keys()):
    if old.get(name) != new.get(name):
        print(f"  {name:32} {old.get(name, '(new)')} -> {new.get(name, '(gone)')}")
PY
if [ ! -s "$changes" ]; then
  echo "[upgrade-lock] nothing newer than the lock: requirements/ unchanged"
  exit 0
fi
echo "[upgrade-lock] $(wc -l < "$changes") packages would change:"
cat "$changes"

echo "[upgrade-lock] whole suite in a new virtualenv ($WORK/venv) with the new versions"
set +e
PLUGSEARCH_VENV=$WORK/venv PLUGSEARCH_REQUIREMENTS=$WORK/requirements bash scripts/test.sh 2>&1 | tee "$WORK/test.log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" != 0 ]; then
  echo "[upgrade-lock] the suite FAILED with the new versions (exit $rc); requirements/ unchanged. What broke:"
  grep -E '^(FAILED|ERROR) |^E  |error:|^\[install\].*(ERROR|error)' "$WORK/test.log" | head -40 || true
  echo "[upgrade-lock] full log: $WORK/test.log; the candidate lock: $WORK/requirements/"
  exit 1
fi
cp "$WORK"/requirements/all.txt "$WORK"/requirements/image-*.txt requirements/
echo "[upgrade-lock] green: requirements/ rewritten. Commit it, e.g.:"
echo "  git commit requirements/ -m \"lock: upgrade $(wc -l < "$changes") packages, suite green\" (changes above)"
