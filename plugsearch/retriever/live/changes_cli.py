"""`plugsearch-index put`, `upload` and `delete`: changing a running retriever's documents from the command line,
through its API (`PUT /documents`, `POST /documents/files`, `POST /documents/delete`; `plugsearch.retriever.live.overlay`).

`put CORPUS.jsonl` sends the documents of a corpus file (what `plugsearch-index ingest` writes: passages with their
`doc_id`; a row without one is a document of its own), each document's passages together, in batches, with a
progress bar; a document already served is replaced whole. `upload PATH...` sends files (text, Markdown, HTML,
PDF, JSONL passages) found under the paths as `ingest` walks them, base64-encoded in batches that fit the
retriever's request body limit; the retriever reads and cuts them as `ingest` does. `delete ID...` deletes
documents. All authenticate with `--token` (default: $PLUGSEARCH_INTERNAL_TOKEN, else $RETRIEVER_ADMIN_KEY), and
go through the project's upstream client (timeouts, retries of no answer and of 429/502/503/504: the changes are
idempotent, a retried put replaces the same document with the same passages).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from plugsearch.common.errors import ServiceError
from plugsearch.common.http import ClientSettings, ServiceClient

DEFAULT_URL = "http://127.0.0.1:8001"


def documents_of(corpus: Path) -> Iterator[dict[str, Any]]:
    """The corpus file's documents in order, each with its passages (rows of one `doc_id` must be adjacent, as
    `ingest` writes them)."""
    from plugsearch.retriever.live.overlay import doc_id_of
    from plugsearch.retriever.store.corpus import CorpusError, parse_line

    current: dict[str, Any] | None = None
    with corpus.open("rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                passage_id, title, text = parse_line(line, number, corpus)
            except CorpusError as exc:
                raise SystemExit(f"error: {exc}") from exc
            doc_id = doc_id_of(passage_id)
            if current is not None and current["id"] != doc_id:
                yield current
                current = None
            if current is None:
                current = {"id": doc_id, "passages": []}
            current["passages"].append({"title": title, "text": text})
    if current is not None:
        yield current


def _client(args: argparse.Namespace) -> ServiceClient:
    token = args.token or os.environ.get("PLUGSEARCH_INTERNAL_TOKEN") or os.environ.get("RETRIEVER_ADMIN_KEY")
    if not token:
        raise SystemExit("error: changing documents needs the internal token or an admin key: --token, or "
                         "$PLUGSEARCH_INTERNAL_TOKEN / $RETRIEVER_ADMIN_KEY")
    settings = ClientSettings(url=args.url, token=SecretStr(token), timeout_s=args.timeout_s, max_retries=3)
    return ServiceClient(settings, name="retriever")


async def _put(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    client = _client(args)
    sent = {"documents": 0, "passages": 0, "seq": None}
    batch: list[dict[str, Any]] = []
    try:
        with tqdm(desc="documents put", unit="doc", disable=args.quiet) as bar:
            async def flush() -> None:
                if not batch:
                    return
                body = (await client.request("PUT", "/documents", json={"documents": batch})).json()
                sent["documents"] += body["documents"]
                sent["passages"] += body["passages"]
                sent["seq"] = body["seq"]
                bar.update(len(batch))
                bar.set_postfix(passages=sent["passages"], seq=body["seq"])
                batch.clear()

            for doc in documents_of(args.corpus):
                batch.append(doc)
                if len(batch) >= args.batch:
                    await flush()
            await flush()
    finally:
        await client.aclose()
    return sent


async def upload(client: ServiceClient, paths: tuple[Path, ...], *, batch: int, batch_bytes: int,
                 words: int | None = None, show_progress: bool = True) -> dict[str, Any]:
    """Send the files under `paths` (walked as `ingest` walks them, only files inside them) to POST
    /documents/files, at most `batch` files and about `batch_bytes` of base64 per request (a file larger than
    that goes alone); returns the counts put and every file skipped with its reason (`kind` "ignored": an
    extension no reader takes, a hidden file, which is no error)."""
    from tqdm import tqdm

    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB, MB, Skipped, kind_of, walk

    found = list(walk(paths, [p.resolve() for p in paths]))
    skipped = [{"path": s.path, "reason": s.reason, "kind": s.kind} for s in found if isinstance(s, Skipped)]
    out: dict[str, Any] = {"files": 0, "documents": 0, "passages": 0, "seq": None, "errors": 0, "skipped": skipped}
    taken: dict[str, Path] = {}  # document id (the path inside the given path) -> the file that took it
    pending: list[tuple[Path, dict[str, str]]] = []
    extra = {} if words is None else {"words": words}
    files = [f for f in found if not isinstance(f, Skipped)]
    bar = tqdm(total=len(files), desc="upload", unit="file", disable=not show_progress, dynamic_ncols=True)

    def skip(path: Path, reason: str, kind: str = "error") -> None:
        skipped.append({"path": str(path), "reason": reason, "kind": kind})

    async def send(part: list[tuple[Path, dict[str, str]]]) -> None:
        try:
            answer = await client.request("POST", "/documents/files", json={"files": [f for _, f in part], **extra})
        except ServiceError as exc:
            if exc.upstream_status == 413 and len(part) > 1:  # over the body limit: halves
                await send(part[:len(part) // 2])
                await send(part[len(part) // 2:])
                return
            if exc.upstream_status == 413:
                reason = (f"too large for one request ({exc.message}): raise RETRIEVER_MAX_BODY_BYTES, or "
                          "`plugsearch-index ingest` it and `plugsearch-index put` the corpus")
            elif exc.upstream_status == 422 and exc.param == "files":  # none of them could be read
                reason = exc.message
            else:
                raise
            for path, _ in part:
                skip(path, reason)
            bar.update(len(part))
            return
        body = answer.json()
        for (path, _), result in zip(part, body["files"], strict=True):
            if result["status"] == "put":
                out["files"] += 1
            else:
                skip(path, result["reason"])
        out["documents"] += body["documents"]
        out["passages"] += body["passages"]
        out["seq"] = body["seq"]
        bar.update(len(part))
        bar.set_postfix(passages=out["passages"], skipped=len(skipped), seq=body["seq"], refresh=False)

    try:
        size = 0
        for file in files:
            try:
                kind_of(file.rel)
                if file.rel in taken:
                    raise SkipFile(f"duplicate document id {file.rel!r}: already taken by {taken[file.rel]}")
                if (on_disk := file.path.stat().st_size) > DEFAULT_MAX_MB * MB:
                    raise SkipFile(f"too large: {on_disk / MB:,.1f} MB, over the limit of {DEFAULT_MAX_MB:g} MB "
                                   "per file")
                encoded = base64.b64encode(file.path.read_bytes()).decode()
            except SkipFile as exc:
                skip(file.path, exc.reason, "ignored" if exc.ignored else "error")
                bar.update(1)
            except OSError as exc:
                skip(file.path, f"cannot be read: {exc.strerror or exc}")
                bar.update(1)
            else:
                taken[file.rel] = file.path
                if pending and (len(pending) >= batch or size + len(encoded) > batch_bytes):
                    await send(pending)
                    pending, size = [], 0
                pending.append((file.path, {"name": file.rel, "content_base64": encoded}))
                size += len(encoded)
        if pending:
            await send(pending)
    finally:
        bar.close()
    out["errors"] = sum(1 for s in skipped if s["kind"] == "error")
    return out


async def _delete(args: argparse.Namespace) -> dict[str, Any]:
    client = _client(args)
    try:
        return dict((await client.request("POST", "/documents/delete", json={"ids": list(args.ids)})).json())
    finally:
        await client.aclose()


def add_parsers(sub: Any) -> None:
    from plugsearch.common.schemas.retriever import MAX_PUT_FILES

    for name, what, route in (
            ("put", "add or replace the documents of a corpus file in a running retriever", "PUT /documents"),
            ("upload", "add or replace documents given as files (txt, md, html, pdf, jsonl) in a running retriever",
             "POST /documents/files"),
            ("delete", "delete documents from a running retriever", "POST /documents/delete")):
        p = sub.add_parser(name, help=what, description=f"{what} (through its API: {route})")
        if name == "put":
            p.add_argument("corpus", type=Path, metavar="CORPUS.jsonl",
                           help="passages with their doc_id (what `plugsearch-index ingest` writes)")
            p.add_argument("--batch", type=int, default=100, help="documents per request (default 100, at most 1000)")
            p.add_argument("--quiet", action="store_true", help="no progress bar")
        elif name == "upload":
            p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files and folders (recursively); "
                           "a document's id is the file's path inside the PATH it was found under")
            p.add_argument("--batch", type=int, default=50,
                           help=f"files per request (default 50, at most {MAX_PUT_FILES})")
            p.add_argument("--batch-mb", type=float, default=1.5, help="base64 per request (default 1.5: under the "
                           "retriever's default 2 MiB RETRIEVER_MAX_BODY_BYTES; a larger file goes alone)")
            p.add_argument("--words", type=int, default=None, help="about this many words per passage (default: "
                           "ingest's, 100)")
            p.add_argument("--quiet", action="store_true", help="no progress bar")
        else:
            p.add_argument("ids", nargs="+", metavar="ID", help="document ids (every passage of each goes)")
        p.add_argument("--url", default=os.environ.get("PLUGSEARCH_RETRIEVER_URL", DEFAULT_URL),
                       help=f"the retriever (default $PLUGSEARCH_RETRIEVER_URL or {DEFAULT_URL})")
        p.add_argument("--token", default=None, help="the internal token or an admin key (default: "
                       "$PLUGSEARCH_INTERNAL_TOKEN, else $RETRIEVER_ADMIN_KEY)")
        p.add_argument("--timeout-s", type=float, default=300.0, help="per request (a batch is encoded before "
                       "it is acknowledged; default 300)")


async def _upload(args: argparse.Namespace) -> dict[str, Any]:
    client = _client(args)
    try:
        return await upload(client, tuple(args.paths), batch=args.batch, batch_bytes=int(args.batch_mb * (1 << 20)),
                            words=args.words, show_progress=not args.quiet)
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    """`put` / `upload` / `delete`: prints the outcome as one JSON line; 0 on success, 1 when the retriever refused
    (or, for `upload`, refused some files: each with its reason in the line)."""
    import json

    from plugsearch.common.schemas.retriever import MAX_PUT_FILES

    if args.command == "put" and not 1 <= args.batch <= 1000:
        raise SystemExit("error: --batch must be between 1 and 1000")
    if args.command == "put" and not args.corpus.is_file():
        raise SystemExit(f"error: {args.corpus} is not a file")
    if args.command == "upload" and not (1 <= args.batch <= MAX_PUT_FILES and args.batch_mb > 0):
        raise SystemExit(f"error: --batch must be between 1 and {MAX_PUT_FILES}, --batch-mb positive")
    if args.command == "upload" and args.words is not None and not 10 <= args.words <= 10_000:
        raise SystemExit("error: --words must be between 10 and 10000")
    jobs = {"put": _put, "upload": _upload, "delete": _delete}
    try:
        result = asyncio.run(jobs[args.command](args))
    except ServiceError as exc:
        sys.stderr.write(f"error: the retriever at {args.url} answered {exc.status}: {exc.message}\n")
        return 1
    sys.stdout.write(json.dumps(result) + "\n")
    return 1 if result.get("errors") else 0
