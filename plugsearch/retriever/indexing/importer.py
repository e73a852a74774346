"""Adopt indexes built elsewhere (pyserini / Anserini Lucene, Search-R1 / FlashRAG FAISS) without rebuilding.

`plugsearch-index import lucene DIR` / `import faiss FILE` check that the artefact belongs to the corpus
(the checks: docs/integrations.md, "Bring your indexes"; a failed one is named), then write the index folder
and manifest `plugsearch-index build` writes (`<index_dir>/pyserini/`, `<index_dir>/dense-<type>/`), the
artefact linked (default) or copied in. The corpus is streamed (count, checksum, sampled rows), never held
in memory.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import orjson

from plugsearch.common.files import atomic_writer
from plugsearch.retriever.backends.faiss_index import dense_folder
from plugsearch.retriever.encoders.encoder import Encoder, encoder_identity
from plugsearch.retriever.settings import EncoderSettings, IndexType
from plugsearch.retriever.store.corpus import (
    CorpusError,
    corpus_lines,
    file_checksum,
    indexed_text,
    parse_line,
)
from plugsearch.retriever.store.manifest import (
    IndexMismatch,
    IndexMissing,
    Manifest,
    index_folder,
)

logger = logging.getLogger(__name__)

LinkMode = Literal["symlink", "copy"]
PassageText = Literal["auto", "contents", "title-text"]

# FAISS classes this service can serve, and the index type (folder `dense-<type>`) each becomes
FAISS_FILE_TYPES: dict[str, IndexType] = {
    "IndexFlatIP": "flat", "IndexFlat": "flat", "IndexHNSWFlat": "hnsw", "IndexScalarQuantizer": "sq8",
    "IndexIVFPQ": "ivfpq",
}


class ImportRefused(IndexMismatch):
    """The artefact does not match the corpus or the settings; the message says which check failed."""


@dataclass(frozen=True)
class CorpusSample:
    """What one streamed pass over the corpus gives: size, checksum and the rows asked for."""

    doc_count: int
    checksum: str
    rows: dict[int, bytes]  # position -> the raw JSON line
    ids_found: set[str]  # the asked ids that occur in the corpus


def evenly_spaced(n: int, count: int) -> list[int]:
    """`count` positions spread over [0, n), first and last included."""
    if count >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})


def count_documents(path: Path) -> int:
    """Non-blank lines of a JSONL corpus (what `Corpus.load` counts), without parsing them."""
    return sum(1 for _ in corpus_lines(path))


def sample_corpus(path: Path, positions: Iterable[int] = (), ids: Iterable[str] = ()) -> CorpusSample:
    """One streamed pass: count documents, collect the rows at `positions` and which of `ids` occur."""
    wanted = set(positions)
    looking = set(ids)
    rows: dict[int, bytes] = {}
    found: set[str] = set()
    n = 0
    for lineno, line in corpus_lines(path):
        if n in wanted:
            rows[n] = line
        if looking:
            doc_id, _, _ = parse_line(line, lineno, path)
            if doc_id in looking:
                found.add(doc_id)
        n += 1
    if n == 0:
        raise CorpusError(f"{path}: no documents")
    return CorpusSample(n, file_checksum(path), rows, found)


def passage_for_encoding(line: bytes, lineno: int, path: Path, how: PassageText) -> str:
    """The text an index builder encoded for this row.

    `contents`: FlashRAG / Search-R1 encode the `contents` string as it is (`"Title"\\ntext`);
    `title-text`: this project's builds encode `Title\\ntext`; `auto`: `contents` where the row has it.
    """
    row = orjson.loads(line)
    if how in ("auto", "contents") and isinstance(row, dict) and isinstance(row.get("contents"), str):
        return str(row["contents"])
    if how == "contents":
        raise CorpusError(f"{path}:{lineno}: --passage-text contents, but the row has no 'contents' field")
    _, title, text = parse_line(line, lineno, path)
    return indexed_text(title, text)


def _place(source: Path, target: Path, how: LinkMode) -> None:
    if how == "symlink":
        os.symlink(source.resolve(), target, target_is_directory=source.is_dir())
    elif source.is_dir():
        shutil.copytree(source, target)
    else:
        shutil.copy2(source, target)


def _faiss_type(index: Any) -> tuple[IndexType, str]:
    import faiss

    inner = faiss.downcast_index(index)
    name = type(inner).__name__
    if name not in FAISS_FILE_TYPES:
        raise ImportRefused(f"FAISS index class {name} is not served here (supported: "
                            f"{', '.join(sorted(FAISS_FILE_TYPES))})")
    if inner.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ImportRefused(f"the FAISS index uses metric {inner.metric_type} (L2 = 1); this service ranks by "
                            "inner product (Search-R1 and FlashRAG build METRIC_INNER_PRODUCT indexes)")
    return FAISS_FILE_TYPES[name], name


def _read_faiss(path: Path) -> Any:
    import faiss

    if not path.is_file():
        raise IndexMissing(f"no FAISS index file at {path}")
    try:  # memory-mapped where the index type allows it: a 60 GB flat index is not read into RAM to check it
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
    except RuntimeError:
        return faiss.read_index(str(path))


def _stored_cosines(index: Any, positions: Sequence[int], vectors: Any) -> Any:
    """Cosine of each re-encoded passage with the vector the index stores for it; None when the index
    cannot give its vectors back (IVF-PQ without a direct map)."""
    try:
        stored = np.stack([np.asarray(index.reconstruct(int(p)), dtype=np.float32) for p in positions])
    except RuntimeError:
        return None
    norms = np.linalg.norm(stored, axis=1) * np.linalg.norm(vectors, axis=1)
    return np.sum(stored * vectors, axis=1) / np.maximum(norms, 1e-12)


def import_faiss(index_file: Path, corpus: Path, index_dir: Path, encoder: EncoderSettings, *,
                 passage_text: PassageText = "auto", sample: int = 32, min_self_hits: float | None = None,
                 min_cosine: float = 0.99, link: LinkMode = "symlink",
                 loaded_encoder: Encoder | None = None) -> Manifest:
    """Check a FAISS index file against `corpus` and `encoder`, then write `<index_dir>/dense-<type>/`.

    `min_self_hits`: share of sampled passages that must come back as their own nearest neighbour
    (default: all of them for exact flat indexes, 80% for approximate ones). `min_cosine`: the least
    cosine between a re-encoded passage and the vector the index stores for it (where it keeps them).
    """
    t0 = time.perf_counter()
    index = _read_faiss(index_file)
    index_type, faiss_class = _faiss_type(index)
    n_vectors, dims = int(index.ntotal), int(index.d)
    n_docs = count_documents(corpus)
    if n_vectors != n_docs:
        raise ImportRefused(f"{index_file} holds {n_vectors} vectors, corpus {corpus} has {n_docs} documents: "
                            "row i of the index must be line i of the corpus it was built from")
    positions = evenly_spaced(n_docs, sample)
    found = sample_corpus(corpus, positions)
    if found.doc_count != n_docs:
        raise CorpusError(f"{corpus} changed while it was read")
    texts = [passage_for_encoding(found.rows[p], p + 1, corpus, passage_text) for p in positions]
    model = loaded_encoder or Encoder(encoder)
    if model.dims != dims:
        raise ImportRefused(f"encoder {encoder.name} gives {model.dims}-d vectors, {index_file} holds {dims}-d: "
                            "pass the encoder the index was built with (--encoder)")
    vectors = model.encode_passages(texts)
    depth = min(n_docs, 10)
    scores, ids = index.search(vectors, depth)
    misses = []
    for row, position in enumerate(positions):
        # a hit: the passage's own row is ranked first, or ties with the first (duplicate passages)
        own = np.flatnonzero(ids[row] == position)
        if not (own.size and scores[row, own[0]] >= scores[row, 0] - 1e-4):
            misses.append((position, int(ids[row, 0]), float(scores[row, 0])))
    hit_rate = 1 - len(misses) / max(1, len(positions))
    needed = min_self_hits if min_self_hits is not None else (1.0 if index_type == "flat" else 0.8)
    described = (f"encoder {encoder.name!r} (pooling {encoder.pooling}, passage prefix {encoder.passage_prefix!r}, "
                 f"normalize {encoder.normalize}, max_seq_length {encoder.max_seq_length}, passage text "
                 f"{passage_text})")
    hint = ("The encoder settings or the passage text form differ from those the index was built with, or "
            "the corpus is not the one (in the same order) it was built from.")
    if hit_rate < needed:
        shown = "; ".join(f"passage {p} -> nearest {q} (score {s:.3f})" for p, q, s in misses[:5])
        raise ImportRefused(f"{len(misses)} of {len(positions)} sampled passages re-encoded with {described} are "
                            f"not their own nearest neighbour in {index_file} ({shown}). {hint}")
    # A nearest-neighbour hit is a weak test on a small corpus (even another pooling can find its own
    # passage); where the index keeps its vectors, the re-encoded passage must point the same way as the
    # stored one. Right settings give 1.0 (0.999+ for an index encoded on GPU in fp16).
    cosines = _stored_cosines(index, positions, vectors)
    worst = float(cosines.min()) if cosines is not None else None
    if worst is not None and worst < min_cosine:
        p_worst = positions[int(np.argmin(cosines))]  # type: ignore[arg-type]
        raise ImportRefused(f"sampled passages re-encoded with {described} differ from the vectors stored in "
                            f"{index_file}: cosine down to {worst:.4f} (passage {p_worst}; at least {min_cosine} "
                            f"expected). {hint}")
    out = dense_folder(index_dir, index_type)
    with index_folder(out) as tmp:
        name = index_file.name
        _place(index_file, tmp / name, link)
        manifest = Manifest(
            kind="dense", backend="faiss", corpus_path=str(corpus), corpus_checksum=found.checksum,
            doc_count=n_docs, encoder=encoder.name, encoder_config=encoder_identity(encoder), dims=dims,
            index_type=index_type, files=[name], build_seconds=round(time.perf_counter() - t0, 3),
            params={"imported_from": str(index_file.resolve()), "link": link, "faiss_class": faiss_class,
                    "metric": "inner_product", "query_prefix": encoder.query_prefix,
                    "passage_text": passage_text, "sampled": len(positions), "self_hit_rate": round(hit_rate, 4),
                    "min_cosine": None if worst is None else round(worst, 5)})
        manifest.write(tmp)
    logger.info("imported FAISS %s index %s (%s vectors, %s of %s sampled passages found themselves) into %s",
                index_type, index_file, n_vectors, len(positions) - len(misses), len(positions), out)
    return manifest


def _open_lucene(folder: Path) -> Any:
    from plugsearch.retriever.backends.pyserini_index import setup_java

    if not folder.is_dir():
        raise IndexMissing(f"no Lucene index folder at {folder}")
    setup_java()
    from pyserini.search.lucene import LuceneSearcher

    try:
        return LuceneSearcher(str(folder))
    except Exception as exc:  # a Java exception: not a Lucene index, or another Lucene version
        raise IndexMissing(f"{folder} is not a readable Lucene index: {exc}") from exc


def export_lucene_corpus(searcher: Any, out: Path) -> int:
    """Write the index's stored raw documents as a JSONL corpus (index order); returns the count."""
    n = int(searcher.num_docs)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(out) as fh:
        for i in range(n):
            doc = searcher.doc(i)
            raw = doc.raw() if doc is not None else None
            if raw is None:
                raise ImportRefused(f"Lucene document {i} has no stored raw text: pass the corpus file")
            row = orjson.loads(raw)
            if not isinstance(row, dict) or ("id" not in row and "docid" not in row):
                row = {"id": doc.docid(), "contents": raw}
            fh.write(orjson.dumps(row) + b"\n")
    return n


