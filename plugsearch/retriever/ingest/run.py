"""Walking the given paths into one corpus file: the checks, the progress bar, the report, the atomic writes.

Files are taken in a stable order (each path as given, a folder's files sorted by their path within it, depth
first). A file's document id is its path relative to one declared root (`--root`, default the current folder),
with `/` separators (`docs/guides/install.md`): `ingest`, `upload` and `sync` give a file the same id whatever
path was typed, so uploading one file of an ingested folder replaces its document (`document_id`: characters an
id cannot hold are %-encoded, so any name a file system allows has an id). Each file is read whole (up to the
size limit) and cut by a worker process of the parse pool (`plugsearch.retriever.ingest.pool`: a CPU budget per
file, several files at once) before any of it is written; any failure, a check that refuses it or an exception
from its reader, skips that file with the reason in the report, and the batch goes on. Refused: a path outside
the root, a path that resolves (links followed) outside the allowed folders, a broken link, a file over the size
limit (by its size on disk: it is never read), an empty file, a file over its CPU budget, an extension no reader
takes (ignored, not an error), a hidden file or folder (ignored), what a documentation generator writes beside the
pages (Sphinx's `_sources/`, `_static/`, `genindex`, `search` and `py-modindex` pages, a site's `404.html`:
ignored), a redirect page (ignored), content that is not what the extension says, a PDF with no text layer, a
document with no text, and a document id or passage id already taken in this batch (the first keeps it).

The corpus goes to a temporary file beside the output, renamed over it once complete (never half-written); with
no passage at all nothing is written there. The report (`<out stem>.report.json`) is written the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import unicodedata
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson

from plugsearch.common.files import atomic_write_bytes, atomic_writer
from plugsearch.retriever.ingest.formats import SkipFile
from plugsearch.retriever.ingest.passages import DEFAULT_WORDS, Passage
from plugsearch.retriever.ingest.reading import MB, kind_of

logger = logging.getLogger(__name__)

DEFAULT_MAX_MB = 200.0


class IngestError(ValueError):
    """Nothing could be ingested (bad options, no passage); the message says why, `report` (when the batch ran)
    what was skipped."""

    def __init__(self, message: str, report: IngestReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class IngestOptions:
    paths: tuple[Path, ...]
    out: Path
    allow: tuple[Path, ...] = ()  # empty: the paths given
    words: int = DEFAULT_WORDS
    max_mb: float = DEFAULT_MAX_MB
    show_progress: bool = True
    root: Path = Path(".")
    """Document ids are paths relative to it (`document_id`)."""
    workers: int = 2
    """Files read at once (worker processes of the parse pool); 0: in this process, with no CPU budget."""

    def __post_init__(self) -> None:
        if not self.paths:
            raise IngestError("no path to ingest")
        if not 10 <= self.words <= 10_000:
            raise IngestError(f"--words {self.words}: between 10 and 10000")
        if self.max_mb <= 0:
            raise IngestError(f"--max-mb {self.max_mb}: must be positive")

    @property
    def report_path(self) -> Path:
        return self.out.with_name(f"{self.out.stem}.report.json")


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str
    kind: Literal["error", "ignored"] = "error"


@dataclass(frozen=True)
class _File:
    path: Path  # as found: the given path joined with its path inside it
    rel: str  # relative to the root, `/`-separated and encoded (`document_id`): the document id and `source`


MAX_ID_CHARS = 512


def _escape(ch: str) -> str:
    return "".join(f"%{b:02X}" for b in os.fsencode(ch))


def document_id(path: Path, root: Path) -> str:
    """The document id of the file at `path`: its path relative to `root` (both made absolute, links not
    followed), `/`-separated, with what an id cannot hold %-encoded as its bytes: `%` itself, control and
    line-separator characters, bytes that are not UTF-8 (a name the file system stores as raw bytes), a leading
    `#` and spaces at either end. Spaces inside, accents and other scripts stay as they are (`My notes/été.md`).
    Raises SkipFile when the file is not under `root`."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir or rel.startswith(os.pardir + os.sep) or rel == os.pardir or os.path.isabs(rel):
        raise SkipFile(f"outside the root {root} (document ids are paths inside it): pass --root with a folder "
                       "that holds it")
    out = []
    for part in rel.split(os.sep):
        chars = ["%25" if ch == "%" else _escape(ch) if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp")
                 else ch for ch in part]
        out.append("".join(chars))
    doc_id = "/".join(out)
    if doc_id.startswith("#"):
        doc_id = "%23" + doc_id[1:]
    if doc_id[:1].isspace():
        doc_id = _escape(doc_id[0]) + doc_id[1:]
    if doc_id[-1:].isspace():
        doc_id = doc_id[:-1] + _escape(doc_id[-1])
    if len(doc_id) > MAX_ID_CHARS:
        raise SkipFile(f"its path inside the root is {len(doc_id):,} characters long, over the {MAX_ID_CHARS} a "
                       "document id may have: pass a --root closer to it")
    return doc_id


