"""The compact policy's document features: the pool of a search (`pool_of`: each document with its BM25
evidence relative to its block), the rows of `DOC_FEATURES` (`doc_columns`, by name: its place in the pool, its
text and the question, the links between the pool's documents) and of `DENSE_FEATURES` (the dense block's
evidence), and `scoring_features`, the one function that joins them for the scorers, in serving and in training."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from plugsearch.common.schemas.searcher import SearchedDocument
from plugsearch.searcher.compact.text import DocText, QuestionInfo, TextCache, TextFacts, _has_new_name
from plugsearch.searcher.env import InfoBlock

LINK_WINDOW = 10
"""Links between documents are looked for among the first this many documents of the pool."""

DOC_FEATURES = (
    "score_rel", "inv_rank", "log_rank", "follow_up", "title_in_q", "title_full_in_q", "q_coverage",
    "mentioned_by", "mentions", "has_year", "has_number", "cap_density", "when_year", "year_year",
    "who_names", "how_many_number", "how_much_number", "linked_from_anchor", "links_to_anchor",
    "has_new_name", "score_z", "is_anchor",
    # titles without their disambiguation: "Machine Head (band)" -> core "machine head", "Davenport, Florida"
    # -> head "davenport"; anchors by core
    "core_in_q", "core_coverage", "is_core_anchor", "core_linked_from_anchor", "head_linked_from_anchor",
    "core_links_to_anchor", "head_links_to_anchor", "head_linked_from_top3", "same_title_above",
    "head_linked_in_top10", "has_core_anchor", "core_anchor_count",
)
DENSE_FEATURES = (
    "in_lexical", "cosine", "cosine_gap", "cosine_z", "in_dense", "dense_inv_rank", "lexical_inv_rank",
)
"""Dense evidence of the pool's documents (the `dense` scorer only): a document the dense block lacks gets
its block's lowest cosine minus `ABSENT_COSINE_GAP`, one the lexical blocks lack a rank past the pool."""
ABSENT_COSINE_GAP = 0.02
ABSENT_RANK = 50
DENSE = "dense"
LEXICAL_SCORER = "lexical"
DENSE_SCORER = "dense"

LEXICAL = "bm25"
"""The method of the lexical blocks its features read (BM25 scores, ranks and z-scores): its follow-up
searches, and the first block of its pool."""


@dataclass
class PoolDoc:
    """One distinct document of the pool, where it was first seen (block index, 1-based position)."""

    doc: SearchedDocument
    block: int
    position: int
    rank: int
    score_rel: float
    score_z: float
    lexical: bool = True
    """Found by a lexical (BM25) block; False: only by the dense block."""

    @cached_property
    def place(self) -> tuple[float, float, float, float, float]:
        """`POOL_COLUMNS` of the document: its place in the pool (worked out once, whatever the steps)."""
        return (self.score_rel, 1.0 / (self.rank + 1), _log_rank(self.rank), float(self.block > 0),
                max(-3.0, min(3.0, self.score_z)))


def block_places(b: int, block: InfoBlock) -> list[PoolDoc]:
    """Every document of block `b` as a pool document: a lexical block's with its BM25 evidence relative to
    the block (score / best, z-score, rank), a dense block's without lexical evidence (rank `ABSENT_RANK`)."""
    docs = block.documents
    if block.method == DENSE:
        return [PoolDoc(doc, b, i + 1, ABSENT_RANK, 0.0, -3.0, lexical=False) for i, doc in enumerate(docs)]
    scores = np.array([d.score or 0.0 for d in docs], dtype=np.float64)
    top = float(scores.max()) if len(scores) and scores.max() > 0 else 1.0
    mean, std = (float(scores.mean()), float(scores.std())) if len(scores) else (0.0, 0.0)
    return [PoolDoc(doc, b, i + 1, i, float(scores[i]) / top, (float(scores[i]) - mean) / (std + 1e-6))
            for i, doc in enumerate(docs)]


