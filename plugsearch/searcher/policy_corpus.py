"""Whether a compact policy may serve a corpus. A policy trained on a user's corpus (`plugsearch-train compact
--corpus ... --qa ...`) records that corpus's identity in its manifest (`corpus`: file, sha256, passages, the
BM25 backend, the dense encoder and index type, and `bound: true`): its features (BM25 evidence, cosines of
that encoder) and its evaluation hold for that corpus and encoder only, so it is served on them only. The
shipped policy records its corpus too but is not bound (it is the general default, served on any corpus;
docs/searcher.md).

`plugsearch-stack --policy DIR` checks before it starts anything; the searcher service checks the retriever's
`/version` before a search (a mismatch is a 503 whose message says what differs and what to do). Documents
changed while serving (the retriever's change log) keep the corpus's identity: the policy keeps serving it, and
the searcher says how far it has moved (`corpus_drift`), advising retraining past `RETRAIN_SHARE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class CorpusMismatch(ValueError):
    """The served corpus, encoder or dense index is not the one the policy was trained on."""


def _same_encoder(served: str, trained: str) -> bool:
    return served == trained or Path(served.rstrip("/")).name == Path(trained.rstrip("/")).name


def bound_corpus(manifest: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The corpus identity a policy is bound to (None: not bound, it serves any corpus)."""
    corpus = manifest.get("corpus")
    return corpus if isinstance(corpus, Mapping) and corpus.get("bound") else None


def check_corpus(manifest: Mapping[str, Any], *, corpus_sha256: str | None, encoder: str | None,
                 dense_index: str | None, name: str = "the policy") -> None:
    """Raise `CorpusMismatch` when a bound policy would serve another corpus (`corpus_sha256`, with or without
    its `sha256:` prefix; None: unknown, not checked), without the dense encoder it was trained with (`encoder`
    None: the retriever serves no dense index), or over another dense index type."""
    corpus = bound_corpus(manifest)
    if corpus is None:
        return
    trained_sha = str(corpus.get("sha256") or "")
    where = f"{corpus.get('file', 'its corpus')} (sha256 {trained_sha[:12]}, {corpus.get('documents', '?')} passages)"
    retrain = ("retrain it on this corpus (plugsearch-train compact --corpus CORPUS.jsonl --qa QUESTIONS.jsonl) or "
               "serve it on the corpus it was trained on")
    if corpus_sha256 is not None and trained_sha:
        served = corpus_sha256.split(":", 1)[-1]
        if served != trained_sha:
            raise CorpusMismatch(f"{name} was trained on {where}; this corpus is sha256 {served[:12]}: {retrain}")
    trained_encoder = corpus.get("encoder")
    if trained_encoder:
        if encoder is None:
            raise CorpusMismatch(f"{name} was trained with the dense encoder {trained_encoder} over {where}; the "
                                 "retriever serves no dense index: serve it with the dense index (plugsearch-stack "
                                 "--dense auto|on)")
        if not _same_encoder(encoder, str(trained_encoder)):
            raise CorpusMismatch(f"{name} was trained with the dense encoder {trained_encoder}; the retriever "
                                 f"encodes with {encoder}: its cosines do not fit; serve it with {trained_encoder} or "
                                 f"{retrain}")
        trained_index = corpus.get("dense_index")
        if trained_index and dense_index is not None and dense_index != trained_index:
            raise CorpusMismatch(f"{name} was trained on a {trained_index} dense index; the retriever serves a "
                                 f"{dense_index} one (RETRIEVER_FAISS__INDEX_TYPE={trained_index} serves it)")


RETRAIN_SHARE = 0.2
"""Past this share of the trained corpus's documents added, replaced or deleted while serving, the searcher advises
training the policy again on the corpus as it is now."""


def corpus_drift(manifest: Mapping[str, Any], changes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """How far the served corpus has moved from the one a bound policy was trained on, from the retriever's
    changes since its build (`/version` `changes`: documents added, replaced, deleted): the counts, their share of
    the trained corpus's passages, and the advice past `RETRAIN_SHARE`. None for a policy bound to no corpus."""
    corpus = bound_corpus(manifest)
    if corpus is None:
        return None
    counts = {k: int((changes or {}).get(k) or 0) for k in ("added", "replaced", "deleted")}
    trained = max(1, int(corpus.get("documents") or 1))
    share = round(sum(counts.values()) / trained, 4)
    advice = (f"{share:.0%} of the corpus it was trained on has changed (over {RETRAIN_SHARE:.0%}): train the "
              "policy again on the corpus as it is now (plugsearch-train compact --corpus ... --qa ...)"
              if share > RETRAIN_SHARE else None)
    return {**counts, "share": share, "retrain_past": RETRAIN_SHARE, "advice": advice}