GENERATED_SITE_MARKERS = ("objects.inv", "searchindex.js", "search/search_index.json")
"""Files at the top of a site a documentation generator built (Sphinx, MkDocs)."""
GENERATED_SITE_EXTRAS = {"_sources": "Sphinx's copies of the pages' sources",
                         "_static": "Sphinx's theme files", "_modules": "Sphinx's highlighted module sources",
                         "genindex.html": "Sphinx's general index", "search.html": "a search page",
                         "py-modindex.html": "Sphinx's module index", "404.html": "the site's not-found page"}
"""What such a generator writes beside the pages, which is no document (ignored, with the reason)."""


def _generated_extra(folder: Path, name: str) -> str | None:
    """Why `name` in `folder` is a generated site's furniture, not a page (None: it is not)."""
    what = GENERATED_SITE_EXTRAS.get(name) or ("Sphinx's general index" if name.startswith("genindex-") and
                                               name.endswith(".html") else None)
    if what is None or not any((folder / marker).is_file() for marker in GENERATED_SITE_MARKERS):
        return None
    return f"{what}, written by the site's generator: not a document"


@dataclass
class IngestReport:
    corpus: str
    written: bool = False
    files: int = 0
    documents: int = 0
    passages: int = 0
    formats: Counter[str] = field(default_factory=Counter)
    skipped: list[Skipped] = field(default_factory=list)
    sha256: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> list[Skipped]:
        return [s for s in self.skipped if s.kind == "error"]

    def to_json(self) -> dict[str, Any]:
        return {"corpus": self.corpus, "written": self.written, "files": self.files, "documents": self.documents,
                "passages": self.passages, "formats": dict(sorted(self.formats.items())), "sha256": self.sha256,
                "errors": len(self.errors), "ignored": len(self.skipped) - len(self.errors),
                "skipped": [{"path": s.path, "kind": s.kind, "reason": s.reason} for s in self.skipped],
                "options": self.options}

    def summary(self) -> list[str]:
        """What a person reads after the run (the command prints it on stderr)."""
        where = f"into {self.corpus}" if self.written else f"(nothing written to {self.corpus})"
        lines = [f"ingested {self.files:,} files ({self.documents:,} documents) as {self.passages:,} passages "
                 f"{where}"]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped):,} ({len(self.errors):,} errors):")
            lines += [f"  {s.path}: {s.reason}" for s in self.skipped]
        return lines


def _inside(path: Path, allowed: list[Path]) -> bool:
    return any(path == a or path.is_relative_to(a) for a in allowed)


def _found(path: Path, root: Path) -> _File | Skipped:
    try:
        return _File(path, document_id(path, root))
    except SkipFile as exc:
        return Skipped(str(path), exc.reason)


