"""The compact policy in the search environment: its steps (pool, with a dense block when asked, follow-up
query, selection, stop), the structured actions of `SearchEnv`, the reward on the documents in the
environment's state, the weights' digest check, and the trainer's log-probabilities of sampled actions."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from plugsearch.common.qa import QAItem
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchedDocument, SearchParams
from plugsearch.searcher.compact import (
    ABSENT_COSINE_GAP,
    CANDIDATE_FEATURES,
    DENSE_FEATURES,
    DOC_FEATURES,
    CompactPolicy,
    CompactPolicyError,
    QuestionInfo,
    candidates,
    dense_features,
    doc_features,
    pool_of,
    softmax,
    title_core,
    title_head,
)
from plugsearch.searcher.env import Action, InfoBlock, SearchEnv, SearchEvent
from plugsearch.searcher.loop import run_search
from plugsearch.trainer.common.rewards import documents_hit
from plugsearch.trainer.compact.data import LabeledItem
from plugsearch.trainer.compact.rl import Episode, run_episode

QUESTION = "Which city is the director of Big Stone Gap based in?"
CORPUS = {
    "big stone gap": [Document(id="d1", title="Big Stone Gap (film)", score=9.0,
                               text="Big Stone Gap is a 2014 film directed by Adriana Trigiani."),
                      Document(id="d2", title="Pebble", score=5.0, text="A pebble is a small piece of rock."),
                      Document(id="d3", title="Gap Inc.", score=4.0, text="Gap is a clothing retailer.")],
    "adriana trigiani": [Document(id="d4", title="Adriana Trigiani", score=8.0,
                                  text="Adriana Trigiani is a writer and director based in Greenwich Village."),
                         Document(id="d2", title="Pebble", score=1.0, text="A pebble is a small piece of rock.")],
}


# the dense retriever's answer to the question: the director's passage (which BM25's pool lacks) first
DENSE_HITS = [Document(id="d4", title="Adriana Trigiani", score=0.71,
                       text="Adriana Trigiani is a writer and director based in Greenwich Village."),
              Document(id="d1", title="Big Stone Gap (film)", score=0.64,
                       text="Big Stone Gap is a 2014 film directed by Adriana Trigiani.")]


class MemoryRetriever:
    """Answers a query with the documents of the first key it contains (lower-cased); the `dense` method
    answers the question with `DENSE_HITS`."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        self.methods: list[str | None] = []

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        self.queries.extend(queries)
        self.methods.extend(method for _ in queries)
        out = []
        for q in queries:
            if method == "dense":
                hits = DENSE_HITS if q == QUESTION else []
            else:
                hits = next((docs for key, docs in CORPUS.items() if key in q.lower()), [])
            out.append([d.model_copy() for d in hits[:k]])
        return out


def _mlp(names: tuple[str, ...], doc: dict[str, float], prefix: str = "") -> dict[str, np.ndarray]:
    """A linear scorer through the MLP's shapes: the first hidden unit carries the weighted feature sum
    (shifted to stay positive through the ReLUs)."""
    n = len(names)
    w1 = np.zeros((n, 2), dtype=np.float32)
    for name, value in doc.items():
        w1[names.index(name), 0] = value
    return {prefix + k: v for k, v in {
        "mean": np.zeros(n, np.float32), "std": np.ones(n, np.float32), "w1": w1,
        "b1": np.array([100.0, 0.0], np.float32), "w2": np.eye(2, dtype=np.float32),
        "b2": np.zeros(2, np.float32), "w3": np.array([[1.0], [0.0]], np.float32), "b3": np.zeros(1, np.float32),
    }.items()}


def weights(*, doc: dict[str, float], query: dict[str, float], dense: dict[str, float] | None = None
            ) -> dict[str, np.ndarray]:
    """The lexical scorer `doc`, the query head `query` and, given `dense`, the dense scorer (over the
    lexical and the dense features)."""
    qv = np.zeros(len(CANDIDATE_FEATURES), dtype=np.float32)
    for name, value in query.items():
        qv[CANDIDATE_FEATURES.index(name)] = value
    out = {**_mlp(DOC_FEATURES, doc), "qv": qv}
    if dense is not None:
        out.update(_mlp(DOC_FEATURES + DENSE_FEATURES, dense, prefix="dense_"))
    return out


