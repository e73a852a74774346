"""Marks from use, kept in one SQLite file (the standard library's `sqlite3`): every answered search, and the
marks users put on them.

Tables (schema version `SCHEMA_VERSION`, in `meta`): `searches` (what a mark needs to become a labelled question:
the question, the returned documents' ids and titles, their text cut to `StoreLimits.text_chars` (0 by default:
the corpus holds it), the mode, the policy model, who searched (`key:<key id>`, never the key) and when) and
`marks` (one per search: helpful / not-helpful ids, the user's answer and comment, who marked and when; `seq`
grows with every mark, a replaced one too, so a reader pages on by it).

Durability, chosen per connection (`PRAGMA synchronous` is a connection's setting):
- marks: WAL + `synchronous=FULL`: the write-ahead log is synced before a mark is acknowledged, so an
  acknowledged mark survives a kill of the process and a power cut alike (a mark is rare: one fsync each);
- searches: written by one background thread per process (`SearchWriter`), in batches, WAL +
  `synchronous=NORMAL`: a committed batch survives a kill of the process (the log is in the operating system's
  hands); a power cut may lose the last batches, whose searches then cannot be marked (404), nothing else. The
  hot path of a search only queues a tuple (bounded: `MAX_PENDING`, past it a search is not recorded and counted).

Several worker processes (`SEARCHER_WORKERS`) open the same file: WAL lets them read while one writes; writes
wait for each other (`BUSY_TIMEOUT_S`). Bounded by `StoreLimits`: searches nobody marked are dropped after
`search_ttl_s` and beyond `max_searches` (oldest first); marks after `mark_ttl_s` and beyond `max_marks`; a marked
search is kept as long as its mark. Pruned by each writer every `PRUNE_EVERY_S`.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from plugsearch.common.errors import Forbidden, NotFound, NotReady, ValidationFailed
from plugsearch.common.sqlite import enable_wal

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 10.0
"""How long a write waits for another process's (then: 503, retry)."""
MAX_PENDING = 10_000
"""Searches queued for the writer at most; past it a search is not recorded (counted, logged)."""
WRITE_BATCH = 512
GATHER_S = 0.05
"""After a search arrives, the writer waits this long for more before it writes: a few batches a second instead of
one wake-up (and one commit) per search, which took the event loop's GIL on every search (naive top-k served about
a fifth fewer searches/s at 16 clients with marks on: docs/benchmarks.md). A mark flushes the writer first."""
PRUNE_EVERY_S = 60.0
TITLE_CHARS = 300
MAX_LISTED_IDS = 10
"""Unknown document ids named in a refusal."""

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS searches (
    search_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    question TEXT NOT NULL,
    mode TEXT NOT NULL,
    policy_model TEXT,
    documents TEXT NOT NULL,
    created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS searches_by_created ON searches (created);
CREATE TABLE IF NOT EXISTS marks (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    search_id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    marked_by TEXT NOT NULL,
    helpful TEXT NOT NULL,
    not_helpful TEXT NOT NULL,
    answer TEXT,
    comment TEXT,
    marked REAL NOT NULL);
CREATE INDEX IF NOT EXISTS marks_by_owner ON marks (owner, seq);
CREATE INDEX IF NOT EXISTS marks_by_marked ON marks (marked);
"""


class FeedbackStoreError(Exception):
    """The file cannot be used (written by a newer schema, not a feedback store, unreadable)."""


class SearchExpired(NotFound):
    """The search is older than the marking window (or was pruned)."""


@dataclass(frozen=True)
class StoreLimits:
    max_searches: int = 100_000
    """Searches nobody marked, at most (oldest dropped first)."""
    search_ttl_s: float = 7 * 24 * 3600.0
    """A search can be marked this long; unmarked, it is dropped after it."""
    max_marks: int = 100_000
    mark_ttl_s: float = 365 * 24 * 3600.0
    text_chars: int = 0
    """Characters of each returned document's text kept with the search (0: ids and titles only)."""


class SearchRecord(NamedTuple):
    """One answered search, as `SearchWriter.record` queues it (cheap to build on the hot path)."""

    search_id: str
    owner: str
    question: str
    mode: str
    policy_model: str | None
    documents: Sequence[tuple[str, str, str]]
    """(id, title, text) of each returned document, in order."""
    created: float


class StoredMark(NamedTuple):
    search_id: str
    helpful: list[str]
    not_helpful: list[str]
    replaced: bool
    marked_at: float


def connect(path: Path, *, synchronous: str) -> sqlite3.Connection:
    """A connection in WAL mode with explicit transactions (`BEGIN IMMEDIATE` ... `COMMIT`), shareable between
    threads under the caller's lock."""
    try:
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise FeedbackStoreError(f"{path}: cannot be opened: {exc}") from exc
    try:
        mode = enable_wal(conn, BUSY_TIMEOUT_S)
        if mode != "wal":
            raise FeedbackStoreError(f"{path}: cannot use write-ahead logging (journal mode {mode})")
        conn.execute(f"PRAGMA synchronous={synchronous}")
    except sqlite3.Error as exc:
        conn.close()
        raise FeedbackStoreError(f"{path}: cannot be used as a feedback store: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """`BEGIN IMMEDIATE` (the write lock, waiting up to `BUSY_TIMEOUT_S` for another process) ... `COMMIT`; rolled
    back when the block raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # the block failed, or the commit did: the connection is usable again after
            with suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


def unavailable(exc: sqlite3.Error) -> NotReady:
    """A storage failure as the answer to a caller: 503 + Retry-After, the reason in words (never a 500)."""
    busy = isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)
    reason = "busy (another worker is writing)" if busy else f"{type(exc).__name__}: {exc}"
    return NotReady(f"the feedback store cannot be used right now: {reason}", retry_after=1 if busy else 5)


def _ids(text: str) -> list[str]:
    value = json.loads(text)
    return [str(i) for i in value] if isinstance(value, list) else []


def _documents(text: str) -> list[tuple[str, str, str]]:
    value = json.loads(text)
    return [(str(d[0]), str(d[1]), str(d[2]) if len(d) > 2 else "") for d in value] if isinstance(value, list) else []


class FeedbackStore:
    """One process's handle on the file: its schema checked (created when new), the marks' connection
    (`synchronous=FULL`) for marks and reads, and, unless `writer` is False (tools that only read), the searches'
    writer thread (`SearchWriter`). Blocking: call it from a thread, never on the event loop."""

    def __init__(self, path: Path, limits: StoreLimits | None = None, *, writer: bool = True,
                 clock: Any = time.time) -> None:
        self.path = path
        self.limits = limits or StoreLimits()
        self.clock = clock
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(path, synchronous="FULL")
        try:
            self._init_schema()
            self.writer = SearchWriter(path, self.limits, clock=clock) if writer else None
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def open_existing(cls, path: Path) -> FeedbackStore:
        """An existing store, to read (`plugsearch-feedback`): refused when the file is missing."""
        if not path.is_file():
            raise FeedbackStoreError(f"{path}: no such feedback store")
        return cls(path, writer=False)

    def _init_schema(self) -> None:
        try:
            with transaction(self._conn) as conn:
                tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
                if tables and "meta" not in tables:
                    raise FeedbackStoreError(f"{self.path}: not a feedback store (tables: {', '.join(sorted(tables))})")
                for statement in SCHEMA.split(";"):  # not executescript: it would commit
                    if statement.strip():
                        conn.execute(statement)
                row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                if row is None:
                    conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
                elif int(row[0]) > SCHEMA_VERSION:
                    raise FeedbackStoreError(f"{self.path}: written by a newer plugsearch (schema version {row[0]}, "
                                             f"this one reads up to {SCHEMA_VERSION}): upgrade, or point "
                                             "SEARCHER_FEEDBACK_DB at another file")
        except sqlite3.DatabaseError as exc:
            raise FeedbackStoreError(f"{self.path}: cannot be used as a feedback store: {exc}") from exc

    # ------------------------------------------------------------------------------------------ marks
    def mark(self, search_id: str, *, marker: str, may_mark_any: bool, helpful: Sequence[str],
             not_helpful: Sequence[str], answer: str | None = None, comment: str | None = None) -> StoredMark:
        """Store the mark of `marker` on `search_id` (replacing its earlier one), synced before it returns.
        Raises `NotFound` (unknown id), `SearchExpired`, `Forbidden` (another key's search, unless
        `may_mark_any`), `ValidationFailed` (ids the search did not return, named), `NotReady` (storage)."""
        now = self.clock()
        try:
            with self._lock, transaction(self._conn) as conn:
                row = conn.execute("SELECT owner, documents, created FROM searches WHERE search_id = ?",
                                   (search_id,)).fetchone()
                if row is None:
                    raise NotFound("unknown search_id: no search with this id (never issued, or dropped after "
                                   "its marking window)", param="search_id")
                owner, documents, created = str(row[0]), _documents(row[1]), float(row[2])
                if created < now - self.limits.search_ttl_s:
                    raise SearchExpired(f"the search is older than the marking window "
                                        f"({self.limits.search_ttl_s / 3600:g} h): it can no longer be marked",
                                        param="search_id")
                if not may_mark_any and owner != marker:
                    raise Forbidden("a key may mark only its own searches (an admin key or the internal token may "
                                    "mark any)", param="search_id")
                returned = {d[0] for d in documents}
                for name, ids in (("helpful", helpful), ("not_helpful", not_helpful)):
                    unknown = [i for i in ids if i not in returned]
                    if unknown:
                        shown = ", ".join(unknown[:MAX_LISTED_IDS]) + (
                            f" and {len(unknown) - MAX_LISTED_IDS} more" if len(unknown) > MAX_LISTED_IDS else "")
                        raise ValidationFailed(f"{name}: not among the documents this search returned: {shown}",
                                               param=name)
                replaced = conn.execute("SELECT 1 FROM marks WHERE search_id = ?", (search_id,)).fetchone()
                conn.execute("INSERT OR REPLACE INTO marks (search_id, owner, marked_by, helpful, not_helpful, answer, "
                             "comment, marked) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (search_id, owner, marker, json.dumps(list(helpful)), json.dumps(list(not_helpful)),
                              answer, comment, now))
        except sqlite3.Error as exc:
            logger.warning("feedback store: a mark was not stored: %s", exc)
            raise unavailable(exc) from exc
        return StoredMark(search_id, list(helpful), list(not_helpful), replaced is not None, now)

    def has_search(self, search_id: str) -> bool:
        try:
            with self._lock:
                return self._conn.execute("SELECT 1 FROM searches WHERE search_id = ?",
                                          (search_id,)).fetchone() is not None
        except sqlite3.Error as exc:
            raise unavailable(exc) from exc

    def marks(self, *, owner: str | None = None, after: int = 0, limit: int | None = 100,
              since: float | None = None) -> list[dict[str, Any]]:
        """Marks after `seq` `after`, oldest first, with their searches (`FeedbackRecord`'s fields): every
        owner's, or `owner`'s alone; stored at or after `since`; at most `limit` (None: all)."""
        where: list[str] = ["m.seq > ?"]
        args: list[Any] = [after]
        if owner is not None:
            where.append("m.owner = ?")
            args.append(owner)
        if since is not None:
            where.append("m.marked >= ?")
            args.append(since)
        sql = ("SELECT m.seq, m.search_id, m.owner, s.question, s.mode, s.policy_model, s.documents, m.helpful, "
               "m.not_helpful, m.answer, m.comment, s.created, m.marked FROM marks m JOIN searches s "
               f"ON s.search_id = m.search_id WHERE {' AND '.join(where)} ORDER BY m.seq")
        if limit is not None:
            sql += " LIMIT ?"
            args.append(limit)
        try:
            with self._lock:
                rows = self._conn.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise unavailable(exc) from exc
        return [{"seq": r[0], "search_id": r[1], "owner": r[2], "question": r[3], "mode": r[4], "policy_model": r[5],
                 "documents": [{"id": d[0], "title": d[1]} for d in _documents(r[6])],
                 "helpful": _ids(r[7]), "not_helpful": _ids(r[8]), "answer": r[9], "comment": r[10],
                 "searched_at": r[11], "marked_at": r[12]} for r in rows]

    def iter_marks(self, *, since: float | None = None, page: int = 1000) -> Iterator[dict[str, Any]]:
        """Every mark (oldest first), a page at a time."""
        after = 0
        while True:
            rows = self.marks(after=after, limit=page, since=since)
            yield from rows
            if len(rows) < page:
                return
            after = rows[-1]["seq"]

    def stats(self) -> dict[str, Any]:
        """Counts: searches, marks, helpful / not-helpful ids, by mode and policy model, the schema version."""
        try:
            with self._lock:
                c = self._conn
                searches = c.execute("SELECT count(*) FROM searches").fetchone()[0]
                version = c.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
                span = c.execute("SELECT min(created), max(created) FROM searches").fetchone()
        except sqlite3.Error as exc:
            raise unavailable(exc) from exc
        out = mark_stats(self.iter_marks())
        out.update(searches=searches, schema_version=int(version[0]) if version else None,
                   first_search=span[0], last_search=span[1], bytes=_size(self.path))
        return out

    def prune(self) -> tuple[int, int]:
        """Drop what the limits no longer keep (`prune`); (searches, marks) dropped."""
        with self._lock:
            return prune(self._conn, self.limits, self.clock())

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        with self._lock:
            self._conn.close()


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def mark_stats(marks: Iterator[dict[str, Any]] | Sequence[dict[str, Any]]) -> dict[str, Any]:
    """What `plugsearch-feedback stats` says of marks (`FeedbackRecord` dicts), wherever they were read from."""
    out: dict[str, Any] = {"marks": 0, "marks_with_helpful": 0, "helpful_ids": 0, "not_helpful_ids": 0,
                           "with_answer": 0, "with_comment": 0, "owners": 0, "by_mode": {}, "by_policy_model": {},
                           "first_mark": None, "last_mark": None}
    owners: set[str] = set()
    for m in marks:
        out["marks"] += 1
        out["marks_with_helpful"] += bool(m["helpful"])
        out["helpful_ids"] += len(m["helpful"])
        out["not_helpful_ids"] += len(m["not_helpful"])
        out["with_answer"] += m.get("answer") is not None
        out["with_comment"] += m.get("comment") is not None
        owners.add(m["owner"])
        for key, value in (("by_mode", m["mode"]), ("by_policy_model", m.get("policy_model") or "none")):
            out[key][value] = out[key].get(value, 0) + 1
        at = m["marked_at"]
        out["first_mark"] = at if out["first_mark"] is None else min(out["first_mark"], at)
        out["last_mark"] = at if out["last_mark"] is None else max(out["last_mark"], at)
    out["owners"] = len(owners)
    return out


