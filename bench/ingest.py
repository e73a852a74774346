"""Documents put while serving: how fast they go in, how soon a search finds them, and what the changes cost the
searches running meanwhile.

The real retriever (`python -m plugsearch.retriever`, RETRIEVER_WORKERS workers, bm25s + the MiniLM flat index over
the shared 23,652-passage corpus, the local stack's indexes in var/indexes/, a fresh change log) is searched by `--clients` threads (BM25 and hybrid, the
shared questions in turn) for `--seconds` without changes (the baseline), then while a writer puts documents in
batches (`PUT /documents`, the internal token): first `--docs` (default 1000,10000: each step adds that many
more), made of real passages the corpus does not hold (the realtimeqa development corpus: news), each document
tagged with a made-up word. After every acknowledged batch a probe searches (BM25) for one of its documents'
words until a search returns it: the seconds from the acknowledgement to that search (through any worker; the
others read the log every RETRIEVER_CHANGES_POLL_S). Passages per second are counted over the writer's requests,
dense encoding included.

    python bench/ingest.py [--docs 1000,10000] [--clients 8] [--seconds 30] [--batch 100] [--workers 2]

Final line: {"baseline": {"searches", "p50_ms", "p99_ms", "errors"}, "steps": [{"documents", "passages",
"passages_per_s", "visible_s": {"p50", "max"}, "search": {...}, "p99_ratio"}], "settings": {...}}
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, load_questions, log  # noqa: E402
from bench.retriever_common import ServedRetriever  # noqa: E402

TOKEN = secrets.token_hex(16)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Searchers:
    """`n` threads searching in turn until stopped, each latency and error recorded."""

    def __init__(self, url: str, questions: list[str], n: int) -> None:
        self.url, self.questions, self.n = url, questions, n
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60, headers=HEADERS) as client:
            j = i
            while not self._stop.is_set():
                q = self.questions[j % len(self.questions)]
                method = "hybrid" if j % 2 else "bm25"
                t0 = time.perf_counter()
                try:
                    r = client.post("/retrieve", json={"queries": [q], "k": 30, "method": method})
                    if r.status_code != 200:
                        self.errors.append(f"{r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                self.latencies.append((time.perf_counter() - t0) * 1000)
                j += self.n

    def __enter__(self) -> Searchers:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def summary(self) -> dict[str, Any]:
        return {"searches": len(self.latencies), "p50_ms": round(percentile(self.latencies, 0.5), 2),
                "p99_ms": round(percentile(self.latencies, 0.99), 2), "errors": len(self.errors),
                "first_errors": self.errors[:3]}


def documents(n: int, start: int) -> list[dict[str, Any]]:
    """`n` documents of real news passages (one each), each tagged with its made-up word."""
    out = []
    with (DATA / "domain" / "realtimeqa_corpus.jsonl").open() as fh:
        for i, line in enumerate(fh):
            if i < start:
                continue
            if len(out) == n:
                break
            row = json.loads(line)
            word = f"qx{start + len(out):06d}zv"
            out.append({"id": f"bench-doc-{start + len(out)}", "title": row["title"],
                        "passages": [{"text": f"{row['text']} {word}"}], "word": word})
    return out


def visible_after(client: httpx.Client, word: str, doc_id: str, acked: float, timeout_s: float = 60.0) -> float:
    """Seconds from `acked` to the first search that returns `doc_id`."""
    while time.perf_counter() - acked < timeout_s:
        r = client.post("/retrieve", json={"queries": [word], "k": 3})
        if r.status_code == 200 and any(d["id"].startswith(f"{doc_id}#") for d in r.json()["results"][0]):
            return time.perf_counter() - acked
        time.sleep(0.02)
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", default="1000,10000", help="documents added by each step (cumulative)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0, help="the baseline's duration")
    parser.add_argument("--batch", type=int, default=100, help="documents per PUT /documents")
    parser.add_argument("--workers", type=int, default=2, help="RETRIEVER_WORKERS")
    args = parser.parse_args()
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings
    from plugsearch.stack.corpus import index_dir_for

    index_dir = index_dir_for(CORPUS, REPO / "var")  # the local stack's indexes (built when missing)
    build(RetrieverSettings(corpus=CORPUS, index_dir=index_dir, bm25=True, dense=True), bm25=["bm25s"], dense=True,
          force=False, show_progress=False)
    questions = [q.question for name in ("nq", "hotpotqa", "popqa", "2wikimultihopqa")
                 for q in load_questions(name, 100)]
    steps = [int(x) for x in args.docs.split(",")]
    changes = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=Path("var") if Path("var").is_dir() else None))
    env = {"RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "true", "RETRIEVER_WORKERS": str(args.workers),
           "RETRIEVER_INTERNAL_TOKEN": TOKEN, "RETRIEVER_CHANGES_DIR": str(changes)}
    result: dict[str, Any] = {"steps": []}
    with ServedRetriever(env, index_dir=index_dir) as served:
        log(f"retriever ready at {served.url}; baseline: {args.clients} clients for {args.seconds:.0f} s")
        with Searchers(served.url, questions, args.clients) as searchers:
            time.sleep(args.seconds)
        result["baseline"] = searchers.summary()
        log(f"baseline {result['baseline']}")
        added = 0
        with httpx.Client(base_url=served.url, timeout=600, headers=HEADERS) as client:
            for step in steps:
                docs = documents(step, added)
                visible: list[float] = []
                passages = 0
                writing = 0.0
                with Searchers(served.url, questions, args.clients) as searchers:
                    for i in range(0, len(docs), args.batch):
                        batch = docs[i:i + args.batch]
                        body = {"documents": [{k: v for k, v in d.items() if k != "word"} for d in batch]}
                        t0 = time.perf_counter()
                        r = client.put("/documents", json=body)
                        acked = time.perf_counter()
                        writing += acked - t0
                        if r.status_code != 200:
                            raise SystemExit(f"PUT /documents: {r.status_code} {r.text[:300]}")
                        passages += r.json()["passages"]
                        probe = batch[len(batch) // 2]
                        visible.append(visible_after(client, probe["word"], probe["id"], acked))
                added += step
                search = searchers.summary()
                entry = {"documents": step, "documents_total": added, "passages": passages,
                         "passages_per_s": round(passages / writing, 1) if writing else 0.0,
                         "visible_s": {"p50": round(statistics.median(visible), 3), "max": round(max(visible), 3)},
                         "search": search,
                         "p99_ratio": round(search["p99_ms"] / max(1e-9, result["baseline"]["p99_ms"]), 3)}
                result["steps"].append(entry)
                log(f"step {entry}")
        version = httpx.get(f"{served.url}/version", headers=HEADERS, timeout=30).json()["details"]
    result["settings"] = {"clients": args.clients, "baseline_seconds": args.seconds, "batch": args.batch,
                          "workers": args.workers, "poll_s": 0.5, "corpus_passages": 23652,
                          "served_after": version.get("documents"), "changes": version.get("changes"),
                          "search": "k 30, bm25 and hybrid in turn, the shared questions' rows 0-99"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