def block(docs: list[Document], method: str | None = None, turn: int = 0) -> InfoBlock:
    return InfoBlock(turn=turn, queries=["q"], method=method, documents=[
        SearchedDocument(**d.model_dump(), turn=turn, query="q") for d in docs])


def params(**kw: int) -> SearchParams:
    return SearchParams(mode="s3", **{"retrieve_k": 3, "select_k": 2, "max_turns": 1, **kw})


# a policy that searches the name the top document introduces, then prefers documents linked from the question's
NAME_SEEKER = CompactPolicy(weights(doc={"linked_from_anchor": 5.0, "is_anchor": 3.0, "score_rel": 1.0},
                                    query={"name_query": 2.0, "stop": 1.0}), name="test-compact")


async def test_policy_searches_a_name_from_the_pool_then_selects_across_blocks() -> None:
    retriever = MemoryRetriever()
    events: list[SearchEvent] = []
    outcome = await run_search(QUESTION, params(), policy=NAME_SEEKER, retriever=retriever, on_event=events.append)
    assert outcome.queries == ["Adriana Trigiani"]  # a name the film's passage introduces, not in the question
    assert retriever.queries == [QUESTION, "Adriana Trigiani"]
    assert [d.id for d in outcome.documents] == ["d1", "d4"]  # the anchor, then the bridge from the second block
    assert outcome.stop_reason == "complete" and not outcome.degraded
    assert outcome.policy_model == "test-compact"
    assert outcome.timings.policy_calls == 2 and outcome.valid_actions == 2 and outcome.invalid_actions == 0
    kinds = [(e.type, e.data.get("kind")) for e in events]
    assert kinds == [("retrieval", None), ("action", "search"), ("retrieval", None), ("action", "select"),
                     ("action", "select"), ("action", "complete"), ("end", None)]
    assert [e.data.get("block") for e in events if e.data.get("kind") == "select"] == [0, 1]
    assert outcome.blocks[0].selected == [1] and outcome.blocks[1].selected == [1]
    # the transcript holds the actions in s3's tags, after s3's first observation
    actions = [m.content for m in outcome.messages if m.role == "assistant"]
    assert actions[0] == '<query>{"query": "Adriana Trigiani"}</query>'
    assert actions[1] == "<important_info>[1]</important_info><important_info>[1]</important_info>" \
                         "<search_complete>True</search_complete>"


async def test_policy_stops_when_the_stop_scores_highest_and_returns_select_k() -> None:
    stopper = CompactPolicy(weights(doc={"score_rel": 1.0}, query={"stop": 5.0}))
    outcome = await run_search(QUESTION, params(select_k=3), policy=stopper, retriever=MemoryRetriever())
    assert outcome.queries == []
    assert [d.id for d in outcome.documents] == ["d1", "d2", "d3"]  # BM25's order when only its score counts


async def test_no_search_is_offered_without_turns_left() -> None:
    outcome = await run_search(QUESTION, params(max_turns=0), policy=NAME_SEEKER, retriever=MemoryRetriever())
    assert outcome.queries == [] and len(outcome.documents) == 2


async def test_a_repeated_search_action_is_invalid_for_every_policy_and_ends_after_max_invalid_in_a_row() -> None:
    """One rule for every policy (an LLM's repeated query is re-prompted the same way): a turn spent, counted
    invalid, the environment asks again; past `max_invalid` in a row the search ends on every block."""
    env = SearchEnv(QUESTION, params(max_turns=5, max_invalid=2), MemoryRetriever())
    await env.reset()
    for n in (1, 2):
        await env.act(Action("search", query=QUESTION.upper()))  # the question itself: a repeat
        assert not env.done and env.invalid == n and env.messages[-1].role == "user"
        assert "already searched" in env.messages[-1].content
    await env.act(Action("search", query=QUESTION.upper()))
    assert env.done and env.stop_reason == "invalid_actions" and env.invalid == 3 and env.queries == []
    assert [d.id for d in env.documents()] == ["d1", "d2", "d3"]  # s3's rule: a block with no tag counts whole