def _walk_folder(folder: Path, root: Path, allowed: list[Path], seen: set[Path]) -> Iterator[_File | Skipped]:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError as exc:
        yield Skipped(str(folder), f"cannot list the folder: {exc.strerror or exc}")
        return
    for entry in entries:
        path = Path(entry.path)
        if entry.name.startswith("."):
            yield Skipped(str(path), "hidden file or folder", "ignored")
            continue
        if (why := _generated_extra(folder, entry.name)) is not None:
            yield Skipped(str(path), why, "ignored")
            continue
        real = path.resolve()
        if not _inside(real, allowed):
            yield Skipped(str(path), f"outside the allowed folders (it resolves to {real}); allow its folder "
                          "with --allow")
        elif real.is_dir():
            if real in seen:
                yield Skipped(str(path), f"a link to a folder already walked ({real})", "ignored")
            else:
                seen.add(real)
                yield from _walk_folder(path, root, allowed, seen)
        elif real.is_file():
            yield _found(path, root)
        elif not real.exists():
            yield Skipped(str(path), f"a broken link (to {real})")
        else:
            yield Skipped(str(path), "not a regular file", "ignored")


def walk(paths: tuple[Path, ...], allowed: list[Path], root: Path = Path(".")) -> Iterator[_File | Skipped]:
    """The files under `paths` in a stable order, each with its document id relative to `root`, and what was
    refused on the way."""
    seen: set[Path] = set()
    for given in paths:
        real = given.resolve()
        if not os.path.lexists(given):
            yield Skipped(str(given), "no such file or folder")
        elif not _inside(real, allowed):
            yield Skipped(str(given), f"outside the allowed folders (it resolves to {real})")
        elif real.is_dir():
            if real not in seen:
                seen.add(real)
                yield from _walk_folder(given, root, allowed, seen)
        elif real.is_file():
            yield _found(given, root)
        else:
            yield Skipped(str(given), "not a regular file, or a broken link")


def check_file(file: _File, *, max_bytes: int) -> int:
    """Its size, after the checks made before a file is read (an extension a reader takes, not empty, not over
    `max_bytes`); SkipFile when one refuses it."""
    kind_of(file.rel)
    size = file.path.stat().st_size
    if size > max_bytes:
        raise SkipFile(f"too large: {size / MB:,.1f} MB, over the limit of {max_bytes / MB:g} MB (--max-mb)")
    if size == 0:
        raise SkipFile("empty file")
    return size


class _Ids:
    """Document and passage ids taken so far in this batch, and by which file."""

    def __init__(self) -> None:
        self.documents: dict[str, str] = {}
        self.passages: dict[str, str] = {}

    def check(self, passages: list[Passage]) -> None:
        doc_ids = dict.fromkeys(p.doc_id for p in passages)
        for doc_id in doc_ids:
            if doc_id in self.documents:
                raise SkipFile(f"duplicate document id {doc_id!r}: already taken by {self.documents[doc_id]}")
        for passage in passages:
            if passage.id in self.passages:
                raise SkipFile(f"duplicate passage id {passage.id!r}: already taken by {self.passages[passage.id]}")

    def take(self, file: _File, passages: list[Passage]) -> int:
        """Record the file's ids; return how many documents it held."""
        doc_ids = dict.fromkeys(p.doc_id for p in passages)
        self.documents.update(dict.fromkeys(doc_ids, str(file.path)))
        self.passages.update(dict.fromkeys((p.id for p in passages), str(file.path)))
        return len(doc_ids)


class _NothingToWrite(Exception):
    """No passage came out: the corpus file is not replaced."""


