"""The retriever's change log: every change to the served corpus (documents put, replacing all their passages, or
deleted), durable before it is acknowledged, read by every worker.

One line per change (`Change`: the passages put, the document ids deleted), its CRC32 at the end of the line; the
dense vectors of the passages put in a file of their own (`vectors/<seq>.npy`), written and synced before the
line that names it. `append` holds an exclusive lock (`fcntl.flock`, so the workers of one retriever, each its own
process, append one at a time), writes the line and syncs it (`os.fsync`) before it returns: an acknowledged
change survives a crash of the process or of the machine. A line cut by a crash has no valid CRC: readers stop
before it (it was never acknowledged) and the next `append` cuts it off; so a change is in the log whole or not
at all. Readers (`read_from`) take the complete, valid lines after an offset: each worker follows the log from
where it last read (`plugsearch.retriever.live.overlay`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson

from plugsearch.common.files import atomic_writer
from plugsearch.retriever.ingest.passages import Passage

logger = logging.getLogger(__name__)

LOG_FILE = "changes.jsonl"
LOCK_FILE = "changes.lock"
VECTORS_DIR = "vectors"


@dataclass(frozen=True)
class Change:
    """One acknowledged change: `put`, the passages of the documents put (each replaces every passage its document
    had), `delete`, the documents deleted; `vectors`, the file of the put passages' dense vectors (in `put`'s
    order), None without a dense index."""

    seq: int
    put: tuple[Passage, ...]
    delete: tuple[str, ...]
    vectors: str | None
    at: float

    @property
    def documents_put(self) -> list[str]:
        return list(dict.fromkeys(p.doc_id for p in self.put))


def _encode(payload: Mapping[str, object]) -> bytes:
    body = orjson.dumps(payload)
    return body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"


def _decode(line: bytes) -> Change | None:
    """The change of a complete line, None when its CRC does not match (a line a crash cut or garbled)."""
    body, sep, crc = line.rstrip(b"\n").rpartition(b"\t")
    if not sep or crc != f"{zlib.crc32(body):08x}".encode():
        return None
    data = orjson.loads(body)
    put = tuple(Passage(id=p["id"], doc_id=p["doc_id"], title=p.get("title", ""), text=p["text"])
                for p in data.get("put", ()))
    return Change(int(data["seq"]), put, tuple(data.get("delete", ())), data.get("vectors"), float(data["at"]))


class ChangeLog:
    """The log in `folder` (created when missing)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        (folder / VECTORS_DIR).mkdir(exist_ok=True)
        self.path = folder / LOG_FILE
        self.path.touch(exist_ok=True)
        self._seq, self._end = 0, 0
        self._holder: int | None = None
        """The thread holding the lock through `hold` (its appends do not take it again)."""

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self._holder == threading.get_ident():
            yield
            return
        with open(self.folder / LOCK_FILE, "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The log's lock for a whole step (this thread's appends inside it do not wait for themselves): no other
        writer, in this process or another, appends meanwhile."""
        with self._locked():
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def read_from(self, offset: int = 0) -> tuple[list[Change], int]:
        """The valid changes after byte `offset` and the offset after the last of them (the next read starts
        there); a cut or garbled line ends the read."""
        changes: list[Change] = []
        with self.path.open("rb") as fh:
            fh.seek(offset)
            for line in fh:
                if not line.endswith(b"\n"):
                    break
                change = _decode(line)
                if change is None:
                    break
                changes.append(change)
                offset += len(line)
        return changes, offset

    def _valid_end(self) -> tuple[int, int]:
        """(the last valid change's seq, the byte offset after it): read on from where this object last knew
        the end (other processes append too)."""
        changes, end = self.read_from(self._end)
        if changes:
            self._seq = changes[-1].seq
        self._end = end
        return self._seq, end

    def append(self, put: Sequence[Passage], delete: Sequence[str],
               vectors: npt.NDArray[np.float32] | None = None) -> Change:
        """Write one change and sync it: it is acknowledged once this returns."""
        with self._locked():
            seq, end = self._valid_end()
            seq += 1
            if self.path.stat().st_size != end:  # a line a crash cut: never acknowledged, cut off
                logger.warning("change log %s: dropping %d bytes after the last whole change (a write a crash "
                               "interrupted)", self.path, self.path.stat().st_size - end)
                os.truncate(self.path, end)
            name = None
            if vectors is not None and len(put):
                name = f"{seq:012d}.npy"
                _write_synced(self.folder / VECTORS_DIR / name, vectors)
            change = Change(seq, tuple(put), tuple(delete), name, time.time())
            payload = {"seq": seq, "at": change.at, "vectors": name, "delete": list(delete),
                       "put": [{"id": p.id, "doc_id": p.doc_id, "title": p.title, "text": p.text} for p in put]}
            line = _encode(payload)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                view = memoryview(line)
                while view:  # a regular file takes it whole unless the disk is full: then it raises
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except OSError:  # not acknowledged: take back what was written, so no reader applies it
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, end)
                raise
            finally:
                os.close(fd)
            self._seq, self._end = seq, end + len(line)
            return change

    def vectors(self, change: Change) -> npt.NDArray[np.float32] | None:
        if change.vectors is None:
            return None
        return np.load(self.folder / VECTORS_DIR / change.vectors)


def _write_synced(path: Path, vectors: npt.NDArray[np.float32]) -> None:
    with atomic_writer(path) as fh:  # synced, with its folder, before the line that names it is written
        np.save(fh, np.ascontiguousarray(vectors, dtype=np.float32))
