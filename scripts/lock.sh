#!/usr/bin/env bash
# Write the lock with uv's pip-compatible compiler (`uv pip compile`, pip-tools' requirements format):
# requirements/all.txt (every package the stack and its tests install: exact versions, sha256 hashes) and
# the images' subsets requirements/image-*.txt and llama-cpp.txt (the same pins; scripts/lock_subsets.py).
# torch is pinned in requirements/torch.txt only (installed first, on its own: see scripts/install.sh).
#
#   bash scripts/lock.sh              # keep every pin; add / drop what pyproject.toml added / dropped
#   bash scripts/lock.sh --upgrade    # the newest versions pyproject.toml allows (use scripts/upgrade-lock.sh,
#                                     # which does this in a scratch folder and keeps it only if the suite passes)
#   bash scripts/lock.sh --out DIR    # write into DIR instead of requirements/
#
# Resolves for Linux x86-64, CPython 3.11 (the images' and the machines' platform). Seconds, not minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=requirements
UPGRADE=()
while [ $# -gt 0 ]; do
  case "$1" in
    --upgrade) UPGRADE=(--upgrade) ;;
    --out) OUT=$2; shift ;;
    *) echo "unknown option: $1" >&2; exit 2 ;;
  esac
  shift
done
UV_VERSION=0.13.9
TOOLS=${PLUGSEARCH_LOCK_TOOLS:-var/lock-tools}
if ! "$TOOLS/bin/uv" --version 2>/dev/null | grep -q "^uv $UV_VERSION "; then
  echo "[lock] uv $UV_VERSION into $TOOLS"
  rm -rf "$TOOLS"
  ${PYTHON:-python3} -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q "uv==$UV_VERSION"
fi
mkdir -p "$OUT"
if [ "$OUT" != requirements ] && [ ${#UPGRADE[@]} = 0 ] && [ -f requirements/all.txt ]; then
  cp requirements/all.txt "$OUT/all.txt"  # uv keeps the pins of the file it rewrites
fi
# uv does not read pip's configuration: hand it pip's index-url (PyPI or a full mirror of it) and find-links
# (where a local CPU torch wheel may lie), on the command line only: none of them is written into the lock.
# pip's extra-index-urls are left out on purpose: a partial mirror lists only some of a release's files, and
# the lock must carry the hash of every file on PyPI so that any machine or image can check what it gets.
index_opts=()
while IFS= read -r line; do
  key=${line%%=*}; key=${key#*.}; value=${line#*=}; value=${value#\'}; value=${value%\'}
  for item in $value; do
    case "$key" in
      index-url) index_opts+=(--index-url "$item") ;;
      find-links) index_opts+=(--find-links "$item") ;;
    esac
  done
done < <(${PYTHON:-python3} -m pip config list 2>/dev/null | sort -u)
extras=()
for extra in retriever onnx milvus llm generator mcp train test otel langchain llamaindex haystack dspy; do extras+=(--extra "$extra"); done
echo "[lock] uv pip compile ${UPGRADE[*]} -> $OUT/all.txt"
start=$(date +%s)
"$TOOLS/bin/uv" pip compile -q "${UPGRADE[@]}" --generate-hashes "${extras[@]}" \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match \
  "${index_opts[@]}" --custom-compile-command "bash scripts/lock.sh" \
  -o "$OUT/all.txt" pyproject.toml requirements/torch.txt
echo "[lock] resolved in $(( $(date +%s) - start )) s: $(grep -c '^[a-z0-9]' "$OUT/all.txt") packages"
"$TOOLS/bin/python" scripts/lock_subsets.py "$OUT"
if grep -qiE '^nvidia-|^triton==' "$OUT/all.txt"; then
  echo "[lock] CUDA packages in the lock: pip found the CUDA build of torch, not the CPU one" >&2
  exit 1
fi
# pip's configuration never belongs in the lock (a machine's mirror or wheel folder)
if grep -nE '^ *(-i|--index-url|--extra-index-url|-f|--find-links|--trusted-host)|file://' "$OUT/all.txt"; then
  echo "[lock] machine-specific pip options in $OUT/all.txt" >&2
  exit 1
fi