def read_files(files: list[_File], *, words: int, max_bytes: int, workers: int = 2
               ) -> Iterator[tuple[_File, tuple[str, list[Passage], str] | Exception]]:
    """Each file with its (format, passages, sha256 of its bytes), or the SkipFile / ParsePool refusal that stopped
    it, in order; read `workers` at a time by the parse pool's worker processes (`check_file` first: a file it
    refuses is never sent). `workers` 0: read here, one after the other, with no CPU budget (what a test that adds
    a format to `FORMATS` in its own process needs)."""
    from plugsearch.retriever.ingest.pool import JOBS, ParseLimits, ParsePool

    checked: list[SkipFile | int] = []
    for file in files:
        try:
            checked.append(check_file(file, max_bytes=max_bytes))
        except SkipFile as exc:
            checked.append(exc)
        except OSError as exc:
            checked.append(SkipFile(f"cannot be read: {exc.strerror or exc}"))
    jobs = (("read_path", (str(f.path), f.rel, f.rel, words, max_bytes), size)
            for f, size in zip(files, checked, strict=True) if isinstance(size, int))
    if workers == 0:
        for file, size in zip(files, checked, strict=True):
            if isinstance(size, SkipFile):
                yield file, size
                continue
            try:
                yield file, JOBS["read_path"](str(file.path), file.rel, file.rel, words, max_bytes)
            except SkipFile as exc:
                yield file, exc
        return
    with ParsePool(ParseLimits(workers=workers)) as pool:
        results = pool.map(jobs)
        for file, size in zip(files, checked, strict=True):
            yield file, size if isinstance(size, SkipFile) else next(results)


def ingest(options: IngestOptions) -> IngestReport:
    """Ingest `options.paths` into `options.out`; return (and write beside it) the report. Raises IngestError
    when no passage came out (the report is written all the same, the corpus file is left as it was)."""
    from tqdm import tqdm

    from plugsearch.retriever.ingest.pool import ParseRefused

    allowed = [p.resolve() for p in (options.allow or options.paths)]
    max_bytes = int(options.max_mb * MB)
    report = IngestReport(corpus=str(options.out), options={
        "paths": [str(p) for p in options.paths], "root": str(options.root), "allow": [str(p) for p in allowed],
        "words": options.words, "max_mb": options.max_mb})
    found = list(walk(options.paths, allowed, options.root))
    files = [f for f in found if isinstance(f, _File)]
    report.skipped += [s for s in found if isinstance(s, Skipped)]
    ids = _Ids()
    options.out.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    bar = tqdm(total=len(files), unit="doc", desc="ingest", disable=not options.show_progress, dynamic_ncols=True)
    unique: list[_File] = []
    for file in files:  # a document id twice: the first keeps it, the second is never read
        if file.rel in ids.documents:
            report.skipped.append(Skipped(str(file.path), f"duplicate document id {file.rel!r}: already taken by "
                                          f"{ids.documents[file.rel]}"))
            bar.update(1)
        else:
            ids.documents[file.rel] = str(file.path)
            unique.append(file)
    ids.documents.clear()
    try:
        with atomic_writer(options.out) as fh:
            for file, outcome in read_files(unique, words=options.words, max_bytes=max_bytes,
                                            workers=options.workers):
                try:
                    if isinstance(outcome, SkipFile):
                        raise outcome
                    if isinstance(outcome, ParseRefused):
                        raise SkipFile(outcome.reason)
                    if isinstance(outcome, Exception):
                        raise outcome
                    kind, passages, _ = outcome
                    ids.check(passages)
                except SkipFile as exc:
                    report.skipped.append(Skipped(str(file.path), exc.reason, "ignored" if exc.ignored else "error"))
                except Exception as exc:  # a reader's failure on one file never stops the batch
                    logger.warning("%s could not be read", file.path, exc_info=True)
                    report.skipped.append(Skipped(str(file.path), f"could not be read: {type(exc).__name__}: {exc}"))
                else:
                    chunk = b"".join(orjson.dumps(p.row()) + b"\n" for p in passages)
                    fh.write(chunk)
                    digest.update(chunk)
                    report.documents += ids.take(file, passages)
                    report.files += 1
                    report.passages += len(passages)
                    report.formats[kind] += 1
                bar.update(1)
                bar.set_postfix(passages=report.passages, skipped=len(report.skipped), refresh=False)
            bar.close()
            if not report.passages:
                raise _NothingToWrite
        report.written, report.sha256 = True, digest.hexdigest()
    except _NothingToWrite:
        pass
    finally:
        bar.close()
    atomic_write_bytes(options.report_path, orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    if not report.written:
        raise IngestError(f"no passage to write: {len(files):,} files found, {len(report.skipped):,} skipped; "
                          f"{options.out} left as it was (see {options.report_path})", report)
    return report
