"""The change log's recovery rules (docs/operations.md, "Changes: durability and recovery"), on the real SQLite
file and a real tiny bm25s index: a torn last write is cut; a damaged record in the middle, or a log that cannot be
opened, stops start-up with the reason and the record, or is served read-only with the changes before it when asked;
never the built corpus as if nothing had been acknowledged. Sequence numbers and index ids are never reused; a delete
of documents that are not served changes nothing; the log and its folder are the owner's alone; the legacy JSONL log
is migrated once, with the same rules."""

from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import orjson
import pytest

from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import (
    LEGACY_FILE,
    LOG_FILE,
    MIGRATED_SUFFIX,
    ChangeLog,
    ChangeLogDamaged,
    ChangeNotWritten,
)
from plugsearch.retriever.serving import ChangesRefused, RetrieverService, change_log_folder, check_indexes
from tests.support.retriever import tiny_bm25s, tiny_settings


def passage(doc: str, n: int, text: str) -> Passage:
    return Passage(id=f"{doc}#{n}", doc_id=doc, title="", text=text)


def five_changes(folder: Path) -> ChangeLog:
    log = ChangeLog(folder)
    for n in range(1, 6):
        log.append([passage(f"doc-{n}", 0, f"record number {n} marker-{n:03d}-text about zyrtonic {n}")], [])
    return log


