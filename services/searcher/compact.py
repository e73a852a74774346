"""The compact searcher policy: a small learned scorer that acts in `SearchEnv` on the CPU, with no LLM.

It takes s3's steps through the environment's structured actions (`env.act`):
1. the environment's first retrieval of the question is the pool: BM25's `retrieve_k` documents and, when
   the retriever serves dense search with the encoder the policy was trained with (`pool_methods`), the
   dense top `retrieve_k` too (one block each, `SearchParams.pool_methods`);
2. up to `max_turns` follow-up searches, each chosen among candidates built from what was retrieved (the
   question with the title of a high-scoring document, or a name that document's text introduces), or a
   stop; the choice is a softmax over candidate features;
3. the selection: the `select_k` best documents of the whole pool under a small MLP over per-document
   features (BM25 evidence: score, rank and z-score in its block; lexical overlap with the question; links
   between documents: a document whose title another document that matches the question mentions, the
   bridge of a two-hop question, titles compared without their "(disambiguation)" and ", place" parts;
   answer-type cues such as a year for a "when" question) and, with the dense block, the dense evidence
   (cosine, its gap to the best and z-score in the block, rank, and which retrievers found the document).
   Two scorers ship: `lexical` (BM25 pool alone) and `dense` (both blocks); the one whose evidence is there
   scores.

Nothing here depends on a passage's length: the corpus's gold passages are often shorter than the others,
and a length feature would be a shortcut that real corpora do not have.

The weights (`weights.npz`, a few kB) and `manifest.json` (how they were trained and evaluated, and their
sha256) live in a folder; `CompactPolicy.load` refuses weights whose digest does not match. Inference is
numpy only, so the searcher image needs no torch; the trainer (`trainer.compact`) trains the same
parameters in torch and samples actions through `decide(..., rng=...)`.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from pydantic import ValidationError

from services.common.schemas.searcher import Method, SearchedDocument, SearchMode, SearchParams, search_cost
from services.searcher import parsing
from services.searcher.env import Action, InfoBlock, SearchEnv
from services.searcher.policy import PolicyRefusal, PolicySetting

WEIGHTS_FILE = "weights.npz"
MANIFEST_FILE = "manifest.json"
MLP_KEYS = ("mean", "std", "w1", "b1", "w2", "b2", "w3", "b3")
DENSE_PREFIX = "dense_"
"""The dense scorer's weights: `dense_mean`, ..., `dense_b3` (optional: a policy without them is lexical only)."""
QUERY_KEYS = ("qv",)
_PAREN = re.compile(r"\s*\([^)]*\)\s*$")

_WORD = re.compile(r"\w+")
_YEAR = re.compile(r"\b(1[0-9]{3}|20[0-9]{2})\b")
_NUM = re.compile(r"\b\d+\b")
_CAP = re.compile(r"\b[A-Z][a-z]+")
_CAP_ASCII = re.compile(r"\b[A-Z][a-z]+", re.ASCII)
"""`_CAP` for an ASCII text (the same matches; faster)."""
_STOP = frozenset(
    "a an the of in on at to for and or is was were are be been by with from as that this which who what when "
    "where how did does do whose whom why it its his her their he she they than then there".split())
WH = ("when", "where", "who", "what", "which", "how many", "how much", "year")
LINK_WINDOW = 10
"""Links between documents are looked for among the first this many documents of the pool."""
MAX_ENTITY_CANDIDATES = 2
MAX_TITLE_CANDIDATES = 3

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
CANDIDATE_FEATURES = (
    "stop", "title_query", "name_query", "source_prob", "source_inv_rank", "source_is_anchor",
    "source_title_in_q", "turn", "stop_x_when", "stop_x_where", "stop_x_who", "stop_x_what", "stop_x_which",
    "stop_x_how", "stop_x_qlen", "stop_x_top_prob", "stop_x_anchor_count",
)


LEXICAL = "bm25"
"""The method of the lexical blocks its features read (BM25 scores, ranks and z-scores): its follow-up
searches, and the first block of its pool."""


class CompactPolicyError(ValueError):
    """A compact policy folder that cannot be served (missing files, digest mismatch, wrong shapes, a
    manifest without the setting it was trained in or with a method its features cannot read)."""


