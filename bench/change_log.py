"""The change log's store: SQLite in write-ahead-log mode (`plugsearch.retriever.live.changelog`) against the
hand-written JSONL log it replaced (one CRC-checked line per change, appended and synced; the passages' vectors in
a file of their own, written and synced before the line: reproduced here as it was), on this machine's disk.

For each store: `--changes` appends of one one-passage change (no vectors: a delete or a BM25-only put), then
`--changes` appends of a 100-passage change with its 384-d vectors (a put with the dense index), each synced before
it returns as an acknowledged change must be; then a full read of the log (a restart's replay). Latency per append
p50 / p99, the read's seconds, the bytes on disk.

    python bench/change_log.py [--changes 300]

Final line: {"sqlite": {...}, "jsonl": {...}, "settings": {...}}
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DATA, REPO, log  # noqa: E402
from plugsearch.common.files import atomic_writer  # noqa: E402
from plugsearch.retriever.ingest.passages import Passage  # noqa: E402
from plugsearch.retriever.live.changelog import ChangeLog  # noqa: E402


class JsonlLog:
    """The earlier store, as it wrote: a line per change (its CRC32 at the end), appended with O_APPEND and synced;
    vectors in `vectors/<seq>.npy`, written whole and synced before the line."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        (folder / "vectors").mkdir(parents=True)
        self.path = folder / "changes.jsonl"
        self.path.touch()
        self.seq = 0

    def append(self, put: list[Passage], delete: list[str], vectors: np.ndarray | None = None) -> None:
        self.seq += 1
        name = None
        if vectors is not None:
            name = f"{self.seq:012d}.npy"
            with atomic_writer(self.folder / "vectors" / name) as fh:
                np.save(fh, vectors)
        body = orjson.dumps({"seq": self.seq, "at": time.time(), "vectors": name, "delete": delete,
                             "put": [{"id": p.id, "doc_id": p.doc_id, "title": p.title, "text": p.text} for p in put]})
        line = body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_all(self) -> int:
        n = 0
        with self.path.open("rb") as fh:
            for line in fh:
                body, _, crc = line.rstrip(b"\n").rpartition(b"\t")
                assert crc == f"{zlib.crc32(body):08x}".encode()
                data = orjson.loads(body)
                if data["vectors"]:
                    np.load(self.folder / "vectors" / data["vectors"])
                n += 1
        return n


def sqlite_read_all(folder: Path) -> int:
    log_ = ChangeLog(folder, writable=False)
    try:
        n = sum(1 for _ in log_.iter_after(0))
        vector_id = 0
        while parts := log_.vectors_after(vector_id):
            vector_id = parts[-1].id
        return n
    finally:
        log_.close()


def measure(name: str, store: Any, folder: Path, changes: int, read_all: Any) -> dict[str, Any]:
    with (DATA / "corpus" / "nq_gold.jsonl").open() as fh:
        texts = [json.loads(line)["text"] for _, line in zip(range(100), fh, strict=False)]
    one = [Passage(id="note#0", doc_id="note", title="A note", text=texts[0])]
    hundred = [Passage(id=f"doc#{i}", doc_id="doc", title="A document", text=t) for i, t in enumerate(texts)]
    vectors = np.random.default_rng(0).standard_normal((100, 384)).astype(np.float32)
    out: dict[str, Any] = {}
    for label, put, vecs in (("one_passage", one, None), ("hundred_passages_with_vectors", hundred, vectors)):
        times = []
        for _ in range(changes):
            t0 = time.perf_counter()
            store.append(put, [], vecs)
            times.append((time.perf_counter() - t0) * 1000)
        ordered = sorted(times)
        out[label] = {"p50_ms": round(statistics.median(times), 2),
                      "p99_ms": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)}
        log(f"{name} {label}: {out[label]}")
    t0 = time.perf_counter()
    out["read_all"] = {"changes": read_all(), "seconds": round(time.perf_counter() - t0, 3)}
    out["bytes_on_disk"] = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, default=300, help="appends of each kind per store")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-change-log-", dir=REPO / "var"))
    try:
        sqlite = ChangeLog(work / "sqlite")
        result = {"sqlite": measure("sqlite", sqlite, work / "sqlite", args.changes,
                                    lambda: sqlite_read_all(work / "sqlite"))}
        sqlite.close()
        result["sqlite"]["bytes_on_disk"] = sum(p.stat().st_size for p in (work / "sqlite").rglob("*") if p.is_file())
        jsonl = JsonlLog(work / "jsonl")
        result["jsonl"] = measure("jsonl", jsonl, work / "jsonl", args.changes, jsonl.read_all)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["settings"] = {"changes": args.changes, "disk": "the machine's var/ folder", "vectors": "384-d float32"}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
