"""Documents put while serving: how fast they go in, what a put costs as the changes grow, how soon a search finds
them, what they cost the searches running meanwhile, the retriever's memory and restart time, before and after
compaction.

The real retriever (`python -m plugsearch.retriever`, RETRIEVER_WORKERS workers, bm25s + the MiniLM flat index over
the shared 23,652-passage corpus, the local stack's indexes in var/indexes/, a fresh change log, automatic compaction
off: RETRIEVER_COMPACT_AFTER=0) is searched by `--clients` threads (BM25 and hybrid, the shared questions in turn) for
`--seconds` without changes (the baseline), then while a writer puts documents in batches of `--batch` (`PUT
/documents`, the internal token) until `--docs` documents are in (default 1000,10000: the totals after each step),
made of real passages the corpus does not hold (the domain corpora: news, annual reports, privacy policies; past
their 30,872 passages they repeat, each document with its own made-up word). After every acknowledged batch a probe
searches (BM25) for one of its documents' words until a search returns it. After each step: `--probe-puts`
one-passage puts alone (their latency: what a change costs at this size), the retriever's memory, and a restart (its
time: the replay of every change). Then `plugsearch-index compact` folds the changes into new indexes, and the same
is measured after it (searches, one-passage puts, memory, restart).

    python bench/ingest.py [--docs 1000,10000] [--clients 8] [--seconds 30] [--batch 100] [--workers 2]

Final line: {"baseline": {...}, "steps": [{"documents_total", "passages", "passages_per_s", "put_ms": {"p50",
"p99"}, "one_passage_put_ms", "visible_s", "search", "p99_ratio", "memory_mb", "restart_s"}], "compaction":
{"seconds", "search", "p99_ratio", "one_passage_put_ms", "memory_mb", "restart_s"}, "settings": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, load_questions, log  # noqa: E402
from bench.retriever_common import ServedRetriever  # noqa: E402

TOKEN = secrets.token_hex(16)
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
SOURCES = ("realtimeqa_corpus.jsonl", "tatqa_corpus.jsonl", "policyqa_corpus.jsonl")


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


def passages() -> Iterator[tuple[str, str]]:
    """(title, text) of the domain corpora's passages, in turn, for ever."""
    while True:
        for name in SOURCES:
            with (DATA / "domain" / name).open() as fh:
                for line in fh:
                    row = json.loads(line)
                    yield row.get("title", ""), row["text"]


def documents(n: int, start: int, source: Iterator[tuple[str, str]]) -> list[dict[str, Any]]:
    """`n` one-passage documents, each tagged with its made-up word."""
    out = []
    for i in range(start, start + n):
        title, text = next(source)
        word = f"qx{i:06d}zv"
        out.append({"id": f"bench-doc-{i}", "title": title, "passages": [{"text": f"{text} {word}"}], "word": word})
    return out


def visible_after(client: httpx.Client, word: str, doc_id: str, acked: float, timeout_s: float = 60.0) -> float:
    """Seconds from `acked` to the first search that returns `doc_id`."""
    while time.perf_counter() - acked < timeout_s:
        r = client.post("/retrieve", json={"queries": [word], "k": 3})
        if r.status_code == 200 and any(d["id"].startswith(f"{doc_id}#") for d in r.json()["results"][0]):
            return time.perf_counter() - acked
        time.sleep(0.02)
    return float("inf")


def one_passage_puts(url: str, n: int, tag: str) -> dict[str, float]:
    """Latency of `n` puts of one one-passage document each (alone: no searches meanwhile)."""
    times = []
    with httpx.Client(base_url=url, timeout=120, headers=HEADERS) as client:
        for i in range(n):
            body = {"documents": [{"id": f"probe-{tag}-{i}", "passages": [{"text": f"A short probe note {tag} {i}"}]}]}
            t0 = time.perf_counter()
            r = client.put("/documents", json=body)
            times.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200:
                raise SystemExit(f"PUT /documents: {r.status_code} {r.text[:300]}")
    return {"p50": round(statistics.median(times), 1), "p99": round(percentile(times, 0.99), 1)}


def memory_mb(served: ServedRetriever) -> dict[str, float]:
    """Resident memory of the retriever's processes (supervisor and workers), and of it what is their own (RssAnon:
    not the memory-mapped index files the workers share through the page cache)."""
    from tests.support.procs import descendants

    rss = anon = 0
    for pid in descendants(served.procs["retriever"].pid):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
                elif line.startswith("RssAnon:"):
                    anon += int(line.split()[1])
        except OSError:
            continue
    return {"rss": round(rss / 1024, 1), "own": round(anon / 1024, 1)}


def started(env: dict[str, str], index_dir: Path) -> tuple[ServedRetriever, float]:
    t0 = time.perf_counter()
    served = ServedRetriever(env, index_dir=index_dir)
    return served, round(time.perf_counter() - t0, 1)