def read_setting(manifest: dict[str, Any], *, has_dense: bool, encoder: str | None) -> PolicySetting | None:
    """The setting a manifest records (`search`: retrieve_k, select_k, max_turns, method, pool_methods; the
    dense encoder from `dense.encoder`), checked against what the policy's features can read; None when the
    manifest records none (a policy built in-process). Raises `CompactPolicyError` saying what is wrong."""
    recorded = manifest.get("search")
    if recorded is None:
        return None
    if not isinstance(recorded, dict):
        raise CompactPolicyError(f"the manifest's `search` must be an object, not {type(recorded).__name__}")
    if recorded.get("mode", "s3") != "s3":
        raise CompactPolicyError(f"the manifest's search mode is {recorded.get('mode')!r}: a compact policy "
                                 "searches in mode s3")
    missing = [k for k in ("retrieve_k", "select_k", "max_turns") if k not in recorded]
    if missing:
        raise CompactPolicyError(f"the manifest's `search` lacks {', '.join(missing)}: the setting the policy "
                                 "was trained in (pool size retrieve_k, documents select_k, follow-up searches "
                                 "max_turns) must travel with it")
    fields = {k: recorded[k] for k in ("retrieve_k", "select_k", "max_turns", "method", "pool_methods")
              if k in recorded}
    fields.setdefault("method", LEXICAL)
    fields.setdefault("pool_methods", [LEXICAL, DENSE] if has_dense else [LEXICAL])
    try:
        setting = PolicySetting(**fields, encoder=encoder)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise CompactPolicyError(f"the manifest's `search` setting is invalid ({problems})") from exc
    if setting.method != LEXICAL:
        raise CompactPolicyError(f"the manifest's follow-up method is {setting.method!r}: the compact policy's "
                                 f"features read BM25 evidence, so its follow-up searches must be {LEXICAL!r}")
    pool = setting.pool_methods or []
    if pool[0] != LEXICAL or len(set(pool)) != len(pool) or not set(pool) <= {LEXICAL, DENSE}:
        raise CompactPolicyError(f"the manifest's pool_methods {pool} cannot be served: a compact policy's pool "
                                 f"is {LEXICAL!r} first, optionally followed by {DENSE!r}")
    if DENSE in pool and not has_dense:
        raise CompactPolicyError("the manifest's pool has a dense block but the weights have no dense scorer")
    if DENSE in pool and not encoder:
        raise CompactPolicyError("the manifest's pool has a dense block but names no encoder (dense.encoder): "
                                 "cosines of another encoder would not fit the dense scorer")
    return setting


def _same_encoder(served: str, trained: str | None) -> bool:
    """The retriever's encoder (a name or a local path) is the one the dense scorer was trained with."""
    if not trained:
        return False
    return served == trained or Path(served.rstrip("/")).name == Path(trained.rstrip("/")).name


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _content(text: str) -> set[str]:
    return {w for w in _words(text) if w not in _STOP}


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
    in_lexical = np.array([float(p.lexical) for p in pool])
    rows = np.stack([in_lexical, cos, cos - cos.max(), (cos - cos.mean()) / (cos.std() + 1e-6), in_dense,
                     1.0 / (dense_rank + 1), 1.0 / (lexical_rank + 1)], axis=1)
    return rows.astype(np.float32).reshape(len(pool), len(DENSE_FEATURES))


def _joined(text: str) -> str:
    """Lower-cased words joined by single spaces, padded: `f" {phrase} " in _joined(text)` matches whole words."""
    return f" {' '.join(_words(text))} "


def title_core(title: str) -> str:
    """A title without its trailing "(disambiguation)": "Machine Head (band)" -> "Machine Head"."""
    return _PAREN.sub("", title).strip()


def title_head(title: str) -> str:
    """A title's core before its first comma: "Davenport, Florida" -> "Davenport"."""
    return title_core(title).split(",")[0].strip()


@dataclass
class QuestionInfo:
    text: str
    lower: str
    joined: str
    content: set[str]
    wh: list[float]

    @classmethod
    def of(cls, question: str) -> QuestionInfo:
        joined = _joined(question)
        wh = [float(f" {w} " in joined) for w in WH]
        return cls(question, question.lower(), joined, _content(question), wh)


_YEARS = frozenset(str(year) for year in range(1000, 2100))
"""The words `_YEAR` matches: a text has a year when one of its words is one."""
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_WORD_BYTES = bytes(c if chr(c).isalnum() or c == 95 else 32 for c in range(128)) + bytes(range(128, 256))
"""A bytes table: an ASCII word character (`\\w`) kept, any other ASCII byte a space, a non-ASCII byte kept."""
_CASE_BYTES = bytes(
    ord("U") if "A" <= chr(c) <= "Z" else ord("l") if "a" <= chr(c) <= "z" else
    ord("d") if chr(c).isalnum() or c == 95 or c >= 128 else 32 for c in range(256))
"""A bytes table of character classes: `U` an ASCII capital, `l` an ASCII small letter, `d` another word character
(a non-ASCII byte: part of a word character once `_spaced`), a space for a non-word character. A word `_CAP`
matches starts where the classes read " Ul" (or "Ul" first)."""