def prune(conn: sqlite3.Connection, limits: StoreLimits, now: float) -> tuple[int, int]:
    """In one transaction: marks past `mark_ttl_s`, then the oldest past `max_marks`; searches nobody marked past
    `search_ttl_s`, then the oldest past `max_searches`. (searches, marks) dropped."""
    unmarked = "NOT EXISTS (SELECT 1 FROM marks m WHERE m.search_id = searches.search_id)"
    with transaction(conn) as c:
        marks = c.execute("DELETE FROM marks WHERE marked < ?", (now - limits.mark_ttl_s,)).rowcount
        excess = c.execute("SELECT count(*) FROM marks").fetchone()[0] - limits.max_marks
        if excess > 0:
            marks += c.execute("DELETE FROM marks WHERE seq IN (SELECT seq FROM marks ORDER BY seq LIMIT ?)",
                               (excess,)).rowcount
        searches = c.execute(f"DELETE FROM searches WHERE created < ? AND {unmarked}",
                             (now - limits.search_ttl_s,)).rowcount
        excess = (c.execute("SELECT count(*) FROM searches").fetchone()[0]
                  - c.execute("SELECT count(*) FROM marks").fetchone()[0] - limits.max_searches)
        if excess > 0:
            searches += c.execute(f"DELETE FROM searches WHERE rowid IN (SELECT rowid FROM searches WHERE {unmarked} "
                                  "ORDER BY created LIMIT ?)", (excess,)).rowcount
    return searches, marks


