"""Cutting a document into passages, as the shared domain corpora were cut (../shared/data/domain/README.md,
"Chunking"; its build_domain_sets.py):

Each block is split into sentences (`plugsearch.common.text.sentences`: after `.`, `!` or `?` and any closing
quotes or brackets, before a capital letter or a digit); a section's sentences are packed greedily, in order,
into passages of at most about `words` words (default 100), no overlap, never across sections. A sentence
longer than 1.5 x `words` is cut into `words`-word pieces; a section's last passage under `words` / 5 words is
merged into the one before when the two stay within 1.5 x `words`. Text is whitespace-normalised (non-breaking and zero-width spaces too).
A code block (HTML `<pre>`, a Markdown fence) is never cut into sentences: its lines are the units, packed the same
way, and a passage keeps them as lines (joined by a line break, as is code to the text beside it).

A passage's id is `<doc_id>#<position>`, its position the passage's index within its document (0, 1, ...), so the
same document cut with the same `words` gives the same ids on every run.

`Passage` is the one passage type: what ingest writes to a corpus, what the API puts (cut from a document's text
or a file, or given), what the change log keeps and the live overlay searches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from plugsearch.common.text import sentences
from plugsearch.retriever.store.corpus import indexed_text

if TYPE_CHECKING:
    from plugsearch.retriever.ingest.formats import Block, ParsedDocument

DEFAULT_WORDS = 100

@dataclass(frozen=True)
class Piece:
    text: str
    words: int
    page: int | None = None
    code: bool = False
    """A line of code (or a passage that ends with one): joined to its neighbours by a line break."""
    starts_code: bool = False


def _joined(pieces: Sequence[Piece]) -> Piece:
    text = pieces[0].text
    for before, after in zip(pieces, pieces[1:], strict=False):
        text += ("\n" if before.code or after.starts_code or after.code else " ") + after.text
    return Piece(text, sum(p.words for p in pieces), pieces[0].page, pieces[-1].code,
                 pieces[0].starts_code or pieces[0].code)


def pack(units: Sequence[Piece], words: int = DEFAULT_WORDS) -> list[Piece]:
    """Greedy, order-preserving packing of sentences (and code lines) into passages of about `words` words, no
    overlap."""
    hard, min_tail = words * 3 // 2, max(1, words // 5)
    out: list[Piece] = []
    current: list[Piece] = []

    def close() -> None:
        if current:
            out.append(_joined(current))
            current.clear()

    for unit in units:
        if unit.words > hard:
            close()
            tokens = unit.text.split()
            out.extend(Piece(" ".join(tokens[k:k + words]), len(tokens[k:k + words]), unit.page, unit.code,
                             unit.code) for k in range(0, len(tokens), words))
        else:
            if current and sum(p.words for p in current) + unit.words > words:  # a passage holds a few units
                close()
            current.append(unit)
    close()
    if len(out) > 1 and out[-1].words < min_tail and out[-2].words + out[-1].words <= hard:
        tail = out.pop()
        out[-1] = _joined([out[-1], tail])
    return out


@dataclass(frozen=True)
class Passage:
    """One passage of a document: what the retriever reads and searches (`id`, `title`, `text`), the document it is
    part of (`doc_id`; its id is `<doc_id>#<position>`), and where in a file it came from (`headings`, `source`,
    `page`: empty for a passage given as it is)."""

    id: str
    title: str
    text: str
    doc_id: str
    headings: tuple[str, ...] = ()
    source: str = ""
    position: int = 0
    page: int | None = None

    @property
    def indexed(self) -> str:
        """The passage as the indexes read it (`plugsearch.retriever.store.corpus.indexed_text`)."""
        return indexed_text(self.title, self.text)

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "title": self.title, "text": self.text, "doc_id": self.doc_id,
                               "headings": list(self.headings), "source": self.source, "position": self.position}
        if self.page is not None:
            out["page"] = self.page
        return out


def doc_id_of(passage_id: str) -> str:
    """The document of a passage: its id before the last `#` (the passage id itself when it has none)."""
    head, sep, tail = passage_id.rpartition("#")
    return head if sep and tail.isdigit() else passage_id


def passage_number(passage_id: str) -> int:
    """A passage's position in its document, from its id (`<doc_id>#<n>`; 0 for an id without one)."""
    _, sep, tail = passage_id.rpartition("#")
    return int(tail) if sep and tail.isdigit() else 0


def passage_digest(passage_id: str, title: str, text: str) -> bytes:
    return hashlib.sha256(orjson.dumps([passage_id, title, text])).digest()


def document_hash(digests: Iterable[bytes]) -> str:
    """A document's content hash: sha256 over its passages' digests (`passage_digest` of each id, title and text)
    in their order. What the retriever lists for each served document (`GET /documents`) and answers for each
    file put, and what `plugsearch-index sync` computes for a file it reads: equal hashes, the same passages."""
    digest = hashlib.sha256()
    for one in digests:
        digest.update(one)
    return digest.hexdigest()


def passages_hash(passages: Iterable[Passage]) -> str:
    """`document_hash` of a document's passages, in order."""
    return document_hash(passage_digest(p.id, p.title, p.text) for p in passages)


def numbered(doc_id: str, parts: Iterable[tuple[str, str]]) -> list[Passage]:
    """A document's passages given as (title, text), in order: `<doc_id>#0`, `<doc_id>#1`, ..."""
    return [Passage(id=f"{doc_id}#{i}", title=title, text=text, doc_id=doc_id, position=i)
            for i, (title, text) in enumerate(parts)]


def _units(block: Block) -> list[Piece]:
    if block.code:  # a code block's lines, never cut into sentences
        return [Piece(line.rstrip(), len(line.split()), block.page, True) for line in block.text.split("\n")
                if line.strip()]
    return [Piece(s, len(s.split()), block.page) for s in sentences(block.text)]


def cut(document: ParsedDocument, *, doc_id: str, source: str, words: int = DEFAULT_WORDS) -> list[Passage]:
    """The document's passages in order; a PDF passage's `page` is the page its first sentence is on."""
    passages: list[Passage] = []
    for section in document.sections:
        units = [unit for block in section.blocks for unit in _units(block)]
        for piece in pack(units, words):
            passages.append(Passage(id=f"{doc_id}#{len(passages)}", title=document.title, text=piece.text,
                                    doc_id=doc_id, headings=section.headings, source=source,
                                    position=len(passages), page=piece.page))
    return passages
