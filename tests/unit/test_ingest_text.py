"""What text goes in: one normalisation for readers and queries (plugsearch/common/text.py `normalize`), HTML's main
text only (no sidebar, breadcrumbs, footers or permalink marks; code blocks kept as lines), PDF text without
running headers, footers and page numbers and with its title, generated sites' furniture files left out, and
document ids for any file name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fpdf import FPDF
from hypothesis import given, settings
from hypothesis import strategies as st

from plugsearch.common.text import normalize, vocabulary, ws
from plugsearch.retriever.ingest.formats import SkipFile, read_document, remove_running_lines
from plugsearch.retriever.ingest.passages import cut
from plugsearch.retriever.ingest.run import Skipped, document_id, walk

# ------------------------------------------------------------------------------------------------ normalize


def test_ligatures_soft_hyphens_controls_and_broken_words_become_the_words_people_type() -> None:
    assert normalize("the speci\ufb01cation of the coe\ufb03cient, \ufb02ow") == \
        "the specification of the coefficient, flow"
    assert normalize("a soft\u00adhyphen, zero\u200bwidth, \ufeffmark, bell\x07 and NUL\x00") == \
        "a softhyphen, zerowidth, mark, bell and NUL"
    assert normalize("the envi-\nronment and the environment") == "the environment and the environment"
    assert normalize("Win\ufffedows and Windows") == "Windows and Windows"  # PDFium's hyphenation mark
    assert normalize("a command-\nline tool") == "a command-line tool"  # 'commandline' is no word of the text
    assert normalize("envi-\nronment", vocabulary(["the environment"])) == "environment"  # the document's words
    assert normalize("full\uff37idth \u00bd caf\u00e9\u00a0noir") == "fullWidth 1\u20442 caf\u00e9 noir"
    assert normalize("lone \ud800 surrogate") == "lone surrogate"
    assert normalize("a\r\nb\rc\fd\u2028e") == "a\nb\nc\nd\ne"


def test_lines_and_indentation_stay_spaces_and_blank_lines_shrink() -> None:
    code = "def f(x):\n    return  x\t+ 1   \n\n\n\nprint(f(2))\n"
    assert normalize(code) == "def f(x):\n    return x + 1\n\nprint(f(2))"
    assert ws(normalize(" a  b \n c ")) == "a b c"


def test_an_ascii_query_is_only_whitespace_normalised() -> None:
    """What the retriever does to every query: plain ASCII text is left as it is but for its spaces, so the queries
    the searcher and the pinned compact policy send are searched exactly as before."""
    for query in ("who wrote the novel the call of the wild", "Robert A. Stemmle (1903-1974)", "x-y: 'a'?"):
        assert normalize(query) == query
    assert normalize("  two   spaces ") == "  two spaces"  # leading indentation is a code line's


TEXT = st.text(alphabet=st.sampled_from(list("ab -\n\t\r\x00\x07\u00ad\u200b\ufb01\ufb03\ufffe\u00a0\u00e9\ud800"
                                             "\uff21\u2028")), max_size=40)


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_normalize_is_idempotent(text: str) -> None:
    once = normalize(text)
    assert normalize(once) == once
    assert "\x00" not in once and "\ufffe" not in once and not any(0xD800 <= ord(c) <= 0xDFFF for c in once)


# --------------------------------------------------------------------------------------------------------- HTML

SPHINX_PAGE = """<!DOCTYPE html><html><head><title>graphlib — Graph structures — Python 3.11 documentation</title>
</head><body>
<div class="related" role="navigation" aria-label="related navigation"><h3>Navigation</h3><ul>
<li class="right"><a href="genindex.html">index</a></li><li><a href="index.html">Python</a> &#187;</li>
<li class="nav-item">The Python Standard Library &#187;</li></ul></div>
<div class="document"><div class="documentwrapper"><div class="bodywrapper">
<div class="body" role="main">
<section id="graphlib"><h1>graphlib — Functionality to operate with graph-like structures<a class="headerlink"
 href="#graphlib" title="Permalink to this headline">¶</a></h1>
