"""The changes applied over one base (the built indexes, or a generation compaction built): which base passages
are no longer served, the passages put and which of them still are, each document's served positions, the counts
`/version` reports. One job: applying changes, in order.

A base passage keeps its position; the passages put take positions `base_n`, `base_n + 1`, ... (rows 0, 1, ... of
the overlay). Everything here only grows: a row, once put, keeps its place; a passage removed records the change
that removed it (`gone_at`). A `LiveState` (the change it is at, how many rows it knows) is therefore a consistent
view for as long as a search holds it, with no copy of anything: a row past its `size`, or removed by a change
after its `seq`, is simply not in it. So the work of a change is the work of its own passages (their tokens, their
vectors), never a copy of what came before (the first version copied every posting list per change: a one-passage
put took 230 ms after five large documents, and replaying 305 changes 34 s).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import Change
from plugsearch.retriever.store.docstore import DocumentStore

NEVER = np.iinfo(np.int64).max
"""`gone_at` of a passage still served."""
MAX_PASSAGES_PER_DOCUMENT = 100_000
"""How far `<doc_id>#<n>` is probed in the base for a document's passages (they are numbered from 0)."""

COUNTERS = ("added", "replaced", "deleted", "passages")


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


class Grow:
    """A 1-d array that grows by doubling: `data[:n]` holds what was appended. A reader reads `data` (whichever
    array is current: a grown one holds everything the old one did) up to the length its state knows."""

    def __init__(self, dtype: Any, fill: Any = 0, shape: tuple[int, ...] = ()) -> None:
        self.fill = fill
        self.data: npt.NDArray[Any] = np.full((16, *shape), fill, dtype=dtype)
        self.n = 0

    def reserve(self, n: int) -> None:
        if n > len(self.data):
            grown = np.full((max(n, 2 * len(self.data)), *self.data.shape[1:]), self.fill, dtype=self.data.dtype)
            grown[:self.n] = self.data[:self.n]
            self.data = grown

    def extend(self, values: Any) -> None:
        values = np.asarray(values, dtype=self.data.dtype)
        self.reserve(self.n + len(values))
        self.data[self.n:self.n + len(values)] = values
        self.n += len(values)

    def __len__(self) -> int:
        return self.n


@dataclass(frozen=True)
class LiveState:
    """One consistent view of the changes over a base: up to change `seq`, the first `size` rows put. Never changed
    once made (the next change makes the next one)."""

    seq: int
    base_n: int
    size: int = 0
    removed: int = 0
    """Base passages no longer served."""
    dead: int = 0
    """Passages put no longer served (replaced or deleted since)."""
    changed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    """Documents added, replaced and deleted since the built corpus, and `passages`: the passages put plus the
    passages deleted (a document put again counts its new passages), what the searcher's corpus check measures drift
    by. Counted from the built corpus, across generations."""

    @property
    def served(self) -> int:
        return self.base_n - self.removed + self.size - self.dead

    @property
    def changes(self) -> bool:
        return bool(self.removed) or bool(self.size)

    @property
    def overlay_passages(self) -> int:
        """What the overlay holds beyond the base: passages put, and base passages it leaves out (what compaction
        folds away)."""
        return self.size + self.removed