def _spaced(text: str) -> str:
    """`text` with its non-ASCII characters that are no word characters (`\\w`: `str.isalnum()` or "_") made
    spaces: then every non-ASCII character left is part of a word, which the bytes tables above rely on."""
    if text.isascii():
        return text
    odd = {c for c in _NON_ASCII.findall(text) if not c.isalnum()}
    if len(odd) > 8:  # one pass through a table rather than many replacements
        return text.translate(dict.fromkeys(map(ord, odd), " "))
    for c in odd:
        text = text.replace(c, " ")
    return text


def _lower_words(text: str, spaced: str | None = None) -> list[str]:
    """`_words(text)`, cheaper: the text `_spaced` (`spaced`, when the caller has it), lower-cased, its ASCII
    non-word characters made spaces through a bytes table (C speed) and split: the same words for every character
    (a test checks them all), except "İ", which lower-cases to two characters, and "Σ", whose small form depends
    on its neighbours: texts with these are tokenised word by word."""
    if "\u0130" in text or "\u03a3" in text:
        return [w.lower() for w in _WORD.findall(text)]
    return (_spaced(text) if spaced is None else spaced).lower().encode().translate(_WORD_BYTES).decode().split()


def _cap_count(text: str, spaced: str | None = None) -> int:
    """`len(_CAP.findall(text))` (capitalised words: an ASCII capital then small letters, at a word start),
    counted on the text's character classes (`_CASE_BYTES`; `spaced`: `_spaced(text)`, when the caller has it)."""
    classes = (_spaced(text) if spaced is None else spaced).encode().translate(_CASE_BYTES)
    return classes.count(b" Ul") + classes.startswith(b"Ul")


def _has_new_name(text: str, known: set[str] | frozenset[str]) -> bool:
    """Whether a capitalised word of `text` (`_CAP`), lower-cased, is not in `known`; stops at the first."""
    pattern = _CAP_ASCII if text.isascii() else _CAP
    return any(m.group().lower() not in known for m in pattern.finditer(text))


class TextFacts(NamedTuple):
    """What the features read of a document's title and text, whatever the search (`TextFacts.of`; kept across
    searches by `TextCache`)."""

    raw_title: str
    raw_text: str
    title: str
    """The title's lower-cased words joined by single spaces ("machine head band")."""
    core: str
    """`title_core`'s words, likewise ("machine head")."""
    head: str
    """`title_head`'s words, likewise ("davenport" for "Davenport, Florida")."""
    title_words: frozenset[str]
    """The title's content words (`_content`)."""
    core_words: frozenset[str]
    words: frozenset[str]
    """The text's distinct lower-cased words."""
    body: str
    """The text's words joined and padded (`_joined`): `f" {phrase} " in body` matches whole words."""
    own: tuple[float, float, float]
    """`TEXT_COLUMNS` of the document."""

    @classmethod
    def of(cls, title: str, text: str) -> TextFacts:
        spaced = _spaced(text)
        words = _lower_words(text, spaced)
        distinct = frozenset(words)
        title_list = _lower_words(title)
        title_words = frozenset(title_list) - _STOP
        title_joined = " ".join(title_list)
        core = title_core(title)
        if core == title:
            core_joined, core_words = title_joined, title_words
        else:
            core_list = _lower_words(core)
            core_joined, core_words = " ".join(core_list), frozenset(core_list) - _STOP
        head = core.split(",")[0].strip()  # title_head
        head_joined = core_joined if head == core else " ".join(_lower_words(head))
        # _YEAR and _NUM match whole words: a year, a word of decimal digits
        own = (float(not distinct.isdisjoint(_YEARS)), float(any(map(str.isdecimal, distinct))),
               _cap_count(text, spaced) / max(1, len(words)))
        return cls(title, text, title_joined, core_joined, head_joined, title_words, core_words, distinct,
                   f" {' '.join(words)} ", own)


class TextCache:
    """A bounded least-recently-used cache of `TextFacts` by document id (checked against the title and text),
    shared by the searches of a process: a document many searches retrieve (a popular passage, the pool of every
    rollout of an RL group, an evaluation run again) is read once. ~8 kB a document; `size` 0: off."""

    def __init__(self, size: int = 2048) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._facts: OrderedDict[str, TextFacts] = OrderedDict()

    def __len__(self) -> int:
        return len(self._facts)

    def facts(self, doc: SearchedDocument) -> TextFacts:
        known = self._facts.get(doc.id) if self.size else None
        if known is not None and known.raw_text == doc.text and known.raw_title == doc.title:
            self._facts.move_to_end(doc.id)
            self.hits += 1
            return known
        self.misses += 1
        facts = TextFacts.of(doc.title, doc.text)
        if self.size:
            self._facts[doc.id] = facts
            self._facts.move_to_end(doc.id)
            if len(self._facts) > self.size:
                self._facts.popitem(last=False)
        return facts


