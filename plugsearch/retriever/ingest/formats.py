"""What a file is and what it says: each format read by the library made for it into a `ParsedDocument`.

Each format is one entry of `FORMATS` (its name, label, extensions, the signature its files start with, and its
reader): the extension picks the entry, `sniff` checks the file's first bytes against it, its reader reads it. A
new format is a reader function and one entry.

A `ParsedDocument` is a title and its sections in order; a section is the heading path it sits under (`("Guide",
"Install")`, empty before the first heading and where the format has none) and its blocks of text (paragraphs,
list items, table rows, a PDF page), each a sentence boundary. Readers:

- plain text (`.txt`, `.text`): UTF-8, else the encoding charset-normalizer detects (a tie between code pages
  goes to cp1252); paragraphs split at blank lines; title = the file name (without its extension).
- Markdown (`.md`, `.markdown`): markdown-it-py (CommonMark + tables); headings give the heading path, title =
  a front matter `title:`, else the first heading, else the file name. Code blocks are kept as text; HTML blocks
  are read as HTML.
- HTML (`.html`, `.htm`, `.xhtml`): BeautifulSoup with the standard library's parser (the encoding from the file's
  declaration, else detected), main text only (`main_element`, `strip_furniture`): the page's main element (the
  first of `MAIN_SELECTORS` found, else `<body>`) without its furniture (navigation, footers, forms, buttons, a
  header without a heading, elements whose class is a furniture name: sidebar, breadcrumbs, related, headerlink,
  toc, ...); scripts, styles, templates, `<head>` and SVG dropped; h1..h6 give the heading path; `<pre>` kept as a
  code block (its lines stay lines); permalink marks (the pilcrow, private-use icon glyphs) removed; title =
  `<title>`, else the first `<h1>`, else the file name. A redirect page (`<meta http-equiv="refresh">` and next
  to no text) is ignored.
- PDF (`.pdf`): PDFium's text layer (pypdfium2; one call at a time per process: `plugsearch.retriever.ingest.pool`
  runs readers in worker processes), a block per page (`Block.page`); a line repeated at the top or bottom of most
  pages (a running header or footer, with its page number) and a line that is only a page number are removed;
  title = the PDF's metadata title, else the first page's text in its largest font, else the file name; no
  heading path. No text on any page: skipped as scanned.

Every reader's text goes through `plugsearch.common.text.normalize` (NFKC, ligatures, soft hyphens, control
characters, words broken at a line end joined where the document knows the joined word, whitespace), with the
document's own words, so a word in a file is found by the word a person types.
- JSONL passages (`.jsonl`, the corpus format the retriever reads): every row checked as the retriever loads it
  and passed through (`read_jsonl`); one bad row skips the file.

Before any of that, `sniff` checks the first bytes against the extension: a format with a signature (PDF: `%PDF-`)
must have it; a text format must not start with a known binary signature or hold NUL bytes (UTF-16/32 with a byte
order mark excepted).
"""

from __future__ import annotations

import re
import threading
import unicodedata
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePath

import orjson
import regex
from bs4 import BeautifulSoup, MarkupResemblesLocatorWarning, XMLParsedAsHTMLWarning
from bs4.element import NavigableString, PreformattedString, Tag
from charset_normalizer import from_bytes
from markdown_it import MarkdownIt
from markdown_it.token import Token

from plugsearch.common.text import normalize, vocabulary, ws
from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.store.corpus import CorpusError, parse_line

NO_TEXT_LAYER = "no text layer (scanned? OCR it first)"

_OTHER_SIGNATURES: tuple[tuple[bytes, str], ...] = (  # files no reader takes, recognised to refuse them by name
    (b"PK\x03\x04", "a ZIP archive (docx, xlsx, epub, ...)"),
    (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1", "an old Office document"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"), (b"GIF89a", "a GIF image"),
    (b"\x1f\x8b", "gzip data"),
    (b"\x7fELF", "an executable"),
)
_UNICODE_BOMS = (b"\xff\xfe", b"\xfe\xff", b"\x00\x00\xfe\xff")


