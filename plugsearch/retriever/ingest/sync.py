"""`plugsearch-index sync FOLDER --root ROOT`: a folder kept in step with a running retriever, the folder the truth.

1. The folder is walked as `ingest` walks it, each file with its document id relative to ROOT (`document_id`: the
   id `ingest` and `upload` give the same file). `.jsonl` files are left out (their rows name their own documents:
   `plugsearch-index put` them).
2. The retriever lists what it serves under the folder's ids (`GET /documents?prefix=...`: each document with the
   content hash of its passages, `document_hash`).
3. A file whose document is served with the hash the file gives is left alone. The hash a file gives is known
   from the cache of earlier syncs (`--cache`, default `var/sync/cache.json`: sha256 of the file's bytes and the
   words per passage -> the hash the retriever answered when it was put), else by reading the file here, as the
   retriever would (the parse pool, a CPU budget per file). Every other file, new or changed, is uploaded
   (`POST /documents/files`, in batches, as `upload` sends), replacing its document whole.
4. Every served document under the folder whose file is gone (an id that names a file a reader takes, under the
   folder's prefix, and no such file now) is deleted. A file that is there but was refused (unreadable now)
   keeps its served document, and the summary says why. Documents that are not files (put by id, or another
   corpus's) are never touched.

It goes through the retriever's API with the project's client and waits out its restarts
(`plugsearch.retriever.ingest.remote`), shows a progress bar, and ends with one JSON line: files added, replaced,
unchanged, documents deleted, files skipped with their reasons. Every change is idempotent and acknowledged only
once durable, so a sync stopped anywhere (Ctrl-C, kill -9, a retriever restart or rebuild) is finished by running
it again: afterwards the served documents under the folder are the folder's files.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import sys
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from plugsearch.common.files import atomic_write_json
from plugsearch.common.http import ServiceClient
from plugsearch.retriever.ingest.remote import Refused, add_connection_options, call, client_of

DEFAULT_CACHE = Path("var") / "sync" / "cache.json"
LIST_PAGE = 5000
DELETE_BATCH = 1000


def _fingerprint(path: Path) -> tuple[int, str]:
    """(size, sha256) of a file's bytes; SkipFile for an empty one or one over ingest's size limit."""
    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.reading import MB
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB

    size = path.stat().st_size
    if size > DEFAULT_MAX_MB * MB:
        raise SkipFile(f"too large: {size / MB:,.1f} MB, over the limit of {DEFAULT_MAX_MB:g} MB")
    if size == 0:
        raise SkipFile("empty file")
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return size, digest.hexdigest()


def local_files(folder: Path, root: Path) -> tuple[str, dict[str, Any], list[dict[str, str]]]:
    """The folder's id prefix, its files that may be documents (id -> file), and what was skipped on the way."""
    from plugsearch.retriever.ingest.formats import FORMATS, SkipFile, format_of
    from plugsearch.retriever.ingest.reading import kind_of
    from plugsearch.retriever.ingest.run import Skipped, document_id, walk

    prefix = "" if folder.resolve() == root.resolve() else document_id(folder, root) + "/"  # SkipFile: outside
    skipped: list[dict[str, str]] = []
    local: dict[str, Any] = {}
    for found in walk((folder,), [folder.resolve()], root):
        if isinstance(found, Skipped):
            skipped.append({"path": found.path, "reason": found.reason, "kind": found.kind})
            continue
        kind = format_of(PurePosixPath(found.rel))
        if kind is None:
            try:
                kind_of(found.rel)
            except SkipFile as exc:
                skipped.append({"path": str(found.path), "reason": exc.reason, "kind": "ignored"})
            continue
        if FORMATS[kind].is_corpus:
            skipped.append({"path": str(found.path), "reason": "a corpus file (its rows name their own documents): "
                            "`plugsearch-index put` it", "kind": "ignored"})
            continue
        local[found.rel] = found
    return prefix, local, skipped


def _is_file_id(doc_id: str) -> bool:
    """Whether a served document can be a file's (its id ends in an extension a reader takes, not a corpus one)."""
    from plugsearch.retriever.ingest.formats import FORMATS, format_of

    kind = format_of(PurePosixPath(doc_id))
    return kind is not None and not FORMATS[kind].is_corpus


