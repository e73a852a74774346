"""The documents the served corpus holds, each with its passage count and content hash: what `plugsearch-index sync`
compares a folder with (`GET /documents`), and how many passages a delete removes.

A read-only view on top of the live overlay (`plugsearch.retriever.live.overlay`: its current `View`, the base and
the documents its changes touched), changing nothing in it. A document's hash is `document_hash` over its served passages in order (their ids,
titles and texts), the same function a client applies to the passages it would put, so equal hashes mean the
served document is what the file gives. A base (the built corpus, or the generation compaction made, which never
changes while served) is read once, when first listed, and kept while it is served; the documents a change touched
are taken from the view.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from plugsearch.retriever.ingest.passages import doc_id_of, document_hash, passage_digest, passage_number
from plugsearch.retriever.live.overlay import LiveIndex, View
from plugsearch.retriever.store.docstore import DocumentStore


@dataclass(frozen=True)
class Listed:
    id: str
    passages: int
    sha256: str


def _hash_of(passages: Iterable[tuple[str, str, str]]) -> tuple[int, str]:
    digests = sorted((passage_number(pid), passage_digest(pid, title, text)) for pid, title, text in passages)
    return len(digests), document_hash(d for _, d in digests)


class _Base:
    """Each document of one base (the built corpus, or the generation compaction made) with its passage count and
    hash, read once."""

    def __init__(self, store: DocumentStore) -> None:
        parts: dict[str, list[tuple[int, bytes]]] = {}
        for pid, title, text in store.iter_documents():
            parts.setdefault(doc_id_of(pid), []).append((passage_number(pid), passage_digest(pid, title, text)))
        self.documents = {doc: (len(p), document_hash(d for _, d in sorted(p))) for doc, p in parts.items()}
        self.ids = sorted(self.documents)


class DocumentListing:
    """The served documents of `store` and, when documents change while serving, of `live`'s current view (its
    base, and the documents its changes touched)."""

    def __init__(self, store: DocumentStore, live: LiveIndex | None) -> None:
        self.store = store
        self.live = live
        self._bases: dict[int, _Base] = {}
        self._lock = threading.Lock()
        self._touched: dict[tuple[int, str, tuple[int, ...]], tuple[int, str]] = {}
        self._sorted: tuple[tuple[int, int], list[str]] | None = None

    def _base(self, view: View | None) -> _Base:
        store = view.base.store if view is not None else self.store
        generation = view.base.generation.gen if view is not None else 0
        with self._lock:
            found = self._bases.get(generation)
            if found is None:
                found = self._bases[generation] = _Base(store)
                for old in [g for g in self._bases if g != generation]:  # a swapped-out generation's listing
                    del self._bases[old]
        return found

    @staticmethod
    def _changed(view: View | None) -> dict[str, tuple[int, ...]]:
        """The documents the view's changes touched -> the positions of each served in its state (none: deleted)."""
        if view is None or not view.state.changes:
            return {}
        overlay, state = view.overlay, view.state
        return {doc: tuple(p for p in overlay.positions_of(doc, remember=False) if overlay.serves(state, p))
                for doc in list(overlay.touched())}

    def _entry(self, view: View, doc: str, positions: tuple[int, ...]) -> tuple[int, str]:
        key = (view.base.generation.gen, doc, positions)
        found = self._touched.get(key)
        if found is None:
            origin = view.base.origin
            found = self._touched[key] = _hash_of(view.documents([origin + p for p in positions]))
        return found

    def _ids(self, view: View | None, base: _Base, changed: dict[str, tuple[int, ...]]) -> list[str]:
        if not changed:
            return base.ids
        key = (view.base.generation.gen, view.state.seq) if view is not None else (0, 0)
        if self._sorted is not None and self._sorted[0] == key:
            return self._sorted[1]
        ids = sorted({*base.documents, *(d for d, positions in changed.items() if positions)}
                     - {d for d, positions in changed.items() if not positions})
        self._sorted = (key, ids)
        return ids

    def page(self, *, after: str | None = None, prefix: str = "", limit: int = 1000) -> tuple[list[Listed], str | None]:
        """Up to `limit` served documents whose ids start with `prefix`, in id order after `after`, and the id to
        ask after for the next page (None: no more)."""
        view = self.live.view if self.live is not None else None
        base = self._base(view)
        changed = self._changed(view)
        ids = self._ids(view, base, changed)
        start = bisect.bisect_right(ids, after) if after is not None else bisect.bisect_left(ids, prefix)
        out: list[Listed] = []
        for doc in ids[start:]:
            if not doc.startswith(prefix):
                if doc > prefix:
                    break
                continue
            if len(out) == limit:
                return out, out[-1].id
            positions = changed.get(doc)
            count, digest = self._entry(view, doc, positions) if view is not None and positions else base.documents[doc]
            out.append(Listed(doc, count, digest))
        return out, None

    def served_passages(self, doc_ids: Sequence[str]) -> int:
        """How many passages of these documents are served now (what deleting them removes)."""
        if self.live is None:
            return 0
        view = self.live.view
        overlay, state = view.overlay, view.state
        return sum(sum(1 for p in overlay.positions_of(doc, remember=False) if overlay.serves(state, p))
                   for doc in dict.fromkeys(doc_ids))
