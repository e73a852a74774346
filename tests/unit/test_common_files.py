"""The one durable atomic write (plugsearch/common/files.py): a file or folder is published whole or not at all, a
failed write leaves the old one and no temporary file, the content is synced before the rename, and a file asked
to be private is never readable by others, whatever the umask."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest

from plugsearch.common import files
from plugsearch.common.files import (
    atomic_folder,
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    atomic_writer,
)


def test_whole_values_replace_the_old_file_and_leave_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    atomic_write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    atomic_write_json(path, {"b": [1, 2]}, indent=2)
    assert path.read_text() == json.dumps({"b": [1, 2]}, indent=2)
    atomic_write_text(tmp_path / "t.txt", "caf\u00e9\n")
    assert (tmp_path / "t.txt").read_bytes() == "caf\u00e9\n".encode()
    atomic_write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.bin", "state.json", "t.txt"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("old\n")
    with pytest.raises(RuntimeError, match="reader broke"), atomic_writer(path) as fh:
        fh.write(b"new, half of it\n")
        raise RuntimeError("reader broke")
    with pytest.raises(TypeError):
        atomic_write_json(path, {"not": {1, 2}})  # a set is no JSON: nothing is published
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["corpus.jsonl"]


def test_streams_and_libraries_that_write_to_a_path(tmp_path: Path) -> None:
    with atomic_writer(tmp_path / "v.npy") as fh:
        np.save(fh, np.arange(3, dtype=np.float32))
    with atomic_path(tmp_path / "w.npy") as tmp:
        shutil.copyfile(tmp_path / "v.npy", tmp)
        assert not (tmp_path / "w.npy").exists()  # not there before the block ends
    assert np.load(tmp_path / "v.npy").tolist() == [0, 1, 2] == np.load(tmp_path / "w.npy").tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.npy", "w.npy"]


def test_content_and_folder_are_synced_before_and_after_the_rename(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_replace, real_fsync = os.replace, os.fsync

    def replace(a: str | Path, b: str | Path) -> None:
        events.append("replace")
        real_replace(a, b)

    def fsync(fd: int) -> None:
        events.append("fsync-folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    monkeypatch.setattr(files.os, "replace", replace)
    monkeypatch.setattr(files.os, "fsync", fsync)
    atomic_write_text(tmp_path / "a.txt", "x")
    assert events == ["fsync-file", "replace", "fsync-folder"]
    events.clear()
    atomic_write_text(tmp_path / "b.txt", "x", durable=False)  # scratch: atomic, not synced
    assert events == ["replace"]


def test_a_private_file_is_never_readable_by_others(tmp_path: Path) -> None:
    old = os.umask(0)  # the most permissive umask: the mode alone decides
    try:
        path = tmp_path / "ready.json"
        seen: list[int] = []
        with atomic_path(path, mode=0o600) as tmp:
            seen.append(stat.S_IMODE(tmp.stat().st_mode))  # already private before a byte is written
            tmp.write_text("{\"internal_token\": \"secret\"}")
        atomic_write_json(tmp_path / "other.json", {}, mode=0o600)
        atomic_write_json(tmp_path / "public.json", {})
    finally:
        os.umask(old)
    assert seen == [0o600] and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "other.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "public.json").stat().st_mode) == 0o666


def test_a_folder_is_swapped_in_whole_or_not_at_all(tmp_path: Path) -> None:
    final = tmp_path / "checkpoint"
    with atomic_folder(final) as tmp:
        (tmp / "weights").write_text("v1")
    with pytest.raises(RuntimeError, match="killed"), atomic_folder(final) as tmp:
        (tmp / "weights").write_text("v2, half")
        raise RuntimeError("killed")
    assert (final / "weights").read_text() == "v1"

    def needs_state(folder: Path) -> None:
        if not (folder / "state.json").is_file():
            raise ValueError("no state")

    with pytest.raises(ValueError, match="no state"), atomic_folder(final, check=needs_state) as tmp:
        (tmp / "weights").write_text("v3")
    (tmp_path / ".checkpoint.tmp-1-dead").mkdir()  # what a killed writer left
    with atomic_folder(final, check=needs_state, clean_stale=True) as tmp:
        (tmp / "weights").write_text("v4")
        (tmp / "state.json").write_text("{}")
    assert (final / "weights").read_text() == "v4" and [p.name for p in tmp_path.iterdir()] == ["checkpoint"]
