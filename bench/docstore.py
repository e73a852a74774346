"""Document stores compared: how the retriever reads the documents it returns, at one corpus size.

- `offsets` (what the service uses, `plugsearch.retriever.store.docstore.DiskStore`): the corpus file memory-mapped,
  a table of line offsets and lengths, each document parsed from its JSON line when returned;
- `binary`: a compact copy of the documents (UTF-8 id, title and text back to back) and an offsets table, both
  memory-mapped: no JSON to parse, but a second copy of the text on disk;
- `sqlite`: an SQLite table (rowid = document number) read with `WHERE rowid IN (...)`;
- `memory`: `Corpus.load`, every document as Python strings (what the service held before).

Per store: build seconds (one streamed pass over the corpus, except `memory`'s load), size on disk, the private
memory it adds to the process once opened (RssAnon), and the time to fetch the documents of a batch of 32
queries x k=10 at random positions (median of `--rounds`, page cache warm: the corpus was just read). The
synthetic corpus is bench/scale.py's (wiki-18's passage lengths).

    python bench/docstore.py                    # 1,000,000 passages (the corpus is cached in var/scale)
    python bench/docstore.py --size 100000

The last line printed is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import mmap
import shutil
import sqlite3
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, log  # noqa: E402
from bench.scale import write_corpus  # noqa: E402


def rss_anon_kb() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("RssAnon:"))


class Binary:
    """UTF-8 id, title and text back to back; offsets (n*3+1) into that file."""

    @staticmethod
    def build(corpus: Path, folder: Path) -> None:
        from plugsearch.retriever.store.corpus import iter_corpus

        offsets = [0]
        with (folder / "docs.bin").open("wb") as fh:
            for doc_id, title, text in iter_corpus(corpus):
                for field in (doc_id, title, text):
                    data = field.encode()
                    fh.write(data)
                    offsets.append(offsets[-1] + len(data))
        np.save(folder / "offsets.npy", np.array(offsets, dtype=np.int64))

    def __init__(self, folder: Path) -> None:
        self.offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        with (folder / "docs.bin").open("rb") as fh:
            self.map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def documents(self, positions: list[int]) -> list[tuple[str, str, str]]:
        out = []
        for p in positions:
            o = self.offsets[3 * p:3 * p + 4].tolist()
            out.append((self.map[o[0]:o[1]].decode(), self.map[o[1]:o[2]].decode(), self.map[o[2]:o[3]].decode()))
        return out


class Sqlite:
    @staticmethod
    def build(corpus: Path, folder: Path) -> None:
        from plugsearch.retriever.store.corpus import iter_corpus

        db = sqlite3.connect(folder / "docs.sqlite")
        db.execute("PRAGMA journal_mode=OFF")
        db.execute("PRAGMA synchronous=OFF")
        db.execute("CREATE TABLE docs (id TEXT NOT NULL, title TEXT NOT NULL, text TEXT NOT NULL)")
        batch: list[tuple[str, str, str]] = []
        for row in iter_corpus(corpus):
            batch.append(row)
            if len(batch) >= 10_000:
                db.executemany("INSERT INTO docs VALUES (?, ?, ?)", batch)
                batch.clear()
        db.executemany("INSERT INTO docs VALUES (?, ?, ?)", batch)
        db.execute("CREATE UNIQUE INDEX docs_id ON docs (id)")  # id -> position, as the offsets store has
        db.commit()
        db.close()

    def __init__(self, folder: Path) -> None:
        self.db = sqlite3.connect(f"file:{folder / 'docs.sqlite'}?mode=ro", uri=True, check_same_thread=False)

    def documents(self, positions: list[int]) -> list[tuple[str, str, str]]:
        marks = ",".join("?" * len(positions))
        found = {r[0]: r[1:] for r in self.db.execute(
            f"SELECT rowid, id, title, text FROM docs WHERE rowid IN ({marks})",  # noqa: S608 - placeholders only
            [p + 1 for p in positions])}
        return [found[p + 1] for p in positions]


def measure(name: str, corpus: Path, folder: Path, n: int, rounds: int) -> dict[str, Any]:
    from plugsearch.retriever.store.corpus import Corpus
    from plugsearch.retriever.store.docstore import DiskStore, build_docstore

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    store: Any
    if name == "offsets":
        manifest = build_docstore(corpus, folder / "docstore", show_progress=False)
    elif name == "binary":
        Binary.build(corpus, folder)
    elif name == "sqlite":
        Sqlite.build(corpus, folder)
    build_s = time.perf_counter() - t0
    before = rss_anon_kb()
    t0 = time.perf_counter()
    if name == "offsets":
        store = DiskStore(folder / "docstore", corpus, manifest.corpus_checksum)
    elif name == "binary":
        store = Binary(folder)
    elif name == "sqlite":
        store = Sqlite(folder)
    else:
        store = Corpus.load(corpus, checksum="unused")
        build_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    times = []
    for _ in range(rounds):
        positions = rng.integers(0, n, 32 * 10).tolist()
        t = time.perf_counter()
        docs = store.documents(positions)
        times.append(time.perf_counter() - t)
        assert len(docs) == len(positions)
    reference = Corpus.load(corpus, limit=1000, checksum="unused")  # the first rows, parsed as the service did
    identical = store.documents(list(range(1000))) == reference.documents(range(1000))  # type: ignore[arg-type]
    out = {"build_s": round(build_s, 1), "disk_mb": round(sum(p.stat().st_size for p in folder.rglob("*")
                                                              if p.is_file()) / 2**20, 1),
           "rss_anon_mb": round((rss_anon_kb() - before) / 1024, 1),
           "batch_ms": round(statistics.median(times) * 1000, 3), "identical": identical}
    del store
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--stores", default="offsets,binary,sqlite,memory")
    parser.add_argument("--work", type=Path, default=REPO / "var" / "scale")
    args = parser.parse_args()
    corpus = write_corpus(args.size, args.work / f"n{args.size}" / "corpus.jsonl")
    result: dict[str, Any] = {"size": args.size, "corpus_mb": round(corpus.stat().st_size / 2**20, 1),
                              "batch": "32 queries x k=10 at random positions", "stores": {}}
    for name in args.stores.split(","):
        result["stores"][name] = measure(name, corpus, args.work / "docstore-bench" / name, args.size, args.rounds)
        log(f"{name}: {result['stores'][name]}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
