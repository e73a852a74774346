"""SQLite as the project's stores use it (the feedback store, the retriever's change log): several processes on one
file in write-ahead-log mode."""

from __future__ import annotations

import sqlite3
import time

_BUSY = ("database is locked", "database is busy")


def enable_wal(conn: sqlite3.Connection, timeout_s: float) -> str:
    """Switch `conn`'s file to write-ahead logging and return the journal mode it is in now ("wal" unless the file
    cannot use it). The switch needs the file to itself for a moment, and SQLite answers "database is locked" at
    once, without waiting out the connection's busy timeout, when another process holds it (two workers opening a
    new file together): retried here until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return str(conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]).lower()
        except sqlite3.OperationalError as exc:
            if not any(b in str(exc) for b in _BUSY) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)
