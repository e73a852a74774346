"""A compact policy trained on a user's corpus is served on that corpus and dense encoder only: refused with a
clear message by `plugsearch-stack --policy DIR` before anything starts, and by the searcher service when the
retriever's `/version` names another corpus."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.errors import NotReady
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.policy_corpus import CorpusMismatch, check_corpus
from plugsearch.searcher.serving import SearchService
from plugsearch.searcher.settings import SearcherSettings
from plugsearch.stack import StackError
from plugsearch.stack.cli import _parse_args
from plugsearch.stack.policy import _compact_policy, check_policy_corpus, serve_dense
from tests.unit.test_searcher_compact import DENSE_READER, NAME_SEEKER, MemoryRetriever

SHA = "ab" * 32


def bound(**corpus: Any) -> dict[str, Any]:
    return {"corpus": {"file": "mine.jsonl", "sha256": SHA, "documents": 446, "encoder": "all-MiniLM-L6-v2",
                       "dense_index": "flat", "bound": True, **corpus}}


def test_a_bound_policy_refuses_another_corpus_encoder_or_index() -> None:
    same = {"corpus_sha256": "sha256:" + SHA, "encoder": "all-MiniLM-L6-v2", "dense_index": "flat"}
    check_corpus(bound(), **same)
    check_corpus(bound(), **{**same, "encoder": "/models/all-MiniLM-L6-v2/"})  # the same model from a folder
    with pytest.raises(CorpusMismatch, match=r"trained on mine.jsonl \(sha256 abababababab, 446 passages\); this "
                                             r"corpus is sha256 cdcdcdcdcdcd: retrain it on this corpus"):
        check_corpus(bound(), **{**same, "corpus_sha256": "cd" * 32})
    with pytest.raises(CorpusMismatch, match="encodes with intfloat/e5-base-v2: its cosines do not fit"):
        check_corpus(bound(), **{**same, "encoder": "intfloat/e5-base-v2"})
    with pytest.raises(CorpusMismatch, match="serves no dense index: serve it with the dense index"):
        check_corpus(bound(), **{**same, "encoder": None, "dense_index": None})
    with pytest.raises(CorpusMismatch, match="trained on a flat dense index; the retriever serves a hnsw one"):
        check_corpus(bound(), **{**same, "dense_index": "hnsw"})
    # not bound (the shipped policy: the general default), or no corpus recorded: any corpus
    check_corpus(bound(bound=False), **{**same, "corpus_sha256": "cd" * 32})
    check_corpus({}, corpus_sha256="cd" * 32, encoder=None, dense_index=None)
    # a BM25-only policy needs no encoder
    check_corpus(bound(encoder=None, dense_index=None), **{**same, "encoder": None, "dense_index": None})


def policy_folder(tmp_path: Path, corpus: Path, policy: CompactPolicy = DENSE_READER) -> Path:
    sha = hashlib.sha256(corpus.read_bytes()).hexdigest()
    folder = tmp_path / "policy"
    # a copy: `save` records the folder and digest on the policy it saves, and the module's policies are shared
    replace(policy).save(folder, {**bound(sha256=sha, file=corpus.name), "dense": {"encoder": "all-MiniLM-L6-v2"},
                         "search": {"retrieve_k": 3, "select_k": 2, "max_turns": 1},
                         "evaluation": {"summary": "tiny", "beats_naive": True}})
    return folder


def test_the_stack_serves_a_policy_folder_on_its_own_corpus_only(tmp_path: Path) -> None:
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text('{"id": "1", "title": "A", "text": "alpha"}\n')
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "1", "title": "B", "text": "beta"}\n')
    folder = policy_folder(tmp_path, corpus)
    said: list[str] = []
    args = _parse_args(["--corpus", str(corpus), "--policy", str(folder)])
    policy = _compact_policy(args, said.append)
    assert policy is not None and policy.folder == folder and "beats_naive: True" in said[-1]
    dense = serve_dense(args.dense, policy)
    assert dense  # its dense scorer asks for the dense index
    check_policy_corpus(policy, corpus, dense, environ={})
    with pytest.raises(StackError, match="trained on mine.jsonl .*this corpus is sha256"):
        check_policy_corpus(policy, other, dense, environ={})
    with pytest.raises(StackError, match="serves no dense index"):
        check_policy_corpus(policy, corpus, False, environ={})
    with pytest.raises(StackError, match="encodes with intfloat/e5-base-v2"):
        check_policy_corpus(policy, corpus, dense, environ={"RETRIEVER_ENCODER__NAME": "intfloat/e5-base-v2"})
    with pytest.raises(SystemExit):  # neither a choice nor a folder
        _parse_args(["--policy", str(tmp_path / "missing")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(StackError, match="not a compact policy folder"):
        _compact_policy(_parse_args(["--policy", str(tmp_path / "empty")]), said.append)


class Identity:
    """The retriever's `/version` details as `IndexIdentity` reads them."""

    def __init__(self, details: dict[str, object]) -> None:
        self.values = details

    async def details(self) -> dict[str, object]:
        return dict(self.values)

    async def served(self) -> tuple[list[str] | None, str | None]:
        return list(self.values.get("methods") or []), self.values.get("encoder")  # type: ignore[return-value]