<p>The graphlib module provides a topological sorter for a graph of hashable nodes.</p>
<div class="highlight-python3 notranslate"><div class="highlight"><pre><span></span>&gt;&gt;&gt; graph = {"D": {"B", "C"}}
&gt;&gt;&gt; ts = TopologicalSorter(graph)
&gt;&gt;&gt; tuple(ts.static_order())
</pre></div></div>
<section id="exceptions"><h2>Exceptions<a class="headerlink" href="#exceptions">¶</a></h2>
<p>A CycleError is raised when the graph has a cycle.</p>
<aside class="footnote brackets" id="id2"><p>Footnotes are kept: they are text.</p></aside>
</section></section></div></div></div>
<div class="sphinxsidebar" role="navigation"><h3>Previous topic</h3><p>functools</p><h3>This Page</h3>
<ul class="this-page-menu"><li>Report a Bug</li><li>Show Source</li></ul>
<div id="searchbox"><h3>Quick search</h3><form><input type="text"/></form></div></div></div>
<div class="footer">&copy; Copyright 2001-2023, Python Software Foundation. Created using Sphinx 5.3.0.</div>
</body></html>"""


def test_a_sphinx_page_gives_its_main_text_code_lines_and_headings_without_furniture_or_marks() -> None:
    doc = read_document("html", SPHINX_PAGE.encode(), "graphlib")
    passages = cut(doc, doc_id="library/graphlib.html", source="library/graphlib.html")
    text = "\n".join(p.text for p in passages)
    for furniture in ("Navigation", "Previous topic", "Report a Bug", "Show Source", "Quick search", "Copyright",
                      "Python Software Foundation", "»", "¶", "This Page"):
        assert furniture not in text, furniture
    assert [p.headings for p in passages] == [
        ("graphlib — Functionality to operate with graph-like structures",),
        ("graphlib — Functionality to operate with graph-like structures", "Exceptions")]
    assert passages[0].text == ("The graphlib module provides a topological sorter for a graph of hashable nodes.\n"
                                '>>> graph = {"D": {"B", "C"}}\n>>> ts = TopologicalSorter(graph)\n'
                                ">>> tuple(ts.static_order())")  # code lines stay lines
    assert passages[1].text == "A CycleError is raised when the graph has a cycle. Footnotes are kept: they are text."
    assert doc.title == "graphlib — Graph structures — Python 3.11 documentation"


def test_a_page_without_a_main_element_loses_its_navigation_panels_by_name() -> None:
    page = b"""<html><body><div class="navheader"><a>Prev</a> <a>Up</a> <a>Next</a></div>
    <h1>Valgrind core</h1><p>Valgrind runs programs on a synthetic CPU.</p>
    <div class="navfooter"><table><tr><td>Prev</td><td>Home</td></tr></table></div>
    <div class="toc"><p>1. Introduction 2. Options</p></div><nav><a>Site map</a></nav><footer>2023</footer>
    <button>copy</button></body></html>"""
    doc = read_document("html", page, "core")
    assert [(s.headings, [b.text for b in s.blocks]) for s in doc.sections] == [
        (("Valgrind core",), ["Valgrind runs programs on a synthetic CPU."])]


def test_redirect_stubs_and_navigation_only_pages_are_ignored_with_their_reason() -> None:
    stub = b'<html><head><meta http-equiv="refresh" content="0; url=../dev-guide/themes/"></head><body>' \
           b'<p>Redirecting...</p></body></html>'
    with pytest.raises(SkipFile, match=r"a redirect page \(to ../dev-guide/themes/\)") as refused:
        read_document("html", stub, "custom-themes")
    assert refused.value.ignored
    nav_only = b'<html><body><div class="toc"><ul><li>1. The GNU GPL</li></ul></div></body></html>'
    with pytest.raises(SkipFile, match="no main text") as refused:
        read_document("html", nav_only, "licenses")
    assert refused.value.ignored


def test_markdown_fences_are_code_lines_and_ligatures_in_any_format_are_letters() -> None:
    doc = read_document("markdown", "# Build\n\nRun the \ufb01rst step:\n\n```sh\nmake\nmake install\n```\n".encode(),
                        "build")
    passages = cut(doc, doc_id="build.md", source="build.md")
    assert [p.text for p in passages] == ["Run the first step:\nmake\nmake install"]


# ---------------------------------------------------------------------------------------------------------- PDF

def write_manual(path: Path, *, title_in_metadata: bool) -> None:
    """Five pages, each with a running header ("Zorblat Manual" and the page number, on either side) and a page
    number at the foot; a title in a large font on page 1; a word broken at a line end."""
    pdf = FPDF()
    pdf.set_auto_page_break(False)
    if title_in_metadata:
        pdf.set_title("Zorblat Reference (metadata)")
    for n in range(1, 6):
        pdf.add_page()
        pdf.set_font("Helvetica", size=9)
        pdf.cell(0, 6, f"{n} Zorblat Manual" if n % 2 == 0 else f"Zorblat Manual {n}", new_x="LMARGIN",
                 new_y="NEXT")
        if n == 1:
            pdf.set_font("Helvetica", size=24)
            pdf.cell(0, 14, "The Zorblat Handbook", new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("Helvetica", size=11)
        topic = ["oil", "gas", "coal", "wind", "sun"][n - 1]
        pdf.multi_cell(0, 6, f"The {topic} chapter explains the environment of the zorblat engine. The envi-\n"
                             f"ronment matters to every {topic} operator.\n{'Gears turn. ' * n}\nThe engine runs "
                             f"on {topic}.")
        pdf.set_y(-20)
        pdf.set_font("Helvetica", size=9)
        pdf.cell(0, 6, str(n), align="C")
    pdf.output(str(path))


def test_pdf_running_headers_and_page_numbers_go_broken_words_join_and_the_title_is_the_largest_text(
        tmp_path: Path) -> None:
    write_manual(tmp_path / "manual.pdf", title_in_metadata=False)
    doc = read_document("pdf", (tmp_path / "manual.pdf").read_bytes(), "manual")
    assert doc.title == "The Zorblat Handbook"  # no metadata title: page 1's largest text, not "manual"
    pages = [b.text for s in doc.sections for b in s.blocks]
    assert len(pages) == 5
    assert not any("Zorblat Manual" in page for page in pages)
    assert all("environment matters" in page and "envi-" not in page for page in pages)
    assert not any(line.strip().isdigit() for page in pages for line in page.split("\n"))
    write_manual(tmp_path / "titled.pdf", title_in_metadata=True)
    assert read_document("pdf", (tmp_path / "titled.pdf").read_bytes(), "titled").title == \
        "Zorblat Reference (metadata)"


def test_running_lines_are_the_repeated_top_and_bottom_lines_not_repeated_content() -> None:
    topics = ["tables", "joins", "indexes", "views", "triggers", "locks"]
    body = "About {t}.\nThe same sentence on every page.\nMore on {t} here.\nThe {t} end."
    pages = [f"Guide 5.4 {n}\n{body.format(t=topics[n - 1])}\n{n}" if n % 2 else
             f"{n} Guide 5.4\n{body.format(t=topics[n - 1])}\nPage {n} of 6" for n in range(1, 7)]
    kept, removed = remove_running_lines(pages)
    assert removed == 12  # the running header (its number on either side) and the page numbers, nothing else
    assert kept[0] == "About tables.\nThe same sentence on every page.\nMore on tables here.\nThe tables end."
    two = ["Title page\nOnly text.", "Second page\nMore text."]
    assert remove_running_lines(two) == (two, 0)  # two pages: nothing repeats often enough


# ------------------------------------------------------------------------------------------- folders and ids

def test_a_generated_sites_furniture_files_are_ignored_with_their_reason(tmp_path: Path) -> None:
    site = tmp_path / "site"
    for name in ("_sources", "_static", "api"):
        (site / name).mkdir(parents=True)
    (site / "objects.inv").write_bytes(b"# Sphinx inventory")
    (site / "_sources" / "index.rst.txt").write_text("Index\n=====\n")
    (site / "_static" / "notes.txt").write_text("theme notes")
    for name in ("genindex.html", "genindex-A.html", "search.html", "py-modindex.html", "404.html", "index.html"):
        (site / name).write_text("<html><body><p>x</p></body></html>")
    (site / "api" / "search.html").write_text("<html><body><p>A page named search, below the top.</p></body></html>")
    found = list(walk((site,), [site.resolve()], tmp_path))
    files = sorted(f.rel for f in found if not isinstance(f, Skipped))
    assert files == ["site/api/search.html", "site/index.html", "site/objects.inv"]
    ignored = {Path(s.path).name: s.reason for s in found if isinstance(s, Skipped)}
    assert ignored.keys() == {"_sources", "_static", "genindex.html", "genindex-A.html", "search.html",
                              "py-modindex.html", "404.html"}
    assert ignored["_sources"].startswith("Sphinx's copies of the pages' sources, written by the site's generator")


def test_document_ids_are_paths_inside_the_root_for_any_name_a_file_system_allows(tmp_path: Path) -> None:
    root = tmp_path / "root"
    folder = root / "My notes"
    folder.mkdir(parents=True)
    names = {"été 2024.txt": "My notes/été 2024.txt", "line\nbreak.txt": "My notes/line%0Abreak.txt",
             "100%.txt": "My notes/100%25.txt", "tab\there.txt": "My notes/tab%09here.txt"}
    for name, expected in names.items():
        (folder / name).write_text("x")
        assert document_id(folder / name, root) == expected
    raw = os.fsdecode(b"caf\xe9-latin1.txt")  # not UTF-8: the file system keeps the byte
    (folder / raw).write_text("x")
    assert document_id(folder / raw, root) == "My notes/caf%E9-latin1.txt"
    (root / "#hash.txt").write_text("x")
    assert document_id(root / "#hash.txt", root) == "%23hash.txt"
    assert document_id(folder / "été 2024.txt", folder) == "été 2024.txt"
    assert document_id(Path("My notes") / "été 2024.txt", Path(".")) == "My notes/été 2024.txt"
    with pytest.raises(SkipFile, match="outside the root"):
        document_id(tmp_path / "elsewhere.txt", root)
