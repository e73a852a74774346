"""BM25 over the passages put while serving, scored with the base index's statistics (its document frequencies,
passage count and average length: `LexicalStats`), so their scores rank with the base's. One job: the passages
put, searched by their words.

The postings only grow: each term's rows and frequencies are appended in place (arrays that double when full), so a
change costs its own tokens, whatever the vocabulary; a search reads the rows its state knows (`LexicalSegment`,
the overlay's words as a `Retriever`, bound to one state).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.backends.base import Hits, LexicalStats, Retriever
from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.state import LiveState, Overlay


class Postings:
    """term -> (rows, frequencies, count): the rows put that hold the term (in increasing order), appended in place.
    `tokenize`: texts -> their tokens, as the base index tokenised its passages."""

    def __init__(self, tokenize: Callable[[list[str]], list[list[str]]]) -> None:
        self.tokenize = tokenize
        self.terms: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32], int]] = {}
        self.lengths = np.zeros(16, dtype=np.float32)
        """Row -> its length in tokens."""

    def add(self, first: int, passages: Sequence[Passage]) -> None:
        """Index the passages put at rows `first`, `first + 1`, ..."""
        words = self.tokenize([p.indexed for p in passages])
        end = first + len(passages)
        if end > len(self.lengths):
            grown = np.zeros(max(end, 2 * len(self.lengths)), dtype=np.float32)
            grown[:first] = self.lengths[:first]
            self.lengths = grown
        self.lengths[first:end] = [len(w) for w in words]
        for i, tokens in enumerate(words):
            counts: dict[str, int] = {}
            for w in tokens:
                counts[w] = counts.get(w, 0) + 1
            row = first + i
            for term, tf in counts.items():
                rows, tfs, n = self.terms.get(term, (None, None, 0))
                if rows is None or tfs is None or n == len(rows):
                    size = max(4, 2 * n)
                    new_rows, new_tfs = np.empty(size, dtype=np.int64), np.empty(size, dtype=np.float32)
                    if rows is not None and tfs is not None:
                        new_rows[:n], new_tfs[:n] = rows[:n], tfs[:n]
                    rows, tfs = new_rows, new_tfs
                rows[n], tfs[n] = row, tf
                self.terms[term] = (rows, tfs, n + 1)  # one assignment: a reader sees the old entry or the new


class LexicalSegment(Retriever):
    """The passages put that `state` serves, searched by BM25 with the base's statistics: hits are positions
    (`base_n + row`)."""

    name = "live-bm25"

    def __init__(self, overlay: Overlay, postings: Postings, stats: LexicalStats, state: LiveState) -> None:
        self.overlay, self.postings, self.stats, self.state = overlay, postings, stats, state

    @property
    def doc_count(self) -> int:
        return self.state.size

    def close(self) -> None:
        """Nothing of its own: the live index holds what it reads."""

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        state, stats = self.state, self.stats
        hits = Hits.empty(len(queries), k)
        if not state.size:
            return hits
        alive = self.overlay.alive(state)
        n = stats.n - state.removed + state.size - state.dead
        lengths = self.postings.lengths
        for row, words in enumerate(self.postings.tokenize(list(queries))):
            scores = np.zeros(state.size, dtype=np.float32)
            for term in set(words):
                entry = self.postings.terms.get(term)
                if entry is None:
                    continue
                rows, tfs, count = entry
                rows, tfs = rows[:count], tfs[:count]
                known = rows < state.size
                rows, tfs = rows[known], tfs[known]
                served = alive[rows]
                if not served.any():
                    continue
                rows, tfs = rows[served], tfs[served]
                df = stats.df(term) + len(rows)
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                norm = stats.k1 * (1 - stats.b + stats.b * lengths[rows] / stats.avgdl)
                scores[rows] += idf * tfs / (tfs + norm)  # a term's rows are distinct
            top(hits, row, scores, state.base_n, k)
        return hits


class LazyStats:
    """The base's statistics, read the first time passages put are searched (a sample of its passages), not at
    start-up: a retriever whose documents never change never pays for it."""

    def __init__(self, read: Callable[[], LexicalStats]) -> None:
        self._read = read
        self._value: LexicalStats | None = None
        self._lock = threading.Lock()

    def get(self) -> LexicalStats:
        if self._value is None:
            with self._lock:  # read once, whichever search asks first
                if self._value is None:
                    self._value = self._read()
        return self._value


def top(hits: Hits, row: int, scores: npt.NDArray[np.float32], offset: int, k: int,
        keep: npt.NDArray[np.bool_] | None = None) -> None:
    """The best `k` of `scores` (positive ones, or those `keep` marks) into `hits[row]`, as positions `offset + i`."""
    candidates = np.flatnonzero(keep if keep is not None else scores > 0)
    if not len(candidates):
        return
    if len(candidates) > k:  # the k best (a partition: sorting every passage put was most of a search's cost)
        candidates = np.sort(candidates[np.argpartition(-scores[candidates], k - 1)[:k]])
    order = candidates[np.argsort(-scores[candidates], kind="stable")]
    hits.ids[row, :len(order)] = order + offset
    hits.scores[row, :len(order)] = scores[order]
