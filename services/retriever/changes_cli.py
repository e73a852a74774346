"""`plugsearch-index put` and `plugsearch-index delete`: changing a running retriever's documents from the command
line, through its API (`PUT /documents`, `POST /documents/delete`; `services.retriever.live`).

`put CORPUS.jsonl` sends the documents of a corpus file (what `plugsearch-index ingest` writes: passages with their
`doc_id`; a row without one is a document of its own), each document's passages together, in batches, with a
progress bar; a document already served is replaced whole. `delete ID...` deletes documents. Both authenticate
with `--token` (default: $PLUGSEARCH_INTERNAL_TOKEN, else $RETRIEVER_ADMIN_KEY), and go through the project's
upstream client (timeouts, retries of no answer and of 429/502/503/504: both changes are idempotent, a retried
put replaces the same document with the same passages).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from services.common.errors import ServiceError
from services.common.http import ClientSettings, ServiceClient

DEFAULT_URL = "http://127.0.0.1:8001"


def documents_of(corpus: Path) -> Iterator[dict[str, Any]]:
    """The corpus file's documents in order, each with its passages (rows of one `doc_id` must be adjacent, as
    `ingest` writes them)."""
    from services.retriever.corpus import CorpusError, parse_line
    from services.retriever.live import doc_id_of

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


async def _delete(args: argparse.Namespace) -> dict[str, Any]:
    client = _client(args)
    try:
        return dict((await client.request("POST", "/documents/delete", json={"ids": list(args.ids)})).json())
    finally:
        await client.aclose()


def add_parsers(sub: Any) -> None:
    for name, what in (("put", "add or replace the documents of a corpus file in a running retriever"),
                       ("delete", "delete documents from a running retriever")):
        p = sub.add_parser(name, help=what, description=what + " (through its API: PUT /documents, "
                           "POST /documents/delete)")
        if name == "put":
            p.add_argument("corpus", type=Path, metavar="CORPUS.jsonl",
                           help="passages with their doc_id (what `plugsearch-index ingest` writes)")
            p.add_argument("--batch", type=int, default=100, help="documents per request (default 100, at most 1000)")
            p.add_argument("--quiet", action="store_true", help="no progress bar")
        else:
            p.add_argument("ids", nargs="+", metavar="ID", help="document ids (every passage of each goes)")
        p.add_argument("--url", default=os.environ.get("PLUGSEARCH_RETRIEVER_URL", DEFAULT_URL),
                       help=f"the retriever (default $PLUGSEARCH_RETRIEVER_URL or {DEFAULT_URL})")
        p.add_argument("--token", default=None, help="the internal token or an admin key (default: "
                       "$PLUGSEARCH_INTERNAL_TOKEN, else $RETRIEVER_ADMIN_KEY)")
        p.add_argument("--timeout-s", type=float, default=300.0, help="per request (a batch is encoded before "
                       "it is acknowledged; default 300)")


def run(args: argparse.Namespace) -> int:
    """`put` / `delete`: prints the outcome as one JSON line; 0 on success, 1 when the retriever refused."""
    import json

    if args.command == "put" and not 1 <= args.batch <= 1000:
        raise SystemExit("error: --batch must be between 1 and 1000")
    if args.command == "put" and not args.corpus.is_file():
        raise SystemExit(f"error: {args.corpus} is not a file")
    try:
        result = asyncio.run(_put(args) if args.command == "put" else _delete(args))
    except ServiceError as exc:
        sys.stderr.write(f"error: the retriever at {args.url} answered {exc.status}: {exc.message}\n")
        return 1
    sys.stdout.write(json.dumps(result) + "\n")
    return 0