@dataclass(slots=True)
class DocText:
    """A document of one search (`PoolTexts`): its `TextFacts` and its bit in the search's masks."""

    doc: SearchedDocument
    number: int
    """Its bit in `PoolTexts`'s masks (`1 << number`)."""
    facts: TextFacts


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


@dataclass
class Candidate:
    query: str
    kind: str
    """`stop`, `title` (question + a document's title) or `name` (a name a document introduces)."""
    source: int = -1


# A name candidate is a name or a title a person would search: capitalised words (joined by "of", "de", ...)
# within one sentence, without leading or trailing function words; never only function words and date parts;
# a lone word only when the passage also capitalises it inside a sentence (not "Although", "Tickets").
_FUNCTION = _STOP | frozenset(
    "but nor so yet these those also although though however therefore thus hence meanwhile moreover furthermore "
    "nevertheless nonetheless after before during while since until unless because despite following according "
    "about above across against along among around between beyond into onto over through throughout toward "
    "towards under upon within without both each either neither every all any some many most other such only not "
    "no born died later early late former currently today now once if whether instead besides we i you our your "
    "my me him them us here".split())
_DATE_PARTS = frozenset(
    "january february march april may june july august september october november december jan feb mar apr jun "
    "jul aug sep sept oct nov dec monday tuesday wednesday thursday friday saturday sunday first second third "
    "fourth fifth sixth seventh eighth ninth tenth century".split())
_CONNECT = frozenset("of de the von van du la and del der da di le".split())
_NATIONALITIES = frozenset("""
afghan albanian algerian american andorran angolan argentine argentinian armenian australian austrian azerbaijani
bahamian bahraini bangladeshi barbadian belarusian belgian belizean beninese bhutanese bolivian bosnian
botswanan brazilian british bruneian bulgarian burmese burundian cambodian cameroonian canadian chadian chilean
chinese colombian congolese croatian cuban cypriot czech danish dominican dutch ecuadorian egyptian emirati
english eritrean estonian ethiopian fijian filipino finnish french gabonese gambian georgian german ghanaian
greek grenadian guatemalan guinean guyanese haitian honduran hungarian icelandic indian indonesian iranian iraqi
irish israeli italian ivorian jamaican japanese jordanian kazakh kenyan korean kosovar kuwaiti kyrgyz lao latvian
lebanese liberian libyan lithuanian luxembourgish macedonian malagasy malawian malaysian maldivian malian maltese
mauritanian mauritian mexican moldovan monegasque mongolian montenegrin moroccan mozambican namibian nepalese
nepali nigerian nigerien nicaraguan norwegian omani pakistani palestinian panamanian paraguayan persian peruvian
polish portuguese qatari romanian russian rwandan salvadoran samoan saudi scottish senegalese serbian sierra
singaporean slovak slovakian slovenian somali spanish sudanese surinamese swazi swedish swiss syrian taiwanese
tajik tanzanian thai tibetan togolese tongan trinidadian tunisian turkish turkmen ugandan ukrainian uruguayan
uzbek venezuelan vietnamese welsh yemeni zambian zimbabwean african asian european arab arabic latin hispanic
american-born soviet yugoslav prussian ottoman byzantine roman catalan basque flemish walloon bavarian cornish
breton sicilian neapolitan venetian hebrew yiddish sanskrit hindi urdu bengali punjabi tamil telugu marathi
gujarati kannada malayalam swahili zulu xhosa amharic hausa yoruba igbo tagalog javanese cantonese mandarin
hokkien creole esperanto gaelic celtic norse anglo-saxon caribbean scandinavian nordic baltic balkan slavic
germanic mediterranean oriental pacific atlantic western eastern northern southern central
""".split())
"""Nationality, language and region adjectives: alone, none is a name a person would search ("American")."""

_ABBREVIATIONS = frozenset("st mt mr mrs ms dr jr sr co inc ltd vs ft gen col lt sgt capt rev prof no".split())
_SENTENCE_END = re.compile(r"([.!?])\s+(?=\S)")
_NAME_WORD = re.compile(r"[^\W_][\w'&.-]*")
_NUMBER = re.compile(r"^\d+(st|nd|rd|th|s)?$")
_QUERY_WORD = re.compile(r"[^\W_][\w'&.-]*[^\W_]|[^\W_]")


def _sentences(text: str) -> list[str]:
    """`text` cut at sentence ends (".", "!", "?" then a space), not after an initial or an abbreviation."""
    out, start = [], 0
    for m in _SENTENCE_END.finditer(text):
        before = text[start:m.start()].split()
        last = (before[-1] if before else "").rstrip(".")
        if m.group(1) == "." and (len(last) <= 1 or last.lower() in _ABBREVIATIONS or "." in last):
            continue  # "J. R. R. Tolkien", "St. Louis", "U.S. Army"
        out.append(text[start:m.start(1)])
        start = m.end()
    out.append(text[start:])
    return out


