"""`plugsearch-index ingest`: real files written here (txt, Markdown, HTML, PDF with and without a text layer,
JSONL passages, and every kind of bad file) into a corpus the retriever loads, indexes and searches."""

from __future__ import annotations

import random
import runpy
from pathlib import Path
from typing import Any

import orjson
import pytest
from fpdf import FPDF

from plugsearch.retriever.backends.bm25s_index import Bm25sRetriever
from plugsearch.retriever.cli import main as cli_main
from plugsearch.retriever.indexing.build import build
from plugsearch.retriever.ingest import formats
from plugsearch.retriever.ingest.formats import (
    FORMATS,
    NO_TEXT_LAYER,
    Block,
    Format,
    ParsedDocument,
    Section,
    SkipFile,
    read_document,
    sniff,
)
from plugsearch.retriever.ingest.passages import Piece, cut, pack
from plugsearch.retriever.ingest.reading import kind_of, read_data
from plugsearch.retriever.ingest.run import IngestError, IngestOptions, ingest
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store.corpus import Corpus

NOTES = ("Solar panels turn light into electricity. Their output falls when the panels are hot.\n\n"
         "Clean panels every spring! Dust can cost a tenth of the yield.\n")
SETUP_MD = """# Setup guide

Read this first. It explains the layout.

## Install

Download the archive. Unpack it into a folder of your choice.

### On Linux

- run `make install`
- add the folder to your PATH

## Configure

Edit the settings file before the first start.
"""
PAGE_HTML = """<!doctype html><html><head><title>Field notes</title><style>p { color: red }</style>
<script>var tracking = "scriptword";</script></head><body>
<h1>Birds</h1><p>Herons wade in <b>shallow</b> water. They eat fish.</p>
<h2>Nesting</h2><div><p>Herons nest in colonies.</p><!-- a comment word --></div>
<h3>Eggs</h3><p>Three to five eggs are laid.</p>
<h2>Migration</h2><p>Some herons migrate south in autumn.</p></body></html>"""
PDF_PAGE_1 = "The zyxolite mineral was first described in 2021. It glows faintly under ultraviolet light."
PDF_PAGE_2 = "Mining permits for zyxolite were approved in the spring. The first shipment left in June."


def write_pdf(path: Path, pages: list[str], title: str | None = None) -> None:
    pdf = FPDF()
    if title:
        pdf.set_title(title)
    pdf.set_font("Helvetica", size=12)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 8, text)
    pdf.output(str(path))


