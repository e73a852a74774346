"""What goes in from real files, before and after the readers' main-text and normalisation work: a folder of
generated documentation sites and PDF manuals read by the readers as they were (the whole HTML page, pypdf's text
layer, no normalisation: commit df88e6f) and as they are (`plugsearch-index ingest`), then compared.

    python bench/ingest_quality.py FOLDER                 # e.g. the Debian documentation set of docs/documents.md

Measured, before and after:
- HTML: the share of boilerplate passages. A passage is boilerplate when at least half of its words are furniture:
  covered by a word 5-gram (lowercased words, digits as 0) that occurs on at least max(3, 30%) of its site's pages
  (counted on the whole pages' text, the same for both readers) or by a navigation phrase ("previous topic", "show
  source", "report a bug", "©", ...). A site is a folder `--site-depth` levels under FOLDER (2: FOLDER/group/site).
  Also the passages that still hold a permalink mark (the pilcrow, private-use icon glyphs).
- PDF: passages holding a ligature character (U+FB00..FB06), passages holding a word split at a line end (`Win-
  dows`: a `word- word` whose joined form is a word of the same document), and each PDF's title (the file name
  when the reader found none).
- Ten questions written from these files (QUESTIONS: each answerable from one file, with the answer's string),
  searched by naive BM25 top-3 (this project's bm25s index over each corpus, the queries normalised as the retriever
  does after, as they were before): answer recall (the answer's string in one of the 3 passages, both normalised
  the same way) and gold hits (a passage of the question's file among the 3).

Prints progress on stderr and one JSON line at the end. The files are never copied into the repository.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import re
import sys
import tempfile
import unicodedata
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import log  # noqa: E402

QUESTIONS: list[dict[str, Any]] = [
    {"q": "Which parameter sets the default units for an unqualified dimension in the DocBook XSL stylesheets?",
     "answer": "default.units", "files": ["pdf/docbook-xsl-reference.pdf"]},
    {"q": "What is the default priority value of treemagic rules in the shared MIME-info database?",
     "answer": "default priority value is 50", "files": ["pdf/shared-mime-info-spec.pdf"]},
    {"q": "Which Fraction method finds the closest fraction whose denominator is at most max_denominator?",
     "answer": "limit_denominator", "files": ["sphinx/python311/library/fractions.html"]},
    {"q": "Which ASN.1 type does libtasn1 not handle?", "answer": "REAL type", "files": ["pdf/libtasn1.pdf"]},
    {"q": "What is the default remote branch that mkdocs gh-deploy commits to?", "answer": "gh-pages",
     "files": ["mkdocs/mkdocs-doc/user-guide/configuration.html"]},
    {"q": "How does CamlIDL name the Caml labels of structs that have identically-named fields?",
     "answer": "prefixes the Caml label names by the names of the structs", "files": ["pdf/camlidl-1.04.doc.pdf"]},
    {"q": "Since which FreedomBox version is the calibre e-book app available?", "answer": "20.15",
     "files": ["other_html/freedombox-wiki/Calibre.part.html", "pdf/freedombox-manual.pdf"]},
    {"q": "How do I check whether a Java runtime is installed on macOS before configuring R?",
     "answer": "java -version", "files": ["pdf/R-admin.pdf"]},
    {"q": "Which FreeFEM command saves a problem to a file for those who write their own solvers?",
     "answer": "saveall", "files": ["pdf/freefem.pdf"]},
    {"q": "What does the route() decorator tell Flask?", "answer": "what URL should trigger our function",
     "files": ["sphinx/flask/quickstart.html"]},
]
"""Written from the files of the Debian documentation set (docs/documents.md, "What text goes in"): each question
asks what one file says (the FreedomBox wiki page and its PDF manual say the same, so either is its file)."""

NAV_PHRASES = [
    "previous topic", "next topic", "this page", "show source", "report a bug", "quick search", "table of contents",
    "navigation", "edit on github", "skip to content", "back to top", "copyright", "©", "created using sphinx",
    "built with mkdocs", "last updated", "theme by", "previous chapter", "next chapter", "previous page",
    "next page", "go to", "page source", "view page source", "documentation »", "« previous", "next »",
    "made with material", "read the docs", "search docs", "related topics", "useful links", "donate",
]
NAV = re.compile("|".join(re.escape(p) for p in sorted(NAV_PHRASES, key=len, reverse=True)))
MARKS = re.compile("[\u00b6\ue000-\uf8ff]")
LIGATURES = re.compile("[\ufb00-\ufb06]")
SPLIT = re.compile(r"([^\W\d_]+)- ([^\W\d_]+)")


# ------------------------------------------------------------------------------------ the readers as they were

def _before_outline() -> Any:
    from plugsearch.common.text import ws
    from plugsearch.retriever.ingest.formats import Block, ParsedDocument, Section

    class Outline:  # the reader of commit df88e6f: no normalisation, blocks as read
        def __init__(self) -> None:
            self.open: list[tuple[int, str]] = []
            self.sections = [Section(())]
            self.first = ""

        def heading(self, level: int, text: str) -> None:
            text = ws(text)
            if not text:
                return
            while self.open and self.open[-1][0] >= level:
                self.open.pop()
            self.open.append((level, text))
            self.first = self.first or text
            self.sections.append(Section(tuple(t for _, t in self.open)))

        def add(self, text: str, page: int | None = None) -> None:
            if text.strip():
                self.sections[-1].blocks.append(Block(text, page))

        def document(self, title: str) -> ParsedDocument:
            return ParsedDocument(title=ws(title), sections=[s for s in self.sections if s.blocks])

    return Outline()


def before_html(data: bytes, name: str) -> Any:
    """The whole page walked as before: every block-level element a block, `<pre>` flattened like any text."""
    from bs4 import BeautifulSoup, MarkupResemblesLocatorWarning, XMLParsedAsHTMLWarning
    from bs4.element import NavigableString, PreformattedString, Tag

    from plugsearch.common.text import ws
    from plugsearch.retriever.ingest import formats

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MarkupResemblesLocatorWarning)
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        soup = BeautifulSoup(data, "html.parser")
    title = soup.title.get_text(" ") if soup.title is not None else ""
    if not ws(title) and (h1 := soup.find("h1")) is not None:
        title = h1.get_text(" ")
    outline = _before_outline()
    buffer: list[str] = []

    def flush() -> None:
        outline.add("".join(buffer))
        buffer.clear()

    stack: list[tuple[Any, bool]] = [(iter(soup.children), False)]
    while stack:
        children, is_block = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            if is_block:
                flush()
        elif isinstance(child, NavigableString):
            if not isinstance(child, PreformattedString):
                buffer.append(str(child))
        elif isinstance(child, Tag) and child.name not in formats._HTML_DROP:
            if child.name in formats._HTML_HEADINGS:
                flush()
                outline.heading(formats._HTML_HEADINGS[child.name], child.get_text(" "))
                continue
            block = child.name in formats._HTML_BLOCKS
            if block:
                flush()
            elif child.name in formats._HTML_CELLS:
                buffer.append(" ")
            stack.append((iter(child.children), block))
    flush()
    return outline.document(title if ws(title) else name)


def before_pdf(data: bytes, name: str) -> Any:
    """pypdf's text layer, a block per page, the metadata title else the file name."""
    import logging

    from pypdf import PdfReader

    from plugsearch.common.text import ws

    logging.getLogger("pypdf").setLevel(logging.ERROR)
    reader = PdfReader(io.BytesIO(data))
    outline = _before_outline()
    for number, page in enumerate(reader.pages, start=1):
        outline.add(page.extract_text() or "", page=number)
    document = outline.document(name)
    metadata = reader.metadata
    if metadata is not None and metadata.title and ws(str(metadata.title)):
        document.title = ws(str(metadata.title))
    return document