def pool_of(blocks: Sequence[InfoBlock], texts: PoolTexts | None = None) -> list[PoolDoc]:
    """The distinct documents of every block (by id, first occurrence kept), with their lexical (BM25)
    evidence relative to their own block: the lexical blocks' documents first, in block order, then those
    only a dense block found (lexical evidence absent: no score, rank `ABSENT_RANK`). `texts`: the search's
    `PoolTexts`, which keeps each block's pool documents for its later steps."""
    seen: set[str] = set()
    pool: list[PoolDoc] = []
    places = [texts.places(b, block) if texts is not None else block_places(b, block)
              for b, block in enumerate(blocks)]
    for lexical in (True, False):
        for block, docs in zip(blocks, places, strict=True):
            if (block.method != DENSE) != lexical:
                continue
            for place in docs:
                if place.doc.id not in seen:
                    seen.add(place.doc.id)
                    pool.append(place)
    return pool


def dense_features(pool: Sequence[PoolDoc], blocks: Sequence[InfoBlock]) -> np.ndarray | None:
    """One row of `DENSE_FEATURES` per pool document, from the first dense block of the question (None
    when the search has none)."""
    dense = next((block for block in blocks if block.method == DENSE and block.turn == 0), None)
    if dense is None or not dense.documents:
        return None
    found: dict[str, tuple[int, float]] = {}
    for i, doc in enumerate(dense.documents):
        found.setdefault(doc.id, (i, float(doc.score or 0.0)))
    absent = min(score for _, score in found.values()) - ABSENT_COSINE_GAP
    cos = np.array([found[p.doc.id][1] if p.doc.id in found else absent for p in pool], dtype=np.float64)
    in_dense = np.array([float(p.doc.id in found) for p in pool])
    dense_rank = np.array([found[p.doc.id][0] if p.doc.id in found else ABSENT_RANK for p in pool], dtype=np.float64)
    lexical_rank = np.array([p.rank if p.lexical else ABSENT_RANK for p in pool], dtype=np.float64)
    columns = {"in_lexical": np.array([float(p.lexical) for p in pool]), "cosine": cos, "cosine_gap": cos - cos.max(),
               "cosine_z": (cos - cos.mean()) / (cos.std() + 1e-6), "in_dense": in_dense,
               "dense_inv_rank": 1.0 / (dense_rank + 1), "lexical_inv_rank": 1.0 / (lexical_rank + 1)}
    rows = np.stack([columns[name] for name in DENSE_FEATURES], axis=1)
    return rows.astype(np.float32).reshape(len(pool), len(DENSE_FEATURES))



TEXT_COLUMNS = ("has_year", "has_number", "cap_density")
"""Document features of the text alone (`DocText.own`)."""
QUESTION_COLUMNS = ("title_in_q", "title_full_in_q", "q_coverage", "has_new_name", "is_anchor", "core_in_q",
                    "core_coverage", "is_core_anchor")
"""Document features of the text and the question (`PoolTexts.asked`)."""


FIXED_COLUMNS = (*TEXT_COLUMNS, *QUESTION_COLUMNS)


def _asked(question: QuestionInfo, f: TextFacts) -> tuple[float, ...]:
    """`QUESTION_COLUMNS` of a document (its `TextFacts`) for `question`."""
    qw, ql = question.content, question.joined
    title_in_q = len(f.title_words & qw) / max(1, len(f.title_words))
    title_full_in_q = bool(f.title) and f" {f.title} " in ql
    # the question's content words are no stop words: those of the text, or of the title
    coverage = (len(qw & f.words) + len((qw - f.words) & f.title_words)) / max(1, len(qw))
    core_in_q = len(f.core) > 3 and f" {f.core} " in ql
    core_cov = len(f.core_words & qw) / max(1, len(f.core_words))
    new_name = _has_new_name(f.raw_text, qw)
    return (title_in_q, float(title_full_in_q), coverage, float(new_name),
            float(title_full_in_q or (bool(f.title) and title_in_q >= 0.99)), float(core_in_q), core_cov,
            float(core_in_q or core_cov >= 0.99))



