"""The served corpus as it changes: a base (the built indexes, or the newest generation compaction built from them:
`plugsearch.retriever.live.generations`) and the change log's changes over it (`plugsearch.retriever.live.changelog`).

`LiveIndex` follows the log and writes to it; each other job has its own module: applying changes (`state`), the
passages put searched by their words (`lexical`) and by their vectors (`vectors`, with the catch-up that encodes
those put before the dense index was there), a dense store that takes the changes itself (`mirror`), folding the
changes into new indexes (`compaction`). A search goes through `LiveRetriever`, a `Retriever` like every backend: it
asks the base's retriever and the overlay's segment (both `Retriever`s, bound to one state), leaves out what the
state no longer serves, and merges by score. A document is its passages: `<doc_id>` alone, or `<doc_id>#0`, `#1`,
... (what `plugsearch-index ingest` writes); putting a document replaces all of its passages, deleting it removes
them all.

Each change applies whole: its state is published by one reference assignment (`view`), so a search sees a change
entirely or not at all. `poll` reads what other workers acknowledged, and moves to a newer generation when
compaction made one (loaded beside the served one, then swapped in; the old one is closed once no search can still
read it). The state's `seq` (and the log's `epoch`) are part of the index identity, so a cache keyed on it never
serves a result from before a change.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.backends.base import DenseMirror, Hits, Retriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.ingest.passages import Passage, doc_id_of
from plugsearch.retriever.live import mirror as mirroring
from plugsearch.retriever.live.changelog import (
    Change,
    ChangeLog,
    ChangeLogDamaged,
    ChangeLogError,
    ChangeNotWritten,
    FoldedAway,
    Generation,
)
from plugsearch.retriever.live.generations import ORIGIN_BITS, Base
from plugsearch.retriever.live.lexical import LazyStats, LexicalSegment, Postings
from plugsearch.retriever.live.state import LiveState, Overlay, base_positions
from plugsearch.retriever.live.vectors import ENCODE_LOCK, Batch, CatchUp, DenseSegment, VectorRows, missing
from plugsearch.retriever.store.corpus import indexed_text
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import IndexMismatch

__all__ = ["LiveCorpus", "LiveIndex", "LiveRetriever", "View", "base_positions", "doc_id_of", "merge"]

logger = logging.getLogger(__name__)

REMOVED_SLACK = mirroring.REMOVED_SLACK
RETIRE_AFTER_S = 120.0
"""How long a generation that was swapped out stays open (a search answered from it is still read) before it is
closed."""
SWITCH_RETRY_S = 60.0
"""How long after a generation failed to load it is tried again."""


@dataclass(frozen=True)
class View:
    """What searches read: a base, the overlay of its changes (`postings`, `vectors`: the overlay's passages by
    their words and vectors) and the state they are at."""

    base: Base
    overlay: Overlay
    postings: Postings | None
    stats: LazyStats | None
    vectors: VectorRows
    state: LiveState

    def segment(self, method: str) -> Retriever | None:
        """The overlay's passages as a `Retriever` for `method` (bm25 / dense), bound to this view's state."""
        if method == "dense":
            encoder = self.base.encoder
            if self.base.mirror is not None and encoder is not None:
                return mirroring.MirrorSearch(self.overlay, self.base.mirror, encoder, self.state)
            return None if encoder is None else DenseSegment(self.overlay, self.vectors, encoder, self.state)
        if self.postings is None or self.stats is None:
            return None
        return LexicalSegment(self.overlay, self.postings, self.stats.get(), self.state)

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        """(id, title, text) of positions of this view's generation."""
        return self.overlay.documents(self.state, [p - self.base.origin for p in positions])