def read_before(folder: Path) -> list[dict[str, Any]]:
    """Every HTML and PDF file under `folder` (all of them, as before: no page was skipped) as passages."""
    from plugsearch.retriever.ingest.passages import cut

    rows: list[dict[str, Any]] = []
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in (".html", ".htm", ".pdf"))
    for n, path in enumerate(files, 1):
        rel = path.relative_to(folder).as_posix()
        try:
            doc = (before_pdf if path.suffix.lower() == ".pdf" else before_html)(path.read_bytes(), path.stem)
        except Exception as exc:  # noqa: BLE001 - a file the old reader could not read is left out, as it was
            log(f"before: {rel} not read ({type(exc).__name__})")
            continue
        rows += [p.row() for p in cut(doc, doc_id=rel, source=rel)]
        if n % 50 == 0:
            log(f"before: {n} / {len(files)} files")
    return rows


def read_after(folder: Path, out: Path) -> list[dict[str, Any]]:
    from plugsearch.retriever.ingest.run import IngestOptions, ingest

    report = ingest(IngestOptions(paths=(folder,), out=out, root=folder, show_progress=False))
    log(f"after: {report.files} files, {report.passages} passages, {len(report.skipped)} skipped")
    return [json.loads(line) for line in out.read_text().splitlines()]


