"""What changes are applied over: the built indexes (generation 0), or the indexes compaction built with the changes
folded in (generation 1, 2, ...: `plugsearch.retriever.live.compaction`), kept beside the change log:

    <change log folder>/generations/g000001/  corpus.jsonl (the served passages), docstore/, bm25s/, dense-flat/,
                                              embeddings/ (the passages' vectors, what the next compaction reuses)

A generation's passages are the built corpus with the changes up to its `folded` applied: the same corpus as far
as a trained policy is concerned (the retriever still reports the built corpus's checksum, and the changes counted
since it), only searched through new index files. Positions (the document numbers searches return) are made unique
across generations: generation g's position p is `g << ORIGIN_BITS | p`, so a search answered from one generation is
still read right while the next one is swapped in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from plugsearch.retriever.backends.base import DenseMirror, LexicalOverlay, Retriever
from plugsearch.retriever.encoders.encoder import Encoder
from plugsearch.retriever.live.changelog import Generation
from plugsearch.retriever.store.docstore import DocumentStore
from plugsearch.retriever.store.manifest import Manifest

if TYPE_CHECKING:
    from plugsearch.retriever.settings import RetrieverSettings

ORIGIN_BITS = 40
"""Positions per generation (2^40: 50,000 times wiki-18's passages)."""
GENERATIONS = "generations"
CORPUS_FILE = "corpus.jsonl"
EMBEDDINGS = "embeddings"


@dataclass(eq=False)
class Base:
    """One generation's indexes: its documents (`store`), its retrievers by method (`bm25`, `dense`), their
    manifests; what live changes need of them (`lexical`: the BM25 index's tokeniser and statistics; `encoder`: the
    dense encoder; `mirror`: a dense store that takes the changes itself)."""

    generation: Generation
    store: DocumentStore
    retrievers: dict[str, Retriever]
    manifests: dict[str, Manifest] = field(default_factory=dict)
    lexical: LexicalOverlay | None = None
    encoder: Encoder | None = None
    mirror: DenseMirror | None = None

    @property
    def origin(self) -> int:
        return self.generation.gen << ORIGIN_BITS

    def close(self, *, keep: Encoder | None = None) -> None:
        """Close its indexes and documents (`keep`: an encoder the next generation goes on using)."""
        from plugsearch.retriever.backends.dense import DenseRetriever

        for retriever in self.retrievers.values():
            if isinstance(retriever, DenseRetriever) and keep is not None and retriever.encoder is keep:
                retriever.index.close()
            else:
                retriever.close()
        self.store.close()


def generation_folder(log_folder: Path, gen: int) -> Path:
    return log_folder / GENERATIONS / f"g{gen:06d}"


def generation_settings(settings: RetrieverSettings, folder: Path) -> RetrieverSettings:
    """`settings` with the generation's corpus and index folder: its indexes are checked, loaded and built as the
    built ones are, through the same registry."""
    return settings.model_copy(update={"corpus": folder / CORPUS_FILE, "index_dir": folder}, deep=True)
