"""The feedback store (`plugsearch.searcher.feedback.store`) on real SQLite files: its bounds (what pruning drops
and what it keeps), its schema version, several processes writing one file at once (as `SEARCHER_WORKERS` does),
and what `plugsearch-feedback export` and `plugsearch-feedback stats` read from it."""

from __future__ import annotations

import json
import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from plugsearch.common.errors import Forbidden, NotFound, ValidationFailed
from plugsearch.searcher.feedback.store import (
    SCHEMA_VERSION,
    FeedbackStore,
    FeedbackStoreError,
    SearchExpired,
    SearchRecord,
    StoreLimits,
)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def record(sid: str, created: float, owner: str = "key:a", docs: int = 3) -> SearchRecord:
    return SearchRecord(sid.ljust(22, "x"), owner, f"question {sid}?", "s3", "compact-gbr@1",
                        [(f"{sid}-d{i}", f"Title {i}", f"text {i} of {sid}") for i in range(docs)], created)


def sid(name: str) -> str:
    return name.ljust(22, "x")


def test_marks_need_a_known_fresh_search_its_owner_and_its_own_documents(tmp_path: Path) -> None:
    clock = Clock()
    store = FeedbackStore(tmp_path / "f.sqlite3", StoreLimits(search_ttl_s=100), clock=clock)
    try:
        assert store.writer is not None
        store.writer.record(record("s1", clock.now))
        assert store.writer.flush()
        with pytest.raises(NotFound, match="unknown search_id"):
            store.mark(sid("nope"), marker="key:a", may_mark_any=False, helpful=["s1-d0"], not_helpful=[])
        with pytest.raises(Forbidden):
            store.mark(sid("s1"), marker="key:b", may_mark_any=False, helpful=["s1-d0"], not_helpful=[])
        with pytest.raises(ValidationFailed, match="s2-d0") as refused:
            store.mark(sid("s1"), marker="key:a", may_mark_any=False, helpful=["s1-d0"], not_helpful=["s2-d0"])
        assert refused.value.param == "not_helpful"
        first = store.mark(sid("s1"), marker="key:a", may_mark_any=False, helpful=["s1-d0"], not_helpful=["s1-d2"])
        second = store.mark(sid("s1"), marker="key:b", may_mark_any=True, helpful=["s1-d1"], not_helpful=[])
        assert not first.replaced and second.replaced
        [mark] = store.marks()
        assert mark["helpful"] == ["s1-d1"] and mark["not_helpful"] == [] and mark["owner"] == "key:a"
        assert mark["seq"] > 1  # a replaced mark moves to the end: a reader paging by seq sees it again
        clock.now += 101
        with pytest.raises(SearchExpired):
            store.mark(sid("s1"), marker="key:a", may_mark_any=False, helpful=["s1-d0"], not_helpful=[])
    finally:
        store.close()