class LiveIndex:
    """The base and the change log, applied in order; `view` is what searches read.

    `log`: None when it could not be opened at all (served read-only, `error` says why, with `changes`: what could
    be read of it). `loader`: a generation's indexes (from the generation and the encoder already loaded), to move
    to the one compaction made.
    `on_error`: `refuse` (a bad record in the log at start-up raises ChangeLogDamaged; later, `error` is set and
    readiness fails) or `read-only` (the changes before it are served, writes are refused)."""

    def __init__(self, log: ChangeLog | None, base: Base, *,
                 loader: Callable[[Generation, Encoder | None], Base] | None = None,
                 on_error: str = "refuse", wait_s: float = 0.5, error: str | None = None,
                 changes: Sequence[Change] = ()) -> None:
        self.log = log
        self.loader = loader
        self.on_error = on_error
        self.wait_s = wait_s
        self.error = error
        """Why the log is not followed any more (a bad record, a log that cannot be opened or written); None: it is."""
        self.partial = error is not None and log is None
        """Whether acknowledged changes are left out (a bad record, a log that could not be read): the index id says
        so. A log that can be read but not written is served whole."""
        self.corpus_checksum = base.store.checksum if base.generation.gen == 0 else \
            str(base.generation.body.get("built_checksum", base.store.checksum))
        """The built corpus's checksum: what the changes are changes of, in every generation."""
        self.epoch = log.epoch if log is not None else ""
        self._lock = threading.Lock()
        self._vector_id = 0
        self._retired: list[tuple[float, View]] = []
        self._failed: tuple[int, float] | None = None
        self._moves: mirroring.Moves = {}
        self._catch_up: CatchUp | None = None
        self.view = self._fresh(base)
        if changes:
            self._publish(self.view, list(changes))
        if log is not None:  # also a log open for reading only: every change it holds is served
            try:
                self._replay()
            except ChangeLogDamaged as exc:
                if on_error == "refuse":
                    raise
                self._freeze(exc)
        if base.mirror is not None and self.writable:
            self._mirror_on(base.mirror)
        self._start_catch_up()

    # ------------------------------------------------------------------------------------------- views
    def _fresh(self, base: Base) -> View:
        postings = Postings(base.lexical.tokenize) if base.lexical is not None else None
        vectors = VectorRows()

        def on_put(first: int, passages: Sequence[Passage]) -> None:
            if postings is not None:
                postings.add(first, passages)
            vectors.grow(first + len(passages))

        lexical = base.lexical
        stats = LazyStats(lambda: lexical.lexical_stats(base.store)) if lexical is not None else None
        generation = base.generation
        overlay = Overlay(base.store, seq=generation.folded, changed=generation.body.get("changed"), on_put=on_put)
        self._vector_id = 0
        return View(base, overlay, postings, stats, vectors, overlay.state)

    def _publish(self, view: View, changes: Sequence[Change]) -> View:
        """Apply `changes` to `view`'s overlay and make its new state the one searched."""
        state = view.state
        for change in changes:
            if change.seq <= state.seq:
                continue
            start = view.overlay.base_n + state.size
            state, gone = view.overlay.apply(change)
            view.overlay.state = state
            if view.base.generation.gen == 0:
                self._moves[change.seq] = (start, tuple(gone))
        view = replace(view, state=state)
        self.view = view  # the swap: searches read the old state or the new one, whole
        return view

    def _replay(self) -> None:
        assert self.log is not None
        t0, view = time.perf_counter(), self.view
        batch: list[Change] = []
        for change in self.log.iter_after(view.state.seq):
            batch.append(change)
            if len(batch) >= 4096:
                view = self._publish(view, batch)
                batch = []
        view = self._publish(view, batch)
        self._read_vectors(view)
        if view.state.seq:
            logger.info("changes replayed up to %d in %.1f s (%d passages put, %d base passages left out)",
                        view.state.seq, time.perf_counter() - t0, view.state.size, view.state.removed)

    def _read_vectors(self, view: View) -> None:
        """Apply the vectors logged since the last read (those of changes this view has applied)."""
        assert self.log is not None
        while True:
            parts = self.log.vectors_after(self._vector_id)
            for part in parts:
                if part.seq > view.state.seq:
                    return  # a change not applied yet: read again at the next poll
                first = view.overlay.first_row.get(part.seq)
                if first is not None:  # else folded into the base
                    view.vectors.set(first + part.first, part.array)
                self._vector_id = part.id
            if len(parts) < 4096:
                return

    @property
    def state(self) -> LiveState:
        return self.view.state

    @property
    def seq(self) -> int:
        return self.view.state.seq

    @property
    def generation(self) -> int:
        return self.view.base.generation.gen

    @property
    def tag(self) -> str:
        """What the index identity adds for the changes: the log's epoch and the last change applied ('' with no
        change: the built indexes as they are); `-partial` while acknowledged changes are left out (a bad record, a
        log that could not be read)."""
        seq = self.view.state.seq
        if not seq:
            return "partial" if self.partial else ""
        return f"{self.epoch[:8]}-c{seq}" + ("-partial" if self.partial else "")

    # ------------------------------------------------------------------------------------------- following
    def poll(self) -> int:
        """Apply the changes acknowledged since the last poll (by any worker), after moving to a newer generation
        when compaction made one; the number applied."""
        with self._lock:
            self._close_retired()
            if self.log is None or self.error is not None:
                return 0
            try:
                return self._poll()
            except ChangeLogDamaged as exc:
                self._freeze(exc)
                return len(exc.changes)
            except (ChangeLogError, FoldedAway) as exc:  # an I/O error, a generation not loaded yet: next poll
                logger.warning("reading the change log failed (retried at the next poll): %s", exc)
                return 0

    def _poll(self) -> int:
        assert self.log is not None
        latest = self.log.generation()
        if latest.gen > self.view.base.generation.gen and self.loader is not None:
            self._switch(latest)
        view = self.view
        changes = self.log.read_after(view.state.seq)
        view = self._publish(view, changes)
        self._read_vectors(view)
        if changes:
            self._start_catch_up()
        return len(changes)

    def _freeze(self, exc: ChangeLogDamaged) -> None:
        self._publish(self.view, exc.changes)
        self.partial = True
        self.error = (f"{exc.reason}; serving the {self.view.state.seq} changes before it, read-only"
                      if self.on_error == "read-only" else exc.reason)
        logger.error("the change log is damaged: %s. Changes are not followed or taken any more; see "
                     "docs/operations.md, 'Changes: durability and recovery'", exc.reason)

    def _switch(self, generation: Generation) -> None:
        """Load `generation` beside the served one, replay the changes after it, then swap it in."""
        assert self.loader is not None and self.log is not None
        if self._failed is not None and self._failed[0] == generation.gen and time.monotonic() < self._failed[1]:
            return
        t0 = time.perf_counter()
        try:
            base = self.loader(generation, self.view.base.encoder)
        except Exception:
            self._failed = (generation.gen, time.monotonic() + SWITCH_RETRY_S)
            logger.exception("generation %d could not be loaded: serving generation %d meanwhile (tried again in "
                             "%.0f s)", generation.gen, self.generation, SWITCH_RETRY_S)
            return
        old = self.view
        view = self._fresh(base)
        self._moves.clear()
        vector_id = self._vector_id
        try:
            self._publish(view, list(self.log.iter_after(generation.folded)))
        except Exception:
            self.view, self._vector_id = old, vector_id
            base.close()
            raise
        self._read_vectors(self.view)
        self._retired.append((time.monotonic() + RETIRE_AFTER_S, old))
        logger.info("serving generation %d (changes up to %d folded into its indexes) in %.1f s: %d passages put "
                    "since, %d left out", generation.gen, generation.folded, time.perf_counter() - t0,
                    self.view.state.size, self.view.state.removed)

    def _close_retired(self, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        keep = []
        for deadline, view in self._retired:
            if deadline <= now:
                view.base.close(keep=self.view.base.encoder)
            else:
                keep.append((deadline, view))
        self._retired = keep

    def resolve(self, generation: int) -> View:
        """The view that serves positions of `generation` (the current one, or one swapped out a moment ago)."""
        view = self.view
        if view.base.generation.gen == generation:
            return view
        for _, old in reversed(self._retired):
            if old.base.generation.gen == generation:
                return old
        raise IndexError(f"positions of generation {generation} are no longer served")

    # ------------------------------------------------------------------------------------------- writing
    @property
    def writable(self) -> bool:
        return self.log is not None and self.log.writable and self.error is None

    def write(self, put: Sequence[Passage], delete: Sequence[str]) -> Change | None:
        """Encode, log (durable: acknowledged once this returns) and apply one change here. None when there is
        nothing to change (documents to delete that are not served): nothing logged. ChangeNotWritten when the
        log cannot take it."""
        if not self.writable or self.log is None:
            raise ChangeNotWritten(self.error or "the change log is open for reading only")
        base = self.view.base
        encoder = base.encoder if "dense" in base.retrievers else None
        vectors = encoder.encode_passages([p.indexed for p in put]) if encoder is not None and put else None
        with self.log.hold():  # one writer at a time across the workers: what is served is known while it writes
            if not put:
                self.poll()
                delete = self.served_documents(delete)
                if not delete:
                    return None
            if base.mirror is not None:
                return self._write_mirrored(base.mirror, put, delete, vectors)
            change = self.log.append(put, delete, vectors)
        self.poll()
        return change

    def served_documents(self, ids: Sequence[str]) -> list[str]:
        """Those of `ids` served now (each once, in order)."""
        view = self.view
        out = []
        for doc_id in dict.fromkeys(ids):
            positions = view.overlay.positions_of(doc_id, remember=False)
            if any(view.overlay.serves(view.state, p) for p in positions):
                out.append(doc_id)
        return out

    def _write_mirrored(self, mirror: DenseMirror, put: Sequence[Passage], delete: Sequence[str],
                        vectors: npt.NDArray[np.float32] | None) -> Change:
        """Under the log's lock: positions are taken, and carried, in the log's order."""
        assert self.log is not None
        self.poll()
        self._carry(mirror, mirror.seq())
        if vectors is not None:  # past every position a state knows: no search sees them before the log does
            state = self.view.state
            mirror.upsert(state.base_n + state.size, vectors)
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

    def _carry(self, mirror: DenseMirror, carried: int) -> None:
        if self.log is None or carried >= self.seq:
            return
        todo = [c for c in self.log.iter_after(carried) if c.seq <= self.seq]
        encoder = self.view.base.encoder
        mirroring.carry(mirror, self.log, todo, self._moves, encoder.encode_passages if encoder else None)

    def _mirror_on(self, mirror: DenseMirror) -> None:
        """Searches' vectors in `mirror` from now on: the changes it lacks carried into it first (refused when it
        carries changes this log does not hold)."""
        if self.log is None:
            return
        with self.log.hold():
            self.poll()
            carried = mirror.seq()
            if carried > self.seq:
                raise IndexMismatch(f"the dense collection carries changes up to {carried}, the change log in "
                                    f"{self.log.folder} only up to {self.seq}: it is not this log's collection; "
                                    "rebuild it with `plugsearch-index build --force`, or point RETRIEVER_CHANGES_DIR "
                                    "at its log")
            self._carry(mirror, carried)

    # ------------------------------------------------------------------------------------------- the dense index
    def add_dense(self, dense: Retriever, encoder: Encoder, mirror: DenseMirror | None) -> None:
        """The dense index arrived (it was pending): searched from now on, with the vectors the log holds; those it
        lacks are encoded by the catch-up, in batches, off the event loop (never here)."""
        with self._lock:
            base = self.view.base
            base.encoder = encoder
            base.mirror = mirror
            base.retrievers["dense"] = dense
        if mirror is not None and self.writable:
            self._mirror_on(mirror)
        self._start_catch_up()

    def pending_vectors(self) -> int:
        """Served passages put that have no vectors yet (the catch-up encodes them)."""
        view = self.view
        if "dense" not in view.base.retrievers or view.base.mirror is not None:
            return 0
        return sum(b.rows for b in missing(view.overlay, view.vectors, view.state))

    def _start_catch_up(self) -> None:
        view = self.view
        if "dense" not in view.base.retrievers or view.base.mirror is not None or view.base.encoder is None:
            return
        if self._catch_up is not None and self._catch_up.is_alive():
            return
        if not missing(view.overlay, view.vectors, view.state, batch=1):
            return
        encoder = view.base.encoder
        log = self.log if self.writable else None

        def todo() -> list[Batch]:
            current = self.view
            return missing(current.overlay, current.vectors, current.state)

        def encode(batch: Batch) -> npt.NDArray[np.float32]:
            passages = self.view.overlay.passages[batch.row:batch.row + batch.rows]
            return encoder.encode_passages([p.indexed for p in passages])

        def store(batch: Batch, vectors: npt.NDArray[np.float32]) -> None:
            if log is not None:
                try:
                    log.add_vectors(batch.seq, batch.first, vectors)
                except ChangeNotWritten as exc:  # kept here, encoded again by the next start
                    logger.warning("vectors of change %d could not be logged: %s", batch.seq, exc.reason)
            current = self.view
            first = current.overlay.first_row.get(batch.seq)
            if first is not None and first + batch.first == batch.row:
                current.vectors.set(batch.row, vectors)

        self._catch_up = CatchUp(todo=todo, encode=encode, store=store, refresh=self.poll,
                                 lock=log.folder / ENCODE_LOCK if log is not None else None, wait_s=self.wait_s)
        self._catch_up.start()

    # ------------------------------------------------------------------------------------------- reading
    def retriever(self, method: str) -> LiveRetriever:
        return LiveRetriever(self, method)

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        """(id, title, text) of served positions (of any generation still open), in order."""
        out: list[tuple[str, str, str] | None] = [None] * len(positions)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(positions):
            groups.setdefault(int(p) >> ORIGIN_BITS, []).append(i)
        for generation, rows in groups.items():
            found = self.resolve(generation).documents([int(positions[i]) for i in rows])
            for i, doc in zip(rows, found, strict=True):
                out[i] = doc
        return [d for d in out if d is not None]

    def sample(self, n: int, seed: int) -> tuple[list[int], int]:
        """`n` served positions drawn by `seed`, each once, and how many are served (the base's draw when nothing
        changed; else positions drawn in turn, those not served passed over: uniform over the served ones)."""
        view = self.view
        state, overlay, origin = view.state, view.overlay, view.base.origin
        rng = random.Random(seed)
        if not state.changes:
            return [origin + p for p in rng.sample(range(state.base_n), min(n, state.base_n))], state.served
        size, wanted = state.base_n + state.size, min(n, state.served)
        drawn: dict[int, None] = {}
        while len(drawn) < wanted:
            p = rng.randrange(size)
            if overlay.serves(state, p):
                drawn.setdefault(p)
        return [origin + p for p in drawn], state.served

    def iter_documents(self) -> Iterator[tuple[str, str, str]]:
        view = self.view
        state, overlay = view.state, view.overlay
        end = state.base_n + state.size
        for start in range(0, end, 4096):
            chunk = [p for p in range(start, min(start + 4096, end)) if overlay.serves(state, p)]
            yield from overlay.documents(state, chunk)

    def close(self) -> None:
        if self._catch_up is not None:
            self._catch_up.stop()
            self._catch_up.join(timeout=30)
        for _, view in self._retired:
            view.base.close(keep=self.view.base.encoder)
        self._retired = []
        self.view.base.close()
        if self.log is not None:
            self.log.close()


def merge(base: Hits, overlay: Hits, removed: Callable[[int], bool], k: int) -> Hits:
    """Per query: the base's hits without the removed positions and the overlay's, by score, the best `k`."""
    out = Hits.empty(len(base), k)
    for row in range(len(base)):
        pairs = [(float(s), int(d)) for d, s in zip(base.ids[row], base.scores[row], strict=True)
                 if d >= 0 and not removed(int(d))]
        pairs += [(float(s), int(d)) for d, s in zip(overlay.ids[row], overlay.scores[row], strict=True) if d >= 0]
        pairs.sort(key=lambda sd: -sd[0])
        for r, (s, d) in enumerate(pairs[:k]):
            out.ids[row, r] = d
            out.scores[row, r] = s
    return out


class LiveRetriever(Retriever):
    """A method (`bm25`, `dense`) as the live corpus serves it: the base's retriever and the overlay's segment,
    both searched through `batch_search`, over one state."""

    def __init__(self, live: LiveIndex, method: str) -> None:
        self.live = live
        self.method = method
        self.name = f"live-{method}"

    @property
    def doc_count(self) -> int:
        return self.live.view.state.served

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        view = self.live.view  # one view for the whole search
        state, base = view.state, view.base.retrievers[self.method]
        segment = view.segment(self.method)
        if isinstance(segment, mirroring.MirrorSearch):  # the collection holds the changes itself
            hits = segment.batch_search(queries, k)
        elif not state.changes or segment is None:
            hits = base.batch_search(queries, k)
        else:
            depth = k + min(state.removed, max(k, REMOVED_SLACK))
            hits = merge(base.batch_search(queries, depth), segment.batch_search(queries, k),
                         view.overlay.removed_in(state), k)
        if view.base.origin:
            hits = Hits(np.where(hits.ids >= 0, hits.ids + view.base.origin, -1), hits.scores)
        return hits

    def close(self) -> None:
        """The live index closes the bases."""


@dataclass
class LiveCorpus:
    """The document store as the live index serves it: positions of any open generation, the passages put."""

    live: LiveIndex

    @property
    def base(self) -> DocumentStore:
        return self.live.view.base.store

    @property
    def path(self) -> Path:
        return self.base.path

    @property
    def checksum(self) -> str:
        """The built corpus's: what the changes (and the policy trained on it) are bound to."""
        return self.live.corpus_checksum

    def __len__(self) -> int:
        return self.live.view.state.served

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        return self.live.documents(positions)

    def positions(self, ids: Sequence[str]) -> npt.NDArray[np.int64]:
        found = self.base.positions(ids)
        origin = self.live.view.base.origin
        return np.where(found >= 0, found + origin, -1)

    def passage(self, i: int) -> str:
        _, title, text = self.documents([i])[0]
        return indexed_text(title, text)

    def iter_documents(self) -> Iterator[tuple[str, str, str]]:
        return self.live.iter_documents()

    def close(self) -> None:
        """The live index closes the stores."""
