"""The dense vectors of the passages put while serving, searched by inner product beside the base's dense index (as
a flat index scores). One job: the passages put, searched by meaning, and their vectors made once.

A passage put while the dense index is there is encoded by its writer and logged with its change. One put while it
was not (still building, RETRIEVER_DENSE_MISSING wait / build) is encoded later by `CatchUp`: in a thread, never on
the event loop, in batches of `CATCH_UP_BATCH` passages, each batch logged beside its change as soon as it is
encoded (by whichever worker holds the encoding lock; the others read the vectors from the log), so no restart
encodes them again. Meanwhile searches go on: BM25 finds every passage put, dense the ones with vectors.
"""

from __future__ import annotations

import bisect
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from plugsearch.common.progress import ProgressLog
from plugsearch.retriever.backends.base import Hits, Retriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.live.lexical import top
from plugsearch.retriever.live.state import Grow, LiveState, Overlay

logger = logging.getLogger(__name__)

CATCH_UP_BATCH = 64
"""Passages encoded per step of the catch-up (each step's vectors logged before the next starts)."""
ENCODE_LOCK = "encode.lock"


class VectorRows:
    """Row -> its vector, for the rows that have one (`has`)."""

    def __init__(self) -> None:
        self.matrix: Grow | None = None
        self.has = Grow(np.bool_, False)

    def grow(self, rows: int) -> None:
        """Rows put up to `rows` (without vectors yet)."""
        if rows > self.has.n:
            self.has.extend(np.zeros(rows - self.has.n, dtype=bool))

    def set(self, first: int, vectors: npt.NDArray[np.float32]) -> None:
        """The vectors of rows `first` .. `first + len(vectors) - 1`."""
        if self.matrix is None:
            self.matrix = Grow(np.float32, 0.0, shape=(int(vectors.shape[1]),))
        end = first + len(vectors)
        self.matrix.reserve(end)
        self.matrix.data[first:end] = vectors
        self.matrix.n = max(self.matrix.n, end)
        self.grow(end)
        self.has.data[first:end] = True  # after the vectors: a reader that sees `has` sees them

    def count(self, size: int) -> int:
        return int(self.has.data[:size].sum())


class DenseSegment(Retriever):
    """The passages put that `state` serves and that have vectors, searched by inner product with the queries'
    vectors (the same encoder as the base index's: its query-vector cache makes the second encoding of a query a
    lookup); hits are positions (`base_n + row`)."""

    name = "live-dense"

    def __init__(self, overlay: Overlay, rows: VectorRows, encoder: Encoder, state: LiveState) -> None:
        self.overlay, self.rows, self.encoder, self.state = overlay, rows, encoder, state

    @property
    def doc_count(self) -> int:
        return self.state.size

    def close(self) -> None:
        """Nothing of its own: the live index holds what it reads."""

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        state, matrix = self.state, self.rows.matrix
        hits = Hits.empty(len(queries), k)
        if not state.size or matrix is None:
            return hits
        size = min(state.size, matrix.n)
        keep = self.overlay.alive(state)[:size] & self.rows.has.data[:size]
        if not keep.any():
            return hits
        scores = self.encoder.encode_queries(queries) @ matrix.data[:size].T
        for row in range(len(queries)):
            top(hits, row, scores[row], state.base_n, k, keep=keep)
        return hits


@dataclass(frozen=True)
class Batch:
    """Passages `first` .. `first + rows - 1` of change `seq`, at overlay row `row`."""

    seq: int
    first: int
    row: int
    rows: int


def missing(overlay: Overlay, vectors: VectorRows, state: LiveState, batch: int = CATCH_UP_BATCH) -> list[Batch]:
    """The served rows of `state` without vectors, as batches within one change each."""
    if not state.size:
        return []
    vectors.grow(state.size)
    need = overlay.alive(state) & ~vectors.has.data[:state.size]
    rows = np.flatnonzero(need).tolist()
    if not rows:
        return []
    starts = [(first, seq) for seq, first in overlay.first_row.items()]
    firsts = [f for f, _ in starts]
    out: list[Batch] = []
    i = 0
    while i < len(rows):
        at = bisect.bisect_right(firsts, rows[i]) - 1
        first, seq = starts[at]
        end = firsts[at + 1] if at + 1 < len(firsts) else state.size
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1 and rows[j + 1] < end and j + 1 - i < batch:
            j += 1
        out.append(Batch(seq, rows[i] - first, rows[i], j - i + 1))
        i = j + 1
    return out


@contextmanager
def try_lock(path: os.PathLike[str] | str) -> Iterator[bool]:
    """A non-blocking exclusive lock on `path`: True while held, False when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class CatchUp(threading.Thread):
    """Encodes the served passages put that have no vectors, in batches, off the event loop (see the module's
    docstring). `todo()`: the batches still missing; `encode(batch) -> vectors`; `store(batch, vectors)`: logs and
    applies them; `refresh()`: reads what other workers logged. Ends when nothing is missing, or at `stop()`."""

    def __init__(self, *, todo: Callable[[], list[Batch]], encode: Callable[[Batch], npt.NDArray[np.float32]],
                 store: Callable[[Batch, npt.NDArray[np.float32]], None], refresh: Callable[[], object],
                 lock: os.PathLike[str] | str | None, wait_s: float) -> None:
        super().__init__(name="dense-catch-up", daemon=True)
        self.todo, self.encode, self.store, self.refresh = todo, encode, store, refresh
        self.lock, self.wait_s = lock, wait_s
        self._halt = threading.Event()
        self.encoded = 0
        self.error: str | None = None

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the passages stay without vectors (BM25 finds them); the next start tries again
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("encoding the passages put while the dense index was not there failed")

    def _run(self) -> None:
        progress: ProgressLog | None = None
        while not self._halt.is_set():
            batches = self.todo()
            if not batches:
                break
            if progress is None:
                total = sum(b.rows for b in batches)
                logger.info("the dense index is here: encoding the %s passages put without vectors, in batches of "
                            "%d, while the retriever serves", f"{total:,}", CATCH_UP_BATCH)
                progress = ProgressLog("dense catch-up", total, "passages", log=logger)
            lock = try_lock(self.lock) if self.lock is not None else _held()
            with lock as mine:
                if not mine:  # another worker encodes them: its vectors reach this one through the log
                    self._halt.wait(self.wait_s)
                    self.refresh()
                    continue
                self.refresh()  # what another worker finished before this one took the lock
                for batch in self.todo():
                    if self._halt.is_set():
                        break
                    vectors = self.encode(batch)
                    self.store(batch, vectors)
                    self.encoded += batch.rows
                    progress.update(batch.rows)
        if progress is not None:
            progress.close()


@contextmanager
def _held() -> Iterator[bool]:
    yield True