# ------------------------------------------------------------------------------------------------- measures

def tokens(text: str) -> list[str]:
    return [re.sub(r"\d", "0", w) for w in re.findall(r"\w+", text.lower())]


def repeated_grams(folder: Path, pages: list[Path]) -> set[tuple[str, ...]]:
    """Word 5-grams on at least max(3, 30%) of the site's pages (whole-page text: the same for both readers)."""
    df: collections.Counter[tuple[str, ...]] = collections.Counter()
    for page in pages:
        words = tokens(" ".join(b.text for s in before_html(page.read_bytes(), page.stem).sections
                                for b in s.blocks))
        df.update({tuple(words[i:i + 5]) for i in range(len(words) - 4)})
    threshold = max(3, 0.3 * len(pages))
    return {g for g, c in df.items() if c >= threshold}


def boilerplate(text: str, repeated: set[tuple[str, ...]]) -> bool:
    low = text.lower()
    spans = [(m.start(), m.end()) for m in NAV.finditer(low)]
    words, mask = [], []
    for m in re.finditer(r"\w+|©", low):
        words.append(re.sub(r"\d", "0", m.group()))
        mask.append(any(a <= m.start() < b for a, b in spans))
    for i in range(len(words) - 4):
        if tuple(words[i:i + 5]) in repeated:
            mask[i:i + 5] = [True] * 5
    return bool(words) and sum(mask) >= 0.5 * len(words)


def site_of(doc_id: str, depth: int) -> str:
    return "/".join(doc_id.split("/")[:depth])


def html_measures(folder: Path, rows: list[dict[str, Any]], repeated: dict[str, set[tuple[str, ...]]],
                  depth: int) -> dict[str, Any]:
    html = [r for r in rows if r["doc_id"].lower().endswith((".html", ".htm"))]
    per_site: dict[str, list[int]] = {}
    for row in html:
        site = site_of(row["doc_id"], depth)
        counts = per_site.setdefault(site, [0, 0])
        counts[0] += 1
        counts[1] += boilerplate(row["text"], repeated.get(site, set()))
    total = sum(c[0] for c in per_site.values())
    boiler = sum(c[1] for c in per_site.values())
    return {"pages": len({r["doc_id"] for r in html}), "passages": total, "boilerplate_passages": boiler,
            "boilerplate_share": round(boiler / total, 4) if total else None,
            "passages_with_marks": sum(1 for r in html if MARKS.search(r["text"])),
            "boilerplate_share_by_site": {s: round(c[1] / c[0], 4) for s, c in sorted(per_site.items()) if c[0]}}