def _word(token: str) -> str:
    """A token without its trailing punctuation (an initial's or an abbreviation's full stop kept)."""
    token = token.rstrip("'-&")
    bare = token.rstrip(".")
    return token if token.endswith(".") and (len(bare) <= 1 or "." in bare or bare.lower() in _ABBREVIATIONS) \
        else bare


def _capitalised(word: str) -> bool:
    return word[:1].isupper()


def _names_nothing(words: Sequence[str]) -> bool:
    return all(w.lower().rstrip(".") in _FUNCTION or w.lower() in _DATE_PARTS or _NUMBER.match(w) for w in words)


def _names(text: str, known: str) -> list[str]:
    """Names and titles in `text` that `known` (question and title, lower-cased) does not contain: runs of
    capitalised words inside one sentence, cut of leading and trailing function words; a run of only function
    words and date parts ("Although", "October", "In 1990") is none, and a lone word the passage capitalises only
    where a sentence starts ("Tickets") or also writes in lower case ("Army" beside "army") is a common word, not a
    name, as is a lone nationality, language or region word ("American", "French")."""
    runs: list[tuple[list[str], bool]] = []
    inside: set[str] = set()  # words the text capitalises inside a sentence
    for sentence in _sentences(text):
        tokens = list(_NAME_WORD.finditer(sentence))
        i = 0
        while i < len(tokens):
            word = _word(tokens[i].group(0))
            if not _capitalised(word):
                i += 1
                continue
            parts, end, k = [word], tokens[i].end(), i + 1
            while k < len(tokens) and sentence[end:tokens[k].start()].strip() in ("", "&"):
                nxt = _word(tokens[k].group(0))
                if _capitalised(nxt):
                    parts += ["&", nxt] if sentence[end:tokens[k].start()].strip() == "&" else [nxt]
                    end, k = tokens[k].end(), k + 1
                elif nxt.lower() in _CONNECT and k + 1 < len(tokens) and _capitalised(_word(tokens[k + 1].group(0))) \
                        and not sentence[tokens[k].end():tokens[k + 1].start()].strip() \
                        and not sentence[end:tokens[k].start()].strip():
                    parts += [nxt, _word(tokens[k + 1].group(0))]
                    end, k = tokens[k + 1].end(), k + 2
                else:
                    break
            initial = i == 0
            while parts and (parts[0].lower().rstrip(".") in _FUNCTION or parts[0].lower() in _CONNECT):
                parts.pop(0)
                initial = False
            while parts and (parts[-1].lower().rstrip(".") in _FUNCTION or parts[-1].lower() in _CONNECT):
                parts.pop()
            if parts:
                if not initial:
                    inside.add(parts[0])
                runs.append((parts, initial))
            i = k
    out: list[str] = []
    lowered = None
    for parts, initial in runs:
        if _names_nothing(parts) or (len(parts) == 1 and initial and parts[0] not in inside):
            continue
        if len(parts) == 1:
            word = parts[0].lower()
            if word in _NATIONALITIES or word.rstrip("s") in _NATIONALITIES:
                continue  # "American", "French": an adjective, not a name
            if lowered is None:
                lowered = set(_WORD.findall(text))
            if word in lowered:
                continue  # the passage also writes it in lower case: a common word ("Church", "Army")
        name = " ".join(parts).strip(" -'")
        if len(name) < 4 or name.lower() in known or name.lower() in _STOP or name in out:
            continue
        out.append(name)
    return out


def title_query(question: QuestionInfo, title: str) -> str:
    """A follow-up a person would type after finding `title`: the title, then the question's content words it
    does not already hold, in the question's order ("Big Stone Gap (film) city director based"), not the question
    copied with the title appended. BM25 drops the function words either way."""
    have = set(_words(title))
    keywords = [w for w in dict.fromkeys(_QUERY_WORD.findall(question.text))
                if w.lower() not in _STOP and w.lower() not in _FUNCTION and w.lower() not in have]
    return " ".join([title.strip(), *keywords]).strip()


