"""Documents read, not held: the corpus file itself, memory-mapped, found through a small on-disk table.

`<index_dir>/docstore/` holds, per document (position = the internal document number every index uses), the
byte offset and length of its line in the corpus file (`offsets.npy`, `lengths.npy`), and the documents'
ids as sorted 64-bit hashes with their positions (`id_hashes.npy`, `id_positions.npy`: id -> position for
indexes that answer with ids, Lucene's). All of it is memory-mapped, as is the corpus file: the workers of
a retriever share those pages through the page cache, and a worker's private memory no longer grows with
the corpus text (24 bytes per document on disk, 0.5 GB at wiki-18's 21M passages, against ~25 GB of Python
strings per worker when the corpus was held). A document is its line parsed by `corpus.parse_line`, the very
code `Corpus.load` runs, so the store returns exactly what the corpus holds.

The store is built by one streamed pass over the corpus (`build_docstore`, also the checksum and the checks
`Corpus.load` made: valid rows, unique ids); `plugsearch-index build` writes it, and the service builds it at
start when an index folder from before has none. `Corpus` (every document as Python strings) remains for
small corpora (`RETRIEVER_DOCSTORE=memory`) and in-process users.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from plugsearch.common.files import atomic_write_json
from plugsearch.retriever.store.corpus import Corpus, CorpusError, file_checksum, indexed_text, parse_line
from plugsearch.retriever.store.manifest import (
    IndexMismatch,
    IndexMissing,
    Manifest,
    index_folder,
)

logger = logging.getLogger(__name__)

STORE_FOLDER = "docstore"
FILES = ["offsets.npy", "lengths.npy", "id_hashes.npy", "id_positions.npy", "id_collisions.npy"]
CHECKSUM_MEMO = ".corpus-checksum.json"
MEMO_MIN_BYTES = 64 << 20  # below this, hashing the file (< 0.2 s) is cheaper than trusting its stat
_BLOCK = 1 << 20


@runtime_checkable
class DocumentStore(Protocol):
    """What the service and the index builders need of a corpus: `Corpus` (in memory) or `DiskStore`."""

    path: Path
    checksum: str

    def __len__(self) -> int: ...

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]: ...

    def positions(self, ids: Sequence[str]) -> npt.NDArray[np.int64]: ...

    def passage(self, i: int) -> str: ...

    def iter_documents(self) -> Iterator[tuple[str, str, str]]: ...

    def close(self) -> None: ...


def id_hashes(ids: Sequence[str]) -> npt.NDArray[np.uint64]:
    """64-bit blake2b of each id's UTF-8 bytes (stable across processes, unlike `hash`)."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(i.encode(), digest_size=8).digest(), "little")
                        for i in ids), dtype=np.uint64, count=len(ids))


def _fingerprint(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def corpus_checksum(path: Path, memo_dir: Path | None = None) -> str:
    """`file_checksum(path)`, memoised in `memo_dir` for large files by the file's identity and times.

    Hashing wiki-18's 14 GB takes tens of seconds, and every worker checks its indexes at start: the memo
    makes that once per corpus file version. A write to the file changes its ctime, which voids the memo."""
    try:
        stat = _fingerprint(path)
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror or exc}") from exc
    memo = memo_dir / CHECKSUM_MEMO if memo_dir is not None else None
    if memo is None or stat["size"] < MEMO_MIN_BYTES:
        return file_checksum(path)
    try:
        saved = json.loads(memo.read_text())
        if saved.get("path") == str(path.resolve()) and saved.get("stat") == stat:
            return str(saved["checksum"])
    except (OSError, ValueError, AttributeError):
        pass
    logger.info("reading the sha256 of %s (%.1f GB; once per version of the file)", path, stat["size"] / 1e9)
    checksum = file_checksum(path)
    _write_memo(path, memo_dir, stat, checksum)  # type: ignore[arg-type]
    return checksum


def _write_memo(path: Path, memo_dir: Path, stat: dict[str, int], checksum: str) -> None:
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_json(memo_dir / CHECKSUM_MEMO, {"path": str(path.resolve()), "stat": stat, "checksum": checksum})
    except OSError as exc:  # a read-only index folder: hash again next time
        logger.debug("cannot memoise the corpus checksum in %s: %s", memo_dir, exc)


