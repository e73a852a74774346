"""Text as the project cuts it: whitespace normalised (`ws`) and split into sentences (`sentences`), the rule the
shared domain corpora were cut by (../shared/data/domain/README.md, "Chunking") and `plugsearch-index ingest`
cuts every file by (plugsearch/retriever/ingest/passages.py).

A sentence ends after `.`, `!` or `?` and any closing quotes or brackets, where whitespace is followed by a capital
letter or a digit (an opening quote or bracket before it allowed). Whitespace means non-breaking and zero-width
spaces too; soft hyphens are dropped.

The compact searcher's follow-up candidates cut their text by a rule of their own
(plugsearch/searcher/compact/candidates.py `_sentences`): never after an initial or an abbreviation ("J. R. R.
Tolkien", "St. Louis", "U.S. Army"), whose names the candidates are made of, and that policy was trained on it.
"""

from __future__ import annotations

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
