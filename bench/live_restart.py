"""What a change costs as changes pile up, and what they cost a restart: the real retriever (one worker, bm25s over
the shared 23,652-passage corpus, a fresh change log, no compaction) takes `--probe` one-passage puts (their
latency), then `--large` large documents (`--large-passages` passages each, real news passages with `--unique-words` made-up words each), the one-passage
puts again, then `--changes` changes of one document each; then it is restarted: the seconds until it is ready (the
whole log replayed).

`--code DIR` runs the retriever from another checkout (its `plugsearch` package first on the path), to measure the
same workload before a change: e.g. a worktree of the commit before compaction.

    python bench/live_restart.py [--changes 1000] [--large 5] [--large-passages 1000] [--code DIR]

Final line: {"one_passage_put_ms": {"before_large", "after_large", "after_changes"}, "large_put_s", "changes_s",
"restart_s", "settings": {...}}
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, log  # noqa: E402
from bench.retriever_common import INDEX_DIR, ServedRetriever, ensure_indexes  # noqa: E402

TOKEN = secrets.token_hex(16)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def news(n: int, skip: int = 0) -> list[tuple[str, str]]:
    with (DATA / "domain" / "realtimeqa_corpus.jsonl").open() as fh:
        rows = [json.loads(line) for _, line in zip(range(skip + n), fh, strict=False)][skip:]
    return [(r["title"], r["text"]) for r in rows]


def one_passage_puts(client: httpx.Client, n: int, tag: str) -> dict[str, float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        r = client.put("/documents", json={"documents": [{"id": f"probe-{tag}-{i}",
                                                          "passages": [{"text": f"A probe note {tag} {i}"}]}]})
        times.append((time.perf_counter() - t0) * 1000)
        r.raise_for_status()
    return {"p50": round(statistics.median(times), 1), "max": round(max(times), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=1000, help="changes of one document each")
    parser.add_argument("--large", type=int, default=5, help="large documents put first")
    parser.add_argument("--large-passages", type=int, default=1000, help="passages of each large document")
    parser.add_argument("--probe", type=int, default=20, help="one-passage puts timed at each point")
    parser.add_argument("--unique-words", type=int, default=5, help="made-up words in each passage of the large "
                        "documents (part numbers and codes, as manuals and reports hold): the overlay's vocabulary")
    parser.add_argument("--dense", action="store_true", help="serve the MiniLM flat index too (the local stack's): "
                        "every passage put is encoded, and its vector kept")
    parser.add_argument("--code", type=Path, help="run the retriever from this checkout instead of this one")
    args = parser.parse_args()
    index_dir = INDEX_DIR
    if args.dense:
        from plugsearch.retriever.indexing.build import build
        from plugsearch.retriever.settings import RetrieverSettings
        from plugsearch.stack.corpus import index_dir_for

        index_dir = index_dir_for(CORPUS, REPO / "var")
        build(RetrieverSettings(corpus=CORPUS, index_dir=index_dir, bm25=True, dense=True), bm25=["bm25s"],
              dense=True, force=False, show_progress=False)
    else:
        ensure_indexes(bm25=["bm25s"], dense=False)
    work = Path(tempfile.mkdtemp(prefix="bench-restart-", dir=REPO / "var"))
    env = {"RETRIEVER_BM25": "true", "RETRIEVER_DENSE": str(args.dense).lower(), "RETRIEVER_WORKERS": "1",
           "RETRIEVER_INTERNAL_TOKEN": TOKEN, "RETRIEVER_CHANGES_DIR": str(work / "changes"),
           "RETRIEVER_COMPACT_AFTER": "0", "RETRIEVER_MAX_BODY_BYTES": str(64 << 20)}  # large documents in one put
    if args.code is not None:  # that checkout's package, not this one's (`python -m` puts the current folder first)
        env.update(PYTHONPATH=str(args.code.resolve()), PYTHONSAFEPATH="1")
    result: dict[str, Any] = {"one_passage_put_ms": {}}
    texts = news(args.large * args.large_passages + args.changes)
    try:
        with ServedRetriever(env, index_dir=index_dir) as served, \
                httpx.Client(base_url=served.url, timeout=3600, headers=HEADERS) as client:
            result["one_passage_put_ms"]["before_large"] = one_passage_puts(client, args.probe, "a")
            t0 = time.perf_counter()
            for d in range(args.large):
                part = texts[d * args.large_passages:(d + 1) * args.large_passages]
                codes = [" ".join(f"k{d}x{i}w{j}" for j in range(args.unique_words)) for i in range(len(part))]
                client.put("/documents", json={"documents": [{"id": f"large-{d}", "passages": [
                    {"title": t, "text": f"{x} {c}"} for (t, x), c in zip(part, codes, strict=True)]}]}
                           ).raise_for_status()
            result["large_put_s"] = round(time.perf_counter() - t0, 1)
            result["one_passage_put_ms"]["after_large"] = one_passage_puts(client, args.probe, "b")
            t0 = time.perf_counter()
            rest = texts[args.large * args.large_passages:]
            for n, (title, text) in enumerate(rest):
                client.put("/documents", json={"documents": [{"id": f"news-{n}", "title": title,
                                                              "passages": [{"text": text}]}]}).raise_for_status()
            result["changes_s"] = round(time.perf_counter() - t0, 1)
            result["one_passage_put_ms"]["after_changes"] = one_passage_puts(client, args.probe, "c")
            log(f"before the restart: {result}")
        t0 = time.perf_counter()
        with ServedRetriever(env, index_dir=index_dir) as again:
            result["restart_s"] = round(time.perf_counter() - t0, 1)
            details = httpx.get(f"{again.url}/version", timeout=30).json()["details"]
            result["changes_after_restart"] = details.get("changes")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["settings"] = {"changes": args.changes, "large": args.large, "large_passages": args.large_passages,
                          "unique_words": args.unique_words, "dense": args.dense,
                          "code": str(args.code) if args.code else "this checkout", "corpus_passages": 23652}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