def pdf_measures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    pdf = [r for r in rows if r["doc_id"].lower().endswith(".pdf")]
    by_doc: dict[str, list[dict[str, Any]]] = {}
    for row in pdf:
        by_doc.setdefault(row["doc_id"], []).append(row)
    split = 0
    for doc_rows in by_doc.values():
        words = {w.lower() for r in doc_rows for w in re.findall(r"[^\W\d_]+", unicodedata.normalize("NFKC", r["text"]))}
        split += sum(1 for r in doc_rows
                     if any((a + b).lower() in words for a, b in SPLIT.findall(unicodedata.normalize("NFKC", r["text"]))))
    titles = {doc: doc_rows[0]["title"] for doc, doc_rows in sorted(by_doc.items())}
    fallback = sum(1 for doc, title in titles.items() if title == Path(doc).stem)
    return {"files": len(by_doc), "passages": len(pdf),
            "passages_with_ligatures": sum(1 for r in pdf if LIGATURES.search(r["text"])),
            "passages_with_split_words": split, "titles_from_file_name": fallback, "titles": titles}


# ------------------------------------------------------------------------------------------------ questions

def matchable(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def answer_questions(rows: list[dict[str, Any]], work: Path, normalise_queries: bool,
                     questions: list[dict[str, Any]]) -> dict[str, Any]:
    """Naive BM25 top-3 of each question over `rows` (this project's bm25s index)."""
    from plugsearch.common.text import normalize
    from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings

    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": r["id"], "title": r["title"], "text": r["text"]},
                                         ensure_ascii=False) + "\n" for r in rows))
    settings = RetrieverSettings(corpus=corpus, index_dir=work / "indexes", dense=False)
    build(settings, bm25=["bm25s"], dense=False, force=True, show_progress=False)
    retriever = Bm25sRetriever(settings.index_dir / "bm25s")
    queries = [normalize(q["q"]) if normalise_queries else q["q"] for q in questions]
    hits = retriever.batch_search(queries, 3)
    ids = [r["id"] for r in rows]
    texts = {r["id"]: r["text"] for r in rows}
    out = []
    for question, row in zip(questions, hits.ids.tolist(), strict=True):
        top = [ids[i] for i in row if i >= 0]
        answer = matchable(question["answer"])
        out.append({"q": question["q"], "top3": top,
                    "answer_found": any(answer in matchable(texts[d]) for d in top),
                    "gold_found": any(d.rsplit("#", 1)[0] in question["files"] for d in top)})
    retriever.close()
    return {"answer_recall_at_3": sum(o["answer_found"] for o in out),
            "gold_at_3": sum(o["gold_found"] for o in out), "questions": len(out), "per_question": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="generated documentation sites and PDF manuals")
    parser.add_argument("--site-depth", type=int, default=2, help="a site is a folder this many levels under "
                        "FOLDER (default 2: FOLDER/group/site)")
    args = parser.parse_args()
    folder = args.folder.resolve()
    questions = [q for q in QUESTIONS if any((folder / f).is_file() for f in q["files"])]
    if len(questions) < len(QUESTIONS):
        log(f"{len(QUESTIONS) - len(questions)} questions left out: their files are not under {folder}")
    sites: dict[str, list[Path]] = {}
    for page in sorted(folder.rglob("*.htm*")):
        sites.setdefault(site_of(page.relative_to(folder).as_posix(), args.site_depth), []).append(page)
    log(f"{sum(len(p) for p in sites.values())} HTML pages in {len(sites)} sites: repeated 5-grams")
    repeated = {site: repeated_grams(folder, pages) for site, pages in sites.items()}
    with tempfile.TemporaryDirectory(prefix="ingest-quality-") as scratch:
        work = Path(scratch)
        before = read_before(folder)
        after = read_after(folder, work / "after.jsonl")
        result: dict[str, Any] = {"folder": str(folder)}
        for name, rows, normalised in (("before", before, False), ("after", after, True)):
            (work / name).mkdir()
            log(f"{name}: {len(rows)} passages; questions")
            result[name] = {"passages": len(rows), "html": html_measures(folder, rows, repeated, args.site_depth),
                            "pdf": pdf_measures(rows),
                            "qa": answer_questions(rows, work / name, normalised, questions) if questions else None}
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
