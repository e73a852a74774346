"""The served corpus as it changes: the built indexes (the base) and the change log's changes over them.

A document is its passages: `<doc_id>` alone, or `<doc_id>#0`, `<doc_id>#1`, ... (what `plugsearch-index ingest`
writes). Putting a document replaces all of its passages; deleting it removes them all. The base's passages
that a change removed are left out of every result; the passages put are searched beside the base, in
memory: BM25 with the base's statistics (its document frequencies, passage count and average length, so their
scores rank with the base's) and the dense vectors the writer encoded (inner products, as a flat index scores).
Each change applies whole: a new `LiveState` is built beside the one searches read, then swapped in (one
reference assignment), so a search sees a change entirely or not at all.

`LiveIndex.poll` reads the changes other workers acknowledged (each worker follows the log); the state's
`seq` is part of the index identity, so a cache keyed on it never serves a result from before a change.
On Milvus (`mirror`: `plugsearch.retriever.backends.milvus_index.MilvusChanges`) the passages put go into the collection itself: under
the log's lock a writer upserts their vectors at their positions, logs the change, then deletes the positions it
removed, and records the change as carried; a change logged but not carried (its writer died, or Milvus did not
answer) is carried by the next writer or at the next start-up. Dense searches then ask Milvus alone, for the
positions the state knows, leaving out the removed ones.

Compaction (a rebuild with the changes folded into the base) is `plugsearch-index build` on a corpus file
exported with the changes.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.backends.base import DenseMirror, Hits, LexicalStats, Retriever
from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import Change, ChangeLog
from plugsearch.retriever.store.corpus import indexed_text
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import IndexMismatch

logger = logging.getLogger(__name__)

MAX_PASSAGES_PER_DOCUMENT = 100_000
"""How far `<doc_id>#<n>` is probed in the base for a document's passages (they are numbered from 0)."""
REMOVED_SLACK = 64
"""How many more base results a search asks for when the base has removed passages (they are left out)."""


def doc_id_of(passage_id: str) -> str:
    """The document of a passage: its id before the last `#` (the passage id itself when it has none)."""
    head, sep, tail = passage_id.rpartition("#")
    return head if sep and tail.isdigit() else passage_id


def base_positions(store: DocumentStore, doc_id: str) -> list[int]:
    """The base's passages of `doc_id`: `<doc_id>` and `<doc_id>#0`, `#1`, ... while they are there."""
    found = [int(p) for p in store.positions([doc_id]) if p >= 0]
    n, step = 0, 16
    while n < MAX_PASSAGES_PER_DOCUMENT:
        ids = [f"{doc_id}#{i}" for i in range(n, n + step)]
        hits = store.positions(ids)
        found.extend(int(p) for p in hits if p >= 0)
        if (hits < 0).any():
            break
        n, step = n + step, min(step * 4, 4096)
    return found


@dataclass(frozen=True)
class LiveState:
    """One consistent view: the base positions removed, the passages put (position `base_n + i`), which of them
    are still served, their vectors and their BM25 postings. Never changed once built (a change builds the
    next one)."""

    seq: int
    base_n: int
    removed: frozenset[int] = frozenset()
    added: tuple[Passage, ...] = ()
    alive: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    documents: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Every document a change touched -> its served positions (none: deleted)."""
    vectors: npt.NDArray[np.float32] | None = None
    lengths: npt.NDArray[np.float32] = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    """Per passage put: its length in tokens."""
    postings: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]] = field(default_factory=dict)
    """term -> (the passages put that hold it, its frequency in each)"""
    changed: dict[str, int] = field(default_factory=lambda: {"added": 0, "replaced": 0, "deleted": 0,
                                                             "passages": 0})
    """Documents added, replaced and deleted since the base, and `passages`: the passages put plus the passages
    deleted (a document put again counts its new passages), what the searcher's corpus check measures drift by."""

    @property
    def served(self) -> int:
        return self.base_n - len(self.removed) + int(self.alive.sum())

    @property
    def changes(self) -> bool:
        return bool(self.removed) or bool(self.added)

    def serves(self, position: int) -> bool:
        """Whether `position` (a base passage, or a passage put) is served in this state."""
        if position < self.base_n:
            return position not in self.removed
        return bool(self.alive[position - self.base_n])


