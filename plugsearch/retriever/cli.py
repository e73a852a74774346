"""`plugsearch-index`: build and check the retriever's indexes (progress bars with an ETA).

It reads the RETRIEVER_* env vars the service reads, so both agree on paths and options. Sub-commands:
`build` (the document store, then what the settings enable, or `--bm25 bm25s|pyserini|both|none`, `--dense`,
`--index-type`; no-op when every index matches the corpus, `--force` rebuilds; the corpus is streamed, never
held; an interrupted dense build resumes from its last embedding chunk or Milvus batch), `import lucene|faiss` (adopt an index built elsewhere without
re-encoding, see `plugsearch.retriever.indexing.importer`; prints the RETRIEVER_* settings that serve it), `check`
(exit 0 when the service would start, 2 otherwise), `info` (print the manifests), `encoder` (load the dense
encoder as the service would: the default backend exports it to ONNX once into RETRIEVER_ENCODER__ONNX_DIR;
prints which backend serves and why; `--require-onnx` exits 1 where it would fall back to torch: the image
build prepares the default model's export this way), `ingest` (documents as files: text, Markdown, HTML, PDF
and JSONL passages under the given paths into a corpus JSONL, `var/corpora/NAME.jsonl`, and its report: see
`plugsearch.retriever.ingest`), `put` / `upload` / `delete` (a running retriever's documents changed through its
API: a corpus file, files read and cut by the retriever, ids to delete: `plugsearch.retriever.ingest.upload`),
`sync` (a folder kept in step with a running retriever: `plugsearch.retriever.ingest.sync`), `compact` and `changes
status|carry|retire|repair` (the change log: `plugsearch.retriever.live.admin_cli`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from plugsearch.common.errors import NotReady
from plugsearch.common.logging import configure_logging
from plugsearch.retriever.backends import registry
from plugsearch.retriever.indexing.build import build
from plugsearch.retriever.settings import EncoderSettings, RetrieverSettings
from plugsearch.retriever.store.corpus import CorpusError
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing, Manifest

logger = logging.getLogger("plugsearch.retriever.cli")


def _import_parser(sub: Any) -> None:
    imp = sub.add_parser("import", help="adopt an existing Lucene or FAISS index (no re-encoding)")
    kinds = imp.add_subparsers(dest="kind", required=True)
    lucene = kinds.add_parser("lucene", help="a pyserini / Anserini Lucene index folder")
    lucene.add_argument("source", type=Path, help="the Lucene index folder")
    faiss = kinds.add_parser("faiss", help="a FAISS index file (e.g. Search-R1 / FlashRAG e5_Flat.index)")
    faiss.add_argument("source", type=Path, help="the FAISS index file")
    faiss.add_argument("--encoder", help="model name or path that encoded the passages (RETRIEVER_ENCODER__NAME)")
    faiss.add_argument("--pooling", choices=["model", "mean", "cls"], help="RETRIEVER_ENCODER__POOLING")
    faiss.add_argument("--query-prefix", help="e.g. 'query: ' for E5 (RETRIEVER_ENCODER__QUERY_PREFIX)")
    faiss.add_argument("--passage-prefix", help="e.g. 'passage: ' for E5 (RETRIEVER_ENCODER__PASSAGE_PREFIX)")
    faiss.add_argument("--max-seq-length", type=int, help="RETRIEVER_ENCODER__MAX_SEQ_LENGTH")
    faiss.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                       help="L2-normalised vectors (RETRIEVER_ENCODER__NORMALIZE)")
    faiss.add_argument("--passage-text", choices=["auto", "contents", "title-text"], default="auto",
                       help="what was encoded per row: FlashRAG's `contents` string as is, or `Title\\ntext` "
                            "(this project's builds); auto: `contents` where the row has it")
    faiss.add_argument("--min-self-hits", type=float,
                       help="share of sampled passages that must find themselves (default 1.0 flat, 0.8 others)")
    faiss.add_argument("--min-cosine", type=float, default=0.99,
                       help="least cosine between a re-encoded passage and its stored vector")
    for p in (lucene, faiss):
        p.add_argument("--corpus", type=Path, help="the JSONL corpus the index was built from (overrides "
                       "RETRIEVER_CORPUS); for Lucene with raw documents, written from them when missing")
        p.add_argument("--index-dir", type=Path, help="where the index folder goes (RETRIEVER_INDEX_DIR)")
        p.add_argument("--copy", action="store_true", help="copy the artefact instead of linking to it")
        p.add_argument("--sample", type=int, default=32 if p is faiss else 200,
                       help="documents checked for alignment")


def run_import(args: argparse.Namespace, settings: RetrieverSettings) -> None:
    """`plugsearch-index import lucene|faiss`: check, write the index folder, print how to serve it."""
    from plugsearch.retriever.indexing import importer

    link: importer.LinkMode = "copy" if args.copy else "symlink"
    encoder = None
    if args.kind == "lucene":
        manifest = importer.import_lucene(args.source, settings.corpus, settings.index_dir, sample=args.sample,
                                          link=link)
    else:
        changes = {"name": args.encoder, "pooling": args.pooling, "query_prefix": args.query_prefix,
                   "passage_prefix": args.passage_prefix, "max_seq_length": args.max_seq_length,
                   "normalize": args.normalize}
        encoder = EncoderSettings.model_validate(
            {**settings.encoder.model_dump(), **{k: v for k, v in changes.items() if v is not None}})
        manifest = importer.import_faiss(args.source, settings.corpus, settings.index_dir, encoder,
                                         passage_text=args.passage_text, sample=args.sample,
                                         min_self_hits=args.min_self_hits, min_cosine=args.min_cosine,
                                         link=link)
    print(f"imported {args.source} ({manifest.doc_count} documents) into {settings.index_dir}")
    print("serve it with:")
    env = importer.serve_env(settings.corpus, settings.index_dir, [manifest], encoder)
    print("  " + " \\\n  ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " \\\n  plugsearch-retriever")


CORPUS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _ingest_parser(sub: Any) -> None:
    from plugsearch.retriever.ingest.passages import DEFAULT_WORDS
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB

    ing = sub.add_parser("ingest", help="documents as files (txt, md, html, pdf, jsonl) into a corpus JSONL",
                         description="Read the files under PATH... (folders recursively), cut them into passages, "
                         "write the corpus (one passage per line) and a JSON report of what was skipped and why.")
    ing.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files and folders to ingest")
    ing.add_argument("--root", type=Path, default=Path("."), metavar="DIR", help="document ids are the files' "
                     "paths inside DIR (default: the current folder); `upload` and `sync` with the same root give "
                     "a file the same id")
    out = ing.add_mutually_exclusive_group(required=True)
    out.add_argument("--corpus", dest="corpus_name", metavar="NAME",
                     help="write <var-dir>/corpora/NAME.jsonl (and NAME.report.json beside it)")
    out.add_argument("--out", type=Path, metavar="FILE", help="write this corpus file instead (report beside it)")
    ing.add_argument("--var-dir", type=Path, default=Path("var"), help="where corpora/ goes (default: var)")
    ing.add_argument("--allow", type=Path, action="append", default=[], metavar="DIR",
                     help="only files inside DIR (after following links; repeatable); default: the paths given")
    ing.add_argument("--words", type=int, default=DEFAULT_WORDS,
                     help=f"about this many words per passage, cut at sentences (default {DEFAULT_WORDS})")
    ing.add_argument("--max-mb", type=float, default=DEFAULT_MAX_MB,
                     help=f"skip larger files without reading them (default {DEFAULT_MAX_MB:g})")
    ing.add_argument("--workers", type=int, default=2, help="files read at once, each in a worker process with "
                     "its CPU budget (default 2)")
    ing.add_argument("--quiet", action="store_true", help="no progress bar")


def run_ingest(args: argparse.Namespace) -> int:
    """`plugsearch-index ingest`: 0 = every file ingested (or only ignored ones skipped), 1 = the corpus was
    written but some files were refused (errors in the report), 2 = nothing written."""
    from plugsearch.retriever.ingest.run import IngestError, IngestOptions, ingest

    if args.corpus_name is not None and not CORPUS_NAME.fullmatch(args.corpus_name):
        print(f"error: --corpus {args.corpus_name!r}: a name (letters, digits, '.', '_', '-'), not a path; "
              "use --out FILE for a path", file=sys.stderr)
        return 2
    out = args.out or args.var_dir / "corpora" / f"{args.corpus_name}.jsonl"
    try:
        if not 1 <= args.workers <= 64:
            raise IngestError("--workers: between 1 and 64")
        options = IngestOptions(paths=tuple(args.paths), out=out, allow=tuple(args.allow), words=args.words,
                                max_mb=args.max_mb, show_progress=not args.quiet, root=args.root,
                                workers=args.workers)
        report = ingest(options)
    except IngestError as exc:
        if exc.report is not None:
            print("\n".join(exc.report.summary()), file=sys.stderr)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report.summary()), file=sys.stderr)
    print(f"report: {options.report_path}", file=sys.stderr)
    return 1 if report.errors else 0


def prepare_encoder(settings: EncoderSettings, *, require_onnx: bool) -> None:
    """Load the encoder once (the export, when missing, happens here) and print what serves it."""
    from plugsearch.retriever.encoders.encoder import Encoder

    t0 = time.perf_counter()
    encoder = Encoder(settings)
    onnx_file = str(encoder.onnx.file) if encoder.onnx is not None else None
    print(json.dumps({"encoder": settings.name, **encoder.describe(), "onnx_file": onnx_file,
                      "seconds": round(time.perf_counter() - t0, 1)}))
    if require_onnx and encoder.onnx is None:
        print(f"error: the encoder would be served by torch: {encoder.fallback}", file=sys.stderr)
        sys.exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="plugsearch-index", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    paths = argparse.ArgumentParser(add_help=False)
    paths.add_argument("--corpus", type=Path, help="overrides RETRIEVER_CORPUS")
    paths.add_argument("--index-dir", type=Path, help="overrides RETRIEVER_INDEX_DIR")
    b = sub.add_parser("build", parents=[paths], help="build missing or stale indexes")
    b.add_argument("--bm25", choices=["bm25s", "pyserini", "both", "none"],
                   help="default: RETRIEVER_BM25_BACKEND when RETRIEVER_BM25 is on")
    b.add_argument("--dense", action=argparse.BooleanOptionalAction, default=None,
                   help="default: RETRIEVER_DENSE")
    b.add_argument("--index-type", choices=["flat", "hnsw", "sq8", "ivfpq", "ivfsq8"],
                   help="overrides RETRIEVER_FAISS__INDEX_TYPE")
    b.add_argument("--chunk-size", type=int, default=2048, help="passages per on-disk embedding chunk")
    b.add_argument("--force", action="store_true", help="rebuild even when up to date")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    sub.add_parser("check", parents=[paths], help="check the configured indexes against the corpus")
    sub.add_parser("info", parents=[paths], help="print the manifests")
    enc = sub.add_parser("encoder", help="load the dense encoder as the service would (exports it to ONNX once)")
    enc.add_argument("--require-onnx", action="store_true", help="exit 1 when it would be served by torch")
    _import_parser(sub)
    _ingest_parser(sub)
    from plugsearch.retriever.ingest import sync, upload
    from plugsearch.retriever.live import admin_cli

    upload.add_parsers(sub)
    sync.add_parser(sub)
    admin_cli.add_parsers(sub, paths)
    args = parser.parse_args(argv)
    if args.command in ("put", "upload", "delete"):  # a running retriever's documents, through its API
        configure_logging("WARNING", service="plugsearch-index")
        sys.exit(upload.run(args))
    if args.command == "sync":  # a folder kept in step with a running retriever
        configure_logging("WARNING", service="plugsearch-index")
        sys.exit(sync.run(args))
    if args.command == "ingest":  # reads no RETRIEVER_* setting
        configure_logging("INFO", service="plugsearch-index")
        sys.exit(run_ingest(args))

    overrides = {name: value for name in ("corpus", "index_dir") if (value := getattr(args, name, None))}
    try:
        settings = RetrieverSettings(**overrides)  # type: ignore[arg-type]
        if args.command == "build" and args.index_type:
            registry.dense(settings.dense_backend).set_index_type(settings, args.index_type)
    except (ValidationError, ValueError) as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging(settings.log_level, service="plugsearch-index")
    os.umask(0o077)  # what the index folders and the change log hold is the owner's alone

    try:
        if args.command in ("compact", "changes"):
            sys.exit(admin_cli.run(args, settings))
        if args.command == "import":
            run_import(args, settings)
        elif args.command == "build":
            backends = {"both": list(registry.LEXICAL), "none": []}.get(
                args.bm25 or "", [args.bm25] if args.bm25 else ([settings.bm25_backend] if settings.bm25 else []))
            dense = settings.dense if args.dense is None else args.dense
            built = build(settings, bm25=backends, dense=dense, force=args.force, chunk_size=args.chunk_size,
                          show_progress=not args.quiet)
            print(f"built: {', '.join(built) if built else 'nothing (up to date)'}")
        elif args.command == "encoder":
            prepare_encoder(settings.encoder, require_onnx=args.require_onnx)
        elif args.command == "check":
            from plugsearch.retriever.serving import check_indexes

            check = check_indexes(settings)
            print(f"ok: {', '.join(check.manifests)} match {settings.corpus} ({check.corpus_checksum})")
        else:
            for folder in sorted(settings.index_dir.glob("*")):
                if (folder / "manifest.json").is_file():
                    print(f"{folder}: {Manifest.read(folder).model_dump_json()}")
    except (IndexMismatch, IndexMissing, CorpusError, ValidationError, NotReady) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