def candidates(question: QuestionInfo, pool: Sequence[PoolDoc], probs: np.ndarray, seen: set[str],
               doc_x: np.ndarray) -> tuple[list[Candidate], np.ndarray]:
    """The stop and the follow-up queries open now, with one row of `CANDIDATE_FEATURES` each."""
    order = np.argsort(-probs, kind="stable")
    out = [Candidate("", "stop")]
    for j in order:
        if len([c for c in out if c.kind == "title"]) >= MAX_TITLE_CANDIDATES:
            break
        query = title_query(question, pool[j].doc.title)
        if parsing.normalize_query(query) not in seen:
            out.append(Candidate(query, "title", int(j)))
    if len(order):
        top = int(order[0])
        known = f"{question.lower} {pool[top].doc.title.lower()}"
        for name in _names(pool[top].doc.text, known)[:MAX_ENTITY_CANDIDATES]:
            if parsing.normalize_query(name) not in seen:
                out.append(Candidate(name, "name", top))
    wh = question.wh
    top_prob = float(probs[order[0]]) if len(order) else 0.0
    anchor_count = float(doc_x[:, DOC_FEATURES.index("is_anchor")].sum()) if len(doc_x) else 0.0
    qlen = min(1.0, len(question.content) / 20)
    turn = float(len({p.block for p in pool}) - 1)
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.arange(len(order))
    rows = []
    for c in out:
        stop = float(c.kind == "stop")
        src = c.source
        rows.append([
            stop, float(c.kind == "title"), float(c.kind == "name"),
            float(probs[src]) if src >= 0 else 0.0, 1.0 / (ranks[src] + 1) if src >= 0 else 0.0,
            float(doc_x[src, DOC_FEATURES.index("is_anchor")]) if src >= 0 else 0.0,
            float(doc_x[src, DOC_FEATURES.index("title_in_q")]) if src >= 0 else 0.0,
            turn, stop * wh[0], stop * wh[1], stop * wh[2], stop * wh[3], stop * wh[4],
            stop * max(wh[5], wh[6]), stop * qlen, stop * top_prob, stop * min(anchor_count, 3) / 3,
        ])
    return out, np.asarray(rows, dtype=np.float32).reshape(len(out), len(CANDIDATE_FEATURES))


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    z = logits / max(temperature, 1e-6)
    z = z - z.max()
    e = np.exp(z)
    return e / e.sum()


@dataclass
class Decision:
    """One step's action and, for training, what it was chosen from."""

    action: Action
    doc_x: np.ndarray
    """The scoring features of the pool (with the dense evidence when the `dense` scorer chose)."""
    cand_x: np.ndarray | None = None
    """Candidate features of the query choice (row 0 the stop), None when no search was open."""
    choice: int | None = None
    selected: list[int] = field(default_factory=list)
    """Pool indices of the chosen documents, in the order they were drawn (the final selection)."""
    scorer: str = LEXICAL_SCORER
    """Which document scorer chose (`lexical` or `dense`)."""


