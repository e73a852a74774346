"""Changes in a dense store that takes them itself (Milvus: `plugsearch.retriever.backends.milvus_index.MilvusChanges`).
One job: keeping the collection in step with the log, and searching it as a state sees it.

Under the log's lock a writer upserts the vectors of the passages put at their positions (past every position a
state knows, so no search sees them before the log does), logs the change, then deletes the positions it removed
and records the change as carried; a change logged but not carried (its writer died, or Milvus did not answer) is
carried by the next writer or at the next start-up. Dense searches then ask the collection alone, for the positions
the state knows, leaving out the removed ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.backends.base import DenseMirror, Hits, Retriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.live.changelog import Change, ChangeLog
from plugsearch.retriever.live.state import LiveState, Overlay

logger = logging.getLogger(__name__)

REMOVED_SLACK = 64
"""How many more results a search asks for when its state leaves passages out (they are dropped)."""


class MirrorSearch(Retriever):
    """Dense search of a collection that holds the changes, as `state` sees them."""

    name = "live-dense-mirror"

    def __init__(self, overlay: Overlay, mirror: DenseMirror, encoder: Encoder, state: LiveState) -> None:
        self.overlay, self.mirror, self.encoder, self.state = overlay, mirror, encoder, state

    @property
    def doc_count(self) -> int:
        return self.state.served

    def close(self) -> None:
        """Nothing of its own: the live index holds what it reads."""

    def batch_search(self, queries: Sequence[str], k: int) -> Hits:
        state = self.state
        end = state.base_n + state.size
        dead = state.removed + state.dead
        found = self.mirror.search(self.encoder.encode_queries(queries), k + min(dead, max(k, REMOVED_SLACK)),
                                   below=end, strong=state.changes)
        out = Hits.empty(len(queries), k)
        for row in range(len(queries)):
            ids = found.ids[row]
            keep = [i for i, d in enumerate(ids.tolist()) if d >= 0 and self.overlay.serves(state, d)][:k]
            out.ids[row, :len(keep)] = ids[keep]
            out.scores[row, :len(keep)] = found.scores[row, keep]
        return out


Moves = dict[int, tuple[int, tuple[int, ...]]]
"""seq -> (the position its first passage put took, the positions it stopped serving)."""


def carry(mirror: DenseMirror, log: ChangeLog, changes: Sequence[Change], moves: Moves,
          encode: Callable[[list[str]], npt.NDArray[np.float32]] | None) -> None:
    """Carry `changes` (logged, applied here, not yet in the collection) into it, in order (under the log's lock)."""
    if changes:
        logger.info("carrying %d logged changes into the dense collection", len(changes))
    for change in changes:
        start, gone = moves[change.seq]
        if change.put:
            vectors = vectors_of(log, change)
            if vectors is None and encode is not None:
                vectors = encode([p.indexed for p in change.put])
            if vectors is not None:
                mirror.upsert(start, vectors)
        mirror.delete(list(gone))
        mirror.mark(change.seq)


def vectors_of(log: ChangeLog, change: Change) -> npt.NDArray[np.float32] | None:
    """The logged vectors of every passage `change` put, in order; None when some are not logged."""
    parts = [v.array for v in log.vectors_for(change.seq)]
    rows = np.concatenate(parts) if parts else None
    return rows if rows is not None and len(rows) == len(change.put) else None
