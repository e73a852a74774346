"""Documents put while the dense index is still building: does the retriever keep answering when the build lands and
the passages put meanwhile are encoded (the dense catch-up), and does a restart encode them again?

The real retriever (`python -m plugsearch.retriever`, one worker, RETRIEVER_DENSE_MISSING=build: BM25 serves while a
child builds the MiniLM flat index) over the first `--base` passages of the shared corpus (a fresh index folder, so
the dense build runs), while a writer puts `--passages` one-passage news documents (the realtimeqa development
corpus) in batches of `--batch`, before the dense index lands. Meanwhile one thread asks `/health/live` every 0.1 s
(30 s timeout) and two search (BM25 and, once served, hybrid). Then the catch-up: from the dense index's arrival until
`/version` says no passage waits for its vector. Then a restart: its time, and whether anything was encoded again.

    python bench/live_catchup.py [--base 3000] [--passages 20000] [--batch 500]

The acceptance criterion of the run: `/health/live` answered every probe within 1 s throughout (`health_live.max_ms`).
Final line: {"passages_put", "put_s", "dense_ready_s", "catch_up_s", "catch_up_passages_per_s", "health_live": {...},
"search": {...}, "restart": {...}, "live_within_1s": bool, "settings": {...}}
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, log  # noqa: E402
from bench.retriever_common import ServedRetriever  # noqa: E402

TOKEN = secrets.token_hex(16)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Probe(threading.Thread):
    """`GET path` every `every_s` (or a search, with `body`), each latency and failure recorded with its time."""

    def __init__(self, url: str, path: str, every_s: float, body: Any = None) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.every_s, self.body = url, path, every_s, body
        self.samples: list[tuple[float, float, bool]] = []  # (time, ms, ok)
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30, headers=HEADERS) as client:
            n = 0
            while not self.halt.is_set():
                t0 = time.perf_counter()
                try:
                    if self.body is None:
                        ok = client.get(self.path).status_code == 200
                    else:
                        ok = client.post(self.path, json=self.body(n)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.samples.append((time.monotonic(), (time.perf_counter() - t0) * 1000, ok))
                n += 1
                self.halt.wait(self.every_s)

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        ms = [m for t, m, _ in self.samples if since <= t <= until]
        failed = sum(1 for t, _, ok in self.samples if since <= t <= until and not ok)
        return {"probes": len(ms), "p50_ms": round(percentile(ms, 0.5), 1), "p99_ms": round(percentile(ms, 0.99), 1),
                "max_ms": round(max(ms), 1) if ms else 0.0, "over_1s": sum(1 for m in ms if m > 1000),
                "failures": failed}


def news(n: int) -> list[dict[str, Any]]:
    out = []
    with (DATA / "domain" / "realtimeqa_corpus.jsonl").open() as fh:
        for i, line in enumerate(fh):
            if i == n:
                break
            row = json.loads(line)
            out.append({"id": f"late-{i}", "title": row["title"], "passages": [{"text": row["text"]}]})
    return out


def version(url: str) -> dict[str, Any]:
    details: dict[str, Any] = httpx.get(f"{url}/version", timeout=30).json()["details"]
    return details


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=int, default=3000, help="passages of the built corpus (its dense index is built "
                        "while the documents are put)")
    parser.add_argument("--passages", type=int, default=20000, help="one-passage documents put during the build")
    parser.add_argument("--batch", type=int, default=500, help="documents per PUT /documents")
    args = parser.parse_args()
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings

    work = Path(tempfile.mkdtemp(prefix="bench-catchup-", dir=REPO / "var"))
    corpus = work / "base.jsonl"
    with CORPUS.open("rb") as src, corpus.open("wb") as dst:
        for _, line in zip(range(args.base), src, strict=False):
            dst.write(line)
    index_dir = work / "indexes"
    build(RetrieverSettings(corpus=corpus, index_dir=index_dir, bm25=True, dense=False), bm25=["bm25s"], dense=False,
          force=False, show_progress=False)
    env = {"RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "true", "RETRIEVER_DENSE_MISSING": "build",
           "RETRIEVER_INTERNAL_TOKEN": TOKEN, "RETRIEVER_CHANGES_DIR": str(work / "changes"),
           "RETRIEVER_COMPACT_AFTER": "0", "RETRIEVER_WORKERS": "1", "RETRIEVER_DENSE_POLL_S": "1"}
    documents = news(args.passages)
    result: dict[str, Any] = {"settings": {"base": args.base, "passages": len(documents), "batch": args.batch,
                                           "encoder": "all-MiniLM-L6-v2 (onnx)", "workers": 1}}
    try:
        t_start = time.monotonic()
        with ServedRetriever(env, corpus=corpus, index_dir=index_dir) as served:
            url = served.url
            live = Probe(url, "/health/live", 0.1)
            searches = Probe(url, "/retrieve", 0.05, body=lambda n: {"queries": [f"news about the election {n}"],
                                                                     "k": 10, "method": "bm25"})
            live.start()
            searches.start()
            t_put = time.monotonic()
            with httpx.Client(base_url=url, timeout=600, headers=HEADERS) as client:
                for i in range(0, len(documents), args.batch):
                    r = client.put("/documents", json={"documents": documents[i:i + args.batch]})
                    if r.status_code != 200:
                        raise SystemExit(f"PUT /documents: {r.status_code} {r.text[:300]}")
            result["put_s"] = round(time.monotonic() - t_put, 1)
            details = version(url)
            result["passages_put"] = details["changes"]["passages"]
            result["put_before_dense"] = "dense" not in details["methods"]
            log(f"put {result['passages_put']} passages in {result['put_s']} s; dense served yet: "
                f"{not result['put_before_dense']}")
            while "dense" not in (details := version(url))["methods"]:
                time.sleep(0.5)
            t_dense = time.monotonic()
            result["dense_ready_s"] = round(t_dense - t_start, 1)
            log(f"dense index served {result['dense_ready_s']} s after the start; catch-up: "
                f"{details['changes']['pending_vectors']} passages to encode")
            while (details := version(url))["changes"]["pending_vectors"]:
                time.sleep(1.0)
            t_done = time.monotonic()
            result["catch_up_s"] = round(t_done - t_dense, 1)
            result["catch_up_passages_per_s"] = round(len(documents) / max(1e-9, t_done - t_dense), 1)
            live.halt.set()
            searches.halt.set()
            live.join(timeout=60)
            searches.join(timeout=60)
            result["health_live"] = live.summary()
            result["health_live_during_catch_up"] = live.summary(t_dense, t_done)
            result["search"] = {"during_catch_up": searches.summary(t_dense, t_done),
                                "before_dense": searches.summary(t_put, t_dense)}
            result["live_within_1s"] = result["health_live"]["max_ms"] < 1000 and not result["health_live"]["failures"]
            log(f"catch-up {result['catch_up_s']} s; /health/live {result['health_live']}")
        env["RETRIEVER_DENSE_MISSING"] = "refuse"
        t0 = time.monotonic()
        with ServedRetriever(env, corpus=corpus, index_dir=index_dir) as again:
            ready_s = time.monotonic() - t0
            details = version(again.url)
            encoded_again = "dense catch-up" in again.log_text("retriever")
            result["restart"] = {"ready_s": round(ready_s, 1), "pending_vectors": details["changes"]["pending_vectors"],
                                 "encoded_again": encoded_again}
            log(f"restart: {result['restart']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