async def served(client: ServiceClient, prefix: str, *, wait_s: float) -> dict[str, str]:
    """id -> content hash of every served document whose id starts with `prefix`."""
    out: dict[str, str] = {}
    after: str | None = None
    while True:
        query = f"/documents?prefix={quote(prefix, safe='')}&limit={LIST_PAGE}"
        if after is not None:
            query += f"&after={quote(after, safe='')}"
        page = await call(client, "GET", query, wait_s=wait_s)
        out.update({d["id"]: d["sha256"] for d in page["documents"]})
        after = page.get("next")
        if after is None:
            return out


def _cache_key(file_hash: str, words: int, doc_id: str) -> str:
    return f"{file_hash}:{words}:{doc_id}"


def _read_cache(path: Path) -> dict[str, str]:
    import json

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


async def sync(client: ServiceClient, folder: Path, root: Path, *, words: int, batch: int, batch_bytes: int,
               cache_path: Path, workers: int = 2, show_progress: bool = True, wait_s: float = 60.0,
               dry_run: bool = False) -> dict[str, Any]:
    """Bring the retriever's documents under `folder` in step with its files (module docstring); the summary."""
    from tqdm import tqdm

    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.passages import DEFAULT_WORDS, passages_hash
    from plugsearch.retriever.ingest.pool import ParseLimits, ParsePool, ParseRefused
    from plugsearch.retriever.ingest.reading import MB
    from plugsearch.retriever.ingest.run import DEFAULT_MAX_MB, _File
    from plugsearch.retriever.ingest.upload import send_files

    words = words or DEFAULT_WORDS
    prefix, local, skipped = await asyncio.to_thread(local_files, folder, root)
    summary: dict[str, Any] = {"folder": str(folder), "root": str(root), "prefix": prefix, "added": 0,
                               "replaced": 0, "unchanged": 0, "deleted": 0, "passages": 0, "seq": None,
                               "errors": 0, "skipped": skipped}
    remote = {doc: digest for doc, digest in (await served(client, prefix, wait_s=wait_s)).items()
              if _is_file_id(doc)}
    cache = _read_cache(cache_path)
    keys: dict[str, str] = {}  # document id -> its cache key (the file's hash, words, id)
    changed: list[tuple[Path, str]] = []
    kept: set[str] = set()  # ids of files that are there but could not be read here: their documents stay
    bar = tqdm(total=len(local), desc="sync: compare", unit="file", disable=not show_progress, dynamic_ncols=True)
    with ParsePool(ParseLimits(workers=workers)) as pool:
        async def compare(doc_id: str, file: _File) -> None:
            try:
                size, file_hash = await asyncio.to_thread(_fingerprint, file.path)
                key = keys[doc_id] = _cache_key(file_hash, words, doc_id)
                if doc_id not in remote:
                    changed.append((file.path, doc_id))
                    return
                expected = cache.get(key)
                if expected is None:  # read it here, as the retriever would, for the hash it would list
                    _, passages, _ = await pool.run("read_path", str(file.path), doc_id, doc_id, words,
                                                    int(DEFAULT_MAX_MB * MB), size=size)
                    expected = passages_hash(passages)
                if expected == remote[doc_id]:
                    cache[key] = expected
                    summary["unchanged"] += 1
                else:
                    changed.append((file.path, doc_id))
            except (SkipFile, ParseRefused) as exc:
                kept.add(doc_id)
                skipped.append({"path": str(file.path), "reason": exc.reason + (
                    " (its served document is kept)" if doc_id in remote else ""),
                                "kind": "ignored" if getattr(exc, "ignored", False) else "error"})
            except OSError as exc:
                kept.add(doc_id)
                skipped.append({"path": str(file.path), "reason": f"cannot be read: {exc.strerror or exc}",
                                "kind": "error"})
            finally:
                bar.update(1)

        items = sorted(local.items())
        for start in range(0, len(items), 4 * workers):  # a few files at a time: the pool takes `workers`
            await asyncio.gather(*(compare(doc_id, file) for doc_id, file in items[start:start + 4 * workers]))
    bar.close()
    changed.sort(key=lambda item: item[1])
    gone = sorted(doc for doc in remote if doc not in local)
    summary["to_put"], summary["to_delete"] = len(changed), len(gone)
    try:
        if changed and not dry_run:
            sent = await send_files(client, changed, batch=batch, batch_bytes=batch_bytes, words=words,
                                    show_progress=show_progress, wait_s=wait_s, desc="sync: put")
            skipped += sent["skipped"]
            summary["passages"] += sent["passages"]
            summary["seq"] = sent["seq"]
            for doc_id, digest in sent["hashes"].items():
                summary["replaced" if doc_id in remote else "added"] += 1
                if doc_id in keys:
                    cache[keys[doc_id]] = digest
            if sent.get("failed"):
                raise Refused(sent["failed"], sent.get("status"))
        for start in range(0, 0 if dry_run else len(gone), DELETE_BATCH):
            body = await call(client, "POST", "/documents/delete", json={"ids": gone[start:start + DELETE_BATCH]},
                              wait_s=wait_s)
            summary["deleted"] += body["documents"]
            summary["seq"] = body["seq"]
    except Refused as exc:
        summary["failed"], summary["status"] = exc.message, exc.status
    finally:
        if not dry_run:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(cache_path, dict(sorted(cache.items())))
    summary["errors"] = sum(1 for s in skipped if s["kind"] == "error") + (1 if summary.get("failed") else 0)
    return summary


