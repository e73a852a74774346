"""`plugsearch-feedback`: marks from use as training data.

    plugsearch-feedback export --db var/feedback/searcher.sqlite3 --out marks.jsonl [--since 2026-11-01] [--min-helpful 1]
    plugsearch-feedback export --url http://127.0.0.1:8000 --api-key ADMIN_KEY --out marks.jsonl
    plugsearch-feedback stats --db var/feedback/searcher.sqlite3

`export` writes one labelled question per marked search (JSONL), the shape `plugsearch-train compact --feedback`
reads: `{"id", "question", "passage_ids": [helpful ids], "negative_ids": [not helpful ids], "answer" (when the user
gave one), "source": "feedback"}`; a search with fewer than `--min-helpful` helpful documents is left out. From the
file (`--db`, read only: the searcher may keep running), or from a running searcher (`--url`, `GET /feedback`: every
key's marks with an admin key or the internal token, a plain key's own marks with it). The file is written whole or
not at all. The last line on stdout is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

DEFAULT_DB = Path("var/feedback/searcher.sqlite3")
"""Where the searcher keeps its marks unless `SEARCHER_FEEDBACK_DB` says otherwise (plugsearch-stack: in --var-dir)."""


def training_row(mark: dict[str, Any]) -> dict[str, Any]:
    """One marked search as a labelled question (`FeedbackRecord` fields in, the trainer's row out)."""
    row: dict[str, Any] = {"id": f"feedback-{mark['search_id']}", "question": mark["question"],
                           "passage_ids": list(mark["helpful"]), "negative_ids": list(mark["not_helpful"])}
    if mark.get("answer"):
        row["answer"] = mark["answer"]
    row["source"] = "feedback"
    return row


def parse_since(value: str) -> float:
    """Unix seconds, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a time: {value!r} (Unix seconds, or ISO 8601 such as 2026-11-01 or "
                                         "2026-11-01T12:00:00+01:00)") from exc
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _iso(seconds: float | None) -> str | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


def marks_from_db(path: Path, since: float | None) -> Iterator[dict[str, Any]]:
    from plugsearch.searcher.feedback.store import FeedbackStore

    store = FeedbackStore.open_existing(path)
    try:
        yield from store.iter_marks(since=since)
    finally:
        store.close()


def marks_from_url(url: str, api_key: str | None, since: float | None) -> Iterator[dict[str, Any]]:
    from plugsearch.client import SearchClient

    with SearchClient(url, api_key=api_key) as client:
        for record in client.marks(since=since):
            yield record.model_dump()


def _source(args: argparse.Namespace) -> Iterable[dict[str, Any]]:
    since = getattr(args, "since", None)
    if args.url:
        return marks_from_url(args.url, args.api_key or os.environ.get("PLUGSEARCH_API_KEY"), since)
    return marks_from_db(Path(args.db or os.environ.get("SEARCHER_FEEDBACK_DB") or DEFAULT_DB), since)


def export(marks: Iterable[dict[str, Any]], out: Path, *, min_helpful: int = 1) -> dict[str, Any]:
    """Write the training rows of `marks` to `out` (whole or not at all); what was written and left out."""
    from plugsearch.common.files import atomic_writer

    written = skipped = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(out) as fh:
        for mark in marks:
            if len(mark["helpful"]) < min_helpful:
                skipped += 1
                continue
            fh.write((json.dumps(training_row(mark), ensure_ascii=False) + "\n").encode())
            written += 1
    return {"out": str(out), "rows": written, "marks": written + skipped, "left_out_min_helpful": skipped,
            "min_helpful": min_helpful}


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    summary = export(_source(args), Path(args.out), min_helpful=args.min_helpful)
    summary["since"] = _iso(args.since)
    return summary


def cmd_stats(args: argparse.Namespace) -> dict[str, Any]:
    from plugsearch.searcher.feedback.store import FeedbackStore, mark_stats

    if args.url:
        out = mark_stats(list(_source(args)))
        out["searches"] = None  # a searcher answers with marks only; the file knows its searches
    else:
        store = FeedbackStore.open_existing(Path(args.db or os.environ.get("SEARCHER_FEEDBACK_DB") or DEFAULT_DB))
        try:
            out = store.stats()
        finally:
            store.close()
        out["first_search"], out["last_search"] = _iso(out["first_search"]), _iso(out["last_search"])
    out["first_mark"], out["last_mark"] = _iso(out["first_mark"]), _iso(out["last_mark"])
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="plugsearch-feedback", description=(__doc__ or "").split("\n")[0],
                                     epilog="See docs/training.md, \"Marks from use\".")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, what in (("export", "the marks as labelled questions (JSONL) for plugsearch-train compact --feedback"),
                       ("stats", "counts of searches and marks")):
        p = sub.add_parser(name, help=what)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--db", help=f"the searcher's feedback file (default: $SEARCHER_FEEDBACK_DB, else {DEFAULT_DB})")
        where.add_argument("--url", help="a running searcher instead (GET /feedback)")
        p.add_argument("--api-key", help="with --url: an admin key or the internal token for every key's marks, a "
                       "plain key for its own (default: $PLUGSEARCH_API_KEY)")
        if name == "export":
            p.add_argument("--since", type=parse_since, default=None,
                           help="only marks stored at or after this time (Unix seconds or ISO 8601, UTC by default)")
            p.add_argument("--out", required=True, help="the JSONL file to write")
            p.add_argument("--min-helpful", type=int, default=1, help="leave out searches with fewer helpful "
                           "documents (default 1: a search marked only not-helpful teaches no positive)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from plugsearch.common.errors import ServiceError
    from plugsearch.searcher.feedback.store import FeedbackStoreError

    try:
        result = cmd_export(args) if args.command == "export" else cmd_stats(args)
    except (FeedbackStoreError, ServiceError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