class _Flush(NamedTuple):
    done: threading.Event


_STOP = object()


class SearchWriter:
    """The searches' writer: one thread with its own connection (`synchronous=NORMAL`), writing what `record`
    queued in batches (whatever queued within `GATHER_S` of a search, up to `WRITE_BATCH`), and pruning
    every `PRUNE_EVERY_S`. `record` never blocks: past `MAX_PENDING` queued, the search is not recorded."""

    def __init__(self, path: Path, limits: StoreLimits, *, clock: Any = time.time) -> None:
        self.limits = limits
        self.clock = clock
        self.recorded = 0
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=MAX_PENDING)
        self._conn = connect(path, synchronous="NORMAL")
        self._pruned_at = 0.0
        self._thread = threading.Thread(target=self._run, name="feedback-writer", daemon=True)
        self._thread.start()

    def record(self, search: SearchRecord) -> bool:
        """Queue one search (False: the queue is full, the search is not recorded)."""
        try:
            self._queue.put_nowait(search)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("feedback store: %d searches not recorded (the writer is behind; they cannot be "
                               "marked)", self.dropped)
            return False
        return True

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every search queued before this call is written (True), or `timeout_s` passed."""
        done = threading.Event()
        try:
            self._queue.put(_Flush(done), timeout=timeout_s)
        except queue.Full:
            return False
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the thread and close its connection."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                items = [self._queue.get()]
                if isinstance(items[0], SearchRecord):
                    time.sleep(GATHER_S)
                while len(items) < WRITE_BATCH:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                searches = [i for i in items if isinstance(i, SearchRecord)]
                try:
                    if searches:
                        self._write(searches)
                except Exception:  # a bug: logged, and the thread goes on
                    self.failed += len(searches)
                    logger.exception("feedback store: the writer failed on %d searches", len(searches))
                for item in items:
                    if isinstance(item, _Flush):
                        item.done.set()
                if any(item is _STOP for item in items):
                    return
                try:
                    self._maybe_prune()
                except Exception:
                    logger.exception("feedback store: pruning failed")
        finally:
            self._conn.close()

    def _write(self, searches: Sequence[SearchRecord]) -> None:
        chars = self.limits.text_chars
        rows = [(s.search_id, s.owner, s.question, s.mode, s.policy_model,
                 json.dumps([[d[0], d[1][:TITLE_CHARS], d[2][:chars]] if chars else [d[0], d[1][:TITLE_CHARS]]
                             for d in s.documents], ensure_ascii=False), s.created) for s in searches]
        try:
            with transaction(self._conn) as conn:
                conn.executemany("INSERT OR IGNORE INTO searches (search_id, owner, question, mode, policy_model, "
                                 "documents, created) VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
            self.recorded += len(rows)
        except sqlite3.Error as exc:
            self.failed += len(rows)
            logger.warning("feedback store: %d searches not recorded: %s", len(rows), exc)

    def _maybe_prune(self) -> None:
        now = self.clock()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        try:
            searches, marks = prune(self._conn, self.limits, now)
        except sqlite3.Error as exc:
            logger.warning("feedback store: pruning failed: %s", exc)
            return
        if searches or marks:
            logger.info("feedback store: dropped %d searches and %d marks past their limits", searches, marks)
