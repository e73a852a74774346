"""The few-question learner: a user's searcher that starts from the shipped policy and moves only as far as the
user's questions carry it.

The shipped policy was trained on thousands of Wikipedia questions; a user has tens. Fitting a new policy from
random weights on 25 questions learns those 25; fine-tuning the shipped weights with a pull back toward them
(L2-SP: the loss plus `pull` * the squared distance to the shipped weights, Li et al. 2018) keeps what
transfers and changes what the user's questions show. How strongly to pull is chosen on the user's training
questions alone (`choose_pull`): each candidate strength is fitted on part of them and judged on the rest
(k-fold for few questions, one dev part carved from them for many), by the answer recall of the searches the
service would run; ties go to the stronger pull, and an infinite pull (`KEEP`: the shipped policy unchanged)
is a candidate, so where the questions show nothing the learner stays where it started. The evaluation
questions are never seen here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from plugsearch.common.qa import MADE_UP, QAItem, found
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import CompactPolicy, TextCache
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.searcher.loop import run_search
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import LabeledItem
from plugsearch.trainer.compact.warmstart import Demonstration, demonstrations, fit

logger = logging.getLogger(__name__)

KEEP = math.inf
"""The pull that keeps the start's weights unchanged."""
PULLS: tuple[float, ...] = (0.0, 0.001, 0.01, 0.1, KEEP)
"""The strengths `choose_pull` tries (`--pull auto`)."""
FOLDS = 5
"""Dev folds for up to `HOLDOUT_FROM` questions (every question judged once)."""
HOLDOUT_FROM = 250
"""From this many real training questions on, one dev part (a fifth, at most `HOLDOUT_MAX`) instead of folds."""
HOLDOUT_MAX = 200
QUERY_STEPS = 300
"""Steps of the query head alone after the fit (`fit(query_steps=...)`): from the shipped weights, the fit's one
step per epoch left it where it was, following up on questions where the user's questions show that stopping
does better (measured on tatqa's training part: 0.548 against 0.696 with the same scorer)."""

DemoCache = MutableMapping[str, Demonstration]
"""Demonstrations by question id (they do not depend on the weights: collected once, fitted often)."""


def cached_demonstrations(items: Sequence[LabeledItem], retriever: RetrieverBackend, params: SearchParams,
                          cache: DemoCache | None = None, progress: bool = False) -> list[Demonstration]:
    """`demonstrations` of `items`, each collected once per `cache`."""
    cache = {} if cache is None else cache
    todo = [it for it in items if it.item.id not in cache]
    for item, demo in zip(todo, demonstrations(todo, retriever, params, progress=progress), strict=True):
        cache[item.item.id] = demo
    return [cache[it.item.id] for it in items]


def served_params(policy: CompactPolicy, retriever: Any, params: SearchParams) -> SearchParams:
    """`params` with the pool `policy` asks for on `retriever` (as the evaluation and the service run it)."""
    methods = list(getattr(retriever, "methods", ()) or ())
    return params.model_copy(update={"pool_methods": policy.pool_methods(methods, getattr(retriever, "encoder", None))})


def with_setting(policy: CompactPolicy, config: CompactConfig, retriever: Any) -> CompactPolicy:
    """`policy` with the setting it was trained in and the dense encoder of its corpus in its manifest: what
    makes it ask for the dense block where it is served (as the saved folder does)."""
    encoder = getattr(retriever, "encoder", None)
    policy.manifest = {**policy.manifest, "search": config.search_setting(),
                       **({"dense": {"encoder": encoder}} if encoder else {})}
    return policy


def judged_hit(ranked: Sequence[Any], item: QAItem) -> float:
    """A question labelled by users' marks, judged on the passages they judged only (a condensed list, as for
    incomplete relevance judgments): 1 when the first of the ranked passages that a user marked (helpful or not)
    is a helpful one. Marks exist only for the passages a searcher showed; counting every unmarked passage as a
    miss would rank the searcher that showed them first whatever the others find."""
    judged = {*item.passage_ids, *item.negative_ids}
    for doc in ranked:
        if doc.id in judged:
            return float(doc.id in item.passage_ids)
    return 0.0


def greedy_hits(policy: CompactPolicy, items: Sequence[LabeledItem], retriever: RetrieverBackend,
                params: SearchParams, texts: TextCache | None = None) -> list[float]:
    """For each question, whether the policy's greedy search (as served, `select_k` documents) finds it; a
    question from users' marks with passages marked as not helpful is judged on the marked passages of the
    policy's whole ranking (`judged_hit`). `texts`: the documents' texts as read by an earlier policy, shared."""
    if texts is not None:
        policy.text_cache = texts

    async def go() -> list[float]:
        out = []
        for it in items:
            backend = it.retriever or retriever
            served = served_params(policy, backend, params)
            if it.item.source == "feedback" and it.item.negative_ids:
                ranked = await run_search(it.item.question, served.model_copy(update={"select_k": served.retrieve_k}),
                                          policy=policy, retriever=backend)
                out.append(judged_hit(ranked.documents, it.item))
                continue
            outcome = await run_search(it.item.question, served, policy=policy, retriever=backend)
            out.append(float(found(outcome.documents, it.item)))
        return out

    return asyncio.run(go())


