"""`plugsearch-index put`, `upload` and `delete`: changing a running retriever's documents from the command line,
through its API (`PUT /documents`, `POST /documents/files`, `POST /documents/delete`; `plugsearch.retriever.live.overlay`).

`put CORPUS.jsonl` sends the documents of a corpus file (what `plugsearch-index ingest` writes: passages with their
`doc_id`; a row without one is a document of its own), each document's passages together, in batches, with a
progress bar; a document already served is replaced whole. `upload PATH...` sends files (text, Markdown, HTML,
PDF, JSONL passages) found under the paths as `ingest` walks them, each with its document id relative to `--root`
(the current folder by default: the id `ingest` and `sync` give the same file, so uploading one file of an
ingested folder replaces its document), base64-encoded in batches that fit the retriever's request body limit; the
retriever reads and cuts them as `ingest` does. `delete ID...` deletes documents. All find the retriever and its
token, and wait out its restarts, as `plugsearch.retriever.ingest.remote` says; each ends with one JSON line, what
was done (and, when it stopped early, `failed`: why, with the status the retriever answered).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from plugsearch.common.http import ServiceClient
from plugsearch.retriever.ingest.remote import Refused, add_connection_options, call, client_of


def documents_of(corpus: Path) -> Iterator[dict[str, Any]]:
    """The corpus file's documents in order, each with its passages (rows of one `doc_id` must be adjacent, as
    `ingest` writes them)."""
    from plugsearch.retriever.ingest.passages import doc_id_of
    from plugsearch.retriever.store.corpus import CorpusError, iter_corpus

    current: dict[str, Any] | None = None
    try:
        for passage_id, title, text in iter_corpus(corpus):  # the retriever's own row rule, blank lines skipped
            doc_id = doc_id_of(passage_id)
            if current is not None and current["id"] != doc_id:
                yield current
                current = None
            if current is None:
                current = {"id": doc_id, "passages": []}
            current["passages"].append({"title": title, "text": text})
    except CorpusError as exc:  # a bad row, or a file that cannot be read
        raise SystemExit(f"error: {exc}") from exc
    if current is not None:
        yield current


async def _put(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    client = client_of(args)
    sent: dict[str, Any] = {"documents": 0, "passages": 0, "seq": None}
    batch: list[dict[str, Any]] = []
    try:
        with tqdm(desc="documents put", unit="doc", disable=args.quiet) as bar:
            async def flush() -> None:
                if not batch:
                    return
                body = await call(client, "PUT", "/documents", json={"documents": batch}, wait_s=args.wait_s,
                                  say=lambda line: bar.write(line, file=sys.stderr))
                sent["documents"] += body["documents"]
                sent["passages"] += body["passages"]
                sent["seq"] = body["seq"]
                bar.update(len(batch))
                bar.set_postfix(passages=sent["passages"], seq=body["seq"])
                batch.clear()

            try:
                for doc in documents_of(args.corpus):
                    batch.append(doc)
                    if len(batch) >= args.batch:
                        await flush()
                await flush()
            except Refused as exc:
                sent.update(failed=exc.message, status=exc.status, errors=1)
    finally:
        await client.aclose()
    return sent


FileSpec = tuple[Path, str]
"""A file to send: its path on disk, its document id (its name for the retriever)."""


async def send_files(client: ServiceClient, files: list[FileSpec], *, batch: int, batch_bytes: int,
                     words: int | None = None, show_progress: bool = True, wait_s: float = 60.0,
                     desc: str = "upload") -> dict[str, Any]:
    """Send `files` to POST /documents/files, at most `batch` files and about `batch_bytes` of base64 per request (a
    file larger than that goes alone; a batch over the body limit is halved); returns the counts put, each file
    skipped with its reason, each file put with its document's content hash (`hashes`: id -> sha256) and, when
    the retriever refused or could not be reached within `wait_s`, `failed` (the files not sent said so)."""
    from tqdm import tqdm

    from plugsearch.retriever.ingest.reading import MB
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB

    out: dict[str, Any] = {"files": 0, "documents": 0, "passages": 0, "seq": None, "skipped": [], "hashes": {}}
    skipped: list[dict[str, str]] = out["skipped"]
    extra = {} if words is None else {"words": words}
    bar = tqdm(total=len(files), desc=desc, unit="file", disable=not show_progress, dynamic_ncols=True)

    def skip(path: Path, reason: str, kind: str = "error") -> None:
        skipped.append({"path": str(path), "reason": reason, "kind": kind})

    async def send(part: list[tuple[Path, dict[str, str]]]) -> None:
        try:
            body = await call(client, "POST", "/documents/files", json={"files": [f for _, f in part], **extra},
                              wait_s=wait_s, say=lambda line: bar.write(line, file=sys.stderr))
        except Refused as exc:
            if exc.status == 413 and len(part) > 1:  # over the body limit: halves
                await send(part[:len(part) // 2])
                await send(part[len(part) // 2:])
                return
            if exc.status == 413:
                reason = (f"too large for one request ({exc.message}): raise RETRIEVER_MAX_BODY_BYTES, or "
                          "`plugsearch-index ingest` it and `plugsearch-index put` the corpus")
            elif exc.status == 422 and exc.param == "files":  # none of them could be read
                reason = exc.message
            else:
                raise
            for path, _ in part:
                answered.add(path)
                skip(path, reason)
            bar.update(len(part))
            return
        for (path, _), result in zip(part, body["files"], strict=True):
            answered.add(path)
            if result["status"] == "put":
                out["files"] += 1
                if result.get("sha256") and result.get("id"):
                    out["hashes"][result["id"]] = result["sha256"]
            else:
                skip(path, result["reason"])
        out["documents"] += body["documents"]
        out["passages"] += body["passages"]
        out["seq"] = body["seq"]
        bar.update(len(part))
        bar.set_postfix(passages=out["passages"], skipped=len(skipped), seq=body["seq"], refresh=False)

    pending: list[tuple[Path, dict[str, str]]] = []
    answered: set[Path] = set()  # sent, and answered for (put, or refused with a reason)
    size = 0
    try:
        for path, doc_id in files:
            try:
                if (on_disk := path.stat().st_size) > DEFAULT_MAX_MB * MB:
                    skip(path, f"too large: {on_disk / MB:,.1f} MB, over the limit of {DEFAULT_MAX_MB:g} MB per file")
                    bar.update(1)
                    continue
                encoded = base64.b64encode(path.read_bytes()).decode()
            except OSError as exc:
                skip(path, f"cannot be read: {exc.strerror or exc}")
                bar.update(1)
                continue
            if pending and (len(pending) >= batch or size + len(encoded) > batch_bytes):
                await send(pending)
                pending, size = [], 0
            pending.append((path, {"name": doc_id, "content_base64": encoded}))
            size += len(encoded)
        if pending:
            await send(pending)
    except Refused as exc:
        out["failed"], out["status"] = exc.message, exc.status
        done = {s["path"] for s in skipped}
        for path, _ in files:
            if path not in answered and str(path) not in done:
                skip(path, f"not sent: {exc.message}")
    finally:
        bar.close()
    return out


async def upload(client: ServiceClient, paths: tuple[Path, ...], *, batch: int, batch_bytes: int,
                 words: int | None = None, show_progress: bool = True, root: Path = Path("."),
                 wait_s: float = 60.0) -> dict[str, Any]:
    """Send the files under `paths` (walked as `ingest` walks them, only files inside them, each with its id
    relative to `root`) to POST /documents/files (`send_files`); returns the counts put and every file skipped with
    its reason (`kind` "ignored": an extension no reader takes, a hidden file, which is no error)."""
    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.reading import kind_of
    from plugsearch.retriever.ingest.run import Skipped, walk

    found = list(walk(paths, [p.resolve() for p in paths], root))
    skipped = [{"path": s.path, "reason": s.reason, "kind": s.kind} for s in found if isinstance(s, Skipped)]
    taken: dict[str, Path] = {}  # document id -> the file that took it
    files: list[FileSpec] = []
    for file in (f for f in found if not isinstance(f, Skipped)):
        try:
            kind_of(file.rel)
            if file.rel in taken:
                raise SkipFile(f"duplicate document id {file.rel!r}: already taken by {taken[file.rel]}")
        except SkipFile as exc:
            skipped.append({"path": str(file.path), "reason": exc.reason, "kind": "ignored" if exc.ignored
                            else "error"})
            continue
        taken[file.rel] = file.path
        files.append((file.path, file.rel))
    out = await send_files(client, files, batch=batch, batch_bytes=batch_bytes, words=words,
                           show_progress=show_progress, wait_s=wait_s)
    out.pop("hashes")
    out["skipped"] = skipped + out["skipped"]
    out["errors"] = sum(1 for s in out["skipped"] if s["kind"] == "error")
    return out


async def _delete(args: argparse.Namespace) -> dict[str, Any]:
    client = client_of(args)
    try:
        return dict(await call(client, "POST", "/documents/delete", json={"ids": list(args.ids)},
                               wait_s=args.wait_s))
    except Refused as exc:
        return {"documents": 0, "passages": 0, "failed": exc.message, "status": exc.status, "errors": 1}
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
            p.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="files and folders (recursively)")
            p.add_argument("--root", type=Path, default=Path("."), metavar="DIR", help="a document's id is the "
                           "file's path inside DIR (default: the current folder), as `ingest` and `sync` give it")
            p.add_argument("--batch", type=int, default=50,
                           help=f"files per request (default 50, at most {MAX_PUT_FILES})")
            p.add_argument("--batch-mb", type=float, default=1.5, help="base64 per request (default 1.5: under the "
                           "retriever's default 2 MiB RETRIEVER_MAX_BODY_BYTES; a larger file goes alone)")
            p.add_argument("--words", type=int, default=None, help="about this many words per passage (default: "
                           "ingest's, 100)")
            p.add_argument("--quiet", action="store_true", help="no progress bar")
        else:
            p.add_argument("ids", nargs="+", metavar="ID", help="document ids (every passage of each goes)")
        add_connection_options(p)


async def _upload(args: argparse.Namespace) -> dict[str, Any]:
    client = client_of(args)
    try:
        return await upload(client, tuple(args.paths), batch=args.batch, batch_bytes=int(args.batch_mb * (1 << 20)),
                            words=args.words, show_progress=not args.quiet, root=args.root, wait_s=args.wait_s)
    finally:
        await client.aclose()


def run(args: argparse.Namespace) -> int:
    """`put` / `upload` / `delete`: prints the outcome as one JSON line (what was done, even when it stopped early:
    then `failed` says why, `status` what the retriever answered); 0 on success, 1 when the retriever refused (or,
    for `upload`, refused some files: each with its reason in the line)."""
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
    result = asyncio.run(jobs[args.command](args))
    if result.get("failed"):
        sys.stderr.write(f"error: {result['failed']}\n")
    sys.stdout.write(json.dumps(result) + "\n")
    return 1 if result.get("errors") or result.get("failed") else 0
