"""`plugsearch-index compact` and `plugsearch-index changes status|carry|retire|repair`: the change log of the
configured corpus (RETRIEVER_CORPUS, RETRIEVER_INDEX_DIR, RETRIEVER_CHANGES_DIR, as the retriever reads them),
looked after from the command line. Each prints one JSON line.

- `compact` folds every logged change into new indexes (`plugsearch.retriever.live.compaction`); a running retriever
  moves to them at its next poll. Exit 0 (done, or nothing to fold, or another compaction running), 3 (refused: the
  reason on stderr).
- `changes status`: the log's sequence numbers, its generation, whether every record reads back, and the earlier
  versions of the corpus whose changes are not carried.
- `changes carry` / `retire`: the changes of an earlier version of the corpus applied to this one, or dropped on
  purpose (`plugsearch.retriever.live.carry`).
- `changes repair --drop-from N`: drops the records from change N on (a damaged record and those after it: they are
  lost, say so to whoever made them). Sequence numbers go on after the last one ever given, so no index id is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from plugsearch.retriever.live import carry
from plugsearch.retriever.live.changelog import ChangeLog, ChangeLogError, ChangeNotWritten, log_folder


def add_parsers(sub: Any, paths: argparse.ArgumentParser) -> None:
    compact = sub.add_parser("compact", parents=[paths], help="fold the changes made while serving into new indexes")
    compact.add_argument("--quiet", action="store_true", help="no progress bars")
    compact.add_argument("--nice", type=int, default=0, help="lower this process's CPU priority by N first")
    changes = sub.add_parser("changes", help="the change log: status, carry, retire, repair")
    actions = changes.add_subparsers(dest="action", required=True)
    actions.add_parser("status", parents=[paths], help="what the change log holds, and whether it reads back")
    actions.add_parser("carry", parents=[paths],
                       help="apply the changes of an earlier version of the corpus (a rebuild) to this one")
    actions.add_parser("retire", parents=[paths],
                       help="drop the changes of an earlier version of the corpus, on purpose")
    repair = actions.add_parser("repair", parents=[paths], help="drop a damaged record and every change after it")
    repair.add_argument("--drop-from", type=int, required=True, metavar="SEQ",
                        help="the first change dropped (the damaged record `status` names)")


def _folder(settings: Any) -> tuple[Path, str]:
    from plugsearch.retriever.store.docstore import corpus_checksum

    checksum = corpus_checksum(settings.corpus, settings.index_dir)
    return log_folder(settings.index_dir, settings.changes_dir, checksum), checksum


def run(args: argparse.Namespace, settings: Any) -> int:
    """Exit status: 0 done, 2 an error, 3 compaction refused."""
    folder, checksum = _folder(settings)
    if args.command == "compact":
        return _compact(args, settings, folder, checksum)
    registry = carry.registry_path(settings.index_dir, settings.changes_dir)
    out: dict[str, Any]
    try:
        if args.action == "status":
            out = status(folder, registry, settings.corpus, checksum)
        elif args.action == "carry":
            out = {"carried": carry.carry(registry, settings.corpus, checksum, folder), "log": str(folder)}
        elif args.action == "retire":
            out = {"retired": carry.retire(registry, settings.corpus, checksum)}
        else:
            out = repair(folder, args.drop_from)
    except (ChangeLogError, ChangeNotWritten) as exc:
        sys.stderr.write(f"error: {getattr(exc, 'reason', exc)}\n")
        return 2
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


def _compact(args: argparse.Namespace, settings: Any, folder: Path, checksum: str) -> int:
    from plugsearch.retriever.live.compaction import CompactionRefused, compact

    if args.nice:
        os.nice(args.nice)
    if not (folder / "changes.sqlite3").is_file():
        sys.stdout.write(json.dumps({"generation": None, "reason": f"no change log in {folder}"}) + "\n")
        return 0
    try:
        generation = compact(settings, folder, checksum, show_progress=not args.quiet)
    except CompactionRefused as exc:
        sys.stderr.write(f"error: compaction refused: {exc}\n")
        return 3
    except (ChangeLogError, ChangeNotWritten) as exc:
        sys.stderr.write(f"error: {getattr(exc, 'reason', exc)}\n")
        return 2
    out: dict[str, Any]
    if generation is None:
        out = {"generation": None, "reason": "nothing to fold, or another compaction is running"}
    else:
        out = {"generation": generation.gen, "folded": generation.folded, **generation.body}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


def status(folder: Path, registry: Path, corpus: Path, checksum: str) -> dict[str, Any]:
    out: dict[str, Any] = {"log": str(folder), "corpus_checksum": checksum}
    try:
        log = ChangeLog(folder, writable=False)
    except ChangeLogError as exc:
        return {**out, "readable": False, "error": exc.reason}
    try:
        generation = log.generation()
        out.update({"epoch": log.epoch, "last_seq": log.last_seq, "folded_away": log.pruned,
                    "generation": generation.gen, "generation_folds": generation.folded})
        try:
            count = sum(1 for _ in log.iter_after(log.pruned))
            out.update({"changes": count, "readable": True, "error": None})
        except ChangeLogError as exc:
            out.update({"readable": False, "error": exc.reason, "bad_record": exc.record,
                        "changes_before_it": len(exc.changes)})
    finally:
        log.close()
    out["not_carried"] = [{"log": str(e.folder), "checksum": e.checksum, "last_seq": e.last_seq}
                          for e in carry.earlier_logs(registry, corpus, checksum)]
    return out


def repair(folder: Path, drop_from: int) -> dict[str, Any]:
    log = ChangeLog(folder)
    try:
        dropped = log.drop_from(drop_from)
    finally:
        log.close()
    return {"log": str(folder), "dropped": dropped, "next_seq": dropped["last_seq"] + 1}
