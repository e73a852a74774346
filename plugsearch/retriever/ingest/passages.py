"""Cutting a document into passages, as the shared domain corpora were cut (../shared/data/domain/README.md,
"Chunking"; its build_domain_sets.py):

Each block is split into sentences (`plugsearch.common.text.sentences`: after `.`, `!` or `?` and any closing
quotes or brackets, before a capital letter or a digit); a section's sentences are packed greedily, in order,
into passages of at most about `words` words (default 100), no overlap, never across sections. A sentence
longer than 1.5 x `words` is cut into `words`-word pieces; a section's last passage under `words` / 5 words is
merged into the one before when the two stay within 1.5 x `words`. Text is whitespace-normalised (non-breaking and zero-width spaces too).

A passage's id is `<doc_id>#<position>`, its position the passage's index within its document (0, 1, ...), so the
same document cut with the same `words` gives the same ids on every run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plugsearch.common.text import sentences

if TYPE_CHECKING:
    from plugsearch.retriever.ingest.formats import Document

DEFAULT_WORDS = 100

@dataclass(frozen=True)
class Piece:
    text: str
    words: int
    page: int | None = None


def pack(units: Sequence[Piece], words: int = DEFAULT_WORDS) -> list[Piece]:
    """Greedy, order-preserving packing of sentences into passages of about `words` words, no overlap."""
    hard, min_tail = words * 3 // 2, max(1, words // 5)
    out: list[Piece] = []
    current: list[Piece] = []

    def close() -> None:
        if current:
            out.append(Piece(" ".join(p.text for p in current), sum(p.words for p in current), current[0].page))
            current.clear()

    for unit in units:
        if unit.words > hard:
            close()
            tokens = unit.text.split()
            out.extend(Piece(" ".join(tokens[k:k + words]), len(tokens[k:k + words]), unit.page)
                       for k in range(0, len(tokens), words))
        else:
            if current and sum(p.words for p in current) + unit.words > words:  # a passage holds a few units
                close()
            current.append(unit)
    close()
    if len(out) > 1 and out[-1].words < min_tail and out[-2].words + out[-1].words <= hard:
        tail = out.pop()
        out[-1] = Piece(f"{out[-1].text} {tail.text}", out[-1].words + tail.words, out[-1].page)
    return out


@dataclass(frozen=True)
class Passage:
    """One corpus row: what the retriever reads (`id`, `title`, `text`) and where it came from."""

    id: str
    title: str
    text: str
    doc_id: str
    headings: tuple[str, ...]
    source: str
    position: int
    page: int | None = None

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "title": self.title, "text": self.text, "doc_id": self.doc_id,
                               "headings": list(self.headings), "source": self.source, "position": self.position}
        if self.page is not None:
            out["page"] = self.page
        return out


def cut(document: Document, *, doc_id: str, source: str, words: int = DEFAULT_WORDS) -> list[Passage]:
    """The document's passages in order; a PDF passage's `page` is the page its first sentence is on."""
    passages: list[Passage] = []
    for section in document.sections:
        units = [Piece(s, len(s.split()), block.page) for block in section.blocks for s in sentences(block.text)]
        for piece in pack(units, words):
            passages.append(Passage(id=f"{doc_id}#{len(passages)}", title=document.title, text=piece.text,
                                    doc_id=doc_id, headings=section.headings, source=source,
                                    position=len(passages), page=piece.page))
    return passages
