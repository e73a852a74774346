"""Index manifests and index folders: a folder is built under a temporary name next to its place,
`manifest.json` written last, then renamed into place (`index_folder`), so a crash mid-build leaves only a
`.tmp-*` folder that never loads (and that the next build removes).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from plugsearch.common.files import atomic_folder, atomic_write_text

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class IndexMismatch(RuntimeError):
    """An index does not belong to the configured corpus / encoder (refuse to start)."""


class IndexMissing(RuntimeError):
    """No complete index where one was expected."""


class Manifest(BaseModel):
    kind: str = Field(..., description="bm25 | dense")
    backend: str = Field(..., description="bm25s | pyserini | faiss")
    corpus_path: str
    corpus_checksum: str
    doc_count: int
    encoder: str | None = None
    encoder_config: dict[str, Any] = Field(default_factory=dict)
    dims: int | None = None
    index_type: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    files: list[str] = Field(default_factory=list)
    build_seconds: float = 0.0
    created_at: str = Field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    format_version: int = FORMAT_VERSION

    def write(self, folder: Path) -> None:
        atomic_write_text(folder / MANIFEST, self.model_dump_json(indent=2))

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST
        if not path.is_file():
            raise IndexMissing(f"no index at {folder} (missing {MANIFEST}); build it with `plugsearch-index build`")
        try:
            return cls.model_validate_json(path.read_bytes())
        except ValueError as exc:
            raise IndexMissing(f"unreadable manifest {path}: {exc}") from exc

    def check_files(self, folder: Path) -> None:
        """Raise IndexMissing when a listed file is gone (e.g. the original of an imported index, linked
        into the folder, was moved or deleted)."""
        missing = [name for name in self.files if not (folder / name).exists()]
        if missing:
            linked = [str(os.readlink(folder / n)) for n in missing if (folder / n).is_symlink()]
            raise IndexMissing(f"index {folder} lists files that are missing: {', '.join(missing)}"
                               + (f" (links to {', '.join(linked)})" if linked else ""))

    def check(self, *, corpus_checksum: str, doc_count: int | None = None, encoder: str | None = None,
              encoder_config: dict[str, Any] | None = None, index_type: str | None = None,
              where: Path | None = None) -> None:
        """Raise IndexMismatch, naming every difference, when this index was built from something else."""
        expected: list[tuple[str, str, Any, str, Callable[[Any], str]]] = [
            ("format version", "format_version", FORMAT_VERSION, "", str),
            ("corpus checksum", "corpus_checksum", corpus_checksum, "configured corpus ", str),
            ("document count", "doc_count", doc_count, "corpus ", str),
            ("encoder", "encoder", encoder, "configured ", repr),
            ("encoder config", "encoder_config", encoder_config, "configured ", str),
            ("index type", "index_type", index_type, "configured ", repr)]
        problems = [f"{what} {show(getattr(self, field))} != {against}{show(wanted)}"
                    for what, field, wanted, against, show in expected
                    if wanted is not None and getattr(self, field) != wanted]
        if problems:
            raise IndexMismatch(
                f"index {where or ''} was built from a different corpus/configuration: " + "; ".join(problems)
                + ". Rebuild it with `plugsearch-index build` (or point RETRIEVER_INDEX_DIR/RETRIEVER_CORPUS "
                "at matching files).")


def checked_manifest(folder: Path, setting: str, backend: str, checksum: str, **expect: Any) -> Manifest:
    """The manifest in `folder`, checked against the corpus, its files and the configured backend (`setting`, the
    variable that configures it, named in the error)."""
    manifest = Manifest.read(folder)
    manifest.check(corpus_checksum=checksum, where=folder, **expect)
    if manifest.backend != backend:
        raise IndexMismatch(f"{folder} holds a {manifest.backend} index, {setting} is {backend}")
    manifest.check_files(folder)
    return manifest


@contextmanager
def index_folder(final: Path) -> Iterator[Path]:
    """An index folder built whole (`plugsearch.common.files.atomic_folder`): a fresh temporary folder next to
    `final` (the temporary folders of a killed build removed first), swapped in only once it holds a manifest,
    removed on error."""

    def has_manifest(tmp: Path) -> None:
        if not (tmp / MANIFEST).is_file():
            raise RuntimeError(f"index build for {final} finished without writing a manifest")

    with atomic_folder(final.resolve(), clean_stale=True, check=has_manifest) as tmp:
        yield tmp