class PoolTexts:
    """The documents of one search as the features read them, each text tokenised once however many steps
    the policy takes (`CompactPolicy.decide` keeps one per search; `cache`: texts read by earlier searches), with
    what depends on the question (for one question at a time) and which documents' texts hold a phrase (a title,
    as whole words) as a mask of their bits (`DocText.number`), each kept and grown as blocks arrive."""

    def __init__(self, cache: TextCache | None = None) -> None:
        self.cache = cache
        self._texts: dict[str, DocText] = {}
        self._docs: list[DocText] = []
        self._postings: dict[str, int] = {}
        """word of `_vocabulary` -> the mask of the documents (the first `_indexed`) whose text has it"""
        self._vocabulary: set[str] = set()
        self._indexed = 0
        self._phrases: dict[str, tuple[int, int]] = {}
        """phrase -> (mask of the documents whose text holds it, how many documents it has looked at)"""
        self._question: str | None = None
        self._fixed = np.zeros((0, len(FIXED_COLUMNS)))
        self._places: dict[int, tuple[InfoBlock, list[PoolDoc]]] = {}

    def places(self, b: int, block: InfoBlock) -> list[PoolDoc]:
        """`block_places(b, block)`, worked out once per block of the search."""
        known = self._places.get(b)
        if known is not None and known[0] is block:
            return known[1]
        docs = block_places(b, block)
        self._places[b] = (block, docs)
        return docs

    def text(self, doc: SearchedDocument, key: str | None = None) -> DocText:
        """`doc`'s `DocText`, under `key` (default: its id); a key seen before with the same title and text
        gives the one worked out then."""
        key = doc.id if key is None else key
        known = self._texts.get(key)
        if known is not None and (known.doc is doc or (known.doc.title == doc.title and known.doc.text == doc.text)):
            return known
        facts = self.cache.facts(doc) if self.cache is not None else TextFacts.of(doc.title, doc.text)
        text = DocText(doc, len(self._docs), facts)
        self._texts[key] = text
        self._docs.append(text)
        return text

    def asked(self, question: QuestionInfo, doc: DocText) -> tuple[float, ...]:
        """`QUESTION_COLUMNS` of `doc` for `question`."""
        return tuple(self.fixed(question)[doc.number, len(TEXT_COLUMNS):])

    def fixed(self, question: QuestionInfo) -> np.ndarray:
        """`FIXED_COLUMNS` of every document read so far, a row per `DocText.number`: what depends on its text and
        the question only (for one question at a time), worked out once per document however many steps read it."""
        if question.text != self._question:
            self._question, self._fixed = question.text, np.zeros((0, len(FIXED_COLUMNS)))
        done = len(self._fixed)
        if done < len(self._docs):
            rows = [(*d.facts.own, *_asked(question, d.facts)) for d in self._docs[done:]]
            self._fixed = np.concatenate([self._fixed, np.array(rows, dtype=np.float64)])
        return self._fixed

    def index(self, phrases: Iterable[str] = ()) -> None:
        """Get ready to find the titles, cores and heads of the documents read so far, and `phrases`
        (`bodies_with`): which documents have each of their words. Only such words are indexed: per document,
        its words among them (a set intersection), and a word new to them in the documents indexed before."""
        postings, docs, vocabulary = self._postings, self._docs, self._vocabulary
        fresh = docs[self._indexed:]
        new = {w for d in fresh for phrase in (d.facts.title, d.facts.core, d.facts.head) if len(phrase) > 3
               for w in phrase.split(" ")}
        new.update(w for phrase in phrases for w in phrase.split(" "))
        new -= vocabulary
        if new:
            for doc in docs[:self._indexed]:
                for word in doc.facts.words & new:
                    postings[word] = postings.get(word, 0) | (1 << doc.number)
            vocabulary |= new
        for doc in fresh:
            for word in doc.facts.words & vocabulary:
                postings[word] = postings.get(word, 0) | (1 << doc.number)
        self._indexed = len(docs)

    def bodies_with(self, phrase: str) -> int:
        """The mask of the documents whose text holds `phrase` (words joined by single spaces) as whole words:
        `f" {phrase} " in body`, looked for only in the texts that have each of its words."""
        n = len(self._docs)
        mask, seen = self._phrases.get(phrase, (0, 0))
        if seen == n:
            return mask
        words = phrase.split(" ")
        if self._indexed < n or not self._vocabulary.issuperset(words):
            self.index([phrase])
        found = (1 << n) - (1 << seen)
        for word in words:
            found &= self._postings.get(word, 0)
            if not found:
                break
        if len(words) > 1:
            padded, left = f" {phrase} ", found
            while left:
                low = left & -left
                if padded not in self._docs[low.bit_length() - 1].facts.body:
                    found ^= low
                left ^= low
        mask |= found
        self._phrases[phrase] = (mask, n)
        return mask