class Overlay:
    """The changes applied over a base of `base_n` passages (`store`: the base's documents, to find a document's
    passages). `apply` runs in one thread at a time (the live index's lock); readers use `state` and the methods
    that take one."""

    def __init__(self, store: DocumentStore, *, seq: int = 0, changed: dict[str, int] | None = None,
                 on_put: Callable[[int, Sequence[Passage]], None] | None = None) -> None:
        self.store = store
        self.base_n = len(store)
        self.passages: list[Passage] = []
        """Row i: the i-th passage put."""
        self.gone_at = Grow(np.int64, NEVER)
        """Row i: the change that stopped serving it (NEVER: served)."""
        self.base_gone: dict[int, int] = {}
        """Base position -> the change that stopped serving it."""
        self.first_row: dict[int, int] = {}
        """Change seq -> the row its first passage put took."""
        self._documents: dict[str, tuple[int, ...]] = {}
        """Every document a change touched -> its served positions (none: deleted)."""
        self._base_of: dict[str, tuple[int, ...]] = {}
        self.on_put = on_put
        """Called with (first row, passages) for the passages each change puts (the lexical postings, the vectors'
        rows)."""
        self.state = LiveState(seq=seq, base_n=self.base_n,
                               changed={**dict.fromkeys(COUNTERS, 0), **(changed or {})})

    # ------------------------------------------------------------------------------------------- applying
    def _base(self, doc_id: str, remember: bool = True) -> tuple[int, ...]:
        known = self._base_of.get(doc_id)
        if known is None:
            known = tuple(base_positions(self.store, doc_id))
            if remember:
                self._base_of[doc_id] = known
        return known

    def positions_of(self, doc_id: str, *, remember: bool = True) -> tuple[int, ...]:
        """The positions `doc_id` is served at now (`remember`: keep what the base holds of it, for a document a
        change touches; not for one merely asked about)."""
        had = self._documents.get(doc_id)
        return had if had is not None else self._base(doc_id, remember)

    def touched(self) -> Iterator[str]:
        """The documents the changes applied here touched."""
        return iter(self._documents)

    def apply(self, change: Change) -> tuple[LiveState, list[int]]:
        """Apply `change` (after every change before it); the new state (not yet published: the caller sets
        `state`) and the positions it stopped serving."""
        state = self.state
        seq, gone = change.seq, []
        removed, dead = state.removed, state.dead
        changed = dict(state.changed)

        def drop(doc_id: str) -> int:
            nonlocal removed, dead
            had = self.positions_of(doc_id)
            for position in had:
                if position < self.base_n:
                    self.base_gone[position] = seq
                    removed += 1
                else:
                    self.gone_at.data[position - self.base_n] = seq
                    dead += 1
                gone.append(position)
            return len(had)

        for doc_id in change.delete:
            dropped = drop(doc_id)
            if dropped:
                changed["deleted"] += 1
                changed["passages"] += dropped
            self._documents[doc_id] = ()
        for doc_id in change.documents_put:
            changed["replaced" if drop(doc_id) else "added"] += 1
        changed["passages"] += len(change.put)
        first = len(self.passages)
        self.first_row[seq] = first
        put_docs: dict[str, list[int]] = {}
        for i, passage in enumerate(change.put):
            put_docs.setdefault(passage.doc_id, []).append(self.base_n + first + i)
        self._documents.update({d: tuple(p) for d, p in put_docs.items()})
        if change.put:
            self.gone_at.extend(np.full(len(change.put), NEVER, dtype=np.int64))
            if self.on_put is not None:
                self.on_put(first, change.put)
            self.passages.extend(change.put)  # last: a reader bounds rows by a published state's size anyway
        return LiveState(seq=seq, base_n=self.base_n, size=len(self.passages), removed=removed, dead=dead,
                         changed=changed), gone

    # ------------------------------------------------------------------------------------------- reading
    def serves(self, state: LiveState, position: int) -> bool:
        """Whether `position` (a base passage, or a passage put) is served in `state`."""
        if position < self.base_n:
            return self.base_gone.get(position, NEVER) > state.seq
        row = position - self.base_n
        return row < state.size and bool(self.gone_at.data[row] > state.seq)

    def alive(self, state: LiveState) -> npt.NDArray[np.bool_]:
        """Per row of `state`: whether it is served."""
        return np.asarray(self.gone_at.data[:state.size] > state.seq)

    def removed_in(self, state: LiveState) -> Callable[[int], bool]:
        """A test of whether a base position is left out in `state`."""
        gone, seq = self.base_gone, state.seq
        return lambda position: gone.get(position, NEVER) <= seq

    def removed_base(self, state: LiveState) -> list[int]:
        """The base positions `state` leaves out."""
        return sorted(p for p, at in self.base_gone.items() if at <= state.seq)

    def documents(self, state: LiveState, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        base = [p for p in positions if p < self.base_n]
        found = iter(self.store.documents(base))
        out = []
        for p in positions:
            if p < self.base_n:
                out.append(next(found))
            else:
                passage = self.passages[p - self.base_n]
                out.append((passage.id, passage.title, passage.text))
        return out