def is_real(item: LabeledItem) -> bool:
    """A user's own question (labelled or from marks): what dev parts are made of (never shipped or made-up
    questions, which always train)."""
    return item.item.source not in MADE_UP and item.item.source != "shipped"


@dataclass
class PullChoice:
    pull: float
    how: str
    dev_questions: int = 0
    recall: dict[str, float] = field(default_factory=dict)
    """Per candidate strength (as text), the answer recall on the dev questions."""

    def record(self) -> dict[str, Any]:
        return {"pull": pull_text(self.pull), "how": self.how, "dev_questions": self.dev_questions,
                "dev_recall": self.recall}


def pull_text(pull: float) -> str:
    return "keep" if math.isinf(pull) else f"{pull:g}"


def dev_parts(real: Sequence[LabeledItem], seed: int) -> list[list[LabeledItem]]:
    """The dev parts carved from the real training questions: `FOLDS` folds (every question judged once) below
    `HOLDOUT_FROM` questions, else one part of a fifth (at most `HOLDOUT_MAX`), drawn by `seed`."""
    order = list(real)
    random.Random(seed).shuffle(order)
    if len(order) >= HOLDOUT_FROM:
        return [order[:min(HOLDOUT_MAX, len(order) // 5)]]
    k = min(FOLDS, len(order))
    return [order[i::k] for i in range(k)] if k >= 2 else []


def choose_pull(train: Sequence[LabeledItem], demos: Sequence[Demonstration], start: CompactPolicy,
                retriever: RetrieverBackend, config: CompactConfig, *, pulls: Sequence[float] = PULLS,
                negative_weight: float = 1.0) -> PullChoice:
    """The pull whose fits find the most answers on dev parts of the training questions (`dev_parts`; each fit
    on the rest, shipped and made-up questions always in it); ties go to the stronger pull. Dev parts are the
    user's own questions; with fewer than 2 of them, the questions made from the corpus (a run on those alone);
    with fewer than 2 of those too, the start is kept."""
    by_id = {it.item.id: d for it, d in zip(train, demos, strict=True)}
    real = [it for it in train if is_real(it)]
    what = "training questions"
    if len(real) < 2:  # no question of the user's: judged on the ones made from the corpus, if any
        real, what = [it for it in train if it.item.source in MADE_UP], "training questions made from the corpus"
    parts = dev_parts(real, config.seed)
    if not parts:
        return PullChoice(KEEP, "fewer than 2 questions of yours to judge a change on: the start is kept")
    params = config.search_params()
    texts = TextCache(20_000)
    hits = {p: 0.0 for p in pulls}
    judged = 0
    for part in parts:
        held = {it.item.id for it in part}
        fold_demos = [by_id[it.item.id] for it in train if it.item.id not in held]
        judged += len(part)
        for pull in pulls:
            policy = start if math.isinf(pull) else with_setting(
                fit(fold_demos, config, start=start, pull=pull, negative_weight=negative_weight,
                    query_steps=QUERY_STEPS)[0], config, retriever)
            hits[pull] += sum(greedy_hits(policy, part, retriever, params, texts))
    best = max(pulls, key=lambda p: (hits[p], p))  # ties: the stronger pull
    how = (f"{len(parts)}-fold over {judged} {what}" if len(parts) > 1 else
           f"a dev part of {judged} of the {len(real)} {what}")
    recall = {pull_text(p): round(hits[p] / judged, 4) for p in pulls}
    logger.info("pull toward the start: %s (answer recall on %s: %s)", pull_text(best), how, recall)
    return PullChoice(best, how, judged, recall)


def learn(train: Sequence[LabeledItem], retriever: RetrieverBackend, config: CompactConfig, *,
          start: CompactPolicy | None, pull: float | None = None, negative_weight: float = 1.0,
          cache: DemoCache | None = None, progress: bool = False) -> tuple[CompactPolicy, dict[str, Any]]:
    """The warm start of a user's run: from scratch (`start` None), or from `start` with the `pull` given or
    chosen on the training questions (`choose_pull`, when None). Returns the policy and what it did (its `pull`
    and how it was chosen, in `learner`)."""
    demos = cached_demonstrations(train, retriever, config.search_params(), cache, progress=progress)
    if start is None:
        policy, info = fit(demos, config, negative_weight=negative_weight, progress=progress, query_steps=QUERY_STEPS)
        return with_setting(policy, config, retriever), {**info, "learner": {"start": "scratch"}}
    choice = choose_pull(train, demos, start, retriever, config, negative_weight=negative_weight) if pull is None \
        else PullChoice(pull, "given")
    if math.isinf(choice.pull):
        policy = CompactPolicy(dict(start.weights), name="compact-warmstart")
        scorers = {s for d in demos for s in d.pools}
        info = {"start": start.model, "pull": "keep", "distance_to_start": 0.0, "negative_weight": negative_weight,
                "marked_negatives": {s: int(sum(d.pools[s][2].sum() for d in demos if s in d.pools)) for s in scorers}}
    else:
        policy, info = fit(demos, config, start=start, pull=choice.pull, negative_weight=negative_weight,
                           progress=progress, query_steps=QUERY_STEPS)
    return with_setting(policy, config, retriever), {**info, "learner": {"start": start.model, **choice.record()}}
