"""The retriever's tests and benches: tiny real corpora and cached tiny indexes.

Tiny corpora are subsets of ../shared/data written to a scratch folder (never into the repository);
indexes built from them are cached under var/ keyed by corpus checksum + encoder (the index folders'
manifests), so a second test run reuses them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from plugsearch.retriever.indexing.build import build
from plugsearch.retriever.settings import RetrieverSettings

TINY_SOURCES = (("nq_gold.jsonl", 120), ("hotpotqa.jsonl", 100), ("popqa.jsonl", 80))


def write_tiny_corpus(data_dir: Path, out: Path, *, contents_format: bool = False) -> Path:
    """~300 real passages (first rows of three corpus files), as title/text or FlashRAG `contents`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as dst:
        for name, n in TINY_SOURCES:
            with (data_dir / "corpus" / name).open() as src:
                for i, line in enumerate(src):
                    if i >= n:
                        break
                    row = json.loads(line)
                    if contents_format:
                        row = {"id": row["id"], "contents": f'"{row["title"]}"\n{row["text"]}'}
                    dst.write(json.dumps(row, ensure_ascii=False) + "\n")
    return out


def cached_index_dir(var_dir: Path, corpus: Path, tag: str = "") -> Path:
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()[:16]
    return var_dir / "cache" / "retriever-tests" / f"{digest}{tag}"


def tiny_settings(corpus: Path, index_dir: Path, **overrides: Any) -> RetrieverSettings:
    base: dict[str, Any] = {"corpus": corpus, "index_dir": index_dir, "bm25": True, "dense": True,
                            "default_method": "bm25"}
    base.update(overrides)
    return RetrieverSettings(**base)


def tiny_bm25s(data_dir: Path, var_dir: Path, folder: Path) -> tuple[Path, Path]:
    """The tiny corpus written in `folder` and its cached bm25s index: (corpus, index folder)."""
    corpus = write_tiny_corpus(data_dir, folder / "tiny.jsonl")
    index_dir = cached_index_dir(var_dir, corpus)
    ensure_tiny_indexes(tiny_settings(corpus, index_dir, dense=False), bm25=["bm25s"], dense=False)
    return corpus, index_dir


def ensure_tiny_indexes(settings: RetrieverSettings, *, bm25: list[str], dense: bool) -> list[str]:
    """Build what is missing (bm25s: ~1 s; MiniLM over ~300 passages: ~10-30 s on 2 cores, then cached)."""
    return build(settings, bm25=bm25, dense=dense, force=False, chunk_size=128, show_progress=False)