def _scan(path: Path, show_progress: bool) -> tuple[str, npt.NDArray[np.int64], npt.NDArray[np.uint32],
                                                    npt.NDArray[np.uint64]]:
    """One pass: sha256 of the bytes, (offset, length) of each non-blank line, the hash of its id."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    offsets: list[npt.NDArray[np.int64]] = []
    lengths: list[npt.NDArray[np.uint32]] = []
    hashes: list[npt.NDArray[np.uint64]] = []
    batch_off: list[int] = []
    batch_len: list[int] = []
    batch_ids: list[str] = []

    def flush() -> None:
        offsets.append(np.array(batch_off, dtype=np.int64))
        lengths.append(np.array(batch_len, dtype=np.uint32))
        hashes.append(id_hashes(batch_ids))
        batch_off.clear()
        batch_len.clear()
        batch_ids.clear()

    size = path.stat().st_size
    bar = tqdm(total=size, unit="B", unit_scale=True, desc="document store", disable=not show_progress)
    position = 0
    try:
        with path.open("rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                digest.update(line)
                bar.update(len(line))
                if line.strip():
                    doc_id, _, _ = parse_line(line, lineno, path)
                    batch_off.append(position)
                    batch_len.append(len(line))
                    batch_ids.append(doc_id)
                    if len(batch_ids) >= 65536:
                        flush()
                position += len(line)
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror or exc}") from exc
    finally:
        bar.close()
    flush()
    return ("sha256:" + digest.hexdigest(), np.concatenate(offsets), np.concatenate(lengths),
            np.concatenate(hashes))


def build_docstore(corpus: Path, out: Path, *, show_progress: bool = True) -> Manifest:
    """Stream the corpus into the store folder `out` (atomic: a crash leaves no loadable store).

    Refuses, as `Corpus.load` did, a corpus with no documents, a malformed row or a duplicate id."""
    t0 = time.perf_counter()
    stat = _fingerprint(corpus)
    checksum, offsets, lengths, hashes = _scan(corpus, show_progress)
    n = len(offsets)
    if n == 0:
        raise CorpusError(f"{corpus}: no documents")
    if n >= 2**32:
        raise CorpusError(f"{corpus}: {n} documents, more than the store's 2^32")
    if int(lengths.max()) >= 2**32 - 1:
        raise CorpusError(f"{corpus}: a line of 4 GiB or more")
    order = np.argsort(hashes, kind="stable")
    sorted_hashes = hashes[order]
    del hashes
    same = np.flatnonzero(sorted_hashes[1:] == sorted_hashes[:-1])
    collisions = np.unique(sorted_hashes[same]) if len(same) else np.zeros(0, dtype=np.uint64)
    with index_folder(out) as tmp:
        np.save(tmp / "offsets.npy", offsets)
        np.save(tmp / "lengths.npy", lengths)
        np.save(tmp / "id_hashes.npy", sorted_hashes)
        np.save(tmp / "id_positions.npy", order.astype(np.uint32))
        np.save(tmp / "id_collisions.npy", collisions)
        if len(collisions):  # equal hashes: a duplicate id (refused), or two ids sharing a hash (kept)
            store = DiskStore(tmp, corpus, checksum)
            for h in collisions:
                lo = int(np.searchsorted(sorted_hashes, h, side="left"))
                hi = int(np.searchsorted(sorted_hashes, h, side="right"))
                ids = [store.document(int(p))[0] for p in order[lo:hi]]
                if len(set(ids)) < len(ids):
                    store.close()
                    raise CorpusError(f"{corpus}: duplicate id {next(i for i in ids if ids.count(i) > 1)!r}")
            store.close()
        manifest = Manifest(kind="docstore", backend="offsets", corpus_path=str(corpus), corpus_checksum=checksum,
                            doc_count=n, files=list(FILES),
                            params={"corpus_bytes": stat["size"], "hash": "blake2b-64",
                                    "id_collisions": int(len(collisions))},
                            build_seconds=round(time.perf_counter() - t0, 3))
        manifest.write(tmp)
    if stat["size"] >= MEMO_MIN_BYTES and stat == _fingerprint(corpus):  # unchanged while read: checksum known
        _write_memo(corpus, out.parent, stat, checksum)
    logger.info("built the document store %s (%s documents) in %.1f s", out, n, manifest.build_seconds)
    return manifest


class _Column(Sequence[str]):
    """`store.ids` / `.titles` / `.texts`: one field of every document, read on access (like `Corpus`'s lists)."""

    def __init__(self, store: DiskStore, field: int) -> None:
        self._store = store
        self._field = field

    def __len__(self) -> int:
        return len(self._store)

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if isinstance(i, slice):
            raise TypeError("a document store column is read one document at a time")
        return self._store.document(i)[self._field]


class DiskStore:
    """The documents of a corpus file, read through the store in `folder` (see the module's docstring)."""

    def __init__(self, folder: Path, corpus: Path, checksum: str) -> None:
        self.folder = folder
        self.path = corpus
        self.checksum = checksum
        self._offsets = np.load(folder / "offsets.npy", mmap_mode="r")
        self._lengths = np.load(folder / "lengths.npy", mmap_mode="r")
        self._hashes = np.load(folder / "id_hashes.npy", mmap_mode="r")
        self._id_positions = np.load(folder / "id_positions.npy", mmap_mode="r")
        self._collisions = {int(h) for h in np.load(folder / "id_collisions.npy")}
        try:
            with corpus.open("rb") as fh:  # the map keeps its own descriptor
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            raise CorpusError(f"cannot read corpus {corpus}: {getattr(exc, 'strerror', None) or exc}") from exc
        self._n = len(self._offsets)
        self.ids = _Column(self, 0)
        self.titles = _Column(self, 1)
        self.texts = _Column(self, 2)

    def __len__(self) -> int:
        return self._n

    def _line(self, i: int) -> bytes:
        if not 0 <= i < self._n:
            raise IndexError(f"document {i} is not in the store ({self._n} documents)")
        start = int(self._offsets[i])
        return self._map[start:start + int(self._lengths[i])]

    def document(self, i: int) -> tuple[str, str, str]:
        """(id, title, text) of document number i."""
        return parse_line(self._line(i), i + 1, self.path)

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        at = np.asarray(positions, dtype=np.int64)
        if at.size and (int(at.min()) < 0 or int(at.max()) >= self._n):
            raise IndexError(f"a document number outside the store ({self._n} documents)")
        starts, ends = self._offsets[at].tolist(), (self._offsets[at] + self._lengths[at]).tolist()
        return [parse_line(self._map[a:b], i + 1, self.path) for a, b, i in zip(starts, ends, at.tolist(), strict=True)]

    def passage(self, i: int) -> str:
        _, title, text = self.document(i)
        return indexed_text(title, text)

    def iter_documents(self) -> Iterator[tuple[str, str, str]]:
        for i in range(self._n):
            yield self.document(i)

    def positions(self, ids: Sequence[str]) -> npt.NDArray[np.int64]:
        """The document number of each id; -1 for an id the corpus does not hold."""
        wanted = id_hashes(ids)
        at = np.searchsorted(self._hashes, wanted)
        out = np.full(len(ids), -1, dtype=np.int64)
        inside = at < self._n
        found = np.zeros(len(ids), dtype=bool)
        found[inside] = self._hashes[at[inside]] == wanted[inside]
        out[found] = self._id_positions[at[found]]
        if self._collisions:  # two ids of the corpus share a hash: read them to choose
            for j in np.flatnonzero(found).tolist():
                if int(wanted[j]) in self._collisions:
                    out[j] = self._resolve(ids[j], int(wanted[j]), int(at[j]))
        return out

    def _resolve(self, doc_id: str, h: int, start: int) -> int:
        stop = start
        while stop < self._n and int(self._hashes[stop]) == h:
            position = int(self._id_positions[stop])
            if self.document(position)[0] == doc_id:
                return position
            stop += 1
        return -1

    def close(self) -> None:
        """Unmap the corpus (a store whose documents are still being read may not be closed)."""
        if not self._map.closed:
            self._map.close()


def store_folder(index_dir: Path) -> Path:
    return index_dir / STORE_FOLDER


@contextmanager
def _build_lock(index_dir: Path) -> Iterator[None]:
    """One builder at a time (the workers of one service start together)."""
    index_dir.mkdir(parents=True, exist_ok=True)
    with open(index_dir / f".{STORE_FOLDER}.lock", "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def check_store(folder: Path, checksum: str) -> Manifest:
    """The store's manifest, checked against the corpus checksum and its files (IndexMissing/-Mismatch)."""
    manifest = Manifest.read(folder)
    if manifest.kind != "docstore":
        raise IndexMismatch(f"{folder} holds a {manifest.kind} index, not a document store")
    manifest.check(corpus_checksum=checksum, where=folder)
    manifest.check_files(folder)
    return manifest


def ensure_docstore(corpus: Path, index_dir: Path, checksum: str, *, show_progress: bool = False) -> bool:
    """Build the store when it is missing or belongs to another corpus; True when it was (re)built."""
    folder = store_folder(index_dir)
    try:
        check_store(folder, checksum)
        return False
    except (IndexMissing, IndexMismatch) as exc:
        reason = str(exc)
    with _build_lock(index_dir):
        try:  # another process may have built it while this one waited for the lock
            check_store(folder, checksum)
            return False
        except (IndexMissing, IndexMismatch):
            pass
        logger.info("building the document store of %s in %s (%s)", corpus, folder, reason)
        manifest = build_docstore(corpus, folder, show_progress=show_progress)
    if manifest.corpus_checksum != checksum:
        raise IndexMismatch(f"corpus {corpus} changed while its document store was built (checksum "
                            f"{manifest.corpus_checksum}, expected {checksum})")
    return True


def open_store(corpus: Path, index_dir: Path, checksum: str, *, mode: str = "disk") -> DocumentStore:
    """The documents of `corpus` for serving: the disk store (built when missing), or the corpus in memory
    (`mode` "memory", or an index folder that cannot be written and holds no store: logged)."""
    if mode == "disk":
        try:
            ensure_docstore(corpus, index_dir, checksum)
        except OSError as exc:  # e.g. an index folder mounted read-only, from before the store existed
            logger.warning("no document store in %s and none can be written there (%s): holding the corpus in "
                           "memory instead; build the store with `plugsearch-index build`", index_dir, exc)
        else:
            folder = store_folder(index_dir)
            check_store(folder, checksum)
            store = DiskStore(folder, corpus, checksum)
            logger.info("documents of %s read from the store %s (%s documents)", corpus, folder, len(store))
            return store
    return Corpus.load(corpus, checksum=checksum)


def stored_bytes(folder: Path) -> int:
    """Bytes of a store folder's files (what it adds to the disk)."""
    return sum(os.path.getsize(folder / name) for name in FILES if (folder / name).exists())
