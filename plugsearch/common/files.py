"""Publishing files whole: the project's one durable atomic write.

A file is written under a temporary name in its own folder (`.<name>.<pid>.<random>.tmp`), synced (`fsync`),
renamed over its final name (`os.replace`, atomic on POSIX) and its folder synced: after a crash of the process or
the machine the final name holds the old file or the new one, never a part of it, and a file once published stays
published. A write that fails leaves the old file as it was and no temporary file behind.

- `atomic_write_bytes` / `atomic_write_text` / `atomic_write_json`: a whole value at once.
- `atomic_writer`: a binary file handle for writers that stream (a corpus, a download).
- `atomic_path`: a temporary path for libraries that write to a path themselves (FAISS, numpy, a GGUF writer).
- `atomic_folder`: a folder built under a temporary name, then swapped in whole (an index, a checkpoint).

`mode` makes a file readable by its owner only (0o600: a file that holds a secret) from the moment it exists, not
after a chmod; None leaves the usual permissions (0o666 less the umask). `durable=False` skips the syncs (the write
is still atomic, but may be lost, whole, by a machine crash): for scratch files only.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def fsync_folder(folder: Path) -> None:
    """Sync a folder's entries (a rename into it, a file created there) to the disk. File systems that cannot sync
    a folder (some network ones) are let be."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Sync a file's content to the disk (whoever wrote it, through whatever handle)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary(final: Path) -> Path:
    return final.with_name(f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


@contextmanager
def atomic_path(final: Path, *, mode: int | None = None, durable: bool = True) -> Iterator[Path]:
    """A temporary path beside `final` to write to; synced and renamed onto `final` when the block succeeds,
    removed when it fails. With `mode`, the file exists (empty, with those permissions) before the block runs. The
    path ends in `.tmp`: a writer that adds its own suffix to a path (numpy's `save`) is given `atomic_writer`'s
    file instead."""
    tmp = _temporary(final)
    try:
        if mode is not None:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
            os.chmod(tmp, mode)  # exactly `mode`, whatever the umask
        yield tmp
        if durable:
            fsync_file(tmp)
        os.replace(tmp, final)
        if durable:
            fsync_folder(final.parent)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_writer(final: Path, *, mode: int | None = None, durable: bool = True) -> Iterator[IO[bytes]]:
    """A binary file to write `final`'s content to, as it comes; published whole when the block succeeds (an
    exception in the block leaves `final` as it was)."""
    with atomic_path(final, mode=mode, durable=durable) as tmp, tmp.open("wb") as fh:
        yield fh
        fh.flush()


def atomic_write_bytes(path: Path, data: bytes, *, mode: int | None = None, durable: bool = True) -> None:
    with atomic_writer(path, mode=mode, durable=durable) as fh:
        fh.write(data)


def atomic_write_text(path: Path, text: str, *, mode: int | None = None, encoding: str = "utf-8",
                      durable: bool = True) -> None:
    atomic_write_bytes(path, text.encode(encoding), mode=mode, durable=durable)


def atomic_write_json(path: Path, value: Any, *, indent: int | None = None, mode: int | None = None,
                      durable: bool = True) -> None:
    """`value` as JSON (`json.dumps`, `indent` as given) at `path`, whole or not at all."""
    atomic_write_text(path, json.dumps(value, indent=indent), mode=mode, durable=durable)


def _sync_tree(folder: Path) -> None:
    """Sync every file and folder under `folder` (links are not followed: what they point to is not ours)."""
    for root, dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                fsync_file(path)
        for name in dirs:
            if not (Path(root) / name).is_symlink():
                fsync_folder(Path(root) / name)
    fsync_folder(folder)


@contextmanager
def atomic_folder(final: Path, *, durable: bool = True, clean_stale: bool = False,
                  check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """A fresh temporary folder beside `final` (`.<name>.tmp-<pid>-<random>`) to build in; when the block succeeds
    (and `check(folder)` raises nothing) it replaces `final` whole, when it fails it is removed. `clean_stale`:
    first remove the temporary folders a killed build of the same `final` left (only where one builder at a time
    works on it). The swap is two renames (the old folder aside, the new one in): a crash between them leaves no
    `final`, never a mixed one."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if clean_stale:
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if check is not None:
            check(tmp)
        if durable:
            _sync_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(final, old)
        os.replace(tmp, final)
        if durable:
            fsync_folder(final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
