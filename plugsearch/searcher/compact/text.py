"""How the compact policy reads text: words, content words and titles (`title_core`, `title_head`), the question
(`QuestionInfo`), and what the features read of a document's title and text (`TextFacts`), worked out once per
document through bytes tables at C speed and kept across searches (`TextCache`)."""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from plugsearch.common.schemas.searcher import SearchedDocument

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


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _content(text: str) -> set[str]:
    return {w for w in _words(text) if w not in _STOP}



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
