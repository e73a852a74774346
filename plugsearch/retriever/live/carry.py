"""A rebuilt corpus and the changes acknowledged against the one before it: carried forward, or dropped on purpose,
never silently.

There is one change log per corpus checksum, so a corpus rebuilt at the same path (a folder ingested again with one
more file, then `plugsearch-index build`) starts a new, empty log, and the changes acknowledged against the old
corpus would simply stop being served. So each log is registered by its corpus file's path, in a registry shared by
the index folders of one place (`.changes-registry.json` beside RETRIEVER_INDEX_DIR, the local stack's
`var/indexes/`, whose index folders are named by the corpus's content; `registry.json` inside RETRIEVER_CHANGES_DIR
when that is set), and the retriever refuses to start on a corpus while an earlier version's log still holds changes
that were neither carried nor retired:

- `plugsearch-index changes carry` appends them to this corpus's log (each document's net change as of the old log's
  last compaction, then its changes after it, in order: a document put through the API replaces the rebuilt
  corpus's version of it, one deleted is deleted again), then marks the old log carried;
- `plugsearch-index changes retire` marks the old log retired: its changes are dropped, on purpose.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from plugsearch.common.files import atomic_write_json
from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import ChangeLog, ChangeLogError, ChangeLogUnavailable

logger = logging.getLogger(__name__)

RETIRED = "retired"
"""The log's meta key set once its changes are carried to another corpus, or dropped."""
CARRY_BATCH = 500
"""Documents per change when carrying."""


class ChangesNotCarried(ChangeLogUnavailable):
    """Changes acknowledged against an earlier version of the corpus are not in this one."""


@dataclass(frozen=True)
class EarlierLog:
    """A log of an earlier version of the corpus that still holds changes."""

    folder: Path
    checksum: str
    last_seq: int
    documents: int
    """Documents its folded changes touched (net), plus its changes still in the log."""
    last_at: float


def registry_path(index_dir: Path, changes_dir: Path | None) -> Path:
    """Where the logs of every corpus served from this place are registered (see the module's docstring)."""
    return changes_dir / "registry.json" if changes_dir is not None else index_dir.parent / ".changes-registry.json"


def _read(registry: Path, corpus: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(registry.read_text())
    except (OSError, ValueError):
        return {}
    logs = data.get(str(corpus.resolve())) if isinstance(data, dict) else None
    return logs if isinstance(logs, dict) else {}


def register(registry: Path, corpus: Path, checksum: str, folder: Path) -> None:
    """Record that `folder` holds the changes of `corpus` at `checksum` (best effort: a registry that cannot be
    written is logged: a rebuild of this corpus will not know of this log's changes)."""
    key = str(folder.resolve())
    if _read(registry, corpus).get(key, {}).get("checksum") == checksum:
        return
    try:
        registry.parent.mkdir(parents=True, exist_ok=True)
        with open(registry.with_name(registry.name + ".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                data = json.loads(registry.read_text()) if registry.is_file() else {}
            except ValueError:
                data = {}
            logs = data.setdefault(str(corpus.resolve()), {})
            logs[key] = {"checksum": checksum, "registered": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            atomic_write_json(registry, data, indent=2, mode=0o600)
    except OSError as exc:
        logger.warning("cannot register the change log of %s in %s (%s): a rebuild of this corpus will not know of "
                       "its changes", corpus, registry, exc.strerror or exc)


def earlier_logs(registry: Path, corpus: Path, checksum: str) -> list[EarlierLog]:
    """The logs of earlier versions of `corpus` that hold changes neither carried nor retired."""
    out = []
    for key, entry in _read(registry, corpus).items():
        folder = Path(key)
        if entry.get("checksum") == checksum or not folder.is_dir():
            continue
        try:
            log = ChangeLog(folder, writable=False)
        except ChangeLogError:
            if any(folder.glob("changes.*")):
                out.append(EarlierLog(folder, str(entry.get("checksum")), -1, -1, 0.0))  # unreadable: still refused
            continue
        try:
            if log.meta(RETIRED) is not None or log.last_seq == 0:
                continue
            unfolded = log.read_after(log.pruned)
            net = sum(1 for _ in log.net_changes())
            out.append(EarlierLog(folder, str(entry.get("checksum")), log.last_seq, net + len(unfolded),
                                  unfolded[-1].at if unfolded else 0.0))
        finally:
            log.close()
    return out


def refusal(registry: Path, corpus: Path, checksum: str) -> str | None:
    """Why the retriever may not serve `corpus` yet (None: it may)."""
    earlier = earlier_logs(registry, corpus, checksum)
    if not earlier:
        return None
    described = "; ".join(
        f"{e.folder} (sha256 {e.checksum.split(':')[-1][:12]}: changes up to {e.last_seq}"
        + (f", the last at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(e.last_at))} UTC" if e.last_at else "")
        + ")" for e in earlier)
    return (f"changes acknowledged against an earlier version of {corpus} are not in this one: {described}. Carry "
            "them to this corpus with `plugsearch-index changes carry`, or drop them on purpose with "
            "`plugsearch-index changes retire`; then start the retriever again")


def _batches(earlier: ChangeLog) -> Iterator[tuple[list[Passage], list[str]]]:
    """The earlier log's changes as (put, delete) steps, in order: its net changes, then its changes after them."""
    put: list[Passage] = []
    delete: list[str] = []
    documents = 0
    for doc_id, passages in earlier.net_changes():
        if passages is None:
            delete.append(doc_id)
        else:
            put.extend(passages)
        documents += 1
        if documents >= CARRY_BATCH:
            yield put, delete
            put, delete, documents = [], [], 0
    if put or delete:
        yield put, delete
    for change in earlier.iter_after(earlier.pruned):
        yield list(change.put), list(change.delete)


def carry(registry: Path, corpus: Path, checksum: str, folder: Path) -> list[dict[str, object]]:
    """Append the changes of every earlier log of `corpus` to the log in `folder` (this checksum's), then mark each
    carried. Returns what was carried, per log."""
    done = []
    log = ChangeLog(folder)
    try:
        register(registry, corpus, checksum, folder)
        for entry in earlier_logs(registry, corpus, checksum):
            earlier = ChangeLog(entry.folder)  # writable: marked carried at the end
            try:
                steps = put = deleted = 0
                first = log.last_seq + 1
                for passages, ids in _batches(earlier):
                    if passages or ids:
                        log.append(passages, ids)
                        steps, put, deleted = steps + 1, put + len(passages), deleted + len(ids)
                earlier.set_meta(RETIRED, f"carried to {checksum} (changes {first} to {log.last_seq} of {folder}) at "
                                          f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
                done.append({"from": str(entry.folder), "changes": steps, "passages_put": put,
                             "documents_deleted": deleted})
            finally:
                earlier.close()
    finally:
        log.close()
    return done


def retire(registry: Path, corpus: Path, checksum: str) -> list[str]:
    """Mark every earlier log of `corpus` retired: its changes are dropped. Returns their folders."""
    out = []
    for entry in earlier_logs(registry, corpus, checksum):
        with contextlib.closing(ChangeLog(entry.folder)) as earlier:
            earlier.set_meta(RETIRED, f"retired by the operator at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        out.append(str(entry.folder))
    return out
