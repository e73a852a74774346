"""The retriever's change log: every change to the served corpus (documents put, replacing all their passages, or
deleted), durable before it is acknowledged, read by every worker; the dense vectors of the passages put, beside
their change; and the generations compaction built (`plugsearch.retriever.live.compaction`).

One SQLite file (`changes.sqlite3`, the standard library's `sqlite3`) in write-ahead-log mode with
`synchronous=FULL`: a change is one transaction (its record, its vectors when the writer encoded them, the log's
last sequence number), committed and synced before `append` returns, so an acknowledged change survives a kill of
the process or a power cut, and the workers of one retriever (each its own process) append one at a time and read
while one writes. SQLite checksums the frames of its write-ahead log: a commit a crash tore is not in the log when
it is next opened (it was never acknowledged). Each record also carries its own CRC32 (of its sequence number, time
and body), so a record damaged on the disk later is found when it is read, with its sequence number.

Recovery rules (docs/operations.md, "Changes: durability and recovery"):
- a torn last write is cut: SQLite's recovery drops a commit that never finished (the legacy JSONL log: a last line
  without a valid CRC, cut once, when the log is migrated);
- any other bad record (its CRC does not match, its body does not decode, a sequence number missing between two
  present), a file SQLite calls malformed, or a log that cannot be opened for writing is `ChangeLogError`: the
  service is not ready and says why and which record, or, with RETRIEVER_CHANGES_ON_ERROR=read-only, serves the
  changes before the bad record and refuses writes; never the base corpus as if nothing had been acknowledged;
- sequence numbers are never reused: the last one given is kept in the log (`meta.last_seq`), also past the
  changes compaction folded away; `epoch`, drawn when the log is created, tells two logs apart in index ids.

Files are the owner's alone: the folder 0700, the log (and SQLite's -wal and -shm beside it) 0600. A log written by
the earlier format (`changes.jsonl`, one CRC-checked line per change, vectors in `vectors/<seq>.npy`) is migrated
once, under the log's lock, into a new SQLite file with the same sequence numbers; the old file is kept, renamed
`changes.jsonl.migrated`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from plugsearch.common.files import atomic_path, fsync_folder
from plugsearch.common.sqlite import enable_wal
from plugsearch.retriever.ingest.passages import Passage

logger = logging.getLogger(__name__)

LOG_FILE = "changes.sqlite3"
LOCK_FILE = "changes.lock"
LEGACY_FILE = "changes.jsonl"
LEGACY_VECTORS = "vectors"
MIGRATED_SUFFIX = ".migrated"
FORMAT = 2
BUSY_TIMEOUT_S = 30.0
"""How long a write waits for another process's (then it fails: 503, retry)."""
READ_PAGE = 512
"""Changes read per query while replaying (bounded memory per step)."""
FOLDER_MODE, FILE_MODE = 0o700, 0o600

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS changes (seq INTEGER PRIMARY KEY, at REAL NOT NULL, body BLOB NOT NULL,
                                    crc INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS vectors (id INTEGER PRIMARY KEY AUTOINCREMENT, seq INTEGER NOT NULL,
                                    first INTEGER NOT NULL, rows INTEGER NOT NULL, dims INTEGER NOT NULL,
                                    data BLOB NOT NULL, crc INTEGER NOT NULL, UNIQUE (seq, first));
CREATE TABLE IF NOT EXISTS generations (gen INTEGER PRIMARY KEY, folded INTEGER NOT NULL, body BLOB NOT NULL,
                                        crc INTEGER NOT NULL, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS net (doc_id TEXT PRIMARY KEY, body BLOB NOT NULL, crc INTEGER NOT NULL);
"""
"""`changes`: one row per change not yet folded away; `vectors`: the dense vectors of passages put, `rows` of them
from the change's passage `first` on (the writer's, or a worker's that encoded them later); `generations`: the
indexes compaction built, each folding the changes up to `folded`; `net`: per document changed since the built
corpus, its passages as of the last generation (or none: deleted), what carrying the changes to a rebuilt corpus
needs once their records are folded away."""


CHANGES_DIR = "changes"


def log_folder(index_dir: Path, changes_dir: Path | None, checksum: str) -> Path:
    """The log of the corpus with `checksum`: one per corpus, under RETRIEVER_CHANGES_DIR (default
    RETRIEVER_INDEX_DIR/changes)."""
    return (changes_dir or index_dir / CHANGES_DIR) / checksum.split(":")[-1][:16]


class ChangeLogError(RuntimeError):
    """The log cannot be used as it is: `reason` (what and where), `record` (the sequence number or line of the bad
    record, None when the log could not be opened at all), `changes` (those read before it, in order)."""

    def __init__(self, reason: str, *, record: int | None = None, changes: Sequence[Change] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.record = record
        self.changes = list(changes)


class ChangeLogUnavailable(ChangeLogError):
    """The log cannot be opened, or not for writing (a read-only or failing file system, no permission)."""


class ChangeLogDamaged(ChangeLogError):
    """A record that is not the torn last write does not read back as written."""


class ChangeNotWritten(Exception):
    """A change could not be committed (a full or read-only disk, an I/O error, a lock held too long): nothing was
    changed. `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class FoldedAway(Exception):
    """The changes asked for were folded into a generation and are no longer in the log: load that generation."""


@dataclass(frozen=True)
class Change:
    """One acknowledged change: `put`, the passages of the documents put (each replaces every passage its document
    had), `delete`, the documents deleted."""

    seq: int
    put: tuple[Passage, ...]
    delete: tuple[str, ...]
    at: float

    @property
    def documents_put(self) -> list[str]:
        return list(dict.fromkeys(p.doc_id for p in self.put))


@dataclass(frozen=True)
class Vectors:
    """Dense vectors of the passages `first` .. `first + len(array) - 1` of change `seq`; `id` orders them in the
    log (a reader follows new ones by it)."""

    id: int
    seq: int
    first: int
    array: npt.NDArray[np.float32]


@dataclass(frozen=True)
class Generation:
    """Indexes compaction built: number `gen`, folding every change up to `folded`; `body` says where they are and
    what they hold (`plugsearch.retriever.live.compaction`)."""

    gen: int
    folded: int
    body: dict[str, Any] = field(default_factory=dict)


NO_GENERATION = Generation(0, 0, {})


def _crc(*parts: bytes) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def _passage_row(p: Passage) -> dict[str, str]:
    return {"id": p.id, "doc_id": p.doc_id, "title": p.title, "text": p.text}


def _passage(row: Mapping[str, Any]) -> Passage:
    return Passage(id=row["id"], doc_id=row["doc_id"], title=row.get("title", ""), text=row["text"])


def encode_change(seq: int, at: float, put: Sequence[Passage], delete: Sequence[str]) -> tuple[bytes, int]:
    body = orjson.dumps({"seq": seq, "at": at, "delete": list(delete), "put": [_passage_row(p) for p in put]})
    return body, _crc(str(seq).encode(), b"\0", body)


def decode_change(seq: int, body: bytes, crc: int) -> Change:
    """The change of a record; ChangeLogDamaged when it does not read back as written."""
    if _crc(str(seq).encode(), b"\0", bytes(body)) != crc:
        raise ChangeLogDamaged(f"change {seq}: its checksum does not match (the record was damaged on the disk)",
                               record=seq)
    try:
        data = orjson.loads(body)
        if int(data["seq"]) != seq:
            raise ValueError(f"the record names change {data['seq']}")
        return Change(seq, tuple(_passage(p) for p in data.get("put", ())), tuple(data.get("delete", ())),
                      float(data["at"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise ChangeLogDamaged(f"change {seq}: its record does not decode ({exc})", record=seq) from exc


def _vector_crc(seq: int, first: int, data: bytes) -> int:
    return _crc(f"{seq}:{first}".encode(), b"\0", data)


def _sql_reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _unavailable(exc: sqlite3.Error) -> bool:
    """Whether an SQLite error means the file cannot be used here (as opposed to damaged content)."""
    text = str(exc).lower()
    return any(s in text for s in ("unable to open", "readonly", "read-only", "disk i/o", "locked", "permission",
                                   "no such file", "full"))


def private_folder(folder: Path) -> None:
    """`folder` (and its missing parents) created, and `folder` itself made the owner's alone."""
    folder.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    if folder.stat().st_mode & 0o777 != FOLDER_MODE:
        os.chmod(folder, FOLDER_MODE)


class ChangeLog:
    """The log in `folder`. `writable` (the default): created when missing (a legacy JSONL log migrated), checked
    to take writes, ChangeLogUnavailable when it cannot; False: opened for reading only (a log on a read-only
    file system, served read-only)."""

    def __init__(self, folder: Path, *, writable: bool = True) -> None:
        self.folder = folder
        self.path = folder / LOG_FILE
        self.writable = writable
        self._holder: int | None = None
        """The thread holding the lock through `hold` (its appends do not take it again)."""
        self._lock = threading.Lock()
        try:
            if writable:
                private_folder(folder)
                _probe_write(folder)
                if not self.path.exists():
                    with self._locked():
                        if not self.path.exists():
                            self._create()
                self._private_files()
            elif not self.path.exists():
                raise ChangeLogUnavailable(f"no change log at {self.path}")
        except OSError as exc:
            raise ChangeLogUnavailable(f"the change log in {folder} cannot be written: "
                                       f"{exc.strerror or exc}") from exc
        self._conn = self._connect()
        meta = self._meta()
        if int(meta.get("format", "0")) > FORMAT:
            self.close()
            raise ChangeLogUnavailable(f"{self.path} was written by a newer version (format {meta['format']})")
        self.epoch = meta.get("epoch", "")
        self.corpus = meta.get("corpus", "")
        if writable:
            self._check_writable()

    # ------------------------------------------------------------------------------------------- opening
    def _create(self) -> None:
        """A new log (the legacy JSONL log's changes in it, when there is one), built under a temporary name and
        renamed into place whole."""
        with atomic_path(self.path, mode=FILE_MODE) as tmp:  # the new log appears whole, 0600, or not at all
            self._fill(tmp)
        legacy = self.folder / LEGACY_FILE
        if legacy.is_file():
            os.replace(legacy, legacy.with_name(LEGACY_FILE + MIGRATED_SUFFIX))
            fsync_folder(self.folder)
            logger.info("change log %s migrated to %s (the old file kept as %s%s)", legacy, self.path, LEGACY_FILE,
                        MIGRATED_SUFFIX)

    def _fill(self, tmp: Path) -> None:
        conn = sqlite3.connect(str(tmp), isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=DELETE")  # built whole, then switched to WAL once in place
            conn.executescript(SCHEMA)
            conn.execute("BEGIN IMMEDIATE")
            legacy = self.folder / LEGACY_FILE
            last = _migrate(legacy, self.folder / LEGACY_VECTORS, conn) if legacy.is_file() else 0
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)",
                             [("format", str(FORMAT)), ("epoch", secrets.token_hex(8)), ("last_seq", str(last)),
                              ("pruned", "0"), ("created", str(time.time()))])
            conn.execute("COMMIT")
        finally:
            conn.close()

    def _private_files(self) -> None:
        for name in (LOG_FILE, f"{LOG_FILE}-wal", f"{LOG_FILE}-shm", LOCK_FILE):
            path = self.folder / name
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_mode & 0o777 != FILE_MODE:
                    os.chmod(path, FILE_MODE)

    def _connect(self) -> sqlite3.Connection:
        try:
            if self.writable:
                conn = sqlite3.connect(str(self.path), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)
            else:
                conn = self._connect_read_only()
        except sqlite3.Error as exc:
            raise ChangeLogUnavailable(f"the change log {self.path} cannot be opened: {_sql_reason(exc)}") from exc
        try:
            if self.writable:
                mode = enable_wal(conn, BUSY_TIMEOUT_S)
                if mode != "wal":
                    raise ChangeLogUnavailable(f"the change log {self.path} cannot use write-ahead logging "
                                               f"(journal mode {mode})")
                conn.execute("PRAGMA synchronous=FULL")
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise self._error("cannot be opened", exc) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def _connect_read_only(self) -> sqlite3.Connection:
        """Read-only: through SQLite's shared memory when it can, else as an immutable file (a read-only file
        system where the log's -shm cannot be made: a log closed cleanly holds every change in its main file)."""
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError:
            conn.close()
        if (self.folder / f"{LOG_FILE}-wal").exists() and (self.folder / f"{LOG_FILE}-wal").stat().st_size:
            raise sqlite3.OperationalError("its write-ahead log holds changes not yet in the main file, and the "
                                           "shared memory needed to read them cannot be made here")
        return sqlite3.connect(f"file:{self.path}?immutable=1", uri=True, isolation_level=None,
                               check_same_thread=False)

    def _check_writable(self) -> None:
        """A write that is rolled back: a log on a read-only file system, or that this process may not write,
        fails here, before the service says it is ready, not at the first change."""
        try:
            with self._lock:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    self._conn.execute("UPDATE meta SET value = value WHERE key = 'format'")
                finally:
                    self._conn.execute("ROLLBACK")
        except sqlite3.Error as exc:
            self.close()
            raise ChangeLogUnavailable(f"the change log {self.path} cannot be written: {_sql_reason(exc)}") from exc

    def _error(self, what: str, exc: sqlite3.Error) -> ChangeLogError:
        if isinstance(exc, sqlite3.OperationalError) and _unavailable(exc):
            return ChangeLogUnavailable(f"the change log {self.path} {what}: {_sql_reason(exc)}")
        return ChangeLogDamaged(f"the change log {self.path} {what}: {_sql_reason(exc)} (SQLite finds the file "
                                "damaged)")

    def _meta(self) -> dict[str, str]:
        try:
            with self._lock:
                return dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.Error as exc:
            self.close()
            raise self._error("cannot be read", exc) from exc

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()

    # ------------------------------------------------------------------------------------------- locking
    @contextmanager
    def _locked(self) -> Iterator[None]:
        if self._holder == threading.get_ident():
            yield
            return
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """The log's lock for a whole step (this thread's appends inside it do not wait for themselves): no other
        writer that holds it, in this process or another, works meanwhile (the dense collection's writers)."""
        with self._locked():
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, committed (and synced) when the block ends; ChangeNotWritten when it cannot be."""
        if not self.writable:
            raise ChangeNotWritten(f"the change log {self.path} is open for reading only")
        with self._lock:
            conn = self._conn
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise ChangeNotWritten(_sql_reason(exc)) from exc
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException as exc:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise ChangeNotWritten(_sql_reason(exc)) from exc
                raise

    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        with self._snapshot() as read:
            return read(sql, args)

    @contextmanager
    def _snapshot(self) -> Iterator[Any]:
        """Reads that see one state of the log (one read transaction), as `read(sql, args) -> rows`."""
        try:
            with self._lock:
                conn = self._conn
                conn.execute("BEGIN")
                try:
                    yield lambda sql, args=(): conn.execute(sql, args).fetchall()
                finally:
                    conn.execute("COMMIT")
        except sqlite3.Error as exc:
            raise self._error("cannot be read", exc) from exc

    # ------------------------------------------------------------------------------------------- changes
    @property
    def last_seq(self) -> int:
        """The last sequence number given (folded away or not)."""
        return int(self._read("SELECT value FROM meta WHERE key = 'last_seq'")[0][0])

    @property
    def pruned(self) -> int:
        """Changes up to this one are folded into a generation and no longer in the log."""
        return int(self._read("SELECT value FROM meta WHERE key = 'pruned'")[0][0])

    def append(self, put: Sequence[Passage], delete: Sequence[str],
               vectors: npt.NDArray[np.float32] | None = None) -> Change:
        """Write one change (and the vectors of its passages put, when given) and sync it: it is acknowledged once
        this returns. ChangeNotWritten when it could not be (nothing was written)."""
        with self._write() as conn:
            seq = int(conn.execute("SELECT value FROM meta WHERE key = 'last_seq'").fetchone()[0]) + 1
            at = time.time()
            body, crc = encode_change(seq, at, put, delete)
            conn.execute("INSERT INTO changes (seq, at, body, crc) VALUES (?, ?, ?, ?)", (seq, at, body, crc))
            if vectors is not None and len(put):
                self._insert_vectors(conn, seq, 0, vectors)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'last_seq'", (str(seq),))
        return Change(seq, tuple(put), tuple(delete), at)

    def read_after(self, seq: int, *, limit: int | None = None) -> list[Change]:
        """The changes after `seq`, in order (at most `limit`). ChangeLogDamaged at a bad record (those before it
        in `changes`), FoldedAway when changes after `seq` were folded into a generation."""
        with self._snapshot() as read:
            meta = dict(read("SELECT key, value FROM meta WHERE key IN ('last_seq', 'pruned', 'dropped')"))
            rows = read("SELECT seq, body, crc FROM changes WHERE seq > ? ORDER BY seq LIMIT ?",
                        (seq, -1 if limit is None else limit))
        last, pruned = int(meta["last_seq"]), int(meta["pruned"])
        dropped = [(int(a), int(b)) for a, b in orjson.loads(meta.get("dropped", "[]"))]

        def after(number: int) -> int:
            """The sequence number expected after `number` (past the ranges `drop_from` dropped)."""
            number += 1
            for first, end in dropped:
                if first <= number <= end:
                    number = end + 1
            return number

        if seq < pruned:
            raise FoldedAway(f"changes after {seq} are folded into a generation (the log holds those after {pruned})")
        changes: list[Change] = []
        expected = after(seq)
        for number, body, crc in rows:
            if number != expected:
                raise ChangeLogDamaged(f"change {expected} is missing from the log (the next record is {number})",
                                       record=expected, changes=changes)
            try:
                changes.append(decode_change(number, body, crc))
            except ChangeLogDamaged as exc:
                exc.changes = changes
                raise
            expected = after(expected)
        if (limit is None or len(changes) < limit) and expected <= last:
            raise ChangeLogDamaged(f"changes {expected} to {last} were acknowledged but are not in the log",
                                   record=expected, changes=changes)
        return changes

    def iter_after(self, seq: int) -> Iterator[Change]:
        """Every change after `seq`, read a page at a time."""
        while True:
            page = self.read_after(seq, limit=READ_PAGE)
            yield from page
            if len(page) < READ_PAGE:
                return
            seq = page[-1].seq

    # ------------------------------------------------------------------------------------------- vectors
    def _insert_vectors(self, conn: sqlite3.Connection, seq: int, first: int,
                        vectors: npt.NDArray[np.float32]) -> bool:
        array = np.ascontiguousarray(vectors, dtype=np.float32)
        data = array.tobytes()
        cursor = conn.execute("INSERT OR IGNORE INTO vectors (seq, first, rows, dims, data, crc) "
                              "VALUES (?, ?, ?, ?, ?, ?)",
                              (seq, first, int(array.shape[0]), int(array.shape[1]), data,
                               _vector_crc(seq, first, data)))
        return cursor.rowcount > 0

    def add_vectors(self, seq: int, first: int, vectors: npt.NDArray[np.float32]) -> bool:
        """The vectors of change `seq`'s passages from `first` on, encoded after it was logged (the dense index was
        not there yet): written once, by whichever worker encodes them first (False: another one had)."""
        with self._write() as conn:
            if conn.execute("SELECT 1 FROM changes WHERE seq = ?", (seq,)).fetchone() is None:
                return False  # folded away meanwhile: its generation holds the vectors
            return self._insert_vectors(conn, seq, first, vectors)

    def vectors_after(self, vector_id: int, *, limit: int = 4096) -> list[Vectors]:
        """The vectors logged after `vector_id` (at most `limit` parts), in the order they were logged."""
        return self._vectors(self._read("SELECT id, seq, first, rows, dims, data, crc FROM vectors WHERE id > ? "
                                        "ORDER BY id LIMIT ?", (vector_id, limit)))

    def vectors_for(self, seq: int) -> list[Vectors]:
        """The vectors logged for change `seq`, by their first passage."""
        return self._vectors(self._read("SELECT id, seq, first, rows, dims, data, crc FROM vectors WHERE seq = ? "
                                        "ORDER BY first", (seq,)))

    @staticmethod
    def _vectors(rows: list[Any]) -> list[Vectors]:
        out = []
        for vid, seq, first, n, dims, data, crc in rows:
            if _vector_crc(seq, first, bytes(data)) != crc or len(data) != n * dims * 4:
                raise ChangeLogDamaged(f"the vectors of change {seq} (from passage {first}) do not read back as "
                                       "written", record=seq)
            out.append(Vectors(vid, seq, first, np.frombuffer(data, dtype=np.float32).reshape(n, dims)))
        return out

    # ------------------------------------------------------------------------------------------- generations
    def generation(self) -> Generation:
        """The newest generation (NO_GENERATION: none, the built indexes serve)."""
        rows = self._read("SELECT gen, folded, body, crc FROM generations ORDER BY gen DESC LIMIT 1")
        if not rows:
            return NO_GENERATION
        gen, folded, body, crc = rows[0]
        if _crc(f"{gen}:{folded}".encode(), bytes(body)) != crc:
            raise ChangeLogDamaged(f"generation {gen}'s record does not read back as written", record=folded)
        return Generation(int(gen), int(folded), orjson.loads(body))

    def add_generation(self, generation: Generation, net: Mapping[str, Sequence[Passage] | None]) -> None:
        """Record a generation (its indexes are in place), the documents' net changes as of it (`net`: passages,
        or None for a document deleted), and drop what the generation before it folded: the changes and vectors up
        to its `folded` (every worker has moved past them: a worker moves to the newest generation)."""
        body = orjson.dumps(generation.body)
        with self._write() as conn:
            current = conn.execute("SELECT max(gen), max(folded) FROM generations").fetchone()
            if current[0] is not None and (current[0] >= generation.gen or current[1] > generation.folded):
                raise ChangeNotWritten(f"generation {current[0]} (changes up to {current[1]}) is already there")
            conn.execute("INSERT INTO generations (gen, folded, body, crc, at) VALUES (?, ?, ?, ?, ?)",
                         (generation.gen, generation.folded, body,
                          _crc(f"{generation.gen}:{generation.folded}".encode(), body), time.time()))
            for doc_id, passages in net.items():
                value = orjson.dumps(None if passages is None else [_passage_row(p) for p in passages])
                conn.execute("INSERT OR REPLACE INTO net (doc_id, body, crc) VALUES (?, ?, ?)",
                             (doc_id, value, _crc(doc_id.encode(), b"\0", value)))
            previous = conn.execute("SELECT folded FROM generations WHERE gen < ? ORDER BY gen DESC LIMIT 1",
                                    (generation.gen,)).fetchone()
            if previous is not None:
                drop = int(previous[0])
                conn.execute("DELETE FROM changes WHERE seq <= ?", (drop,))
                conn.execute("DELETE FROM vectors WHERE seq <= ?", (drop,))
                conn.execute("DELETE FROM generations WHERE gen < ?", (generation.gen - 1,))
                conn.execute("UPDATE meta SET value = ? WHERE key = 'pruned'", (str(drop),))

    def net_changes(self) -> Iterator[tuple[str, list[Passage] | None]]:
        """Each document changed since the built corpus, as of the newest generation: its passages, or None."""
        for doc_id, body, crc in self._read("SELECT doc_id, body, crc FROM net ORDER BY doc_id"):
            if _crc(doc_id.encode(), b"\0", bytes(body)) != crc:
                raise ChangeLogDamaged(f"the net change of document {doc_id!r} does not read back as written")
            rows = orjson.loads(body)
            yield doc_id, None if rows is None else [_passage(r) for r in rows]

    def drop_from(self, seq: int) -> dict[str, int]:
        """Delete change `seq` and every one after it (a damaged record and what followed it), with their vectors.
        The last sequence number given stays: the next change gets the one after it, so none is reused."""
        with self._write() as conn:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            last, pruned = int(meta["last_seq"]), int(meta["pruned"])
            if seq <= pruned or seq > last:
                raise ChangeNotWritten(f"change {seq} is not in the log (it holds changes {pruned + 1} to {last})")
            records = conn.execute("DELETE FROM changes WHERE seq >= ?", (seq,)).rowcount
            conn.execute("DELETE FROM vectors WHERE seq >= ?", (seq,))
            dropped = [*orjson.loads(meta.get("dropped", "[]")), [seq, last]]
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('dropped', ?)", (orjson.dumps(dropped).decode(),))
        logger.warning("change log %s: changes %d to %d dropped (%d records); the next change is %d", self.path, seq,
                       last, records, last + 1)
        return {"from": seq, "to": last, "records": records, "last_seq": last}

    def set_meta(self, key: str, value: str) -> None:
        with self._write() as conn:
            conn.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def meta(self, key: str) -> str | None:
        rows = self._read("SELECT value FROM meta WHERE key = ?", (key,))
        return str(rows[0][0]) if rows else None

    def checkpoint(self) -> None:
        """Fold the write-ahead log into the main file (compaction's deletes leave it large)."""
        with contextlib.suppress(sqlite3.Error), self._lock:
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def _probe_write(folder: Path) -> None:
    """A file written, synced and removed in `folder`: a read-only or failing file system says so here, by its own
    words (`Read-only file system`), before SQLite's `unable to open database file`."""
    probe = folder / f".write-probe.{os.getpid()}"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        os.write(fd, b"probe")
        os.fsync(fd)
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------- the legacy log
def _legacy_change(line: bytes) -> tuple[Change, str | None] | None:
    """The change of a legacy line and its vectors file, None when its CRC does not match."""
    body, sep, crc = line.rstrip(b"\n").rpartition(b"\t")
    if not sep or crc != f"{zlib.crc32(body):08x}".encode():
        return None
    data = orjson.loads(body)
    put = tuple(_passage(p) for p in data.get("put", ()))
    return Change(int(data["seq"]), put, tuple(data.get("delete", ())), float(data["at"])), data.get("vectors")


def read_legacy(path: Path) -> tuple[list[tuple[Change, str | None]], int]:
    """The changes of a legacy JSONL log and the byte offset after the last whole one. A last line a crash tore (no
    newline, or a CRC that does not match on the very last line) is cut; a bad line anywhere else is
    ChangeLogDamaged naming its line."""
    out: list[tuple[Change, str | None]] = []
    lines = path.read_bytes().splitlines(keepends=True)
    offset = 0
    for number, line in enumerate(lines, start=1):
        last = number == len(lines)
        decoded: tuple[Change, str | None] | None
        try:
            decoded = _legacy_change(line) if line.endswith(b"\n") or not last else None
        except (ValueError, KeyError, TypeError):
            decoded = None
        if decoded is None:
            if last:
                logger.warning("change log %s: cutting its last line (%d bytes), a write a crash interrupted: it was "
                               "never acknowledged", path, len(line))
                break
            raise ChangeLogDamaged(f"{path}: line {number} of {len(lines)} is damaged (its checksum does not match); "
                                   f"the {len(lines) - number} changes after it cannot be trusted to follow it",
                                   record=number, changes=[c for c, _ in out])
        change = decoded[0]
        if out and change.seq != out[-1][0].seq + 1:
            raise ChangeLogDamaged(f"{path}: line {number} holds change {change.seq} after change {out[-1][0].seq}",
                                   record=number, changes=[c for c, _ in out])
        out.append(decoded)
        offset += len(line)
    return out, offset


def _migrate(legacy: Path, vectors_dir: Path, conn: sqlite3.Connection) -> int:
    """The legacy log's changes (and vectors) into `conn`'s tables; the last sequence number."""
    changes, _ = read_legacy(legacy)
    for change, vectors in changes:
        body, crc = encode_change(change.seq, change.at, change.put, change.delete)
        conn.execute("INSERT INTO changes (seq, at, body, crc) VALUES (?, ?, ?, ?)", (change.seq, change.at, body, crc))
        if vectors is not None and (vectors_dir / vectors).is_file():
            array = np.ascontiguousarray(np.load(vectors_dir / vectors), dtype=np.float32)
            data = array.tobytes()
            conn.execute("INSERT INTO vectors (seq, first, rows, dims, data, crc) VALUES (?, ?, ?, ?, ?, ?)",
                         (change.seq, 0, int(array.shape[0]), int(array.shape[1]), data,
                          _vector_crc(change.seq, 0, data)))
    logger.info("migrating the change log %s: %d changes", legacy, len(changes))
    return changes[-1][0].seq if changes else 0