async def test_the_searcher_refuses_to_search_another_corpus_with_a_bound_policy(tmp_path: Path) -> None:
    corpus = tmp_path / "mine.jsonl"
    corpus.write_text('{"id": "1", "title": "A", "text": "alpha"}\n')
    policy = CompactPolicy.load(policy_folder(tmp_path, corpus, NAME_SEEKER))
    sha = hashlib.sha256(corpus.read_bytes()).hexdigest()
    served = {"methods": ["bm25", "dense", "hybrid"], "encoder": "all-MiniLM-L6-v2", "dense_index": "flat"}
    params = SearchParams(mode="s3", retrieve_k=3, select_k=2, max_turns=1)

    def service(details: dict[str, object]) -> SearchService:
        return SearchService(SearcherSettings(retrieve_k=3, select_k=2, max_turns=1), policy=policy,
                             retriever=MemoryRetriever(), index_identity=Identity(details))  # type: ignore[arg-type]

    ok = await service({**served, "corpus_checksum": f"sha256:{sha}"})._pool(params)
    assert ok.pool_methods == ["bm25"]  # NAME_SEEKER has no dense scorer
    with pytest.raises(NotReady, match="trained on mine.jsonl .*this corpus is sha256 ffffffffffff"):
        await service({**served, "corpus_checksum": "sha256:" + "f" * 64})._pool(params)
    with pytest.raises(NotReady, match="encodes with intfloat/e5-base-v2"):
        await service({**served, "corpus_checksum": f"sha256:{sha}", "encoder": "intfloat/e5-base-v2"})._pool(params)
    # naive searches never ask the policy
    naive = params.model_copy(update={"mode": "naive"})
    assert await service({**served, "corpus_checksum": "sha256:" + "f" * 64})._pool(naive) == naive


async def test_a_bound_policy_keeps_serving_a_changing_corpus_and_says_how_far_it_moved(tmp_path: Path) -> None:
    """Documents put and deleted while serving keep the corpus's identity (the policy serves on), and the
    searcher reports the drift, advising retraining past the documented share."""
    from plugsearch.searcher.policy_corpus import RETRAIN_SHARE, corpus_drift

    corpus = tmp_path / "mine.jsonl"
    corpus.write_text('{"id": "1", "title": "A", "text": "alpha"}\n')
    policy = CompactPolicy.load(policy_folder(tmp_path, corpus, NAME_SEEKER))
    trained = int(policy.manifest["corpus"]["documents"])
    sha = hashlib.sha256(corpus.read_bytes()).hexdigest()
    params = SearchParams(mode="s3", retrieve_k=3, select_k=2, max_turns=1)

    def service(changes: dict[str, int]) -> SearchService:
        details = {"methods": ["bm25", "dense", "hybrid"], "encoder": "all-MiniLM-L6-v2", "dense_index": "flat",
                   "corpus_checksum": f"sha256:{sha}", "changes": {"seq": 3, **changes}}
        return SearchService(SearcherSettings(retrieve_k=3, select_k=2, max_turns=1), policy=policy,
                             retriever=MemoryRetriever(), index_identity=Identity(details))  # type: ignore[arg-type]

    small = service({"added": 1, "replaced": 0, "deleted": 1})
    await small._pool(params)  # serves
    assert small.drift == {"added": 1, "replaced": 0, "deleted": 1, "share": round(2 / trained, 4),
                           "retrain_past": RETRAIN_SHARE, "advice": None}
    moved = int(trained * RETRAIN_SHARE) + 1
    large = service({"added": moved, "replaced": 0, "deleted": 0})
    await large._pool(params)  # still serves: the same corpus, changed
    assert large.drift is not None and large.drift["share"] > RETRAIN_SHARE
    assert "train the policy again" in (large.drift["advice"] or "")
    assert corpus_drift({}, {"added": 5}) is None  # the shipped policy is bound to no corpus