def test_pruning_drops_old_and_excess_searches_and_marks_but_keeps_marked_searches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.searcher.feedback import store as module

    monkeypatch.setattr(module, "PRUNE_EVERY_S", 1e12)  # pruned here when the test says, not by the writer
    clock = Clock()
    limits = StoreLimits(max_searches=3, search_ttl_s=1000, max_marks=2, mark_ttl_s=5000)
    store = FeedbackStore(tmp_path / "f.sqlite3", limits, clock=clock)
    try:
        assert store.writer is not None
        for i in range(6):  # s0 oldest
            store.writer.record(record(f"s{i}", clock.now - 2000 + i * 300))  # s0..s3 older than the window
        assert store.writer.flush()
        clock.now -= 1500  # mark s0 and s1 while they were fresh
        store.mark(sid("s0"), marker="key:a", may_mark_any=False, helpful=["s0-d0"], not_helpful=[])
        store.mark(sid("s1"), marker="key:a", may_mark_any=False, helpful=["s1-d0"], not_helpful=[])
        clock.now += 1500
        assert store.prune() == (2, 0)  # s2, s3: unmarked and past the window; the marked s0, s1 stay
        left = {r["search_id"] for r in store.marks(limit=None)}
        assert left == {sid("s0"), sid("s1")}
        with sqlite3.connect(tmp_path / "f.sqlite3") as db:
            assert {r[0] for r in db.execute("SELECT search_id FROM searches")} == {sid(f"s{i}") for i in (0, 1, 4, 5)}
        # a third mark: the oldest mark goes (max_marks 2), and its search with it (unmarked, past the window)
        store.writer.record(record("s6", clock.now))
        store.writer.record(record("s7", clock.now))
        store.writer.record(record("s8", clock.now))
        assert store.writer.flush()
        store.mark(sid("s6"), marker="key:a", may_mark_any=False, helpful=["s6-d1"], not_helpful=[])
        searches, marks = store.prune()
        assert marks == 1 and {r["search_id"] for r in store.marks(limit=None)} == {sid("s1"), sid("s6")}
        with sqlite3.connect(tmp_path / "f.sqlite3") as db:
            kept = {r[0] for r in db.execute("SELECT search_id FROM searches")}
        # unmarked searches kept: at most 3, the newest (s4 went, as s0 did once its mark was gone)
        assert kept == {sid("s1"), sid("s6"), sid("s5"), sid("s7"), sid("s8")} and searches == 2
        clock.now += 6000  # every mark past mark_ttl_s
        assert store.prune()[1] == 2 and store.marks() == []
    finally:
        store.close()


def test_the_writer_prunes_on_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.searcher.feedback import store as module

    monkeypatch.setattr(module, "PRUNE_EVERY_S", 0.0)  # after every batch (the service's writer: once a minute)
    clock = Clock()
    store = FeedbackStore(tmp_path / "f.sqlite3", StoreLimits(max_searches=2, search_ttl_s=50), clock=clock)
    try:
        assert store.writer is not None
        for i in range(5):
            store.writer.record(record(f"old{i}", clock.now - 100))  # past the window
        for i in range(4):
            store.writer.record(record(f"new{i}", clock.now - i))
        assert store.writer.flush()
        assert store.writer.flush()  # the writer takes this one after pruning past the batch that held the first
        with sqlite3.connect(tmp_path / "f.sqlite3") as db:
            kept = sorted(r[0] for r in db.execute("SELECT search_id FROM searches"))
    finally:
        store.close()
    assert kept == sorted([sid("new0"), sid("new1")])  # the two newest: max_searches 2


def test_a_file_of_a_newer_schema_or_of_something_else_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.sqlite3"
    FeedbackStore(path, writer=False).close()
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.raises(FeedbackStoreError, match="newer plugsearch"):
        FeedbackStore(path)
    other = tmp_path / "other.sqlite3"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE notes (x)")
    with pytest.raises(FeedbackStoreError, match="not a feedback store"):
        FeedbackStore(other)
    garbage = tmp_path / "garbage.sqlite3"
    garbage.write_bytes(b"this is not a database at all" * 100)
    with pytest.raises(FeedbackStoreError, match="cannot be used"):
        FeedbackStore(garbage)
    with pytest.raises(FeedbackStoreError, match="no such"):
        FeedbackStore.open_existing(tmp_path / "missing.sqlite3")


def _worker(path: str, name: str, n: int, marks: int) -> None:
    """One worker process: records `n` searches and marks the first `marks`, while the other does the same."""
    store = FeedbackStore(Path(path))
    try:
        assert store.writer is not None
        for i in range(n):
            store.writer.record(record(f"{name}{i}", 1e12 - 1, owner=f"key:{name}"))
            if i < marks:
                assert store.writer.flush()
                store.mark(sid(f"{name}{i}"), marker=f"key:{name}", may_mark_any=False, helpful=[f"{name}{i}-d0"],
                           not_helpful=[f"{name}{i}-d1"])
    finally:
        store.close()


