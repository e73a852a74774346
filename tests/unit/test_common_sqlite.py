"""Two processes opening a new SQLite file together in write-ahead-log mode (what two searcher or retriever workers
starting at once do with the feedback store and the change log): SQLite answers the WAL switch "database is
locked" at once, ignoring the busy timeout, about one open in twelve on this machine; `enable_wal` waits it out."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.sqlite import enable_wal


def _open_together(path: str, barrier: Any, results: Any) -> None:
    barrier.wait()
    try:
        conn = sqlite3.connect(path, timeout=10, isolation_level=None)
        mode = enable_wal(conn, 10.0)
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("CREATE TABLE IF NOT EXISTS t (x)")
        conn.execute("COMMIT")
        conn.close()
        results.put(mode)
    except Exception as exc:  # reported to the test, which names it
        results.put(f"{type(exc).__name__}: {exc}")


def test_two_processes_switch_a_new_file_to_wal_together(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    outcomes: list[str] = []
    for trial in range(40):
        barrier, results = ctx.Barrier(2), ctx.Queue()
        path = str(tmp_path / f"store-{trial}.sqlite3")
        procs = [ctx.Process(target=_open_together, args=(path, barrier, results)) for _ in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        outcomes += [results.get(timeout=10) for _ in procs]
    assert outcomes == ["wal"] * 80, sorted(set(outcomes))


def test_other_errors_are_not_retried(tmp_path: Path) -> None:
    conn = sqlite3.connect(str(tmp_path / "closed.sqlite3"))
    conn.close()
    with pytest.raises(sqlite3.ProgrammingError, match="closed"):  # raised at once, not waited on
        enable_wal(conn, 10.0)
