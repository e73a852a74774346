"""The encoded passages on disk: an embeddings folder (`<index_dir>/embeddings-<key>/`) holds the passages' vectors
in document order as chunk files (`chunk-000000.npy`, ...) and their manifest. Written by
`plugsearch.retriever.indexing.embeddings.embed_corpus`; read back, one chunk at a time, by the dense stores'
builds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt


def chunk_path(folder: Path, number: int) -> Path:
    return folder / f"chunk-{number:06d}.npy"


def iter_chunks(folder: Path) -> Iterator[npt.NDArray[np.float32]]:
    """The chunks of `folder` in order, each memory-mapped."""
    for path in sorted(folder.glob("chunk-*.npy")):
        yield np.load(path, mmap_mode="r")