class SkipFile(Exception):
    """The file is not ingested; the message says why (it goes into the report). `ignored`: not an error (an
    extension no reader takes, a hidden file)."""

    def __init__(self, reason: str, *, ignored: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.ignored = ignored


@dataclass(frozen=True)
class Block:
    """A run of text that ends a sentence where it ends (a paragraph, list item, table row, PDF page); `code`: a
    code block, whose lines stay lines (never cut into sentences)."""

    text: str
    page: int | None = None
    code: bool = False


@dataclass
class Section:
    headings: tuple[str, ...]
    blocks: list[Block] = field(default_factory=list)


@dataclass
class ParsedDocument:
    """A file as its reader understood it: its title and its sections in order."""

    title: str
    sections: list[Section]


def format_of(path: PurePath) -> str | None:
    """The format an extension asks for (a `FORMATS` name: `text`, `markdown`, ...); None for any other."""
    suffix = path.suffix.lower()
    return next((f.name for f in FORMATS.values() if suffix in f.extensions), None)


def extensions() -> list[str]:
    """Every extension a reader takes, sorted."""
    return sorted(extension for f in FORMATS.values() for extension in f.extensions)


def _magic(head: bytes) -> str | None:
    signatures = [(f.signature, f.looks) for f in FORMATS.values() if f.signature is not None] + list(_OTHER_SIGNATURES)
    return next((what for magic, what in signatures if head.startswith(magic)), None)


def sniff(kind: str, head: bytes) -> None:
    """Refuse a file whose first bytes say it is not what its extension says."""
    entry = FORMATS[kind]
    if entry.signature is not None:  # a format with a signature: within the first KiB, as readers allow
        if entry.signature not in head[:1024]:
            looks = _magic(head) or ("binary data" if b"\x00" in head else "text")
            raise SkipFile(f"not a {entry.label}: no {entry.signature.decode()} header (it looks like {looks})")
        return
    if (what := _magic(head)) is not None:
        raise SkipFile(f"not a {entry.label} file: it is {what}")
    if b"\x00" in head and not head.startswith(_UNICODE_BOMS):
        raise SkipFile(f"not a {entry.label} file: binary data (NUL bytes)")


def decode_text(data: bytes, label: str) -> str:
    """UTF-8 (with or without a byte order mark), else the encoding charset-normalizer finds; text that decodes
    into control characters is binary."""
    text: str | None = None
    if not data.startswith(_UNICODE_BOMS):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = None
    if text is None:
        matches = from_bytes(data)
        best = matches.best()
        if best is None:
            raise SkipFile(f"not a {label} file: no character encoding fits its bytes")
        # single-byte code pages often fit equally well (cp1250 and cp1252 read French alike to it): a tie goes to
        # Windows' Western code page, the commonest legacy encoding
        tied = [m for m in matches if (m.chaos, m.coherence) == (best.chaos, best.coherence)]
        text = str(next((m for m in tied if "cp1252" in m.could_be_from_charset), best))
    sample = text[:65536]
    controls = sum(1 for c in sample if unicodedata.category(c) == "Cc" and c not in "\t\n\r\f\v")
    if controls > max(2, len(sample) // 100):
        raise SkipFile(f"not a {label} file: binary data ({controls} control characters in its first "
                       f"{len(sample):,} characters)")
    return text


class _Outline:
    """Sections as headings arrive: a heading of level L closes every open heading of level >= L. Blocks are kept as
    read; `document` normalises them all with the document's own words (`plugsearch.common.text.normalize`)."""

    def __init__(self) -> None:
        self.open: list[tuple[int, str]] = []
        self.sections = [Section(())]
        self.first_heading = ""

    def heading(self, level: int, text: str) -> None:
        text = ws(normalize(text))
        if not text:
            return
        while self.open and self.open[-1][0] >= level:
            self.open.pop()
        self.open.append((level, text))
        self.first_heading = self.first_heading or text
        self.sections.append(Section(tuple(t for _, t in self.open)))

    def add(self, text: str, page: int | None = None, *, code: bool = False) -> None:
        if text.strip():
            self.sections[-1].blocks.append(Block(text, page, code))

    def document(self, title: str) -> ParsedDocument:
        words = vocabulary(b.text for s in self.sections for b in s.blocks)
        sections = []
        for section in self.sections:
            blocks = [Block(text, b.page, b.code) for b in section.blocks
                      if (text := normalize(b.text, words)).strip()]
            if blocks:
                sections.append(Section(section.headings, blocks))
        return ParsedDocument(title=ws(normalize(title)), sections=sections)


# ---------------------------------------------------------------------------------------------------- plain text

def read_text(data: bytes, name: str) -> ParsedDocument:
    outline = _Outline()
    for paragraph in re.split(r"\n[ \t\f\v]*\n", decode_text(data, "text").replace("\r\n", "\n")):
        outline.add(paragraph)
    return outline.document(name)


# ------------------------------------------------------------------------------------------------------ Markdown

_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n(.*?)\r?\n(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.S)
_FRONT_TITLE = re.compile(r"^title:[ \t]*(.+?)[ \t]*$", re.M)
_MD_FLUSH = {"paragraph_close", "tr_close", "list_item_close", "blockquote_close", "hr"}


def _inline_text(children: list[Token] | None) -> str:
    parts = []
    for child in children or []:
        if child.type in ("text", "code_inline", "image"):  # an image's content is its alt text
            parts.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            parts.append(" ")
    return "".join(parts)


def read_markdown(data: bytes, name: str) -> ParsedDocument:
    text = decode_text(data, "Markdown")
    title = ""
    if front := _FRONT_MATTER.match(text):  # YAML front matter: its title, the rest is not text
        if found := _FRONT_TITLE.search(front.group(1)):
            title = found.group(1).strip("'\"")
        text = text[front.end():]
    tokens = MarkdownIt("commonmark", {"html": True}).enable("table").parse(text)
    outline = _Outline()
    buffer: list[str] = []

    def flush() -> None:
        outline.add(" ".join(buffer))
        buffer.clear()

    heading_level = 0
    for token in tokens:
        if token.type == "heading_open":
            flush()
            heading_level = int(token.tag[1:])
        elif token.type == "heading_close":
            heading_level = 0
        elif token.type == "inline" and heading_level:
            outline.heading(heading_level, _inline_text(token.children))
        elif token.type == "inline":
            buffer.append(_inline_text(token.children))
        elif token.type in ("fence", "code_block"):
            flush()
            outline.add(token.content.strip("\n"), code=True)
        elif token.type == "html_block":
            flush()
            for block in _html_blocks(_soup(token.content.encode()), _Outline()).sections:
                for piece in block.blocks:
                    outline.add(piece.text, code=piece.code)
        elif token.type in _MD_FLUSH:
            flush()
    flush()
    return outline.document(title or outline.first_heading or name)


# ---------------------------------------------------------------------------------------------------------- HTML

_HTML_DROP = {"script", "style", "noscript", "template", "head", "title", "svg", "math", "iframe", "object",
              "canvas"}
_HTML_HEADINGS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5, "h6": 6}
_HTML_BLOCKS = {"address", "article", "aside", "blockquote", "body", "br", "caption", "dd", "details", "dialog",
                "div", "dl", "dt", "fieldset", "figcaption", "figure", "footer", "form", "header", "hr", "li",
                "main", "nav", "ol", "p", "pre", "section", "summary", "table", "tbody", "tfoot", "thead", "tr",
                "ul"}
_HTML_CELLS = {"td", "th"}


def _soup(data: bytes) -> BeautifulSoup:
    with warnings.catch_warnings():  # a page that reads like a URL or is XHTML: parsed as it is, on purpose
        warnings.simplefilter("ignore", MarkupResemblesLocatorWarning)
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        return BeautifulSoup(data, "html.parser")


MAIN_SELECTORS = ("[role=main]", "[itemprop=articleBody]", "div.body", "article", "main", "div#content",
                  "div.content", "div.document")
"""Where a page's main text is, first found first (Sphinx's `div.body` / `[role=main]`, MkDocs' `[role=main]` and
`article`, most sites' `<main>`); none: `<body>`, whose furniture is then removed by name alone."""
FURNITURE_CLASS = re.compile(r"(sphinx|md-|wy-|bs-)?(sidebar|related|breadcrumbs?|footer|headerlink|navbar|navheader|"
                             r"navfooter|nav|navigation|skip-?link|prev-?next|searchbox|search|toc)(-.*)?", re.I)
"""A class token (matched whole: never a substring of an id, which Sphinx makes of headings) that names page
furniture."""
FURNITURE_IDS = frozenset({"sidebar", "related", "breadcrumbs", "breadcrumb", "footer", "navigation", "nav",
                           "searchbox", "toc", "skip-link"})
_FURNITURE_TAGS = {"nav", "footer", "form", "button", "input", "select"}  # <aside> stays: docutils' footnotes
_FURNITURE_HOLDERS = {"div", "span", "a", "p", "ul", "section", "table", "td", "li", "aside"}
_MARKS = re.compile("[\u00b6\ue000-\uf8ff]")
"""Permalink marks: the pilcrow (Sphinx) and private-use glyphs (icon fonts: MkDocs' U+F0C1)."""


def main_element(soup: BeautifulSoup) -> Tag:
    """The page's main element: the largest match of the first of `MAIN_SELECTORS` found, else `<body>`."""
    body = soup.body or soup
    for selector in MAIN_SELECTORS:
        if found := body.select(selector):
            return max(found, key=lambda t: len(t.get_text()))
    return body


def strip_furniture(root: Tag) -> None:
    """Remove navigation, footers, forms, buttons, a header without a heading, and every element whose class
    token or id names page furniture (`FURNITURE_CLASS`, `FURNITURE_IDS`)."""
    for tag in list(root.find_all(True)):
        if tag.decomposed:
            continue
        classes: list[str] = list(tag.get("class") or [])
        if tag.name in _FURNITURE_TAGS or (tag.name == "table" and "nav" in classes) \
                or (tag.name == "header" and tag.find(list(_HTML_HEADINGS)) is None) \
                or (tag.name in _FURNITURE_HOLDERS and (any(FURNITURE_CLASS.fullmatch(c) for c in classes)
                                                        or str(tag.get("id") or "").lower() in FURNITURE_IDS)):
            tag.decompose()


def _unmarked(text: str) -> str:
    return _MARKS.sub(" ", text)


def _html_blocks(root: Tag, outline: _Outline) -> _Outline:
    """Walk the tree in document order (iteratively: deep nesting is no recursion), a block at each block-level
    element, a section at each heading, a code block at each `<pre>` (its lines kept)."""
    buffer: list[str] = []

    def flush() -> None:
        outline.add(_unmarked("".join(buffer)))
        buffer.clear()

    stack: list[tuple[Iterator[object], bool]] = [(iter(root.children), False)]
    while stack:
        children, is_block = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            if is_block:
                flush()
        elif isinstance(child, NavigableString):
            if not isinstance(child, PreformattedString):  # comments, CDATA, doctype, processing instructions
                buffer.append(str(child))
        elif isinstance(child, Tag) and child.name not in _HTML_DROP:
            if child.name in _HTML_HEADINGS:
                flush()
                outline.heading(_HTML_HEADINGS[child.name], _unmarked(child.get_text(" ")))
                continue
            if child.name == "pre":
                flush()
                outline.add(child.get_text().strip("\n"), code=True)
                continue
            block = child.name in _HTML_BLOCKS
            if block:
                flush()
            elif child.name in _HTML_CELLS:
                buffer.append(" ")
            stack.append((iter(child.children), block))
    flush()
    return outline


REDIRECT_MAX_WORDS = 40
"""A page with a `<meta http-equiv="refresh">` and at most this many words is a redirect stub (MkDocs writes one
per moved page), not a document."""


def _redirect(soup: BeautifulSoup) -> str | None:
    """Where a redirect stub sends the reader (None: not a stub)."""
    meta = soup.find("meta", attrs={"http-equiv": re.compile("^refresh$", re.I)})
    if not isinstance(meta, Tag):
        return None
    body = soup.body or soup
    if len(body.get_text(" ").split()) > REDIRECT_MAX_WORDS:
        return None
    content = str(meta.get("content") or "")
    return content.partition("url=")[2].strip(" '\"") or content.partition("URL=")[2].strip(" '\"") or "?"


def read_html(data: bytes, name: str) -> ParsedDocument:
    if not data.startswith(_UNICODE_BOMS):
        decode_text(data[:65536], "HTML")  # binary data refused before it is parsed
    soup = _soup(data)
    if (target := _redirect(soup)) is not None:
        raise SkipFile(f"a redirect page (to {target[:200]}), no document", ignored=True)
    title = soup.title.get_text(" ") if soup.title is not None else ""
    if not ws(_unmarked(title)) and (h1 := soup.find("h1")) is not None:
        title = h1.get_text(" ")
    root = main_element(soup)
    had_text = bool(root.get_text().strip())
    strip_furniture(root)
    outline = _html_blocks(root, _Outline())
    title = ws(_unmarked(title))
    document = outline.document(title if title else name)
    if not document.sections and had_text:
        raise SkipFile("no main text: the page holds only navigation (a table of contents, links)", ignored=True)
    return document


# ----------------------------------------------------------------------------------------------------------- PDF

_PDFIUM = threading.Lock()
"""PDFium is not thread-safe: one call at a time in a process (the service and `ingest` read files in worker
processes, `plugsearch.retriever.ingest.pool`; this lock keeps threads of one process apart all the same)."""
_ROMAN = r"(?=[ivxlcdm])m{0,3}(?:cm|cd|d?c{0,3})(?:xc|xl|l?x{0,3})(?:ix|iv|v?i{0,3})"
_PAGE_NUMBER = re.compile(rf"(?:page\s*)?(?:\d+|{_ROMAN})(?:\s*(?:/|of)\s*\d+)?", re.I)
"""A line that is only a page number: `12`, `xiv`, `3 / 92`, `Page 3 of 40`."""
_KEY_ENDS = re.compile(rf"^(?:#|{_ROMAN})\s+|\s+(?:#|{_ROMAN})$")
EDGE_LINES = 2
"""Lines at the top and at the bottom of each page that may be a running header or footer."""
EDGE_MAX_WORDS = 20
"""A longer line is text, never a running header or footer."""
REPEATED_SHARE = 0.5
"""A top or bottom line is a running header or footer when its key (lowercased, digits as #, a page number at
either end dropped: even and odd pages put it on opposite sides) is on at least this share of the pages, and on 3."""


def _edge_key(line: str) -> str:
    """What a running line is recognised by: lowercased, digit runs `#`, a page number at either end dropped."""
    return _KEY_ENDS.sub("", re.sub(r"\d+", "#", ws(line).lower()))


def remove_running_lines(pages: list[str]) -> tuple[list[str], int]:
    """Each page without its running header and footer lines and its page-number lines (module docstring);
    returns the pages and how many lines were removed."""
    edges: list[list[int]] = []
    counts: Counter[str] = Counter()
    page_lines = [page.split("\n") for page in pages]
    for lines in page_lines:
        filled = [i for i, line in enumerate(lines) if line.strip()]
        candidates = sorted(i for i in set(filled[:EDGE_LINES] + filled[-EDGE_LINES:])
                            if len(lines[i].split()) <= EDGE_MAX_WORDS)
        edges.append(candidates)
        counts.update({_edge_key(lines[i]) for i in candidates})
    threshold = max(3, REPEATED_SHARE * len(pages))
    removed = 0
    out = []
    for lines, candidates in zip(page_lines, edges, strict=True):
        drop = {i for i in candidates if _PAGE_NUMBER.fullmatch(ws(lines[i]))
                or (len(pages) >= 3 and (key := _edge_key(lines[i])) and counts[key] >= threshold)}
        removed += len(drop)
        out.append("\n".join(line for i, line in enumerate(lines) if i not in drop))
    return out, removed


TITLE_MAX_WORDS, TITLE_MAX_CHARS, TITLE_SIZE_TOLERANCE = 15, 120, 0.6


def _largest_text(lines: list[tuple[float, str]]) -> str:
    """The first run of consecutive lines set in the page's largest font (letters required; a line repeated for a
    shadow effect once), capped at `TITLE_MAX_WORDS` words and `TITLE_MAX_CHARS` characters (else its first
    line)."""
    lettered = [(size, text) for size, text in lines if re.search(r"[^\W\d_]{2}", text)]
    if not lettered:
        return ""
    top = max(size for size, _ in lettered)
    run: list[str] = []
    for size, text in lines:
        if size >= top - TITLE_SIZE_TOLERANCE and text.strip():
            if text.strip() not in run:
                run.append(text.strip())
        elif run and text.strip():
            break
    title = ws(" ".join(run))
    if len(title.split()) > TITLE_MAX_WORDS or len(title) > TITLE_MAX_CHARS:
        first = ws(run[0])
        title = first if len(first) <= TITLE_MAX_CHARS else first[:TITLE_MAX_CHARS].rsplit(" ", 1)[0]
    return title


def _sized_lines(textpage: object, text: str) -> list[tuple[float, str]]:
    """The page's lines (PDFium's line breaks), each with its largest glyph's font size."""
    import pypdfium2.raw as pdfium_c

    raw = textpage.raw  # type: ignore[attr-defined]
    lines: list[tuple[float, str]] = []
    current: list[str] = []
    size = 0.0
    for i in range(min(len(text), textpage.count_chars())):  # type: ignore[attr-defined]
        ch = text[i]
        if ch in "\r\n":
            if current:
                lines.append((size, "".join(current)))
            current, size = [], 0.0
            continue
        current.append(ch)
        if not ch.isspace():
            size = max(size, round(float(pdfium_c.FPDFText_GetFontSize(raw, i)), 1))
    if current:
        lines.append((size, "".join(current)))
    return lines


_PAGE_END_BREAK = regex.compile(r"\p{L}(?:-|\ufffe)\s*$")
_PAGE_START_WORD = regex.compile(r"\s*(\p{L}+)")
_DOT_LEADERS = re.compile(r"(?:[ \t]*\.){4,}")


def _across_pages(pages: list[str]) -> list[str]:
    """A word broken at the end of a page brought back whole (its second half moved up: `normalize` then joins
    it or keeps the hyphen), and a table of contents' dot leaders one space."""
    pages = [_DOT_LEADERS.sub(" ", page) for page in pages]
    for i in range(len(pages) - 1):
        if _PAGE_END_BREAK.search(pages[i]) and (m := _PAGE_START_WORD.match(pages[i + 1])):
            pages[i] = pages[i].rstrip() + "\n" + m[1]
            pages[i + 1] = pages[i + 1][m.end():]
    return pages


def read_pdf(data: bytes, name: str) -> ParsedDocument:
    import pypdfium2 as pdfium

    pages: list[str] = []
    with _PDFIUM:
        try:
            document = pdfium.PdfDocument(data)
        except pdfium.PdfiumError as exc:
            if "password" in str(exc).lower():
                raise SkipFile("an encrypted PDF (it needs a password): decrypt it first") from exc
            raise SkipFile(f"not a readable PDF: {exc}") from exc
        try:
            if len(document) == 0:
                raise SkipFile("empty document: a PDF without pages")
            first: list[tuple[float, str]] = []
            for number in range(len(document)):
                page = document[number]
                textpage = page.get_textpage()
                try:
                    text = textpage.get_text_range()
                    if number == 0:
                        first = _sized_lines(textpage, text)
                finally:
                    textpage.close()
                    page.close()
                pages.append(text.replace("\r\n", "\n").replace("\r", "\n"))
            metadata = ws(normalize(str(document.get_metadata_value("Title") or "")))
        except pdfium.PdfiumError as exc:
            raise SkipFile(f"not a readable PDF: {exc}") from exc
        finally:
            document.close()
    pages = _across_pages(remove_running_lines(pages)[0])
    outline = _Outline()
    for number, text in enumerate(pages, start=1):
        outline.add(text, page=number)
    document_read = outline.document(name)
    if not document_read.sections:
        raise SkipFile(NO_TEXT_LAYER)
    document_read.title = metadata or ws(normalize(_largest_text(first))) or document_read.title
    return document_read


def read_document(kind: str, data: bytes, name: str) -> ParsedDocument:
    """`data` (the whole file) as a document of format `kind`; `name`: the title when the document has none."""
    read = FORMATS[kind].read
    if read is None:
        raise ValueError(f"{kind} files are read as passages (read_passages), not as a document")
    return read(data, name)


# --------------------------------------------------------------------------------------------- JSONL passages

def read_jsonl(data: bytes, source: str) -> list[Passage]:
    """A corpus file's rows as passages, each checked as the retriever loads it (`corpus.parse_line`): `id`, and
    `title` + `text` or `contents`; `doc_id`, `headings`, `source`, `position`, `page` kept where a row has them
    (a corpus written by `ingest`), else the row is its own document (`doc_id` = `id`, position 0) from this
    file. A bad row skips the whole file, naming its line."""
    passages: list[Passage] = []
    first_line: dict[str, int] = {}
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            passage_id, title, text = parse_line(line, lineno, Path(source))
        except CorpusError as exc:
            raise SkipFile(f"bad row: {exc}") from exc
        if passage_id in first_line:
            raise SkipFile(f"line {lineno}: passage id {passage_id!r} is used again (first at line "
                           f"{first_line[passage_id]})")
        first_line[passage_id] = lineno
        if not text.strip():
            raise SkipFile(f"line {lineno}: passage {passage_id!r} has no text")
        row = orjson.loads(line)
        doc_id, headings = row.get("doc_id", passage_id), row.get("headings", [])
        row_source, position, page = row.get("source", source), row.get("position", 0), row.get("page")
        if not isinstance(doc_id, str) or not doc_id or not isinstance(row_source, str) \
                or not isinstance(headings, list) or not all(isinstance(h, str) for h in headings) \
                or not isinstance(position, int) or isinstance(position, bool) or position < 0 \
                or not (page is None or (isinstance(page, int) and not isinstance(page, bool))):
            raise SkipFile(f"line {lineno}: doc_id and source must be strings, headings a list of strings, "
                           "position an integer >= 0, page an integer")
        passages.append(Passage(id=passage_id, title=title, text=text, doc_id=doc_id, headings=tuple(headings),
                                source=row_source, position=position, page=page))
    if not passages:
        raise SkipFile("empty document: no rows")
    return passages


# ------------------------------------------------------------------------------------------------- the formats

@dataclass(frozen=True)
class Format:
    """One format a file may be in: `name` (what reports and the API call it), `label` (how messages name it), the
    extensions that ask for it, the `signature` its files start with (None: a text format, refused when it starts
    with a known binary signature) and how a file with that signature is named (`looks`), and its reader: `read`
    into a `ParsedDocument` that is then cut into passages, or, for a corpus format whose rows are passages
    already (each naming its document), `read_passages`."""

    name: str
    label: str
    extensions: tuple[str, ...]
    read: Callable[[bytes, str], ParsedDocument] | None = None
    read_passages: Callable[[bytes, str], list[Passage]] | None = None
    signature: bytes | None = None
    looks: str = ""

    @property
    def is_corpus(self) -> bool:
        """Its rows are passages that name their own documents (a file of it is no single document)."""
        return self.read_passages is not None


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("text", "text", (".txt", ".text"), read=read_text),
    Format("markdown", "Markdown", (".md", ".markdown"), read=read_markdown),
    Format("html", "HTML", (".html", ".htm", ".xhtml"), read=read_html),
    Format("pdf", "PDF", (".pdf",), read=read_pdf, signature=b"%PDF-", looks="a PDF"),
    Format("jsonl", "JSONL", (".jsonl",), read_passages=read_jsonl),
)}