class LiveIndex:
    """The base (its document store and the lexical statistics of its BM25 index) and the change log, applied
    in order; `state` is what searches read."""

    def __init__(self, folder: Path, store: DocumentStore, *, stats: Callable[[], LexicalStats] | None,
                 tokenize: Any = None, encode: Any = None, mirror: DenseMirror | None = None) -> None:
        self.log = ChangeLog(folder)
        self.store = store
        self._stats = stats
        """Reads the base's statistics (a sample of its passages) the first time passages put are searched, not at
        start-up: a retriever whose documents never change never pays for it."""
        self._stats_read: LexicalStats | None = None
        self._stats_lock = threading.Lock()
        self.tokenize = tokenize
        """queries or texts -> their tokens, as the base's BM25 index tokenised (None: no BM25)."""
        self.encode = encode
        """passages -> their dense vectors, as the base's were encoded (None: no dense index)."""
        self.state = LiveState(seq=0, base_n=len(store))
        self._offset = 0
        self._lock = threading.Lock()
        self._base_of: dict[str, tuple[int, ...]] = {}
        self.mirror: DenseMirror | None = mirror
        """Where the dense vectors of the changes go (None: kept here, searched beside the base index)."""
        self._moves: dict[int, tuple[int, tuple[int, ...]]] = {}
        """seq -> (the first position its passages put took, the positions it removed)."""
        self.poll()
        if mirror is not None:
            self._mirror_on(mirror)

    @property
    def seq(self) -> int:
        return self.state.seq

    @property
    def stats(self) -> LexicalStats | None:
        if self._stats_read is None and self._stats is not None:
            with self._stats_lock:  # read once, whichever search asks first
                if self._stats_read is None:
                    self._stats_read = self._stats()
        return self._stats_read

    def serve_dense(self, encode: Callable[[list[str]], npt.NDArray[np.float32]],
                    mirror: DenseMirror | None = None) -> None:
        """A dense index arrived after changes were applied: encode the passages put so far (or carry them into
        `mirror`), then every new one."""
        if mirror is not None:
            self.encode = encode
            self._mirror_on(mirror)
            return
        with self._lock:
            state = self.state
            vectors = encode([p.indexed for p in state.added]) if state.added else None
            self.encode = encode
            self.state = replace(state, vectors=vectors)

    def _mirror_on(self, mirror: DenseMirror) -> None:
        """Searches' vectors in `mirror` from now on: the changes it lacks carried into it first (refused when it
        carries changes this log does not hold)."""
        with self.log.hold():
            self.poll()
            carried = mirror.seq()
            if carried > self.seq:
                raise IndexMismatch(f"the dense collection carries changes up to {carried}, the change log in "
                                    f"{self.log.folder} only up to {self.seq}: it is not this log's collection; "
                                    "rebuild it with `plugsearch-index build --force`, or point RETRIEVER_CHANGES_DIR "
                                    "at its log")
            self.mirror = mirror
            self._carry(carried)
            with self._lock:
                self.state = replace(self.state, vectors=None)

    def poll(self) -> int:
        """Apply the changes acknowledged since the last poll (by any worker); the number applied."""
        with self._lock:
            changes, offset = self.log.read_from(self._offset)
            state = self.state
            for change in changes:
                if change.seq > state.seq:
                    start = state.base_n + len(state.added)
                    state, gone = self._apply(state, change)
                    self._moves[change.seq] = (start, tuple(gone))
            self._offset = offset
            self.state = state  # the swap: searches read the old state or the new one, whole
            return len(changes)

    def write(self, put: Sequence[Passage], delete: Sequence[str]) -> Change:
        """Encode, log (durable: acknowledged once this returns) and apply one change here."""
        vectors = self.encode([p.indexed for p in put]) if self.encode is not None and put else None
        mirror = self.mirror
        if mirror is None:
            change = self.log.append(put, delete, vectors)
            self.poll()
            return change
        with self.log.hold():  # one writer at a time: positions are taken, and carried, in the log's order
            self.poll()
            self._carry(mirror.seq())
            if vectors is not None:  # past every position a state knows: no search sees them before the log does
                state = self.state
                mirror.upsert(state.base_n + len(state.added), vectors)
            change = self.log.append(put, delete, vectors)
            self.poll()
            try:
                mirror.delete(list(self._moves[change.seq][1]))
                mirror.mark(change.seq)
            except Exception:  # acknowledged all the same: searches leave the removed positions out, and the next
                # writer (or the next start-up) carries the rest
                logger.warning("change %d is logged but not yet carried into the dense collection", change.seq,
                               exc_info=True)
            return change

    def _carry(self, carried: int) -> None:
        """Carry the logged changes after `carried` into the mirror, in order (under the log's lock)."""
        if self.mirror is None or carried >= self.seq:
            return
        changes, _ = self.log.read_from(0)
        todo = [c for c in changes if carried < c.seq <= self.seq]
        logger.info("carrying %d logged changes into the dense collection", len(todo))
        for change in todo:
            start, gone = self._moves[change.seq]
            if change.put:
                vectors = self.log.vectors(change)
                if vectors is None and self.encode is not None:
                    vectors = self.encode([p.indexed for p in change.put])
                if vectors is not None:
                    self.mirror.upsert(start, vectors)
            self.mirror.delete(list(gone))
            self.mirror.mark(change.seq)

    def _base(self, doc_id: str) -> tuple[int, ...]:
        known = self._base_of.get(doc_id)
        if known is None:
            known = self._base_of[doc_id] = tuple(base_positions(self.store, doc_id))
        return known

    def _apply(self, state: LiveState, change: Change) -> tuple[LiveState, list[int]]:
        """The state after `change`, and the positions it stopped serving."""
        removed = set(state.removed)
        gone: list[int] = []
        alive = state.alive.copy()
        documents = dict(state.documents)
        changed = dict(state.changed)

        def drop(doc_id: str) -> int:
            """Remove the document's served passages; how many it had."""
            had = documents.get(doc_id)
            if had is None:
                had = self._base(doc_id)
            for position in had:
                if position < state.base_n:
                    removed.add(position)
                else:
                    alive[position - state.base_n] = False
                gone.append(position)
            return len(had)

        for doc_id in change.delete:
            dropped = drop(doc_id)
            if dropped:
                changed["deleted"] += 1
                changed["passages"] = changed.get("passages", 0) + dropped
            documents[doc_id] = ()
        put_docs: dict[str, list[int]] = {}
        for doc_id in change.documents_put:
            changed["replaced" if drop(doc_id) else "added"] += 1
            put_docs[doc_id] = []
        changed["passages"] = changed.get("passages", 0) + len(change.put)
        first = len(state.added)
        texts = [p.indexed for p in change.put]
        words = self.tokenize(texts) if self.tokenize is not None and texts else [[] for _ in texts]
        new_postings: dict[str, tuple[list[int], list[float]]] = {}
        for i, (passage, tokens) in enumerate(zip(change.put, words, strict=True)):
            put_docs[passage.doc_id].append(state.base_n + first + i)
            counts: dict[str, int] = {}
            for w in tokens:
                counts[w] = counts.get(w, 0) + 1
            for term, tf in counts.items():
                rows, tfs = new_postings.setdefault(term, ([], []))
                rows.append(first + i)
                tfs.append(float(tf))
        postings = dict(state.postings)
        for term, (rows, tfs) in new_postings.items():
            old = postings.get(term)
            new = (np.asarray(rows, dtype=np.int64), np.asarray(tfs, dtype=np.float32))
            postings[term] = new if old is None else (np.concatenate([old[0], new[0]]), np.concatenate([old[1], new[1]]))
        documents.update({d: tuple(p) for d, p in put_docs.items()})
        vectors = state.vectors
        if self.encode is not None and self.mirror is None and change.put:  # a change logged without vectors (by
            # a worker whose dense index was still pending) is encoded here: every passage put has its row, in order
            new_vectors = self.log.vectors(change)
            if new_vectors is None:
                new_vectors = self.encode(texts)
            vectors = new_vectors if vectors is None else np.concatenate([vectors, new_vectors])
        lengths = np.concatenate([state.lengths, np.asarray([len(w) for w in words], dtype=np.float32)])
        return LiveState(seq=change.seq, base_n=state.base_n, removed=frozenset(removed),
                         added=(*state.added, *change.put),
                         alive=np.concatenate([alive, np.ones(len(change.put), dtype=bool)]),
                         documents=documents, vectors=vectors, lengths=lengths, postings=postings,
                         changed=changed), gone

    # ------------------------------------------------------------------------------- searching the overlay
    def lexical(self, state: LiveState, queries: Sequence[str], k: int) -> Hits:
        """BM25 over the passages put that are still served, with the base's statistics."""
        hits = Hits.empty(len(queries), k)
        if self.tokenize is None or not state.alive.any():
            return hits
        stats = self.stats
        if stats is None:
            return hits
        n = stats.n - len(state.removed) + int(state.alive.sum())
        norm = stats.k1 * (1 - stats.b + stats.b * state.lengths / stats.avgdl)
        for row, words in enumerate(self.tokenize(list(queries))):
            scores = np.zeros(len(state.added), dtype=np.float32)
            for term in set(words):
                posting = state.postings.get(term)
                if posting is None:
                    continue
                rows, tfs = posting
                served = state.alive[rows]
                if not served.any():
                    continue
                rows, tfs = rows[served], tfs[served]
                df = stats.df(term) + len(rows)
                idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
                scores[rows] += idf * tfs / (tfs + norm[rows])
            _top(hits, row, scores, state.base_n, k)
        return hits

    def dense(self, state: LiveState, vectors: npt.NDArray[np.float32], k: int) -> Hits:
        """Inner products of the query vectors with the passages put that are still served."""
        hits = Hits.empty(len(vectors), k)
        if state.vectors is None or not state.alive.any():
            return hits
        scores = vectors @ state.vectors.T
        scores[:, ~state.alive] = -np.inf
        for row in range(len(vectors)):
            _top(hits, row, scores[row], state.base_n, k, keep=np.isfinite)
        return hits

    # ------------------------------------------------------------------------------- documents
    def documents(self, state: LiveState, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        base = [p for p in positions if p < state.base_n]
        found = iter(self.store.documents(base))
        out = []
        for p in positions:
            if p < state.base_n:
                out.append(next(found))
            else:
                passage = state.added[p - state.base_n]
                out.append((passage.id, passage.title, passage.text))
        return out

    def sample(self, state: LiveState, n: int, seed: int) -> list[int]:
        """`n` served positions drawn by `seed`, each once (the base's draw when nothing changed; else positions
        drawn in turn, those not served passed over: uniform over the served ones, without a walk over them)."""
        rng = random.Random(seed)
        if not state.changes:
            return rng.sample(range(state.base_n), min(n, state.base_n))
        size, wanted = state.base_n + len(state.added), min(n, state.served)
        drawn: dict[int, None] = {}
        while len(drawn) < wanted:
            p = rng.randrange(size)
            if state.serves(p):
                drawn.setdefault(p)
        return list(drawn)


def _top(hits: Hits, row: int, scores: npt.NDArray[np.float32], offset: int, k: int,
         keep: Any = None) -> None:
    """The best `k` of `scores` (positive, or where `keep` says) into `hits[row]`, as positions `offset + i`."""
    mask = keep(scores) if keep is not None else scores > 0
    candidates = np.flatnonzero(mask)
    if not len(candidates):
        return
    if len(candidates) > k:  # the k best (a partition: sorting every passage put was most of a search's cost)
        candidates = np.sort(candidates[np.argpartition(-scores[candidates], k - 1)[:k]])
    order = candidates[np.argsort(-scores[candidates], kind="stable")]
    hits.ids[row, :len(order)] = order + offset
    hits.scores[row, :len(order)] = scores[order]


def merge(base: Hits, overlay: Hits, removed: frozenset[int], k: int) -> Hits:
    """Per query: the base's hits without the removed positions and the overlay's, by score, the best `k`."""
    out = Hits.empty(len(base), k)
    for row in range(len(base)):
        pairs = [(float(s), int(d)) for d, s in zip(base.ids[row], base.scores[row], strict=True)
                 if d >= 0 and int(d) not in removed]
        pairs += [(float(s), int(d)) for d, s in zip(overlay.ids[row], overlay.scores[row], strict=True) if d >= 0]
        pairs.sort(key=lambda sd: -sd[0])
        for r, (s, d) in enumerate(pairs[:k]):
            out.ids[row, r] = d
            out.scores[row, r] = s
    return out


class LiveRetriever(Retriever):
    """A base retriever and the live overlay searched together (`kind` lexical: BM25, dense: the vectors)."""

    def __init__(self, base: Retriever, live: LiveIndex, kind: str) -> None:
        self.base = base
        self.live = live
        self.kind = kind
        self.name = base.name

    @property
    def doc_count(self) -> int:
        return self.base.doc_count

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        state = self.live.state  # one state for the whole search
        if self.kind == "dense" and self.live.mirror is not None:  # the changes are in the collection itself
            return self._mirrored(state, queries, k)
        if not state.changes:
            return self.base.batch_search(queries, k)
        depth = k + min(len(state.removed), max(k, REMOVED_SLACK))
        if self.kind == "dense":
            vectors = self.base.encoder.encode_queries(queries)  # type: ignore[attr-defined]
            base = self.base.index.search(vectors, depth)  # type: ignore[attr-defined]
            overlay = self.live.dense(state, vectors, k)
        else:
            base = self.base.batch_search(queries, depth)
            overlay = self.live.lexical(state, queries, k)
        return merge(base, overlay, state.removed, k)

    def _mirrored(self, state: LiveState, queries: Sequence[str], k: int) -> Hits:
        """Milvus holds the changes: ask it for the positions this state knows, then leave out what the state no
        longer serves (a delete Milvus has not done yet)."""
        end = state.base_n + len(state.added)
        dead = len(state.removed) + int(len(state.alive) - state.alive.sum())
        vectors = self.base.encoder.encode_queries(queries)  # type: ignore[attr-defined]
        found = self.base.index.search(vectors, k + min(dead, max(k, REMOVED_SLACK)),  # type: ignore[attr-defined]
                                       below=end, strong=state.changes)
        out = Hits.empty(len(queries), k)
        for row in range(len(queries)):
            ids = found.ids[row]
            keep = [i for i, d in enumerate(ids.tolist()) if d >= 0 and state.serves(d)][:k]
            out.ids[row, :len(keep)] = ids[keep]
            out.scores[row, :len(keep)] = found.scores[row, keep]
        return out

    def close(self) -> None:
        self.base.close()


@dataclass
class LiveCorpus:
    """The document store as the live state serves it: positions past the base are the passages put."""

    live: LiveIndex

    @property
    def base(self) -> DocumentStore:
        return self.live.store

    @property
    def path(self) -> Path:
        return self.base.path  # type: ignore[attr-defined,no-any-return]

    @property
    def checksum(self) -> str:
        return self.base.checksum  # type: ignore[attr-defined,no-any-return]

    def __len__(self) -> int:
        return len(self.base)

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        return self.live.documents(self.live.state, positions)

    def positions(self, ids: Sequence[str]) -> npt.NDArray[np.int64]:
        return self.base.positions(ids)

    def passage(self, i: int) -> str:
        _, title, text = self.documents([i])[0]
        return indexed_text(title, text)

    def iter_documents(self) -> Iterator[tuple[str, str, str]]:
        state = self.live.state
        for start in range(0, state.base_n + len(state.added), 4096):
            chunk = [p for p in range(start, min(start + 4096, state.base_n + len(state.added))) if state.serves(p)]
            yield from self.live.documents(state, chunk)

    def close(self) -> None:
        self.base.close()
