"""Corpus loading: JSONL with `id` and either `title` + `text` or FlashRAG / Search-R1 `contents`.

`contents` is `'"' + title + '"\\n' + text` (FlashRAG's wiki dumps); both shapes load into the same
`Corpus` (parallel lists; position = the internal document number every index uses).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import orjson

logger = logging.getLogger(__name__)


class CorpusError(ValueError):
    """The corpus file is missing or malformed (the message names the file and line)."""


def file_checksum(path: Path, block: int = 1 << 20) -> str:
    """sha256 of the file's bytes (what manifests record)."""
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(block):
                digest.update(chunk)
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror or exc}") from exc
    return "sha256:" + digest.hexdigest()


def split_contents(contents: str) -> tuple[str, str]:
    """FlashRAG `contents` -> (title, text). A first line in double quotes is the title."""
    first, sep, rest = contents.partition("\n")
    if sep and len(first) >= 2 and first.startswith('"') and first.endswith('"'):
        return first[1:-1], rest
    return "", contents


def join_contents(title: str, text: str) -> str:
    """(title, text) -> FlashRAG / Search-R1 `contents`."""
    return f'"{title}"\n{text}'


def indexed_text(title: str, text: str) -> str:
    """A passage as every index reads it (BM25 tokens, dense vectors, the changes put while serving): its title
    and its text, one line apart; the text alone without a title."""
    return f"{title}\n{text}" if title else text


def parse_line(line: bytes, lineno: int, path: Path) -> tuple[str, str, str]:
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise CorpusError(f"{path}:{lineno}: expected a JSON object")
    doc_id = row.get("id", row.get("_id", row.get("docid")))
    if doc_id is None or doc_id == "":
        raise CorpusError(f"{path}:{lineno}: missing 'id'")
    if "text" in row:
        title, text = row.get("title") or "", row["text"]
    elif "contents" in row:
        title, text = split_contents(row["contents"])
    else:
        raise CorpusError(f"{path}:{lineno}: needs 'title'+'text' or 'contents'")
    if not isinstance(text, str) or not isinstance(title, str):
        raise CorpusError(f"{path}:{lineno}: 'title'/'text' must be strings")
    return str(doc_id), title, text


def corpus_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Stream (line number, line) of the non-blank lines of a corpus file, unparsed."""
    try:
        with path.open("rb") as fh:
            for lineno, line in enumerate(fh, start=1):
                if line.strip():
                    yield lineno, line
    except OSError as exc:
        raise CorpusError(f"cannot read corpus {path}: {exc.strerror or exc}") from exc


def iter_corpus(path: Path) -> Iterator[tuple[str, str, str]]:
    """Stream (id, title, text) from a corpus file without holding it in memory."""
    return (parse_line(line, lineno, path) for lineno, line in corpus_lines(path))


@dataclass
class Corpus:
    """Parallel lists; index i is document number i in every index built from this corpus.

    Every document as Python strings in this process (~0.9 KB per 100-word passage): for small corpora and
    in-process users. The service reads documents from `plugsearch.retriever.store.docstore.DiskStore` instead,
    which has the same methods."""

    path: Path
    ids: list[str] = field(default_factory=list)
    titles: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    checksum: str = ""
    _lookup: dict[str, int] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.ids)

    def passage(self, i: int) -> str:
        """Text used for indexing: title and body together."""
        return indexed_text(self.titles[i], self.texts[i])

    def documents(self, positions: Sequence[int]) -> list[tuple[str, str, str]]:
        """(id, title, text) of each document number."""
        return [(self.ids[i], self.titles[i], self.texts[i]) for i in positions]

    def positions(self, ids: Sequence[str]) -> npt.NDArray[np.int64]:
        """The document number of each id; -1 for an id the corpus does not hold."""
        if self._lookup is None:
            self._lookup = {doc_id: i for i, doc_id in enumerate(self.ids)}
        return np.array([self._lookup.get(doc_id, -1) for doc_id in ids], dtype=np.int64)

    def iter_documents(self) -> Iterator[tuple[str, str, str]]:
        return zip(self.ids, self.titles, self.texts, strict=True)

    def close(self) -> None:
        """Nothing to release (the lists go with the object)."""

    @classmethod
    def load(cls, path: Path, *, checksum: str | None = None, limit: int | None = None) -> Corpus:
        """Load the file (all of it, or the first `limit` documents). Ids must be unique."""
        corpus = cls(path=path)
        seen: set[str] = set()
        for doc_id, title, text in iter_corpus(path):
            if doc_id in seen:
                raise CorpusError(f"{path}: duplicate id {doc_id!r}")
            seen.add(doc_id)
            corpus.ids.append(doc_id)
            corpus.titles.append(title)
            corpus.texts.append(text)
            if limit is not None and len(corpus.ids) >= limit:
                break
        if not corpus.ids:
            raise CorpusError(f"{path}: no documents")
        corpus.checksum = checksum or (file_checksum(path) if limit is None else "")
        logger.info("loaded corpus %s: %s documents", path, len(corpus.ids))
        return corpus


def check_corpus_file(path: Path, *, progress: bool = False) -> int:
    """Every row of a corpus file read before any work (what the retriever will index; the trainer checks a user's
    corpus with it): a row that is not a passage, or an id used twice, raises `QAFileError` with its line (and the
    line of the first use); returns the passages counted."""
    from tqdm import tqdm

    from plugsearch.common.qa import QAFileError

    first: dict[str, int] = {}
    try:
        size = path.stat().st_size
        with tqdm(total=size, unit="B", unit_scale=True, desc="checking the corpus", disable=not progress) as bar:
            for lineno, line in corpus_lines(path):
                doc_id, _, _ = parse_line(line, lineno, path)
                bar.update(len(line))
                seen = first.setdefault(doc_id, lineno)
                if seen != lineno:
                    raise QAFileError(f"{path}:{lineno}: passage id {doc_id!r} is used again (first at line {seen}); "
                                      "every passage needs its own id")
    except CorpusError as exc:
        raise QAFileError(str(exc)) from exc
    except OSError as exc:
        raise QAFileError(f"cannot read corpus {path}: {exc.strerror or exc}") from exc
    if not first:
        raise QAFileError(f"{path}: the corpus holds no passage")
    return len(first)
