"""Text as the project reads and cuts it: one normalisation for every reader and every query (`normalize`),
whitespace normalised (`ws`) and split into sentences (`sentences`), the rule the shared domain corpora were cut by
(../shared/data/domain/README.md, "Chunking") and `plugsearch-index ingest` cuts every file by
(plugsearch/retriever/ingest/passages.py).

`normalize` is what makes a word in a file findable by the word a person types: Unicode NFKC (the ligatures
U+FB00..FB06 become their letters, full-width forms and compatibility characters their plain forms, a non-breaking
space a space), soft hyphens, zero-width spaces and byte order marks dropped, other control characters dropped
(form feed, vertical tab, line and paragraph separators are line ends), a word broken at a line end (`envi-` /
`ronment`, or PDFium's U+FFFE mark) joined again when the joined word is a word of the same document (else kept as
one hyphenated word, `command-line`), lone surrogates dropped, runs of spaces one space and blank lines one blank
line (a line's indentation, which code needs, is kept). It is idempotent and cheap (ASCII text skips the Unicode
steps), and the retriever applies it to every query (plugsearch/retriever/serving.py) as every reader applies it to
what it reads (plugsearch/retriever/ingest/formats.py), so both sides of BM25 and of the encoder see the same text.

A sentence ends after `.`, `!` or `?` and any closing quotes or brackets, where whitespace is followed by a capital
letter or a digit (an opening quote or bracket before it allowed). Whitespace means non-breaking and zero-width
spaces too; soft hyphens are dropped.

The compact searcher's follow-up candidates cut their text by a rule of their own
(plugsearch/searcher/compact/candidates.py `_sentences`): never after an initial or an abbreviation ("J. R. R.
Tolkien", "St. Louis", "U.S. Army"), whose names the candidates are made of, and that policy was trained on it.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable

import regex

_SENTENCE_END = regex.compile(r"(?<=[.!?][\"'\u201d\u2019)\]]*)\s+(?=[\"'\u201c\u2018(\[]?[\p{Lu}\p{N}])")
_INVISIBLE = str.maketrans({"\u00a0": " ", "\u200b": None, "\ufeff": None, "\u00ad": None})


def ws(text: str) -> str:
    """Whitespace-normalised: one space between words, none at the ends."""
    return " ".join(text.translate(_INVISIBLE).split())


def sentences(block: str) -> list[str]:
    """A block's sentences, whitespace-normalised."""
    block = ws(block)
    return [s for s in _SENTENCE_END.split(block) if s.strip()] if block else []



_DROPPED = str.maketrans({"\u00ad": None, "\u200b": None, "\ufeff": None, "\u2060": None, "\uffff": "\ufffe",
                          "\u2028": "\n", "\u2029": "\n", "\u0085": "\n", "\f": "\n", "\v": "\n",
                          "\r": "\n"})
_CONTROLS = regex.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\ud800-\udfff]")
_BROKEN = regex.compile(r"(?<=\p{L})(?:\ufffe[^\S\n]*\n?|-[^\S\n]*\n)[^\S\n]*(?=\p{L})")
_LETTERS_BEFORE = regex.compile(r"\p{L}+", flags=regex.REVERSE)
_LETTERS_AFTER = regex.compile(r"\p{L}+")
_WORD = regex.compile(r"\p{L}+")
_RUNS = regex.compile(r"[^\S\n]+")
_PLAIN = regex.compile(r"[\x20-\x7e\n]*")


def vocabulary(texts: Iterable[str]) -> set[str]:
    """The words (letters only, lowercased) of a document's texts: what `normalize` joins a broken word by."""
    return {w.lower() for text in texts for w in _WORD.findall(text)}


def _lines(text: str) -> str:
    """Each line's runs of spaces one space and no trailing space (its indentation kept), blank lines one blank
    line, none at the ends."""
    out: list[str] = []
    for line in text.split("\n"):
        body = line.lstrip()
        if not body:
            if out and out[-1]:
                out.append("")
            continue
        indent = line[:len(line) - len(body)]
        out.append(indent.replace("\t", "    ") + _RUNS.sub(" ", body).rstrip() if indent else
                   _RUNS.sub(" ", body).rstrip())
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _join_broken(text: str, words: set[str] | None) -> str:
    """Each line-end break between two words (`envi-` / `ronment`, or a U+FFFE mark) joined when the joined word
    is one of `words` (default: the text's own), else one hyphenated word."""
    known = words
    out: list[str] = []
    end = 0
    for m in _BROKEN.finditer(text):
        before = _LETTERS_BEFORE.match(text, 0, m.start())
        after = _LETTERS_AFTER.match(text, m.end())
        if known is None:  # the document's own words, read once at the first broken word
            known = vocabulary([text])
        whole = (before.group() if before else "") + (after.group() if after else "")
        out.append(text[end:m.start()])
        out.append("" if whole.lower() in known else "-")
        end = m.end()
    out.append(text[end:])
    return "".join(out)


def normalize(text: str, words: set[str] | None = None) -> str:
    """`text` as every reader and every query gives it to the indexes (module docstring). `words`: the document's
    `vocabulary` a broken word is joined by (default: the words of `text` itself). Lines are kept (a code block's
    lines stay lines); `ws` then makes prose one line. Idempotent: normalize(normalize(t)) == normalize(t)."""
    if not _PLAIN.fullmatch(text):  # anything but printable ASCII and newlines: the Unicode steps
        text = text.replace("\r\n", "\n").translate(_DROPPED)
        text = _CONTROLS.sub("", unicodedata.normalize("NFKC", _CONTROLS.sub("", text)))
    if "\ufffe" in text or "\n" in text and "-" in text:
        text = _join_broken(text, words)
        if "\ufffe" in text:  # a mark not between two words: gone, and what it separated looked at again
            text = _join_broken(text.replace("\ufffe", ""), words)
    return _lines(text)