def test_two_processes_write_one_file_at_once(tmp_path: Path) -> None:
    path = tmp_path / "shared.sqlite3"
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_worker, args=(str(path), name, 300, 40)) for name in ("a", "b")]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    assert [w.exitcode for w in workers] == [0, 0]
    store = FeedbackStore.open_existing(path)
    try:
        marks = list(store.iter_marks(page=7))
        stats = store.stats()
    finally:
        store.close()
    assert sorted(m["search_id"] for m in marks) == sorted(sid(f"{n}{i}") for n in "ab" for i in range(40))
    assert all(m["helpful"] == [m["search_id"].rstrip("x") + "-d0"] for m in marks)
    assert stats["searches"] == 600 and stats["marks"] == 80 and stats["owners"] == 2
    assert stats["helpful_ids"] == 80 and stats["not_helpful_ids"] == 80 and stats["schema_version"] == SCHEMA_VERSION
    assert [m["seq"] for m in marks] == sorted(m["seq"] for m in marks) and len({m["seq"] for m in marks}) == 80
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert json.loads(db.execute("SELECT documents FROM searches LIMIT 1").fetchone()[0])[0][1] == "Title 0"


def test_export_writes_one_labelled_question_per_marked_search(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    from plugsearch.searcher.feedback.cli import main

    clock = Clock(1_790_000_000.0)  # 2026-09-21
    path = tmp_path / "f.sqlite3"
    store = FeedbackStore(path, StoreLimits(search_ttl_s=1e9), clock=clock)
    try:
        assert store.writer is not None
        for name in ("s1", "s2", "s3", "s4"):
            store.writer.record(record(name, clock.now))
        assert store.writer.flush()
        store.mark(sid("s1"), marker="key:a", may_mark_any=False, helpful=["s1-d2", "s1-d0"], not_helpful=["s1-d1"],
                   answer="an answer", comment="a comment")
        store.mark(sid("s2"), marker="key:a", may_mark_any=False, helpful=[], not_helpful=["s2-d0"])
        clock.now += 10 * 86400
        store.mark(sid("s3"), marker="internal", may_mark_any=True, helpful=["s3-d1"], not_helpful=[])
    finally:
        store.close()
    out = tmp_path / "out" / "marks.jsonl"
    assert main(["export", "--db", str(path), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [
        {"id": f"feedback-{sid('s1')}", "question": "question s1?", "passage_ids": ["s1-d2", "s1-d0"],
         "negative_ids": ["s1-d1"], "answer": "an answer", "source": "feedback"},
        {"id": f"feedback-{sid('s3')}", "question": "question s3?", "passage_ids": ["s3-d1"], "negative_ids": [],
         "source": "feedback"}]
    assert summary == {"out": str(out), "rows": 2, "marks": 3, "left_out_min_helpful": 1, "min_helpful": 1,
                       "since": None}
    # the trainer's reader takes these rows as labelled questions (`passage_ids`)
    from plugsearch.common.qa import read_qa_file

    assert [(q.id, q.passage_ids) for q in read_qa_file(out)] == [(r["id"], r["passage_ids"]) for r in rows]
    assert main(["export", "--db", str(path), "--out", str(out), "--since", "2026-09-25", "--min-helpful", "1"]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"feedback-{sid('s3')}"]
    assert json.loads(capsys.readouterr().out)["since"] == "2026-09-25T00:00:00+00:00"
    assert main(["export", "--db", str(path), "--out", str(out), "--min-helpful", "2"]) == 0
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [f"feedback-{sid('s1')}"]
    capsys.readouterr()
    assert main(["stats", "--db", str(path)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert {k: stats[k] for k in ("searches", "marks", "marks_with_helpful", "helpful_ids", "not_helpful_ids",
                                  "with_answer", "with_comment", "owners")} == {
        "searches": 4, "marks": 3, "marks_with_helpful": 2, "helpful_ids": 3, "not_helpful_ids": 2,
        "with_answer": 1, "with_comment": 1, "owners": 1}
    assert stats["by_mode"] == {"s3": 3} and stats["first_mark"].startswith("2026-09-21")
    # a missing file or a bad time is said, not a traceback
    assert main(["stats", "--db", str(tmp_path / "missing.sqlite3")]) == 2
    assert "no such feedback store" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["export", "--db", str(path), "--out", str(out), "--since", "last tuesday"])
