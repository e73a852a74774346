"""The document store: the corpus file read through an on-disk offsets table, documents identical to `Corpus`'s,
ids found through hashes (collisions too), built once by streaming, refused or rebuilt like an index."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from plugsearch.retriever.backends.base import Hits
from plugsearch.retriever.settings import RetrieverSettings
from plugsearch.retriever.store import docstore
from plugsearch.retriever.store.corpus import Corpus, CorpusError
from plugsearch.retriever.store.docstore import (
    DiskStore,
    build_docstore,
    ensure_docstore,
    open_store,
    store_folder,
)
from plugsearch.retriever.store.manifest import IndexMismatch, Manifest
from tests.support.retriever import write_tiny_corpus

ODD_ROWS = [{"id": "a", "title": 'Quote "and" \\ slash', "text": "caf\u00e9 \u2603 line\nbreak"},
            {"id": "b", "title": "", "text": "plain"},
            {"id": "c", "contents": '"Title in contents"\nbody of c'},
            {"id": 7, "title": "numeric id", "text": "x" * 3000}]


def write_rows(path: Path, rows: list[dict[str, object]], *, blank_lines: bool = False) -> Path:
    sep = "\n\n  \n" if blank_lines else "\n"
    path.write_text(sep.join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    return path


def open_disk(corpus: Path, index_dir: Path) -> DiskStore:
    manifest = build_docstore(corpus, store_folder(index_dir), show_progress=False)
    return DiskStore(store_folder(index_dir), corpus, manifest.corpus_checksum)


@pytest.mark.parametrize("contents_format", [False, True])
def test_documents_equal_the_loaded_corpus(data_dir: Path, tmp_path: Path, contents_format: bool) -> None:
    path = write_tiny_corpus(data_dir, tmp_path / "tiny.jsonl", contents_format=contents_format)
    held = Corpus.load(path)
    store = open_disk(path, tmp_path / "index")
    assert len(store) == len(held) and store.checksum == held.checksum
    every = list(range(len(held)))
    assert store.documents(every) == held.documents(every)
    assert list(store.iter_documents()) == list(held.iter_documents())
    assert [store.passage(i) for i in every] == [held.passage(i) for i in every]
    assert store.ids[3] == held.ids[3] and store.titles[3] == held.titles[3] and store.texts[3] == held.texts[3]
    order = [17, 0, len(held) - 1, 17]
    assert store.documents(order) == held.documents(order)  # any order, repeats
    ids = [held.ids[i] for i in order] + ["not-an-id", ""]
    assert store.positions(ids).tolist() == order + [-1, -1] == held.positions(ids).tolist()
    with pytest.raises(IndexError):
        store.document(len(held))
    store.close()


def test_odd_rows_and_blank_lines(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "odd.jsonl", ODD_ROWS, blank_lines=True)
    store = open_disk(path, tmp_path / "index")
    held = Corpus.load(path)
    assert store.documents(range(4)) == held.documents(range(4)) == [  # type: ignore[arg-type]
        ("a", 'Quote "and" \\ slash', "caf\u00e9 \u2603 line\nbreak"), ("b", "", "plain"),
        ("c", "Title in contents", "body of c"), ("7", "numeric id", "x" * 3000)]
    assert store.positions(["7", "c", "a"]).tolist() == [3, 2, 0]
    manifest = Manifest.read(store_folder(tmp_path / "index"))
    assert manifest.kind == "docstore" and manifest.doc_count == 4 and manifest.corpus_checksum == held.checksum


@pytest.mark.parametrize(("body", "message"), [
    ('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', "duplicate id 'a'"),
    ('{"id": "a", "text": "x"}\nnot json\n', r"bad\.jsonl:2: not valid JSON"),
    ("\n\n", "no documents"),
])
def test_a_bad_corpus_is_refused_as_when_loading(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(body)
    with pytest.raises(CorpusError, match=message):
        build_docstore(path, tmp_path / "docstore", show_progress=False)
    assert not (tmp_path / "docstore").exists()  # nothing loadable left behind


def test_ids_sharing_a_hash_are_told_apart_and_duplicates_still_found(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    real = docstore.id_hashes
    monkeypatch.setattr(docstore, "id_hashes", lambda ids: real([str(len(i) % 2) for i in ids]))  # two hashes
    rows = [{"id": f"id{'x' * i}", "text": f"passage {i}"} for i in range(9)]
    store = open_disk(write_rows(tmp_path / "c.jsonl", rows), tmp_path / "index")
    assert Manifest.read(store_folder(tmp_path / "index")).params["id_collisions"] == 2
    ids = [r["id"] for r in rows]
    assert store.positions(ids[::-1] + ["idxxxxxxxxxxxx", "zz"]).tolist() == list(range(8, -1, -1)) + [-1, -1]
    rows.append({"id": "idxx", "text": "a second idxx"})
    with pytest.raises(CorpusError, match="duplicate id 'idxx'"):
        build_docstore(write_rows(tmp_path / "d.jsonl", rows), tmp_path / "d", show_progress=False)


def test_ensure_builds_once_and_rebuilds_for_another_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_rows(tmp_path / "c.jsonl", ODD_ROWS)
    index_dir = tmp_path / "index"
    calls: list[Path] = []
    real = docstore.build_docstore

    def counted(corpus: Path, out: Path, **kw: bool) -> Manifest:
        calls.append(out)
        return real(corpus, out, **kw)

    monkeypatch.setattr(docstore, "build_docstore", counted)
    checksum = Corpus.load(path).checksum
    threads = [threading.Thread(target=ensure_docstore, args=(path, index_dir, checksum)) for _ in range(3)]
    for t in threads:  # the workers of one service start together: one builds, the others wait and reuse it
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert ensure_docstore(path, index_dir, checksum) is False and len(calls) == 1
    write_rows(path, ODD_ROWS[:3])
    changed = Corpus.load(path).checksum
    assert ensure_docstore(path, index_dir, changed) is True and len(calls) == 2
    assert Manifest.read(store_folder(index_dir)).doc_count == 3
    with pytest.raises(IndexMismatch, match="changed while"):  # the checksum the caller saw is not the file's
        ensure_docstore(path, tmp_path / "other", checksum)


def test_open_store_falls_back_to_memory_where_no_store_can_be_written(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_rows(tmp_path / "c.jsonl", ODD_ROWS)
    checksum = Corpus.load(path).checksum
    assert isinstance(open_store(path, tmp_path / "a", checksum, mode="memory"), Corpus)
    assert not (tmp_path / "a" / "docstore").exists()

    def read_only(*args: object, **kw: object) -> None:
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(docstore, "build_docstore", read_only)
    fallback = open_store(path, tmp_path / "b", checksum)
    assert isinstance(fallback, Corpus) and fallback.documents([2]) == [("c", "Title in contents", "body of c")]
    monkeypatch.undo()
    disk = open_store(path, tmp_path / "b", checksum)
    assert isinstance(disk, DiskStore) and disk.documents([2]) == fallback.documents([2])
    disk.close()


def test_checksum_memo_for_large_files_follows_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_rows(tmp_path / "c.jsonl", ODD_ROWS)
    hashed: list[Path] = []
    real = docstore.file_checksum

    def counted(p: Path) -> str:
        hashed.append(p)
        return real(p)

    monkeypatch.setattr(docstore, "file_checksum", counted)
    first = docstore.corpus_checksum(path, tmp_path)
    assert docstore.corpus_checksum(path, tmp_path) == first and len(hashed) == 2  # small file: always hashed
    monkeypatch.setattr(docstore, "MEMO_MIN_BYTES", 0)
    assert docstore.corpus_checksum(path, tmp_path) == first and len(hashed) == 3
    assert docstore.corpus_checksum(path, tmp_path) == first and len(hashed) == 3  # memoised
    write_rows(path, ODD_ROWS[:2])  # a write changes the times: hashed again
    assert docstore.corpus_checksum(path, tmp_path) == real(path) != first and len(hashed) == 4
    assert docstore.corpus_checksum(path, None) == real(path) and len(hashed) == 5  # no memo folder


def test_service_renders_the_same_bytes_from_either_store(tmp_path: Path) -> None:
    from plugsearch.retriever.serving import RetrieverService

    path = write_rows(tmp_path / "c.jsonl", ODD_ROWS)
    held = Corpus.load(path)
    disk = open_disk(path, tmp_path / "index")

    class Fixed:
        name = "bm25"
        doc_count = 4

        def batch_search(self, queries: list[str], k: int) -> Hits:
            raise AssertionError("not searched here")

        def close(self) -> None:
            pass

    hits = Hits(np.array([[2, 0, 3], [1, -1, -1], [-1, -1, -1], [3, 3, 1]], dtype=np.int64),
                np.array([[3.5, 1e-7, 0.25], [0.1, 0, 0], [0, 0, 0], [2, 2, 1]], dtype=np.float32))
    services = [RetrieverService(store, {"bm25": Fixed()}, RetrieverSettings(), index_id="idx-test")  # type: ignore[dict-item]
                for store in (held, disk)]
    assert services[0].render("bm25", hits, 1.5) == services[1].render("bm25", hits, 1.5)
    for scores in (True, False):
        assert services[0].render_searchr1(hits, scores) == services[1].render_searchr1(hits, scores)
    assert services[1].documents(hits)[0][0] == {"id": "c", "title": "Title in contents", "text": "body of c",
                                                "score": 3.5}
    disk.close()