def _same_text(raw: str, corpus_line: bytes, where: Path) -> bool:
    try:
        _, title, text = parse_line(raw.encode(), 0, where)
    except CorpusError:
        return True  # raw documents in another format (not JSON): nothing to compare
    _, c_title, c_text = parse_line(corpus_line, 0, where)
    return " ".join(f"{title} {text}".split()) == " ".join(f"{c_title} {c_text}".split())


def import_lucene(source: Path, corpus: Path, index_dir: Path, *, sample: int = 200,
                  link: LinkMode = "symlink") -> Manifest:
    """Check a pyserini / Anserini Lucene index against `corpus` (written from the index's raw documents
    when the file does not exist yet), then write `<index_dir>/pyserini/`."""
    t0 = time.perf_counter()
    searcher = _open_lucene(source)
    try:
        n_index = int(searcher.num_docs)
        if n_index == 0:
            raise ImportRefused(f"the Lucene index {source} holds no documents")
        first = searcher.doc(0)
        has_raw = first is not None and first.raw() is not None
        if not corpus.exists():
            if not has_raw:
                raise ImportRefused(f"corpus {corpus} does not exist and {source} stores no raw documents "
                                    "(built without -storeRaw): pass the JSONL corpus the index was built from")
            logger.info("writing the corpus %s from the %s raw documents of %s", corpus, n_index, source)
            export_lucene_corpus(searcher, corpus)
        internal = evenly_spaced(n_index, sample)
        index_docs = {i: searcher.doc(i) for i in internal}
        index_ids = {i: d.docid() for i, d in index_docs.items() if d is not None}
        n_docs = count_documents(corpus)
        if n_docs != n_index:
            raise ImportRefused(f"{source} holds {n_index} documents, corpus {corpus} has {n_docs}")
        positions = evenly_spaced(n_docs, sample)
        found = sample_corpus(corpus, positions, ids=index_ids.values())
        missing = sorted(set(index_ids.values()) - found.ids_found)
        if missing:
            raise ImportRefused(f"{len(missing)} of {len(index_ids)} sampled Lucene document ids are not in "
                                f"{corpus} (e.g. {missing[:3]}): the index was built from another corpus")
        corpus_ids = {p: parse_line(found.rows[p], p + 1, corpus)[0] for p in positions}
        absent = [doc_id for doc_id in corpus_ids.values() if searcher.doc(doc_id) is None]
        if absent:
            raise ImportRefused(f"{len(absent)} of {len(corpus_ids)} sampled corpus ids are not in {source} "
                                f"(e.g. {absent[:3]}): the index was built from another corpus")
        if has_raw:
            differ = [doc_id for p, doc_id in corpus_ids.items()
                      if not _same_text(searcher.doc(doc_id).raw(), found.rows[p], corpus)]
            if differ:
                raise ImportRefused(f"{len(differ)} of {len(corpus_ids)} sampled documents have another text in "
                                    f"{source} than in {corpus} (e.g. {differ[:3]})")
    finally:
        searcher.close()
    out = index_dir / "pyserini"
    with index_folder(out) as tmp:
        _place(source, tmp / "lucene", link)
        manifest = Manifest(
            kind="bm25", backend="pyserini", corpus_path=str(corpus), corpus_checksum=found.checksum,
            doc_count=n_docs, files=["lucene"], build_seconds=round(time.perf_counter() - t0, 3),
            params={"analyzer": "lucene-default-english", "imported_from": str(source.resolve()), "link": link,
                    "raw_documents": has_raw, "sampled": len(positions)})
        manifest.write(tmp)
    logger.info("imported Lucene index %s (%s documents, raw documents %s) into %s", source, n_docs,
                "stored" if has_raw else "absent", out)
    return manifest