@dataclass
class CompactPolicy:
    """The policy behind `env.act`: `decide` is one step (greedy, or sampled when given an `rng`)."""

    weights: dict[str, np.ndarray]
    name: str = "compact"
    digest: str = ""
    manifest: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    text_cache: TextCache = field(default_factory=TextCache, repr=False, compare=False)
    """Documents' texts as the features read them, across searches (`TextCache(0)`: off)."""
    _texts: weakref.WeakKeyDictionary[SearchEnv, PoolTexts] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False, compare=False)
    """Each running search's `PoolTexts`: its documents read once, whatever the number of steps."""

    @property
    def model(self) -> str:
        """The `policy_model` of its responses (part of the cache key)."""
        return f"{self.name}@{self.digest[:12]}" if self.digest else self.name

    @property
    def setting(self) -> PolicySetting | None:
        """The setting it was trained in, from its manifest (`read_setting`); None when it records none."""
        return read_setting(self.manifest, has_dense=self.has_dense, encoder=self.dense_encoder)

    def search_setting(self) -> dict[str, int]:
        """`retrieve_k`, `select_k` and `max_turns` of its trained setting (what the benches and tools that drive
        it in-process build their `SearchParams` from; empty when it records none)."""
        setting = self.setting
        if setting is None:
            return {}
        return {"retrieve_k": setting.retrieve_k, "select_k": setting.select_k, "max_turns": setting.max_turns}

    # ------------------------------------------------------------------------------------ weights
    @classmethod
    def load(cls, folder: Path) -> CompactPolicy:
        manifest_path, weights_path = folder / MANIFEST_FILE, folder / WEIGHTS_FILE
        if not manifest_path.is_file() or not weights_path.is_file():
            raise CompactPolicyError(f"{folder} is not a compact policy folder (needs {MANIFEST_FILE} and "
                                     f"{WEIGHTS_FILE})")
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise CompactPolicyError(f"{manifest_path}: not JSON ({exc})") from exc
        data = weights_path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if manifest.get("weights_sha256") != digest:
            raise CompactPolicyError(f"{weights_path}: sha256 {digest} does not match the manifest's "
                                     f"{manifest.get('weights_sha256')}")
        with np.load(weights_path) as npz:
            weights = {k: np.asarray(npz[k], dtype=np.float32) for k in npz.files}
        policy = cls(weights, name=str(manifest.get("name", folder.name)), digest=digest, manifest=manifest,
                     folder=folder)
        policy.check()
        try:
            if policy.setting is None:
                raise CompactPolicyError("the manifest has no `search` setting (retrieve_k, select_k, max_turns, "
                                         "method, pool_methods): the setting the policy was trained in must "
                                         "travel with it")
        except CompactPolicyError as exc:
            raise CompactPolicyError(f"{manifest_path}: {exc}") from exc
        return policy

    def check(self) -> None:
        missing = [k for k in (*MLP_KEYS, *QUERY_KEYS) if k not in self.weights]
        if missing:
            raise CompactPolicyError(f"compact policy weights lack {missing}")
        dense = [k for k in MLP_KEYS if DENSE_PREFIX + k in self.weights]
        if dense and len(dense) != len(MLP_KEYS):
            raise CompactPolicyError(f"compact policy weights have part of the dense scorer ({dense})")
        w = self.weights
        for prefix, n in (("", len(DOC_FEATURES)), (DENSE_PREFIX, len(DOC_FEATURES) + len(DENSE_FEATURES))):
            if prefix and not dense:
                continue
            shapes = w[prefix + "mean"].shape, w[prefix + "std"].shape, w[prefix + "w1"].shape[0]
            if shapes != ((n,), (n,), n):
                raise CompactPolicyError(f"compact policy {prefix or 'lexical_'}scorer weights are for "
                                         f"{w[prefix + 'w1'].shape[0]} document features, this code computes {n}")
        if w["qv"].shape != (len(CANDIDATE_FEATURES),):
            raise CompactPolicyError(f"compact policy query weights are for {w['qv'].shape} candidate features, "
                                     f"this code computes {len(CANDIDATE_FEATURES)}")

    @property
    def has_dense(self) -> bool:
        """Whether it ships the `dense` scorer (it then asks for a dense block where `pool_methods` allows)."""
        return DENSE_PREFIX + "w1" in self.weights

    @property
    def dense_encoder(self) -> str | None:
        """The dense encoder its `dense` scorer was trained with (cosines of another encoder do not fit)."""
        if not self.has_dense:
            return None
        return str((self.manifest.get("dense") or {}).get("encoder") or "") or None

    def pool_methods(self, served: Sequence[str] | None, encoder: str | None) -> list[Method] | None:
        """The methods of its first retrieval on a retriever that serves `served` with dense `encoder`: its
        trained pool (bm25, plus dense when it has the dense scorer), the dense block only where the
        retriever's encoder is the one it was trained with; None (`method` alone: bm25) when the retriever
        does not say what it serves or serves no bm25."""
        if not served or LEXICAL not in served:
            return None
        dense_ok = (self.has_dense and DENSE in served and encoder is not None
                    and _same_encoder(encoder, self.dense_encoder))
        return [m for m in self.trained_pool() if m != DENSE or dense_ok]

    def trained_pool(self) -> list[Method]:
        """The methods of the pool it was trained on: its setting's, else bm25 (+ dense with the dense scorer)."""
        setting = self.setting
        if setting is not None and setting.pool_methods:
            return list(setting.pool_methods)
        return ["bm25", "dense"] if self.has_dense else ["bm25"]

    def save(self, folder: Path, manifest: dict[str, Any]) -> Path:
        """Write `weights.npz` and `manifest.json` (with the weights' digest) into `folder`."""
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / WEIGHTS_FILE
        arrays: dict[str, Any] = {k: np.asarray(v, dtype=np.float32) for k, v in self.weights.items()}
        np.savez(path, **arrays)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        manifest = {**manifest, "name": self.name, "weights_sha256": digest,
                    "doc_features": list(DOC_FEATURES), "candidate_features": list(CANDIDATE_FEATURES),
                    **({"dense_features": list(DENSE_FEATURES)} if self.has_dense else {})}
        (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        self.digest, self.manifest, self.folder = digest, manifest, folder
        return path

    # ------------------------------------------------------------------------------------ scoring
    def doc_logits(self, x: np.ndarray, scorer: str = LEXICAL_SCORER) -> np.ndarray:
        w = self.weights
        pre = DENSE_PREFIX if scorer == DENSE_SCORER else ""
        h = (x - w[pre + "mean"]) / w[pre + "std"]
        h = np.maximum(h @ w[pre + "w1"] + w[pre + "b1"], 0)
        h = np.maximum(h @ w[pre + "w2"] + w[pre + "b2"], 0)
        return (h @ w[pre + "w3"] + w[pre + "b3"]).reshape(-1)

    def features(self, question: QuestionInfo, pool: Sequence[PoolDoc], blocks: Sequence[InfoBlock],
                 texts: PoolTexts | None = None) -> tuple[np.ndarray, np.ndarray, str]:
        """(lexical features, scoring features, scorer): the scoring features add the dense evidence when
        the search has a dense block and the policy its scorer. `texts`: the search's (`doc_columns`)."""
        doc_x = doc_features(question, pool, texts)
        dense_x = dense_features(pool, blocks) if self.has_dense else None
        if dense_x is None:
            return doc_x, doc_x, LEXICAL_SCORER
        return doc_x, np.concatenate([doc_x, dense_x], axis=1), DENSE_SCORER

    def query_logits(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weights["qv"]

    def decide(self, env: SearchEnv, *, rng: np.random.Generator | None = None, temperature: float = 1.0
               ) -> Decision:
        """The next action in `env`: a follow-up search or the end with the selection. Greedy without `rng`;
        with one, the query is drawn from the candidates' softmax and the selection by Plackett-Luce."""
        texts = self._texts.get(env)
        if texts is None:
            texts = self._texts[env] = PoolTexts(self.text_cache)
        question = QuestionInfo.of(env.question)
        pool = pool_of(env.blocks, texts)
        doc_x, score_x, scorer = self.features(question, pool, env.blocks, texts)
        logits = self.doc_logits(score_x, scorer) if len(pool) else np.zeros(0, dtype=np.float32)
        cand_x, choice = None, None
        if env.can_search and len(pool):
            cands, cand_x = candidates(question, pool, softmax(logits), env.seen_queries, doc_x)
            q_logits = self.query_logits(cand_x)
            prefetch: tuple[str, ...] = ()
            if rng is None:
                choice = int(np.argmax(q_logits))
                if env.searches_left > 1:  # the next search is nearly always this step's runner-up: ask for it now
                    runner_up = next((int(i) for i in np.argsort(-q_logits, kind="stable")
                                      if i != choice and cands[i].kind != "stop"), None)
                    prefetch = (cands[runner_up].query,) if runner_up is not None else ()
            else:
                choice = int(rng.choice(len(cands), p=softmax(q_logits, temperature)))
            if cands[choice].kind != "stop":
                return Decision(Action("search", query=cands[choice].query, prefetch=prefetch), score_x, cand_x,
                                choice, scorer=scorer)
        k = min(env.params.select_k, len(pool))
        if rng is None:
            chosen = [int(i) for i in np.argsort(-logits, kind="stable")[:k]]
        else:
            chosen, left = [], np.ones(len(pool), dtype=bool)
            for _ in range(k):
                p = softmax(np.where(left, logits, -np.inf), temperature)
                i = int(rng.choice(len(pool), p=p))
                chosen.append(i)
                left[i] = False
        picks = tuple((pool[i].block, pool[i].position) for i in chosen)
        return Decision(Action("complete", selected=picks), score_x, cand_x, choice, selected=chosen, scorer=scorer)

    # ------------------------------------------------------------------- the searcher's policy API
    # (`services.searcher.policy.SearcherPolicy`: what the service asks of the policy it serves)
    @property
    def modes(self) -> tuple[SearchMode, ...]:
        return ("s3",)

    @property
    def acting(self) -> CompactPolicy:
        return self

    def uses_llm(self, mode: SearchMode) -> bool:
        return False

    def first_retrieval(self, served: Sequence[str] | None, encoder: str | None) -> list[Method] | None:
        return self.pool_methods(served, encoder)

    def cost(self, params: SearchParams, question_chars: int) -> float:
        """`search_cost` of the retrievals it may make, no LLM call: its trained pool (one block per method,
        whatever the retriever serves at the moment: the guess before the search is what it is charged) and
        `max_turns` follow-ups."""
        pool = params.model_copy(update={"pool_methods": list(self.trained_pool())})
        return search_cost(pool, question_chars, llm_policy=False)

    def check_request(self, params: SearchParams, *, method_asked: Method | None) -> None:
        """s3 only; the request's `method` only where it is the trained one (bm25): a dense or hybrid block
        read as BM25 evidence would run the policy outside what it was trained on."""
        if params.mode not in ("s3", "naive"):
            raise PolicyRefusal(f"this searcher's policy ({self.model}) runs s3 and naive searches; "
                                f"{params.mode} needs an LLM policy (SEARCHER_POLICY_KIND=llm)", param="mode")
        setting = self.setting
        trained = setting.method if setting is not None and setting.method else LEXICAL
        if params.mode == "s3" and method_asked is not None and method_asked != trained:
            raise PolicyRefusal(f"method {method_asked!r}: this searcher's policy ({self.model}) was trained on "
                                f"{trained!r} follow-up searches and a pool it retrieves itself; leave method "
                                f"unset (or {trained!r}) for s3, or use mode naive for a {method_asked} top-k",
                                param="method")

    async def act(self, env: SearchEnv) -> Action:
        return self.decide(env).action

    async def check_health(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None