class CountingRetriever(MemoryRetriever):
    """Also records each call's queries (one call: one retriever request)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        self.calls.append(list(queries))
        return await super().retrieve(queries, k, method)


async def test_a_prefetched_query_is_retrieved_with_the_search_before_and_searched_from_there() -> None:
    retriever = CountingRetriever()
    env = SearchEnv(QUESTION, params(max_turns=2), retriever)
    await env.reset()
    await env.act(Action("search", query="big stone gap film", prefetch=("Adriana  Trigiani", "big stone gap film")))
    assert retriever.calls[-1] == ["big stone gap film", "Adriana Trigiani"]  # one request; the repeat left out
    await env.act(Action("search", query="Adriana Trigiani"))
    assert len(retriever.calls) == 2  # no request: its documents came with the first search
    plain = SearchEnv(QUESTION, params(max_turns=2), MemoryRetriever())
    await plain.reset()
    await plain.act(Action("search", query="big stone gap film"))
    await plain.act(Action("search", query="Adriana Trigiani"))
    assert [[(d.id, d.turn, d.query) for d in b.documents] for b in env.blocks] == \
           [[(d.id, d.turn, d.query) for d in b.documents] for b in plain.blocks]
    assert env.queries == plain.queries and not env.can_search


async def test_a_prefetch_is_only_asked_with_a_search_left_after_it_and_a_wrong_guess_costs_a_request() -> None:
    retriever = CountingRetriever()
    env = SearchEnv(QUESTION, params(max_turns=2), retriever)
    await env.reset()
    await env.act(Action("search", query="big stone gap film", prefetch=("pebble",)))
    await env.act(Action("search", query="Adriana Trigiani", prefetch=("gap",)))  # the last search: no prefetch
    assert retriever.calls[1:] == [["big stone gap film", "pebble"], ["Adriana Trigiani"]]


async def test_the_greedy_policy_prefetches_its_runner_up_while_a_search_is_left_after_and_samples_never_do(
        ) -> None:
    env = SearchEnv(QUESTION, params(max_turns=2), MemoryRetriever())
    await env.reset()
    decision = NAME_SEEKER.decide(env)
    pool = pool_of(env.blocks)
    cands, _ = candidates(QuestionInfo.of(QUESTION), pool, softmax(NAME_SEEKER.doc_logits(decision.doc_x)),
                          env.seen_queries, decision.doc_x)
    assert decision.cand_x is not None
    q_logits = NAME_SEEKER.query_logits(decision.cand_x)
    ranked = [cands[i].query for i in np.argsort(-q_logits, kind="stable") if cands[i].kind != "stop"]
    assert decision.action.query == ranked[0] and decision.action.prefetch == (ranked[1],)
    assert NAME_SEEKER.decide(env, rng=np.random.default_rng(0)).action.prefetch == ()  # training: as sampled
    last = SearchEnv(QUESTION, params(max_turns=1), MemoryRetriever())
    await last.reset()
    assert NAME_SEEKER.decide(last).action.prefetch == ()  # no search after this one


async def test_selection_outside_the_blocks_is_ignored() -> None:
    env = SearchEnv(QUESTION, params(), MemoryRetriever())
    await env.reset()
    await env.act(Action("complete", selected=((0, 2), (0, 9), (5, 1), (0, 2))))
    assert [d.id for d in env.documents()] == ["d2"]


async def test_every_mode_takes_its_actions_through_act_and_naive_takes_none() -> None:
    env = SearchEnv(QUESTION, params(max_turns=2).model_copy(update={"mode": "qagent"}), MemoryRetriever())
    await env.reset()
    await env.act(Action("search", queries=("big stone gap film", "Adriana Trigiani")))
    assert env.queries == ["big stone gap film", "Adriana Trigiani"] and not env.done
    await env.act(Action("complete"))
    assert env.done and env.stop_reason == "complete"
    assert {d.id for d in env.documents()} == {"d1", "d2", "d3", "d4"}  # QAgent: the union of its rounds
    naive = SearchEnv(QUESTION, params().model_copy(update={"mode": "naive"}), MemoryRetriever())
    await naive.reset()
    assert naive.done
    with pytest.raises(RuntimeError, match="finished"):
        await naive.act(Action("complete"))


async def test_training_episode_reward_reads_the_environments_documents() -> None:
    item = LabeledItem(QAItem(id="q", question=QUESTION, golden_answers=["Greenwich Village"]),
                       frozenset({"Adriana Trigiani"}))
    retriever = MemoryRetriever()
    ep: Episode = await run_episode(NAME_SEEKER, item, retriever, params(), rng=None)
    assert [d.id for d in ep.documents] == ["d1", "d4"]
    naive = (await retriever.retrieve([QUESTION], len(ep.documents), None))[0]
    # the answer is only in the bridge passage the follow-up search found: GBR (recall) = 1 - 0
    assert documents_hit(ep.documents, item.item.golden_answers) - documents_hit(naive, item.item.golden_answers) == 1
    assert ep.steps[0].choice is not None and ep.steps[-1].selected == [0, 3]


async def test_sampled_log_probability_matches_the_trainers() -> None:
    torch = pytest.importorskip("torch")
    from plugsearch.trainer.compact.model import log_prob, norms_of, torch_model

    policy = CompactPolicy(weights(doc={"score_rel": 2.0, "title_in_q": 1.0}, query={"name_query": 0.5}))
    item = LabeledItem(QAItem(id="q", question=QUESTION, golden_answers=["x"]))
    ep = await run_episode(policy, item, MemoryRetriever(), params(select_k=2), rng=np.random.default_rng(3))
    expected = 0.0
    for step in ep.steps:
        if step.cand_x is not None:
            q = step.cand_x @ policy.weights["qv"]
            expected += q[step.choice] - math.log(np.exp(q).sum())
        logits = policy.doc_logits(step.doc_x).astype(np.float64)
        left = list(range(len(logits)))
        for i in step.selected:
            expected += logits[i] - math.log(sum(math.exp(logits[j]) for j in left))
            left.remove(i)

    model = torch_model((2, 2), ["lexical"], policy.weights)
    got = log_prob(model, ep, norms_of(policy.weights), 1.0)
    assert got.requires_grad  # the gradient reaches both heads
    assert float(got.detach()) == pytest.approx(expected, abs=1e-4)
    assert torch.is_tensor(got)


def test_weights_round_trip_and_digest_check(tmp_path: Path) -> None:
    saved = replace(NAME_SEEKER)  # `save` records the digest on the policy it saves: not on the shared one
    saved.save(tmp_path, {"search": {"retrieve_k": 3, "select_k": 2, "max_turns": 1}})
    loaded = CompactPolicy.load(tmp_path)
    assert loaded.setting is not None and loaded.setting.method == "bm25" and loaded.setting.pool_methods == ["bm25"]
    assert loaded.digest == saved.digest and loaded.model.startswith("test-compact@")
    assert loaded.manifest["doc_features"] == list(DOC_FEATURES)
    data = bytearray((tmp_path / "weights.npz").read_bytes())
    data[-30] ^= 1
    (tmp_path / "weights.npz").write_bytes(bytes(data))
    with pytest.raises(CompactPolicyError, match="does not match"):
        CompactPolicy.load(tmp_path)
    with pytest.raises(CompactPolicyError, match="not a compact policy folder"):
        CompactPolicy.load(tmp_path / "missing")


def _rewrite_manifest(folder: Path, **changes: object) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, **changes}))


def test_a_manifest_whose_feature_names_differ_from_the_code_s_is_refused_naming_them(tmp_path: Path) -> None:
    """Weights trained on a row in another order have the same shapes: only the names tell, and they must."""
    saved = replace(NAME_SEEKER)
    saved.save(tmp_path, {"search": {"retrieve_k": 3, "select_k": 2, "max_turns": 1}})
    names = list(DOC_FEATURES)
    names[0], names[1] = names[1], names[0]  # score_rel <-> inv_rank: same length, same set
    _rewrite_manifest(tmp_path, doc_features=names)
    with pytest.raises(CompactPolicyError, match=r"manifest.json: .*`doc_features` differs from the code's at "
                       r"0: 'inv_rank' \(code 'score_rel'\); 1: 'score_rel' \(code 'inv_rank'\)"):
        CompactPolicy.load(tmp_path)
    cands = [*CANDIDATE_FEATURES[:-1], "stop_x_new_thing"]
    _rewrite_manifest(tmp_path, doc_features=list(DOC_FEATURES), candidate_features=cands)
    with pytest.raises(CompactPolicyError, match=r"`candidate_features` differs .*'stop_x_new_thing' \(code "
                       r"'stop_x_anchor_count'\)"):
        CompactPolicy.load(tmp_path)
    _rewrite_manifest(tmp_path, candidate_features=list(CANDIDATE_FEATURES)[:-1])
    with pytest.raises(CompactPolicyError, match="16 names, the code builds 17; not in the manifest: "
                       "stop_x_anchor_count"):
        CompactPolicy.load(tmp_path)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    del manifest["doc_features"]
    manifest["candidate_features"] = list(CANDIDATE_FEATURES)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CompactPolicyError, match="`doc_features` is not recorded"):
        CompactPolicy.load(tmp_path)
    _rewrite_manifest(tmp_path, doc_features=list(DOC_FEATURES))
    assert CompactPolicy.load(tmp_path).digest == saved.digest  # the names restored: it loads again


def test_the_dense_scorer_s_feature_names_are_checked_too(tmp_path: Path) -> None:
    saved = replace(DENSE_READER)
    saved.save(tmp_path, {"search": {"retrieve_k": 3, "select_k": 2, "max_turns": 1}, "dense": {"encoder": "e"}})
    assert CompactPolicy.load(tmp_path).manifest["dense_features"] == list(DENSE_FEATURES)
    _rewrite_manifest(tmp_path, dense_features=list(reversed(DENSE_FEATURES)))
    with pytest.raises(CompactPolicyError, match="`dense_features` differs from the code's at 0: 'lexical_inv_rank'"):
        CompactPolicy.load(tmp_path)


def test_weights_for_other_features_are_refused() -> None:
    bad = dict(NAME_SEEKER.weights)
    bad["qv"] = np.zeros(3, np.float32)
    with pytest.raises(CompactPolicyError, match="candidate features"):
        CompactPolicy(bad).check()


def test_features_ignore_passage_length() -> None:
    """The same passage repeated to five times its length scores the same (no length shortcut)."""
    short = Document(id="a", title="Adriana Trigiani", score=4.0, text="Adriana Trigiani is a director born 1969.")
    long = short.model_copy(update={"text": " ".join([short.text] * 5)})
    q = QuestionInfo.of("When was Adriana Trigiani born?")
    x_short = doc_features(q, pool_of([block([short])]))
    x_long = doc_features(q, pool_of([block([long])]))
    assert np.allclose(x_short, x_long)


def test_act_returns_the_greedy_decision() -> None:
    """`act` (what the searcher serves) is `decide` without sampling."""
    async def go() -> Action:
        env = SearchEnv(QUESTION, params(), MemoryRetriever())
        await env.reset()
        return await NAME_SEEKER.act(env)

    assert asyncio.run(go()).kind == "search"


# ------------------------------------------------------------------------------------ the dense block
DENSE_READER = CompactPolicy(weights(doc={"score_rel": 1.0}, query={"stop": 5.0},
                                     dense={"cosine": 10.0, "score_rel": 1.0}), name="test-dense",
                             manifest={"dense": {"encoder": "all-MiniLM-L6-v2"}})


async def test_a_dense_pool_is_a_block_of_its_own_and_the_dense_scorer_reads_it() -> None:
    retriever = MemoryRetriever()
    events: list[SearchEvent] = []
    outcome = await run_search(QUESTION, params(pool_methods=["bm25", "dense"], select_k=2), policy=DENSE_READER,
                               retriever=retriever, on_event=events.append)
    assert retriever.methods == ["bm25", "dense"] and retriever.queries == [QUESTION, QUESTION]
    assert [(b.turn, b.method) for b in outcome.blocks] == [(0, "bm25"), (0, "dense")]
    assert [e.data["method"] for e in events if e.type == "retrieval"] == ["bm25", "dense"]
    assert outcome.queries == []  # the dense block is the first retrieval, not a follow-up search
    # the cosine decides: the director's passage only the dense block found, and the film's (in block order)
    assert [d.id for d in outcome.documents] == ["d1", "d4"]
    assert outcome.blocks[0].selected == [1] and outcome.blocks[1].selected == [1]
    assert outcome.timings.retrieval_calls == 2
    # the same policy on a BM25 pool alone scores with its lexical scorer (BM25's order)
    lexical = await run_search(QUESTION, params(pool_methods=["bm25"], select_k=2), policy=DENSE_READER,
                               retriever=MemoryRetriever())
    assert [d.id for d in lexical.documents] == ["d1", "d2"]


def test_dense_evidence_of_the_pool() -> None:
    bm25 = block(CORPUS["big stone gap"], "bm25")
    dense = block(DENSE_HITS, "dense")
    pool = pool_of([bm25, dense])
    assert [p.doc.id for p in pool] == ["d1", "d2", "d3", "d4"]  # the lexical block first, then what only dense found
    assert [p.lexical for p in pool] == [True, True, True, False]
    x = dense_features(pool, [bm25, dense])
    assert x is not None and x.shape == (4, len(DENSE_FEATURES))
    col = {name: x[:, i] for i, name in enumerate(DENSE_FEATURES)}
    assert col["in_lexical"].tolist() == [1, 1, 1, 0] and col["in_dense"].tolist() == [1, 0, 0, 1]
    absent = 0.64 - ABSENT_COSINE_GAP  # the dense block's lowest cosine, minus the gap
    assert col["cosine"] == pytest.approx([0.64, absent, absent, 0.71])
    assert col["cosine_gap"] == pytest.approx([0.64 - 0.71, absent - 0.71, absent - 0.71, 0.0])
    assert col["dense_inv_rank"][0] == pytest.approx(1 / 2) and col["dense_inv_rank"][3] == pytest.approx(1.0)
    assert dense_features(pool_of([bm25]), [bm25]) is None  # no dense block: the lexical scorer


def test_the_dense_block_is_asked_for_only_with_the_trained_encoder() -> None:
    assert DENSE_READER.has_dense and DENSE_READER.dense_encoder == "all-MiniLM-L6-v2"
    served = ["bm25", "dense", "hybrid"]
    assert DENSE_READER.pool_methods(served, "all-MiniLM-L6-v2") == ["bm25", "dense"]
    assert DENSE_READER.pool_methods(served, "/models/all-MiniLM-L6-v2/") == ["bm25", "dense"]  # a local copy
    assert DENSE_READER.pool_methods(served, "intfloat/e5-base-v2") == ["bm25"]  # other cosines: lexical
    assert DENSE_READER.pool_methods(["bm25"], None) == ["bm25"]
    assert DENSE_READER.pool_methods(["dense"], "all-MiniLM-L6-v2") is None  # no BM25: the retriever's default
    assert DENSE_READER.pool_methods(None, None) is None  # the retriever did not say
    assert NAME_SEEKER.pool_methods(served, "all-MiniLM-L6-v2") == ["bm25"]  # no dense scorer


def test_a_partial_dense_scorer_is_refused() -> None:
    bad = dict(DENSE_READER.weights)
    del bad["dense_w2"]
    with pytest.raises(CompactPolicyError, match="part of the dense scorer"):
        CompactPolicy(bad).check()
    wrong = dict(DENSE_READER.weights)
    wrong["dense_mean"] = np.zeros(3, np.float32)
    with pytest.raises(CompactPolicyError, match="dense_scorer"):
        CompactPolicy(wrong).check()


def test_titles_link_without_their_disambiguation() -> None:
    assert title_core("Machine Head (band)") == "Machine Head" and title_head("Davenport, Florida") == "Davenport"
    question = QuestionInfo.of("Which year was the band that toured with Livin la Vida Loco formed?")
    tour = Document(id="t", title="Livin la Vida Loco", score=5.0,
                    text="Other bands that were featured included Machine Head and Slipknot.")
    band = Document(id="b", title="Machine Head (band)", score=1.0, text="Formed on October 12, 1991 in Oakland.")
    other = Document(id="o", title="Psycho Circus", score=2.0, text="A concert tour by Kiss.")
    x = doc_features(question, pool_of([block([tour, other, band])]))
    col = {name: x[:, i] for i, name in enumerate(DOC_FEATURES)}
    assert col["is_core_anchor"].tolist() == [1, 0, 0]
    assert col["core_linked_from_anchor"].tolist() == [0, 0, 1]  # "(band)" would have hidden the link
    assert col["linked_from_anchor"].tolist() == [0, 0, 0]  # the whole title is not in the anchor's text


async def test_sampled_log_probability_with_the_dense_scorer_matches_the_trainers() -> None:
    pytest.importorskip("torch")
    from plugsearch.trainer.compact.model import log_prob, norms_of, torch_model

    item = LabeledItem(QAItem(id="q", question=QUESTION, golden_answers=["x"]))
    ep = await run_episode(DENSE_READER, item, MemoryRetriever(), params(pool_methods=["bm25", "dense"], select_k=2),
                           rng=np.random.default_rng(5))
    assert [s.scorer for s in ep.steps] == ["dense"]
    step = ep.steps[0]
    assert step.cand_x is not None and step.choice == 0  # the stop, sampled among the follow-ups
    q = step.cand_x @ DENSE_READER.weights["qv"]
    logits = DENSE_READER.doc_logits(step.doc_x, "dense").astype(np.float64)
    left, expected = list(range(len(logits))), float(q[0] - math.log(np.exp(q).sum()))
    for i in step.selected:
        expected += logits[i] - math.log(sum(math.exp(logits[j]) for j in left))
        left.remove(i)
    model = torch_model((2, 2), ["lexical", "dense"], DENSE_READER.weights)
    assert float(log_prob(model, ep, norms_of(DENSE_READER.weights), 1.0).detach()) == pytest.approx(expected, abs=1e-4)


def test_follow_up_names_are_names_and_titles_within_one_sentence() -> None:
    from plugsearch.searcher.compact.candidates import _names

    # the served searcher's follow-ups of 2026-11-27: "European Union. Tickets", "Although", "October"
    eiffel = ("The Eiffel Tower is in Paris. Although it was criticised, it became a symbol of France. Tickets are "
              "sold by the European Union. Tickets went on sale in October.")
    assert _names(eiffel, "what is the capital of the country where the eiffel tower is") == [
        "Paris", "France", "European Union"]
    derrickson = "In October 1998 he met Ed Wood. On Monday, the 3rd, During the war he moved."
    assert _names(derrickson, "") == ["Ed Wood"]
    # initials and abbreviations do not end a sentence; connectors join; function words are cut off the ends
    assert _names("J. R. R. Tolkien moved to St. Louis with the U.S. Army. In 1990 the University of California at "
                  "Berkeley hired John von Neumann.", "") == [
        "J. R. R. Tolkien", "St. Louis", "U.S. Army", "University of California", "Berkeley", "John von Neumann"]
    # a lone word capitalised only where its sentence starts is a common word; inside a sentence, a name
    assert _names("Critics praised it. Critics in Rome too.", "") == ["Rome"]
    assert _names("Madonna sang. Fans cheered for Madonna.", "") == ["Madonna"]
    assert _names('It is an alternative to "Dungeons & Dragons".', "") == ["Dungeons & Dragons"]
    # a lone nationality, language or region word is an adjective, not a name; nor is a word the passage also
    # writes in lower case (issue 46: "American" was 24 of 400 follow-ups on HotpotQA questions)
    assert _names("He was an American actor who spoke French. Later the Army of Spain and the army of Peru met "
                  "Asians in Lima.", "") == ["Army of Spain", "Peru", "Lima"]


def test_a_title_follow_up_is_the_title_and_the_questions_other_words_not_a_copy() -> None:
    from plugsearch.searcher.compact import title_query

    q = QuestionInfo.of("Which city is the director of Big Stone Gap based in?")
    assert title_query(q, "Big Stone Gap (film)") == "Big Stone Gap (film) city director based"
    assert title_query(q, "Adriana Trigiani") == "Adriana Trigiani city director Big Stone Gap based"
    assert title_query(QuestionInfo.of("who wrote it?"), "Hamlet") == "Hamlet wrote"