_LOG_RANK = [math.log1p(r) / math.log(51) for r in range(ABSENT_RANK + 1)]


def _log_rank(rank: int) -> float:
    return _LOG_RANK[rank] if 0 <= rank <= ABSENT_RANK else math.log1p(rank) / math.log(51)


def _bit_rows(masks: Sequence[int], size: int) -> np.ndarray:
    """Masks as the rows of a 0/1 matrix of `size` columns (bit j of mask i at [i, j])."""
    width = (size + 7) // 8
    raw = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in masks), dtype=np.uint8)
    return np.unpackbits(raw.reshape(len(masks), width), axis=1, count=size, bitorder="little")


LINK_COLUMNS = ("mentioned_by", "mentions", "linked_from_anchor", "links_to_anchor", "core_linked_from_anchor",
                "head_linked_from_anchor", "core_links_to_anchor", "head_links_to_anchor", "head_linked_from_top3",
                "head_linked_in_top10", "same_title_above")
"""Document features of the links between the pool's documents (`doc_columns`)."""
POOL_COLUMNS = ("score_rel", "inv_rank", "log_rank", "follow_up", "score_z")
"""Document features of its place in the pool (`PoolDoc.place`)."""


def doc_columns(question: QuestionInfo, pool: Sequence[PoolDoc], texts: PoolTexts | None = None
                ) -> dict[str, np.ndarray]:
    """`DOC_FEATURES` of the pool by name, one float64 array (a value per pool document) each. `texts`: the
    search's `PoolTexts` (what its earlier steps read is not read again); without it, a new one."""
    if texts is None:
        texts = PoolTexts()
    docs = [texts.text(p.doc) for p in pool]
    bits = [1 << d.number for d in docs]
    if len(set(bits)) != len(bits):  # one id twice in the pool (not a `pool_of` pool): a bit per position
        texts = PoolTexts()
        docs = [texts.text(p.doc, key=str(i)) for i, p in enumerate(pool)]
        bits = [1 << d.number for d in docs]
    n = len(pool)
    if not n:
        return {name: np.zeros(0) for name in DOC_FEATURES}
    numbers = np.fromiter((d.number for d in docs), dtype=np.intp, count=n)
    fixed = texts.fixed(question)[numbers]
    columns: dict[str, np.ndarray] = {name: fixed[:, j] for j, name in enumerate(FIXED_COLUMNS)}
    places = np.array([p.place for p in pool], dtype=np.float64)
    columns.update((name, places[:, j]) for j, name in enumerate(POOL_COLUMNS))

    # Links: which bodies of the pool hold each document's title, core and head as whole words (only phrases
    # longer than 3 characters link; a body never links to itself), as 0/1 matrices by document number: row k,
    # column j is 1 when body j holds document k's phrase. A "from" feature reads a row (the bodies that hold the
    # document's phrase), a "to" feature a column (the phrases its body holds), over a few documents: the link
    # window (the pool's first LINK_WINDOW), its first 3, the anchors (documents whose title the question names).
    texts.index()
    everyone = sum(bits)
    size = max(d.number for d in docs) + 1
    title_in, core_in, head_in = [0] * size, [0] * size, [0] * size
    for d, bit in zip(docs, bits, strict=True):
        f, other = d.facts, everyone & ~bit
        title_in[d.number] = t = texts.bodies_with(f.title) & other if len(f.title) > 3 else 0
        core_in[d.number] = c = t if f.core == f.title else texts.bodies_with(f.core) & other if len(f.core) > 3 else 0
        head_in[d.number] = c if f.head == f.core else texts.bodies_with(f.head) & other if len(f.head) > 3 else 0
    title, core, head = _bit_rows(title_in, size), _bit_rows(core_in, size), _bit_rows(head_in, size)
    window, top3 = numbers[:LINK_WINDOW], numbers[:3]
    anchors = numbers[columns["is_anchor"] > 0]
    core_anchors = numbers[columns["is_core_anchor"] > 0]
    title_from, head_from = title[numbers], head[numbers]  # rows of the pool's documents, in pool order

    def count(links: np.ndarray) -> np.ndarray:
        return np.minimum(links.sum(axis=1, dtype=np.int64), 3) / 3

    def any_of(links: np.ndarray, axis: int) -> np.ndarray:
        return np.asarray(links.any(axis=axis), dtype=np.float64)

    first_of_core: dict[str, int] = {}
    columns.update({
        "mentioned_by": count(title_from[:, window]),
        "mentions": count(title[window][:, numbers].T),
        "linked_from_anchor": any_of(title_from[:, anchors], 1),
        "links_to_anchor": any_of(title[anchors][:, numbers], 0),
        "core_linked_from_anchor": any_of(core[numbers][:, core_anchors], 1),
        "head_linked_from_anchor": any_of(head_from[:, core_anchors], 1),
        "core_links_to_anchor": any_of(core[core_anchors][:, numbers], 0),
        "head_links_to_anchor": any_of(head[core_anchors][:, numbers], 0),
        "head_linked_from_top3": any_of(head_from[:, top3], 1),
        "head_linked_in_top10": count(head_from[:, window]),
        "same_title_above": np.array([float(first_of_core.setdefault(d.facts.core, i) != i)
                                      for i, d in enumerate(docs)]),
    })
    has_year, has_number, cap_density = columns["has_year"], columns["has_number"], columns["cap_density"]
    wh = question.wh
    n_core_anchors = len(core_anchors)
    columns.update({
        "when_year": wh[0] * has_year,
        "year_year": wh[7] * has_year,
        "who_names": wh[2] * cap_density,
        "how_many_number": wh[5] * has_number,
        "how_much_number": wh[6] * has_number,
        "has_core_anchor": np.full(n, float(n_core_anchors > 0)),
        "core_anchor_count": np.full(n, min(n_core_anchors, 3) / 3),
    })
    return {name: columns[name] for name in DOC_FEATURES}


