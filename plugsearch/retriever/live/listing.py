"""The documents the served corpus holds, each with its passage count and content hash: what `plugsearch-index sync`
compares a folder with (`GET /documents`), and how many passages a delete removes.

A read-only view on top of the live overlay (`plugsearch.retriever.live.overlay`: its `LiveState` and document
store), changing nothing in it. A document's hash is `document_hash` over its served passages in order (their ids,
titles and texts), the same function a client applies to the passages it would put, so equal hashes mean the
served document is what the file gives. The base (the built corpus, which never changes while serving) is read
once, when first listed, and kept; the documents a change touched are taken from the state.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from plugsearch.retriever.ingest.passages import document_hash, passage_digest, passage_number
from plugsearch.retriever.live.overlay import LiveIndex, LiveState, base_positions, doc_id_of
from plugsearch.retriever.store.docstore import DocumentStore


@dataclass(frozen=True)
class Listed:
    id: str
    passages: int
    sha256: str


def _hash_of(passages: Iterable[tuple[str, str, str]]) -> tuple[int, str]:
    digests = sorted((passage_number(pid), passage_digest(pid, title, text)) for pid, title, text in passages)
    return len(digests), document_hash(d for _, d in digests)


class DocumentListing:
    """The served documents of `store` and, when documents change while serving, of `live`'s state."""

    def __init__(self, store: DocumentStore, live: LiveIndex | None) -> None:
        self.store = store
        self.live = live
        self._base: dict[str, tuple[int, str]] | None = None
        self._base_ids: list[str] = []
        self._lock = threading.Lock()
        self._touched: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}
        self._sorted: tuple[int, list[str]] | None = None

    def _read_base(self) -> dict[str, tuple[int, str]]:
        with self._lock:
            if self._base is None:
                parts: dict[str, list[tuple[int, bytes]]] = {}
                for pid, title, text in self.store.iter_documents():
                    parts.setdefault(doc_id_of(pid), []).append((passage_number(pid),
                                                                  passage_digest(pid, title, text)))
                self._base = {doc: (len(p), document_hash(d for _, d in sorted(p))) for doc, p in parts.items()}
                self._base_ids = sorted(self._base)
        return self._base

    def _touched_entry(self, state: LiveState, doc: str, positions: tuple[int, ...]) -> tuple[int, str]:
        key = (doc, positions)
        found = self._touched.get(key)
        if found is None:
            assert self.live is not None
            found = self._touched[key] = _hash_of(self.live.documents(state, list(positions)))
        return found

    def _ids(self, state: LiveState | None) -> list[str]:
        base = self._read_base()
        if state is None or not state.documents:
            return self._base_ids
        if self._sorted is not None and self._sorted[0] == state.seq:
            return self._sorted[1]
        ids = sorted({*base, *(d for d, positions in state.documents.items() if positions)}
                     - {d for d, positions in state.documents.items() if not positions})
        self._sorted = (state.seq, ids)
        return ids

    def page(self, *, after: str | None = None, prefix: str = "", limit: int = 1000) -> tuple[list[Listed], str | None]:
        """Up to `limit` served documents whose ids start with `prefix`, in id order after `after`, and the id to
        ask after for the next page (None: no more)."""
        state = self.live.state if self.live is not None else None
        base = self._read_base()
        ids = self._ids(state)
        start = bisect.bisect_right(ids, after) if after is not None else bisect.bisect_left(ids, prefix)
        out: list[Listed] = []
        for doc in ids[start:]:
            if not doc.startswith(prefix):
                if doc > prefix:
                    break
                continue
            if len(out) == limit:
                return out, out[-1].id
            touched = state.documents.get(doc) if state is not None else None
            count, digest = self._touched_entry(state, doc, touched) if touched else base[doc]  # type: ignore[arg-type]
            out.append(Listed(doc, count, digest))
        return out, None

    def served_passages(self, doc_ids: Sequence[str]) -> int:
        """How many passages of these documents are served now (what deleting them removes)."""
        state = self.live.state if self.live is not None else None
        total = 0
        for doc in dict.fromkeys(doc_ids):
            if state is not None and doc in state.documents:
                total += len(state.documents[doc])
            else:
                positions = base_positions(self.store, doc)
                total += sum(1 for p in positions if state is None or state.serves(p))
        return total