def serve_env(corpus: Path, index_dir: Path, manifests: Sequence[Manifest],
              encoder: EncoderSettings | None = None) -> dict[str, str]:
    """The RETRIEVER_* variables that serve what was imported (printed by the command)."""
    kinds = {m.kind for m in manifests}
    env = {"RETRIEVER_CORPUS": str(corpus), "RETRIEVER_INDEX_DIR": str(index_dir),
           "RETRIEVER_BM25": str("bm25" in kinds).lower(), "RETRIEVER_DENSE": str("dense" in kinds).lower()}
    if "bm25" in kinds:
        env["RETRIEVER_BM25_BACKEND"] = "pyserini"
    dense = [m for m in manifests if m.kind == "dense"]
    if dense and encoder is not None:
        env["RETRIEVER_DEFAULT_METHOD"] = "dense" if "bm25" not in kinds else "hybrid"
        env["RETRIEVER_FAISS__INDEX_TYPE"] = str(dense[0].index_type)
        env.update({"RETRIEVER_ENCODER__NAME": encoder.name, "RETRIEVER_ENCODER__POOLING": encoder.pooling,
                    "RETRIEVER_ENCODER__QUERY_PREFIX": encoder.query_prefix,
                    "RETRIEVER_ENCODER__PASSAGE_PREFIX": encoder.passage_prefix,
                    "RETRIEVER_ENCODER__NORMALIZE": str(encoder.normalize).lower(),
                    "RETRIEVER_ENCODER__MAX_SEQ_LENGTH": str(encoder.max_seq_length)})
    return env
