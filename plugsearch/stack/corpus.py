"""The stack's corpus: `--corpus`, else the shared combined corpus, else FlashRAG's public sample downloaded once
into `var/corpus/`; and the folder its indexes live in, keyed by the corpus's content."""

from __future__ import annotations

import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from plugsearch.common.files import atomic_path
from plugsearch.stack import StackError

SAMPLE_URL = ("https://raw.githubusercontent.com/RUC-NLPIR/FlashRAG/adb2a8bc285042abf7c0c56ff004283f62318c5a/"
              "examples/quick_start/indexes/sample_data.jsonl")
"""FlashRAG's quick-start sample of the DPR Wikipedia dump (1,000 passages, `{"id", "contents"}`, MIT)."""
SAMPLE_NAME = "flashrag_wiki_sample.jsonl"


def check_first_passage(path: Path) -> None:
    """A corpus the retriever can index, judged on its first passage by the retriever's own row rule
    (`plugsearch.retriever.store.corpus.parse_line`: an id, and `title`+`text` or `contents`), before the stack
    starts anything; every row is read again when the index is built."""
    from plugsearch.retriever.store.corpus import CorpusError, corpus_lines, parse_line

    try:
        for lineno, line in corpus_lines(path):
            parse_line(line, lineno, path)
            return
    except CorpusError as exc:
        if isinstance(exc.__cause__, OSError):  # the file, not its rows: no advice on the row format
            raise StackError(str(exc)) from exc
        raise StackError(f"{exc}: each line needs an `id` and `title`+`text` or `contents` field") from exc
    raise StackError(f"{path}: the corpus holds no passage")


def download_sample(dest: Path, url: str = SAMPLE_URL, *, timeout_s: float = 60.0,
                    log: Callable[[str], None] = print) -> Path:
    """Download the public sample corpus once (atomically) and check it looks like a corpus."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"no local corpus: downloading a public sample corpus (FlashRAG wiki sample, ~0.7 MB)\n"
        f"  from {url}\n  to   {dest}\n  (pass --corpus PATH to index your own JSONL instead)")
    try:
        with atomic_path(dest) as tmp:  # published only once whole and checked
            with urllib.request.urlopen(url, timeout=timeout_s) as response, tmp.open("wb") as out:  # noqa: S310
                shutil.copyfileobj(response, out)
            check_first_passage(tmp)
    except (urllib.error.URLError, OSError, StackError) as exc:
        raise StackError(f"could not download the sample corpus from {url}: {exc}; "
                         "pass --corpus PATH to a local JSONL corpus") from exc
    return dest


def resolve_corpus(corpus: Path | None, *, data_dir: Path, var_dir: Path, download: bool = True,
                   log: Callable[[str], None] = print) -> Path:
    """`--corpus`, else the shared combined corpus, else the downloaded public sample."""
    if corpus is not None:
        if not corpus.is_file():
            raise StackError(f"--corpus {corpus} is not a file")
        check_first_passage(corpus)
        return corpus.resolve()
    shared = data_dir / "corpus" / "combined.jsonl"
    if shared.is_file():
        return shared.resolve()
    sample = var_dir / "corpus" / SAMPLE_NAME
    if not sample.is_file() and not download:
        raise StackError(f"no corpus at {shared} and downloads are off; pass --corpus PATH")
    return download_sample(sample, log=log).resolve()


def index_dir_for(corpus: Path, var_dir: Path) -> Path:
    """Indexes are keyed by the corpus's content: `var/indexes/<stem>-<sha256 prefix>`."""
    from plugsearch.retriever.store.corpus import file_checksum

    digest = file_checksum(corpus).split(":", 1)[-1]
    return (var_dir / "indexes" / f"{corpus.stem}-{digest[:12]}").resolve()