def search_for(url: str, questions: list[str], clients: int, seconds: float) -> dict[str, Any]:
    with Searchers(url, questions, clients) as searchers:
        time.sleep(seconds)
    return searchers.summary()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", default="1000,10000", help="documents put in all after each step (increasing)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0, help="the baseline's duration (and after compaction)")
    parser.add_argument("--batch", type=int, default=100, help="documents per PUT /documents")
    parser.add_argument("--workers", type=int, default=2, help="RETRIEVER_WORKERS")
    parser.add_argument("--probe-puts", type=int, default=20, help="one-passage puts timed alone after each step")
    args = parser.parse_args()
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings
    from plugsearch.stack.corpus import index_dir_for

    index_dir = index_dir_for(CORPUS, REPO / "var")  # the local stack's indexes (built when missing)
    build(RetrieverSettings(corpus=CORPUS, index_dir=index_dir, bm25=True, dense=True), bm25=["bm25s"], dense=True,
          force=False, show_progress=False)
    questions = [q.question for name in ("nq", "hotpotqa", "popqa", "2wikimultihopqa")
                 for q in load_questions(name, 100)]
    totals = [int(x) for x in args.docs.split(",")]
    changes = Path(tempfile.mkdtemp(prefix="bench-ingest-", dir=Path("var") if Path("var").is_dir() else None))
    env = {"RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "true", "RETRIEVER_WORKERS": str(args.workers),
           "RETRIEVER_INTERNAL_TOKEN": TOKEN, "RETRIEVER_CHANGES_DIR": str(changes),
           "RETRIEVER_COMPACT_AFTER": "0", "RETRIEVER_CORPUS": str(CORPUS), "RETRIEVER_INDEX_DIR": str(index_dir)}
    result: dict[str, Any] = {"steps": []}
    source = passages()
    served, ready_s = started(env, index_dir)
    try:
        log(f"retriever ready at {served.url} in {ready_s} s; baseline: {args.clients} clients for {args.seconds:.0f} s")
        result["baseline"] = search_for(served.url, questions, args.clients, args.seconds)
        result["baseline"]["memory_mb"] = memory_mb(served)
        log(f"baseline {result['baseline']}")
        added = 0
        for total in totals:
            docs = documents(total - added, added, source)
            visible: list[float] = []
            put_ms: list[float] = []
            count = 0
            writing = 0.0
            with httpx.Client(base_url=served.url, timeout=3600, headers=HEADERS) as client, \
                    Searchers(served.url, questions, args.clients) as searchers:
                for i in range(0, len(docs), args.batch):
                    batch = docs[i:i + args.batch]
                    body = {"documents": [{k: v for k, v in d.items() if k != "word"} for d in batch]}
                    t0 = time.perf_counter()
                    r = client.put("/documents", json=body)
                    acked = time.perf_counter()
                    writing += acked - t0
                    put_ms.append((acked - t0) * 1000)
                    if r.status_code != 200:
                        raise SystemExit(f"PUT /documents: {r.status_code} {r.text[:300]}")
                    count += r.json()["passages"]
                    probe = batch[len(batch) // 2]
                    visible.append(visible_after(client, probe["word"], probe["id"], acked))
            added = total
            search = searchers.summary()
            entry: dict[str, Any] = {
                "documents_total": total, "passages": count,
                "passages_per_s": round(count / writing, 1) if writing else 0.0,
                "put_ms": {"p50": round(statistics.median(put_ms), 1), "p99": round(percentile(put_ms, 0.99), 1),
                           "documents_per_put": args.batch},
                "visible_s": {"p50": round(statistics.median(visible), 3), "max": round(max(visible), 3)},
                "search": search, "p99_ratio": round(search["p99_ms"] / max(1e-9, result["baseline"]["p99_ms"]), 3)}
            entry["one_passage_put_ms"] = one_passage_puts(served.url, args.probe_puts, f"s{total}")
            entry["memory_mb"] = memory_mb(served)
            served.__exit__(None, None, None)
            served, entry["restart_s"] = started(env, index_dir)
            entry["memory_mb_after_restart"] = memory_mb(served)
            result["steps"].append(entry)
            log(f"step {entry}")
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "plugsearch.retriever.cli", "compact", "--quiet"], cwd=REPO,
                              env={**os.environ, **env}, capture_output=True, text=True, check=False)
        compaction: dict[str, Any] = {"seconds": round(time.perf_counter() - t0, 1)}
        if done.returncode != 0:
            raise SystemExit(f"plugsearch-index compact failed ({done.returncode}): {done.stderr[-2000:]}")
        compaction["generation"] = json.loads(done.stdout.strip().splitlines()[-1])
        deadline = time.monotonic() + 600
        while served.log_text("retriever").count("serving generation") < args.workers and time.monotonic() < deadline:
            time.sleep(0.5)
        compaction["switched_s"] = round(time.perf_counter() - t0, 1)
        log(f"compacted: {compaction}")
        served.__exit__(None, None, None)
        served, compaction["restart_s"] = started(env, index_dir)
        compaction["memory_mb_after_restart"] = memory_mb(served)
        compaction["search"] = search_for(served.url, questions, args.clients, args.seconds)
        compaction["p99_ratio"] = round(compaction["search"]["p99_ms"] / max(1e-9, result["baseline"]["p99_ms"]), 3)
        compaction["one_passage_put_ms"] = one_passage_puts(served.url, args.probe_puts, "compacted")
        result["compaction"] = compaction
        version = httpx.get(f"{served.url}/version", headers=HEADERS, timeout=30).json()["details"]
    finally:
        served.__exit__(None, None, None)
        shutil.rmtree(changes, ignore_errors=True)  # the log and its generations: hundreds of MB at 10,000
    result["settings"] = {"clients": args.clients, "baseline_seconds": args.seconds, "batch": args.batch,
                          "workers": args.workers, "poll_s": 0.5, "corpus_passages": 23652,
                          "served_after": version.get("documents"), "changes": version.get("changes"),
                          "search": "k 30, bm25 and hybrid in turn, the shared questions' rows 0-99"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