def flip_byte(path: Path, marker: bytes) -> None:
    """One byte inside the record that holds `marker` changed, as a failing disk would."""
    data = bytearray(path.read_bytes())
    at = data.index(marker)
    data[at + 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_torn_last_write_is_cut_and_the_changes_before_it_kept(tmp_path: Path) -> None:
    """A commit the machine lost halfway (its write-ahead-log frames cut short): the log opens with every change
    before it, and the next change takes the number the torn one never got acknowledged with."""
    live, torn = tmp_path / "live", tmp_path / "torn"
    log = ChangeLog(live)
    log.append([passage("a", 0, "first change")], [])
    log.append([passage("b", 0, "second change")], [])
    wal = live / f"{LOG_FILE}-wal"
    before = wal.stat().st_size
    log.append([passage("c", 0, "third change, torn " * 50)], [])
    after = wal.stat().st_size
    assert after > before  # the third commit is in the write-ahead log only (no checkpoint yet)
    torn.mkdir()
    shutil.copy(live / LOG_FILE, torn / LOG_FILE)
    (torn / f"{LOG_FILE}-wal").write_bytes(wal.read_bytes()[:(before + after) // 2])  # cut inside its frames
    log.close()
    reopened = ChangeLog(torn)
    assert [c.seq for c in reopened.read_after(0)] == [1, 2] and reopened.last_seq == 2
    assert reopened.append([passage("d", 0, "after the crash")], []).seq == 3


def test_a_flipped_byte_in_a_middle_record_is_named_and_never_silently_dropped(tmp_path: Path) -> None:
    log = five_changes(tmp_path)
    log.close()  # checkpointed: the records are in the main file
    flip_byte(tmp_path / LOG_FILE, b"marker-002")
    damaged = ChangeLog(tmp_path)
    with pytest.raises(ChangeLogDamaged) as caught:
        damaged.read_after(0)
    assert caught.value.record == 2 and [c.seq for c in caught.value.changes] == [1]
    assert "change 2" in caught.value.reason
    # the operator drops the damaged record and what followed it: the numbers go on after the last one given
    dropped = damaged.drop_from(2)
    assert dropped == {"from": 2, "to": 5, "records": 4, "last_seq": 5}
    assert [c.seq for c in damaged.read_after(0)] == [1]
    assert damaged.append([], ["doc-1"]).seq == 6
    assert [c.seq for c in ChangeLog(tmp_path).read_after(0)] == [1, 6]


def test_a_missing_record_between_two_is_damage_not_the_end(tmp_path: Path) -> None:
    log = five_changes(tmp_path)
    log._conn.execute("DELETE FROM changes WHERE seq = 3")  # as if its page were lost
    with pytest.raises(ChangeLogDamaged) as caught:
        ChangeLog(tmp_path).read_after(0)
    assert caught.value.record == 3 and [c.seq for c in caught.value.changes] == [1, 2]
    log._conn.execute("DELETE FROM changes WHERE seq >= 4")  # the last changes gone: acknowledged, so damage too
    with pytest.raises(ChangeLogDamaged, match="acknowledged but are not in the log"):
        ChangeLog(tmp_path).read_after(2)


def legacy_line(payload: dict[str, object]) -> bytes:
    body = orjson.dumps(payload)
    return body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"


def write_legacy(folder: Path, n: int) -> Path:
    folder.mkdir(parents=True)
    lines = [legacy_line({"seq": i, "at": 1.0 * i, "vectors": None, "delete": [],
                          "put": [{"id": f"old-{i}#0", "doc_id": f"old-{i}", "title": "", "text": f"legacy {i} txt"}]})
             for i in range(1, n + 1)]
    (folder / LEGACY_FILE).write_bytes(b"".join(lines))
    return folder / LEGACY_FILE


def test_the_legacy_log_is_migrated_once_with_its_numbers_and_its_torn_tail_cut(tmp_path: Path) -> None:
    legacy = write_legacy(tmp_path / "log", 3)
    with legacy.open("ab") as fh:
        fh.write(b'{"seq": 4, "put": [{"id": "c#0"')  # a write a crash cut
    log = ChangeLog(tmp_path / "log")
    assert [c.seq for c in log.read_after(0)] == [1, 2, 3] and log.read_after(0)[2].put[0].text == "legacy 3 txt"
    assert not legacy.exists() and legacy.with_name(LEGACY_FILE + MIGRATED_SUFFIX).is_file()
    assert log.append([], ["old-1"]).seq == 4
    assert [c.seq for c in ChangeLog(tmp_path / "log").read_after(0)] == [1, 2, 3, 4]  # migrated once


def test_a_legacy_log_with_a_flipped_byte_in_line_2_of_5_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """The probe's case: the earlier code served change 1 only, silently, and its next write cut changes 2 to 5
    off the disk."""
    legacy = write_legacy(tmp_path / "log", 5)
    original = legacy.read_bytes()
    flip_byte(legacy, b"legacy 2")
    damaged = legacy.read_bytes()
    assert damaged != original
    with pytest.raises(ChangeLogDamaged) as caught:
        ChangeLog(tmp_path / "log")
    assert caught.value.record == 2 and "line 2 of 5" in caught.value.reason
    assert legacy.read_bytes() == damaged and not (tmp_path / "log" / LOG_FILE).exists()


def test_the_log_and_its_folder_are_the_owners_alone(tmp_path: Path) -> None:
    folder = tmp_path / "changes" / "abc"
    log = ChangeLog(folder)
    log.append([passage("a", 0, "private")], [])
    assert folder.stat().st_mode & 0o777 == 0o700
    files = [p for p in folder.iterdir() if p.is_file()]
    assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files), {p.name: oct(p.stat().st_mode)
                                                                              for p in files}


# ------------------------------------------------------------------------------------------- the service
@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("recovery"))


def load(tiny: tuple[Path, Path], changes: Path, **overrides: object) -> RetrieverService:
    settings = tiny_settings(*tiny, dense=False, changes_dir=changes, **overrides)
    return RetrieverService.load(settings, check_indexes(settings))


def ids_for(svc: RetrieverService, query: str, k: int = 5) -> list[str]:
    hits = svc.batchers["bm25"].fn([query], k)
    return [doc for doc, _, _ in svc.corpus.documents([int(d) for d in hits.ids[0] if d >= 0])]


def test_a_damaged_middle_record_stops_start_up_or_is_served_read_only_when_asked(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    svc = load(tiny, tmp_path)
    assert svc.live is not None
    base_id = svc.index_id
    for n in range(1, 6):
        svc.live.write([passage(f"doc-{n}", 0, f"record number {n} marker-{n:03d}-text about zyrtonic{n}")], [])
    healthy_ids = {svc.index_id}
    folder = svc.live.log.folder  # type: ignore[union-attr]
    svc.live.close()
    flip_byte(folder / LOG_FILE, b"marker-002")
    with pytest.raises(ChangesRefused) as refused:
        load(tiny, tmp_path)
    assert "change 2" in str(refused.value) and "(record 2)" in str(refused.value)
    served = load(tiny, tmp_path, changes_on_error="read-only")
    assert served.live is not None and served.live.seq == 1 and not served.live.writable
    assert ids_for(served, "zyrtonic1") == ["doc-1#0"] and ids_for(served, "zyrtonic3") == []
    described = served.describe()
    assert "change 2" in described["changes_error"] and described["changes"]["writable"] is False
    assert served.index_id.endswith("-partial") and served.index_id not in healthy_ids | {base_id}
    with pytest.raises(ChangeNotWritten):
        served.live.write([passage("new", 0, "refused while read-only")], [])


def test_a_log_that_cannot_be_opened_stops_start_up_and_is_never_the_built_corpus_in_silence(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """The changes folder sits under a file (as a log whose file system cannot be written is, for this process):
    not ready, with the reason; read-only when asked: the built corpus, said so, marked partial, writes refused."""
    good = load(tiny, tmp_path / "changes")
    assert good.live is not None
    base_id = good.index_id
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the change log's folder should be")
    with pytest.raises(ChangesRefused, match="cannot be written: Not a directory"):
        load(tiny, blocked / "changes")
    served = load(tiny, blocked / "changes", changes_on_error="read-only")
    assert served.live is not None and served.live.log is None and served.live.error is not None
    assert served.index_id == f"{base_id}-partial" and served.describe()["changes_error"]
    with pytest.raises(ChangeNotWritten):
        served.live.write([passage("new", 0, "refused")], [])


def test_a_delete_of_documents_not_served_changes_nothing(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    svc = load(tiny, tmp_path)
    assert svc.live is not None and svc.live.log is not None
    before = svc.index_id
    assert svc.live.write([], ["no-such-document", "nor-this-one"]) is None
    assert svc.index_id == before and svc.live.log.last_seq == 0
    change = svc.live.write([passage("real", 0, "a document that exists")], [])
    assert change is not None and change.seq == 1
    after_put = svc.index_id
    deleted = svc.live.write([], ["real", "ghost"])
    assert deleted is not None and deleted.delete == ("real",) and svc.index_id != after_put
    assert svc.live.write([], ["real"]) is None  # already deleted


def test_a_rebuilt_corpus_is_refused_until_the_changes_before_it_are_carried_or_retired(
        data_dir: Path, var_dir: Path, tmp_path: Path) -> None:
    """The probe's case: a corpus rebuilt at its path (one more passage) lost the changes acknowledged against the
    one before, silently. Now start-up refuses with the reason; `carry` applies them to the rebuilt corpus."""
    from plugsearch.retriever.live import carry
    from tests.support.retriever import ensure_tiny_indexes, write_tiny_corpus

    corpus = write_tiny_corpus(data_dir, tmp_path / "mine.jsonl")
    index_dir = tmp_path / "indexes" / "mine-1"
    settings = tiny_settings(corpus, index_dir, dense=False)
    ensure_tiny_indexes(settings, bm25=["bm25s"], dense=False)
    first = RetrieverService.load(settings, check_indexes(settings))
    assert first.live is not None
    first.live.write([passage("api-note", 0, "the quillifax memo put through the API")], [])
    victim = ids_for(first, "Big Stone Gap", 1)[0]
    first.live.write([], [victim])
    first.live.close()
    with corpus.open("a") as fh:  # the folder ingested again, one file more
        fh.write(orjson.dumps({"id": "added-file#0", "title": "Added", "text": "a file added to the folder"}).decode()
                 + "\n")
    rebuilt = tiny_settings(corpus, tmp_path / "indexes" / "mine-2", dense=False)  # the stack: a folder per content
    ensure_tiny_indexes(rebuilt, bm25=["bm25s"], dense=False)
    with pytest.raises(ChangesRefused, match="earlier version") as refused:
        RetrieverService.load(rebuilt, check_indexes(rebuilt))
    assert "plugsearch-index changes carry" in str(refused.value)
    checksum = check_indexes(rebuilt).corpus_checksum
    registry = carry.registry_path(rebuilt.index_dir, rebuilt.changes_dir)
    done = carry.carry(registry, corpus, checksum, change_log_folder(rebuilt, checksum))
    assert done and done[0]["passages_put"] == 1 and done[0]["documents_deleted"] == 1
    second = RetrieverService.load(rebuilt, check_indexes(rebuilt))
    assert ids_for(second, "quillifax memo", 1) == ["api-note#0"]
    assert victim not in ids_for(second, "Big Stone Gap", 50)
    assert ids_for(second, "file added to the folder", 1) == ["added-file#0"]


def test_the_command_line_reports_repairs_compacts_and_carries(
        tiny: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`plugsearch-index changes status` names the damaged record, `changes repair --drop-from` drops it and what
    followed (numbers go on after the last one given), `compact` folds the rest, `changes carry` / `retire` have
    nothing to do on a corpus never rebuilt."""
    import json

    from plugsearch.retriever.cli import main

    corpus, index_dir = tiny
    monkeypatch.setenv("RETRIEVER_CORPUS", str(corpus))
    monkeypatch.setenv("RETRIEVER_INDEX_DIR", str(index_dir))
    monkeypatch.setenv("RETRIEVER_CHANGES_DIR", str(tmp_path))
    monkeypatch.setenv("RETRIEVER_DENSE", "false")
    svc = load(tiny, tmp_path)
    assert svc.live is not None
    for n in range(1, 6):
        svc.live.write([passage(f"doc-{n}", 0, f"record number {n} marker-{n:03d}-text about zyrtonic{n}")], [])
    folder = svc.live.log.folder  # type: ignore[union-attr]
    svc.live.close()
    flip_byte(folder / LOG_FILE, b"marker-004")

    def run(*argv: str) -> dict[str, object]:
        with pytest.raises(SystemExit) as done:
            main(list(argv))
        assert done.value.code == 0, capsys.readouterr().err
        answer: dict[str, object] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        return answer

    status = run("changes", "status")
    assert status["readable"] is False and status["bad_record"] == 4 and status["changes_before_it"] == 3
    assert run("changes", "repair", "--drop-from", "4")["next_seq"] == 6
    assert run("changes", "status")["readable"] is True
    compacted = run("compact", "--quiet")
    assert compacted["generation"] == 1 and compacted["folded"] == 3 and compacted["passages"] == 303
    assert run("changes", "carry")["carried"] == [] and run("changes", "retire")["retired"] == []
    again = load(tiny, tmp_path)
    assert again.live is not None and again.live.generation == 1 and ids_for(again, "zyrtonic3", 1) == ["doc-3#0"]
    assert again.live.write([passage("doc-9", 0, "after the repair")], []).seq == 6  # type: ignore[union-attr]
    assert ids_for(again, "zyrtonic4") == []