def add_parser(sub: Any) -> None:
    p = sub.add_parser("sync", help="keep a running retriever's documents in step with a folder (the folder wins)",
                       description="Put what is new or changed in FOLDER (by content hash), delete the documents "
                       "whose files left it: afterwards the retriever serves FOLDER's files, each as the document "
                       "whose id is its path inside ROOT (through the retriever's API).")
    p.add_argument("folder", type=Path, metavar="FOLDER", help="the folder (recursively)")
    p.add_argument("--root", type=Path, default=Path("."), metavar="ROOT", help="document ids are paths inside "
                   "ROOT (default: the current folder), as `ingest` and `upload` make them")
    p.add_argument("--words", type=int, default=None, help="about this many words per passage (default 100)")
    p.add_argument("--batch", type=int, default=50, help="files per request (default 50)")
    p.add_argument("--batch-mb", type=float, default=1.5, help="base64 per request (default 1.5)")
    p.add_argument("--workers", type=int, default=2, help="files read at once here to compare (default 2)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"what earlier syncs learnt (default "
                   f"{DEFAULT_CACHE})")
    p.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_connection_options(p)


def run(args: argparse.Namespace) -> int:
    """0: in step; 1: some files refused (each reason in the summary) or the retriever refused; 2: bad arguments."""
    import json

    from plugsearch.common.schemas.retriever import MAX_PUT_FILES
    from plugsearch.retriever.ingest.formats import SkipFile

    if not args.folder.is_dir():
        raise SystemExit(f"error: {args.folder} is not a folder")
    if not (1 <= args.batch <= MAX_PUT_FILES and args.batch_mb > 0 and 1 <= args.workers <= 64):
        raise SystemExit(f"error: --batch between 1 and {MAX_PUT_FILES}, --batch-mb positive, --workers 1 to 64")
    if args.words is not None and not 10 <= args.words <= 10_000:
        raise SystemExit("error: --words must be between 10 and 10000")

    async def go() -> dict[str, Any]:
        client = client_of(args)
        try:
            return await sync(client, args.folder, args.root, words=args.words, batch=args.batch,
                              batch_bytes=int(args.batch_mb * (1 << 20)), cache_path=args.cache,
                              workers=args.workers, show_progress=not args.quiet, wait_s=args.wait_s,
                              dry_run=args.dry_run)
        finally:
            await client.aclose()

    try:
        summary = asyncio.run(go())
    except SkipFile as exc:
        raise SystemExit(f"error: {args.folder}: {exc.reason}") from exc
    except Refused as exc:
        summary = {"failed": exc.message, "status": exc.status, "errors": 1}
    if summary.get("failed"):
        sys.stderr.write(f"error: {summary['failed']}\n")
    sys.stdout.write(json.dumps(summary) + "\n")
    return 1 if summary.get("errors") else 0