def doc_features(question: QuestionInfo, pool: Sequence[PoolDoc], texts: PoolTexts | None = None) -> np.ndarray:
    """One row of `DOC_FEATURES` per pool document (`doc_columns` in that order)."""
    columns = doc_columns(question, pool, texts)
    if not pool:
        return np.zeros((0, len(DOC_FEATURES)), dtype=np.float32)
    return np.stack([columns[name] for name in DOC_FEATURES], axis=1).astype(np.float32)



def scoring_features(question: QuestionInfo, pool: Sequence[PoolDoc], blocks: Sequence[InfoBlock],
                     texts: PoolTexts | None = None, *, dense: bool = True) -> tuple[np.ndarray, np.ndarray, str]:
    """(lexical features, scoring features, scorer) of the pool: the scoring features add the dense evidence
    (`dense_features`) when the search has a dense block and `dense` (the policy has the `dense` scorer), and
    the `dense` scorer reads them; else they are the lexical features and the `lexical` scorer reads them. The one
    rule, for serving (`CompactPolicy.decide`) and for the warm start's labelled pools."""
    doc_x = doc_features(question, pool, texts)
    dense_x = dense_features(pool, blocks) if dense else None
    if dense_x is None:
        return doc_x, doc_x, LEXICAL_SCORER
    return doc_x, np.concatenate([doc_x, dense_x], axis=1), DENSE_SCORER