def write_scanned_pdf(path: Path) -> None:
    """A page that shows something (a filled rectangle, as a scan shows an image) but has no text layer."""
    pdf = FPDF()
    pdf.add_page()
    pdf.rect(20, 20, 120, 160, style="F")
    pdf.output(str(path))


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    """docs/: one good file of each format and every kind of bad file; more/: a second folder with a notes.txt of
    its own; outside/: a folder a link in docs/ points into."""
    docs, more, outside = tmp_path / "docs", tmp_path / "more", tmp_path / "outside"
    for folder in (docs / "guide", more, outside):
        folder.mkdir(parents=True)
    (docs / "notes.txt").write_text(NOTES)
    (docs / "guide" / "setup.md").write_text(SETUP_MD)
    (docs / "page.html").write_text(PAGE_HTML)
    write_pdf(docs / "report.pdf", [PDF_PAGE_1, PDF_PAGE_2], title="Zyxolite annual report")
    write_scanned_pdf(docs / "scan.pdf")
    (docs / "corrupt.pdf").write_bytes(random.Random(0).randbytes(4096))
    (docs / "truncated.pdf").write_bytes((docs / "report.pdf").read_bytes()[:400])
    (docs / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (docs / "empty.md").write_bytes(b"")
    (docs / "huge.txt").write_text("many words here. " * 150_000)  # 2.6 MB: over --max-mb 1
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    (docs / ".DS_Store").write_bytes(b"\x00\x01")
    (docs / "passages.jsonl").write_text(
        '{"id": "faq-1", "title": "FAQ", "text": "Refunds take five days."}\n'
        '{"id": "faq-2", "contents": "\\"FAQ\\"\\nShipping is free over fifty euros."}\n')
    (outside / "secret.txt").write_text("Nothing from here may be read.")
    (docs / "escape.txt").symlink_to(outside / "secret.txt")
    (more / "notes.txt").write_text("A different file with the same relative path.")
    return {"docs": docs, "more": more, "outside": outside}


def rows(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_a_mixed_folder_gives_passages_with_titles_headings_sources_and_a_report(
        folders: dict[str, Path], tmp_path: Path) -> None:
    docs, more = folders["docs"], folders["more"]
    out = tmp_path / "var" / "corpora" / "mine.jsonl"
    report = ingest(IngestOptions(paths=(docs, more), out=out, max_mb=1, show_progress=False, root=docs))
    reasons = {Path(s.path).relative_to(tmp_path).as_posix(): (s.kind, s.reason) for s in report.skipped}
    assert reasons["more/notes.txt"][1].startswith(f"outside the root {docs} (document ids are paths inside it)")
    report = ingest(IngestOptions(paths=(docs, more), out=out, max_mb=1, show_progress=False, root=tmp_path))

    passages = rows(out)
    by_doc: dict[str, list[dict[str, Any]]] = {}
    for row in passages:
        by_doc.setdefault(row["doc_id"].removeprefix("docs/"), []).append(row)
    assert list(by_doc) == ["guide/setup.md", "notes.txt", "page.html", "faq-1", "faq-2", "report.pdf",
                            "more/notes.txt"]
    for doc_rows in by_doc.values():
        doc_id = doc_rows[0]["doc_id"]
        if "#" in doc_rows[0]["id"]:
            assert [r["id"] for r in doc_rows] == [f"{doc_id}#{n}" for n in range(len(doc_rows))]
            assert [r["position"] for r in doc_rows] == list(range(len(doc_rows)))
            assert {r["source"] for r in doc_rows} == {doc_id}

    setup = by_doc["guide/setup.md"]
    assert {r["title"] for r in setup} == {"Setup guide"}  # the first heading
    assert [(r["headings"], r["text"]) for r in setup] == [
        (["Setup guide"], "Read this first. It explains the layout."),
        (["Setup guide", "Install"], "Download the archive. Unpack it into a folder of your choice."),
        (["Setup guide", "Install", "On Linux"], "run make install add the folder to your PATH"),
        (["Setup guide", "Configure"], "Edit the settings file before the first start."),
    ]
    assert by_doc["notes.txt"] == [{
        "id": "docs/notes.txt#0", "title": "notes", "text": " ".join(NOTES.split()), "doc_id": "docs/notes.txt",
        "headings": [], "source": "docs/notes.txt", "position": 0}]  # no title in a text file: its name

    page = by_doc["page.html"]
    assert {r["title"] for r in page} == {"Field notes"}
    assert [(r["headings"], r["text"]) for r in page] == [
        (["Birds"], "Herons wade in shallow water. They eat fish."),
        (["Birds", "Nesting"], "Herons nest in colonies."),
        (["Birds", "Nesting", "Eggs"], "Three to five eggs are laid."),
        (["Birds", "Migration"], "Some herons migrate south in autumn."),
    ]
    assert not any(w in r["text"] for r in page for w in ("scriptword", "color", "comment"))

    pdf = by_doc["report.pdf"]
    assert [(r["title"], r["headings"], r["page"]) for r in pdf] == [("Zyxolite annual report", [], 1)]
    assert pdf[0]["text"] == f"{PDF_PAGE_1} {PDF_PAGE_2}"  # one passage: the pages' 31 words fit in one

    assert [(r["id"], r["title"], r["text"], r["source"]) for r in by_doc["faq-1"] + by_doc["faq-2"]] == [
        ("faq-1", "FAQ", "Refunds take five days.", "docs/passages.jsonl"),
        ("faq-2", "FAQ", "Shipping is free over fifty euros.", "docs/passages.jsonl")]

    reasons = {Path(s.path).relative_to(tmp_path).as_posix(): (s.kind, s.reason) for s in report.skipped}
    assert reasons.keys() == {"docs/.DS_Store", "docs/binary.txt", "docs/corrupt.pdf", "docs/empty.md",
                              "docs/escape.txt", "docs/huge.txt", "docs/image.png", "docs/scan.pdf",
                              "docs/truncated.pdf"}
    assert reasons["docs/scan.pdf"] == ("error", NO_TEXT_LAYER)
    assert reasons["docs/corrupt.pdf"][1].startswith("not a PDF: no %PDF- header")
    assert reasons["docs/truncated.pdf"][1].startswith("not a readable PDF")
    assert reasons["docs/binary.txt"][1] == "not a text file: binary data (NUL bytes)"
    assert reasons["docs/empty.md"][1] == "empty file"
    assert reasons["docs/huge.txt"][1] == "too large: 2.4 MB, over the limit of 1 MB (--max-mb)"
    assert reasons["docs/escape.txt"][1].startswith("outside the allowed folders")
    assert reasons["docs/image.png"][0] == reasons["docs/.DS_Store"][0] == "ignored"
    assert reasons["docs/image.png"][1].startswith("unknown extension '.png'")
    assert "Nothing from here" not in out.read_text()

    assert (report.files, report.documents, report.passages) == (6, 7, len(passages))
    assert (len(report.errors), len(report.skipped)) == (7, 9)
    written = orjson.loads((tmp_path / "var" / "corpora" / "mine.report.json").read_bytes())
    assert written == orjson.loads(orjson.dumps(report.to_json()))
    assert written["formats"] == {"html": 1, "jsonl": 1, "markdown": 1, "pdf": 1, "text": 2}

    corpus = Corpus.load(out)  # the retriever's own reader takes the extra fields
    assert corpus.ids == [r["id"] for r in passages]
    assert corpus.titles[corpus.ids.index("docs/report.pdf#0")] == "Zyxolite annual report"


def test_the_command_writes_var_corpora_name_the_same_bytes_twice_and_bm25_finds_the_pdf(
        folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    var = tmp_path / "var"
    argv = ["ingest", str(folders["docs"]), "--corpus", "mine", "--var-dir", str(var), "--max-mb", "1", "--quiet",
            "--root", str(folders["docs"])]
    outputs = []
    for _ in range(2):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 1  # written, some files refused
        outputs.append(((var / "corpora" / "mine.jsonl").read_bytes(),
                        (var / "corpora" / "mine.report.json").read_bytes()))
    assert outputs[0] == outputs[1]
    assert sorted(p.name for p in (var / "corpora").iterdir()) == ["mine.jsonl", "mine.report.json"]  # no tmp
    err = capsys.readouterr().err
    assert "ingested 5 files (6 documents) as" in err and f"{folders['docs'] / 'scan.pdf'}: {NO_TEXT_LAYER}" in err

    settings = RetrieverSettings(corpus=var / "corpora" / "mine.jsonl", index_dir=tmp_path / "indexes")
    build(settings, bm25=["bm25s"], dense=False, force=False, show_progress=False)
    hits = Bm25sRetriever(settings.index_dir / "bm25s").batch_search(["zyxolite shipment"], 3)
    corpus = Corpus.load(settings.corpus)
    assert corpus.ids[int(hits.ids[0, 0])] == "report.pdf#0"


def test_a_refused_corpus_name_and_a_batch_with_nothing_to_ingest(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["ingest", str(tmp_path), "--corpus", "../elsewhere", "--var-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "not a path" in capsys.readouterr().err

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("   \n\n  ")
    out = tmp_path / "c.jsonl"
    out.write_text("kept\n")
    with pytest.raises(IngestError, match="no passage to write") as raised:
        ingest(IngestOptions(paths=(tmp_path / "in", tmp_path / "missing"), out=out, show_progress=False,
                             root=tmp_path))
    assert raised.value.report is not None
    assert [s.reason for s in raised.value.report.skipped] == ["no such file or folder", "empty document: no text"]
    assert out.read_text() == "kept\n"  # left as it was
    assert orjson.loads((tmp_path / "c.report.json").read_bytes())["written"] is False


def test_allowed_folders_jsonl_checks_and_ids_taken_twice(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x.txt").write_text("First file. It is allowed.")
    (a / "bad.jsonl").write_text('{"id": "p1", "text": "ok"}\n{"id": "p1", "text": "again"}\n')
    (a / "row.jsonl").write_text('{"id": "p2", "text": "ok"}\n{"title": "no id"}\n')
    (a / "clash.jsonl").write_text('{"id": "y#0", "doc_id": "x.txt", "text": "Claims the text file\'s id."}\n')
    (b / "y.txt").write_text("Outside the allowed folder.")
    report = ingest(IngestOptions(paths=(a, b), out=tmp_path / "c.jsonl", allow=(a,), show_progress=False, root=a))
    reasons = {Path(s.path).name: s.reason for s in report.skipped}
    assert reasons["bad.jsonl"] == "line 2: passage id 'p1' is used again (first at line 1)"
    assert reasons["row.jsonl"].endswith(":2: missing 'id'")
    assert reasons["b"].startswith("outside the allowed folders")
    assert reasons["x.txt"].startswith("duplicate document id 'x.txt': already taken by")  # clash.jsonl came first
    assert [r["id"] for r in rows(tmp_path / "c.jsonl")] == ["y#0"]


def test_titles_encodings_and_content_that_is_not_what_its_extension_says() -> None:
    markdown = b'---\ntitle: "From front matter"\ntags: [a]\n---\n# Heading\n\nBody text.\n'
    assert read_document("markdown", markdown, "file").title == "From front matter"
    assert read_document("markdown", b"No heading at all.\n", "file").title == "file"
    html = read_document("html", b'<?xml version="1.0"?><html><body><h1>First h1</h1><p>x</p></body></html>', "f")
    assert html.title == "First h1" and html.sections[0].headings == ("First h1",)
    latin = read_document("text", "Un caf\u00e9 cr\u00e8me co\u00fbte trois euros.".encode("cp1252"), "f")
    assert latin.sections[0].blocks[0].text == "Un caf\u00e9 cr\u00e8me co\u00fbte trois euros."
    utf16 = read_document("text", "Texte en UTF-16, avec BOM.".encode("utf-16"), "f")
    assert utf16.sections[0].blocks[0].text == "Texte en UTF-16, avec BOM."
    sniff("text", "Texte".encode("utf-16"))  # NUL bytes after a byte order mark are text
    with pytest.raises(SkipFile, match="not a HTML file: it is a ZIP archive"):
        sniff("html", b"PK\x03\x04" + bytes(20))
    with pytest.raises(SkipFile, match="not a PDF: no %PDF- header \\(it looks like text\\)"):
        sniff("pdf", b"just some text")


def test_each_format_is_one_entry_and_a_new_one_needs_nothing_else(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension picks the entry, the entry's signature and label check the first bytes, its reader reads: a
    format added as one entry (here comma-separated values, one paragraph per row) is ingested like the others."""
    assert [(f.name, f.extensions) for f in FORMATS.values()] == [
        ("text", (".txt", ".text")), ("markdown", (".md", ".markdown")), ("html", (".html", ".htm", ".xhtml")),
        ("pdf", (".pdf",)), ("jsonl", (".jsonl",))]
    assert [f.name for f in FORMATS.values() if f.is_corpus] == ["jsonl"]
    assert formats.format_of(Path("Guide.MD")) == "markdown" and formats.format_of(Path("a.docx")) is None
    with pytest.raises(SkipFile, match=r"unknown extension '.csv' \(ingested: .htm, .html, .jsonl, .markdown"):
        kind_of("table.csv")

    def read_csv(data: bytes, name: str) -> ParsedDocument:
        rows = [Block(", ".join(line.split(","))) for line in data.decode().splitlines() if line.strip()]
        return ParsedDocument(title=name, sections=[Section((), rows)])

    monkeypatch.setitem(FORMATS, "csv", Format("csv", "CSV", (".csv",), read=read_csv))
    kind, passages = read_data("tables/prices.csv", b"Tea,3 euros.\nCoffee,2 euros.\n", doc_id="prices",
                               words=100, max_bytes=1000)
    assert kind == "csv" and [(p.id, p.title, p.text, p.source) for p in passages] == [
        ("prices#0", "prices", "Tea, 3 euros. Coffee, 2 euros.", "tables/prices.csv")]
    with pytest.raises(SkipFile, match="not a CSV file: it is gzip data"):
        read_data("x.csv", b"\x1f\x8b rest", doc_id="x", words=100, max_bytes=1000)
    (tmp_path / "prices.csv").write_text("Tea,3 euros.\n")
    report = ingest(IngestOptions(paths=(tmp_path / "prices.csv",), out=tmp_path / "c.jsonl", show_progress=False,
                                  root=tmp_path, workers=0))  # read here: the format was added in this process
    assert report.formats == {"csv": 1} and report.passages == 1


def test_passages_pack_sentences_cut_long_ones_merge_a_short_tail_and_never_cross_sections() -> None:
    def sentence(n: int, word: str = "w") -> str:
        return " ".join([word] * (n - 1) + ["end."])

    units = [Piece(sentence(n), n) for n in (40, 40, 30, 10)]
    assert [p.words for p in pack(units, 100)] == [80, 40]  # 80 + 30 > 100; the 10-word tail stays (40 >= 20)
    assert [p.words for p in pack([Piece(sentence(60), 60), Piece(sentence(50), 50), Piece(sentence(15), 15)],
                                  100)] == [60, 65]  # a last passage under 20 words joins the one before
    assert [p.words for p in pack([Piece(sentence(320), 320)], 100)] == [100, 100, 100, 20]  # > 150: cut in 100s
    assert [p.words for p in pack([Piece(sentence(140), 140)], 100)] == [140]  # within 1.5x: kept whole
    document = ParsedDocument("T", [Section(("A",), [Block(sentence(30)), Block(sentence(5))]),
                              Section(("A", "B"), [Block(sentence(5))])])
    passages = cut(document, doc_id="d", source="d", words=100)
    assert [(p.id, p.headings, len(p.text.split())) for p in passages] == [("d#0", ("A",), 35),
                                                                          ("d#1", ("A", "B"), 5)]
    assert cut(document, doc_id="d", source="d", words=100) == passages


def test_cutting_matches_the_shared_domain_corpora_builder(data_dir: Path) -> None:
    """The same passages as ../shared/data/domain/build_domain_sets.py's chunk_document on the same blocks."""
    reference = runpy.run_path(str(data_dir / "domain" / "build_domain_sets.py"))
    rng = random.Random(7)
    vocabulary = ["river", "Stone", "a", "the", "42", "Valley", "rain", "and"]
    for _ in range(200):
        groups = []
        for _ in range(rng.randint(1, 3)):
            blocks = []
            for _ in range(rng.randint(1, 4)):
                count = rng.choice([1, 2, 3, 5, 12, 25, 60, 110, 160, 340])
                blocks.append(" ".join(
                    " ".join(rng.choice(vocabulary) for _ in range(rng.randint(1, count))).capitalize() + "."
                    for _ in range(rng.randint(1, 6))))
            groups.append(blocks)
        document = ParsedDocument("t", [Section((str(i),), [Block(b) for b in blocks]) for i, blocks in enumerate(groups)])
        assert [p.text for p in cut(document, doc_id="d", source="d")] == reference["chunk_document"](groups)
