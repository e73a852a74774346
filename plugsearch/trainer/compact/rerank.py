"""The naive-start learner: a user's searcher that starts as naive BM25 top-k and moves only as far as the user's
questions carry it.

Its policy searches once (the pool of BM25 top-`retrieve_k` and, where the corpus has a dense index, dense
top-`retrieve_k`), never follows up, and returns the `select_k` documents its scorer ranks first. The scorer is
naive BM25's order (a positive mix of the BM25 rank features `inv_rank` and `-log_rank`: any such mix ranks the
pool exactly as BM25 does, the dense block's own documents after them) plus a correction, a linear function of
the pool's standardised features (`DOC_FEATURES`, and `DENSE_FEATURES` with the dense block), fitted on the
training questions' first pools with a listwise loss (the softmax probability of the passages that hold an
answer) and an L2 penalty on the correction: with a strong penalty the correction is 0 and the policy *is* naive
BM25, so at tiny n it is never worse than naive; a weak one lets the questions re-weigh the evidence.

How strong a penalty: by default `STRENGTH` / n for n training questions (`default_penalty`), the rule that did
best on the development sets' training parts (`bench/learner_dev.py`); or chosen on the user's training
questions alone (`choose_penalty`, `--pull cv`), as the shipped-start learner chooses its pull
(`plugsearch.trainer.compact.finetune.dev_parts`: 5 folds up to 250 questions, one dev part above): every
candidate is fitted without a dev part and judged on it by the answer recall at `select_k` of the search the
service would run (the first pool ranked by the scorer), `NAIVE` (no correction) among them; the most answers
wins, a tie goes to the stronger penalty (on 25-100 questions the folds were too noisy: that choice kept less
than half the gain the fixed rule found). The evaluation questions are never seen here.

The policy is an ordinary compact policy (`CompactPolicy`: its MLP scorers carry the linear score exactly, one
ReLU pair per layer, and its query head always stops), so serving, the corpus check and RL need nothing new.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plugsearch.common.qa import MADE_UP, found
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import (
    CANDIDATE_FEATURES,
    DENSE,
    DENSE_FEATURES,
    DENSE_SCORER,
    DOC_FEATURES,
    LEXICAL_SCORER,
    CompactPolicy,
    QuestionInfo,
    pool_of,
    scoring_features,
)
from plugsearch.searcher.env import Action, RetrieverBackend, SearchEnv
from plugsearch.searcher.loop import drive
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import LabeledItem
from plugsearch.trainer.compact.finetune import dev_parts, is_real, with_setting
from plugsearch.trainer.compact.model import SCORER_PREFIX

logger = logging.getLogger(__name__)

NAIVE = math.inf
"""The penalty that keeps the correction at 0: naive BM25's order."""
STRENGTH = 5.0
"""The default penalty is `STRENGTH` / n for n training questions (`default_penalty`: the loss summed over the
questions with a fixed prior on the correction, so it weakens as questions grow). Chosen on the training parts of
the development sets alone (`bench/learner_dev.py`): over tatqa, realtimeqa and policyqa at 25, 50 and 100
questions, 5 draws each, judged on a part of the training questions never drawn, it found the most answers on
average of the rules tried (fixed penalties 3 to 0.01, c / n for c in 5, 10, 20, 40, and the k-fold choices
below), with no (set, n) below naive BM25 on average."""
PENALTIES: tuple[float, ...] = (NAIVE, 3.0, 1.0, 0.3, 0.1, 0.03, 0.01)
"""The strengths `choose_penalty` tries (`--pull cv` with `--start naive`)."""
CV = "cv"
"""`learn_naive(penalty=CV)`: the penalty chosen by k-fold on the training questions (`choose_penalty`)."""
PRIOR = ("inv_rank", "log_rank")
"""The BM25 rank features whose positive mix (`inv_rank` up, `log_rank` down) is naive BM25's order."""
STOP_WEIGHT = 50.0
"""The query head's weight on the stop candidate: far above any follow-up's logit (those are 0), so it stops."""
MAX_ITER = 200
"""L-BFGS iterations of a fit (a convex loss of at most a few dozen parameters: it converges in far fewer)."""


@dataclass
class FirstPool:
    """One training question's first pool, per scorer (`lexical` without the dense block, `dense` with it): the
    scoring features, which passages the fit counts as good (`LabeledItem.positive`), which answer the question as
    an evaluation counts it (`found`), and, for a question from users' marks with passages marked as not helpful,
    which passages users judged (its hit is then the first judged passage of the ranking: `finetune.judged_hit`)."""

    pools: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]
    """Per scorer: features, positives, found, judged (all-False when the question is not judged that way)."""
    condensed: bool = False

    @property
    def served(self) -> str:
        """The scorer the service uses on this pool: `dense` where the search had a dense block."""
        return DENSE_SCORER if DENSE_SCORER in self.pools else LEXICAL_SCORER

    def hit(self, scores: np.ndarray, k: int, scorer: str | None = None) -> float:
        """Whether the `k` best-scored passages answer the question (stable order: ties keep the pool's, BM25's)."""
        _, _, hits, judged = self.pools[scorer or self.served]
        order = np.argsort(-scores, kind="stable")
        if self.condensed:
            first = next((i for i in order if judged[i]), None)
            return float(first is not None and hits[first])
        return float(hits[order[:k]].any())


class _FirstLook:
    """An `ActingPolicy` that looks at the first pool and stops (what a stop-at-once policy's search sees)."""

    model = "compact-first-look"

    def __init__(self) -> None:
        self.blocks: list[Any] = []

    async def act(self, env: SearchEnv) -> Action:
        self.blocks = list(env.blocks)
        return Action("complete")


async def first_pool(item: LabeledItem, retriever: RetrieverBackend, params: SearchParams) -> FirstPool:
    """The first pool of `item`'s search and its labels, for each scorer."""
    look = _FirstLook()
    await drive(SearchEnv(item.item.question, params.model_copy(update={"max_turns": 0}), retriever), look)
    question = QuestionInfo.of(item.item.question)
    condensed = item.item.source == "feedback" and bool(item.item.negative_ids)
    judged_ids = {*item.item.passage_ids, *item.item.negative_ids} if condensed else set()
    out = {}
    lexical = [b for b in look.blocks if b.method != DENSE]
    for wanted, blocks in ((LEXICAL_SCORER, lexical), (DENSE_SCORER, look.blocks)):
        pool = pool_of(blocks)
        _, x, scorer = scoring_features(question, pool, blocks)
        if scorer == wanted:
            docs = [p.doc for p in pool]
            out[scorer] = (x, np.array([item.positive(d) for d in docs], dtype=np.float32),
                           np.array([found([d], item.item) for d in docs], dtype=bool),
                           np.array([d.id in judged_ids for d in docs], dtype=bool))
    return FirstPool(out, condensed)


FirstPoolCache = MutableMapping[str, FirstPool]


def first_pools(items: Sequence[LabeledItem], retriever: RetrieverBackend, params: SearchParams,
                cache: FirstPoolCache | None = None, progress: bool = False) -> list[FirstPool]:
    """`first_pool` of every item (over its own corpus's retriever where it has one), each collected once per
    `cache`."""
    from tqdm import tqdm

    cache = {} if cache is None else cache
    todo = [it for it in items if it.item.id not in cache]

    async def collect() -> None:
        for it in tqdm(todo, desc="naive start: first pools", disable=not progress):
            cache[it.item.id] = await first_pool(it, it.retriever or retriever, params)

    if todo:
        asyncio.run(collect())
    return [cache[it.item.id] for it in items]


# ------------------------------------------------------------------------------------------------ the scorer
def n_features(scorer: str) -> int:
    return len(DOC_FEATURES) + (len(DENSE_FEATURES) if scorer == DENSE_SCORER else 0)


PRIOR_INDEX = tuple(DOC_FEATURES.index(name) for name in PRIOR)
PRIOR_SIGN = np.array([1.0, -1.0])
"""`inv_rank` counts up, `log_rank` down: a positive mix of the two signed features is BM25's order."""


@dataclass
class LinearScorer:
    """score = `prior` . (signed rank features, standardised) + `weights` . (standardised features): on raw
    features, ((x - mean) / std) @ `direction()`."""

    mean: np.ndarray
    std: np.ndarray
    prior: np.ndarray
    """The weights (>= 0) of `inv_rank` and `-log_rank`, standardised."""
    weights: np.ndarray
    """The correction (0: naive BM25's order)."""

    def direction(self) -> np.ndarray:
        u = self.weights.astype(np.float64).copy()
        for j, sign, a in zip(PRIOR_INDEX, PRIOR_SIGN, self.prior, strict=True):
            u[j] += sign * a
        return u

    def scores(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.mean) / self.std) @ self.direction()

    def mlp(self) -> dict[str, np.ndarray]:
        """The same score as the compact policy's MLP (`CompactPolicy.doc_logits`): layer 1 holds the linear
        score z as relu(z) and relu(-z), layer 2 passes them on, the output is their difference, z exactly."""
        u = self.direction().astype(np.float32)
        pair = np.array([[1.0, -1.0], [-1.0, 1.0]], dtype=np.float32)
        return {"mean": self.mean.astype(np.float32), "std": self.std.astype(np.float32),
                "w1": np.stack([u, -u], axis=1), "b1": np.zeros(2, np.float32), "w2": pair,
                "b2": np.zeros(2, np.float32), "w3": np.array([[1.0], [-1.0]], dtype=np.float32),
                "b3": np.zeros(1, np.float32)}


def naive_scorer(scorer: str, norms: tuple[np.ndarray, np.ndarray] | None = None) -> LinearScorer:
    """Naive BM25's order (no correction), on `norms`' standardisation (default: none)."""
    n = n_features(scorer)
    mean, std = norms if norms is not None else (np.zeros(n), np.ones(n))
    return LinearScorer(np.asarray(mean, np.float64), np.asarray(std, np.float64), np.ones(len(PRIOR)), np.zeros(n))


def norms_of_pools(pools: Sequence[FirstPool], scorer: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The features' mean and std over every pool of `scorer` (no labels read)."""
    xs = [p.pools[scorer][0] for p in pools if scorer in p.pools]
    if not xs:
        return None
    x = np.concatenate(xs).astype(np.float64)
    return x.mean(0), x.std(0) + 1e-3


def fit_linear(pools: Sequence[FirstPool], scorer: str, penalty: float,
               norms: tuple[np.ndarray, np.ndarray], *, target: str = "found") -> LinearScorer:
    """The correction with the listwise loss (-log of the softmax mass on a question's good passages, averaged
    over the questions whose pool has both good and other passages) plus `penalty` * its squared norm; the
    prior's two weights are fitted unpenalised and kept >= 0 (softplus). `NAIVE`: no fit, no correction.
    `target`: the good passages are those that answer the question as the evaluation counts it (`found`, the
    default: what the penalty is chosen by and the policy judged on) or the warm start's `positive` ones (which
    add the passages of a row's supporting titles)."""
    if math.isinf(penalty):
        return naive_scorer(scorer, norms)
    import torch

    mean, std = norms
    column = 2 if target == "found" else 1
    rows = [(p.pools[scorer][0], p.pools[scorer][column].astype(np.float32)) for p in pools if scorer in p.pools]
    rows = [(x, y) for x, y in rows if 0 < y.sum() < len(y)]
    if not rows:
        return naive_scorer(scorer, norms)
    most = max(len(x) for x, _ in rows)
    n = n_features(scorer)
    z = np.zeros((len(rows), most, n))
    inside = np.zeros((len(rows), most), dtype=bool)
    good = np.zeros((len(rows), most), dtype=bool)
    for i, (x, y) in enumerate(rows):
        z[i, :len(x)] = (x - mean) / std
        inside[i, :len(x)] = True
        good[i, :len(x)] = y > 0
    z_t, in_t, good_t = torch.from_numpy(z), torch.from_numpy(inside), torch.from_numpy(good)
    prior_x = z_t[:, :, list(PRIOR_INDEX)] * torch.from_numpy(PRIOR_SIGN)
    raw = torch.zeros(len(PRIOR), dtype=torch.float64, requires_grad=True)
    w = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([raw, w], lr=1.0, max_iter=MAX_ITER, line_search_fn="strong_wolfe")

    def loss() -> Any:
        opt.zero_grad()
        s = prior_x @ torch.nn.functional.softplus(raw) + z_t @ w
        total = (torch.logsumexp(s.masked_fill(~in_t, -math.inf), 1)
                 - torch.logsumexp(s.masked_fill(~good_t, -math.inf), 1)).mean() + penalty * (w ** 2).sum()
        total.backward()
        return total

    opt.step(loss)
    with torch.no_grad():
        prior = torch.nn.functional.softplus(raw).numpy().copy()
    return LinearScorer(np.asarray(mean, np.float64), np.asarray(std, np.float64), prior, w.detach().numpy().copy())


def policy_of(scorers: dict[str, LinearScorer], name: str = "compact-naive-start") -> CompactPolicy:
    """The compact policy that scores with `scorers` (`lexical` always: naive where it was not fitted) and always
    stops at once (its query head's weight on the stop candidate, `STOP_WEIGHT`)."""
    weights: dict[str, np.ndarray] = {}
    scorers = {LEXICAL_SCORER: naive_scorer(LEXICAL_SCORER), **scorers}
    for scorer, fitted in scorers.items():
        weights.update({SCORER_PREFIX[scorer] + k: v for k, v in fitted.mlp().items()})
    qv = np.zeros(len(CANDIDATE_FEATURES), np.float32)
    qv[CANDIDATE_FEATURES.index("stop")] = STOP_WEIGHT
    weights["qv"] = qv
    policy = CompactPolicy(weights, name=name)
    policy.check()
    return policy


# ------------------------------------------------------------------------------------------- the choice
@dataclass
class PenaltyChoice:
    penalty: float
    how: str
    dev_questions: int = 0
    recall: dict[str, float] | None = None
    """Per candidate strength (as text), the answer recall on the dev questions."""

    def record(self) -> dict[str, Any]:
        return {"pull": penalty_text(self.penalty), "how": self.how, "dev_questions": self.dev_questions,
                "dev_recall": self.recall or {}}


def penalty_text(penalty: float) -> str:
    return "keep" if math.isinf(penalty) else f"{penalty:g}"


def served_scorer(pools: Sequence[FirstPool]) -> str:
    """The scorer the service uses on these questions' corpus (`dense` where their searches have a dense block)."""
    return DENSE_SCORER if any(DENSE_SCORER in p.pools for p in pools) else LEXICAL_SCORER


def choose_penalty(train: Sequence[LabeledItem], pools: Sequence[FirstPool], config: CompactConfig, *,
                   penalties: Sequence[float] = PENALTIES, margin: int = 0, target: str = "found") -> PenaltyChoice:
    """The penalty whose fits find the most answers on dev parts of the user's own training questions (the same
    parts as `finetune.choose_pull`'s; shipped and made-up questions always train); ties, and a gain over naive
    of `margin` questions or fewer, go to the stronger penalty (`NAIVE` the strongest)."""
    by_id = {it.item.id: p for it, p in zip(train, pools, strict=True)}
    real = [it for it in train if is_real(it)]
    what = "training questions"
    if len(real) < 2:
        real, what = [it for it in train if it.item.source in MADE_UP], "training questions made from the corpus"
    parts = dev_parts(real, config.seed)
    if not parts:
        return PenaltyChoice(NAIVE, "fewer than 2 questions of yours to judge a change on: naive BM25's order is kept")
    scorer = served_scorer(pools)
    norms = norms_of_pools(pools, scorer)
    assert norms is not None
    hits = dict.fromkeys(penalties, 0.0)
    judged = 0
    for part in parts:
        held = {it.item.id for it in part}
        rest = [by_id[it.item.id] for it in train if it.item.id not in held]
        dev = [by_id[it.item.id] for it in part]
        judged += len(part)
        for penalty in penalties:
            fitted = fit_linear(rest, scorer, penalty, norms, target=target)
            hits[penalty] += sum(p.hit(fitted.scores(p.pools[scorer][0]), config.select_k, scorer)
                                 for p in dev if scorer in p.pools)
    best = select(hits, margin)
    how = (f"{len(parts)}-fold over {judged} {what}" if len(parts) > 1 else
           f"a dev part of {judged} of the {len(real)} {what}")
    recall = {penalty_text(p): round(hits[p] / judged, 4) for p in penalties}
    logger.info("correction of naive BM25's order: penalty %s (answer recall on %s: %s)", penalty_text(best), how,
                recall)
    return PenaltyChoice(best, how, judged, recall)


def select(hits: dict[float, float], margin: int = 0) -> float:
    """The penalty with the most dev answers; ties, and a gain over `NAIVE` of `margin` answers or fewer, go to
    the stronger penalty."""
    naive = hits.get(NAIVE, -math.inf)
    return max(hits, key=lambda p: (hits[p] if math.isinf(p) or hits[p] > naive + margin else -math.inf, p))


def default_penalty(n: int) -> float:
    """`STRENGTH` / n: the default penalty on the correction for `n` training questions."""
    return STRENGTH / max(1, n)


def learn_naive(train: Sequence[LabeledItem], retriever: RetrieverBackend, config: CompactConfig, *,
                penalty: float | str | None = None, cache: FirstPoolCache | None = None, margin: int = 0,
                progress: bool = False) -> tuple[CompactPolicy, dict[str, Any]]:
    """The warm start of a user's run from naive BM25: the first pools of the training questions, the penalty
    (None: `default_penalty`; `CV`: chosen on them by `choose_penalty`; else as given), the correction fitted on
    all of them. Returns the policy and what it did (`learner`: start `naive`, its `pull` (the penalty) and how it
    was chosen; `rl` False: the policy is served as fitted)."""
    pools = first_pools(train, retriever, config.search_params(), cache, progress=progress)
    if penalty == CV:
        choice = choose_penalty(train, pools, config, margin=margin)
    elif penalty is None:
        choice = PenaltyChoice(default_penalty(len(train)), f"{STRENGTH:g} / {len(train)} training questions")
    else:
        choice = PenaltyChoice(float(penalty), "given")
    scorers: dict[str, LinearScorer] = {}
    for scorer in (LEXICAL_SCORER, DENSE_SCORER):
        norms = norms_of_pools(pools, scorer)
        if norms is not None:
            scorers[scorer] = fit_linear(pools, scorer, choice.penalty, norms)
    policy = with_setting(policy_of(scorers), config, retriever)
    served = served_scorer(pools)
    info = {"start": "naive", "pull": penalty_text(choice.penalty),
            "documents": {s: int(sum(len(p.pools[s][0]) for p in pools if s in p.pools)) for s in scorers},
            "positives": {s: int(sum(p.pools[s][1].sum() for p in pools if s in p.pools)) for s in scorers},
            "pool_recall": round(float(np.mean([p.pools[p.served][2].any() for p in pools])), 4) if pools else None,
            "correction": {s: round(float(np.linalg.norm(f.weights)), 4) for s, f in scorers.items()},
            "largest_weights": _largest(scorers[served]) if served in scorers else {}}
    return policy, {**info, "learner": {"start": "naive", "rl": False, **choice.record()}}


def _largest(scorer: LinearScorer, top: int = 6) -> dict[str, float]:
    """The correction's largest weights by feature name (what the questions re-weighed)."""
    names = (*DOC_FEATURES, *DENSE_FEATURES)[:len(scorer.weights)]
    order = np.argsort(-np.abs(scorer.weights))[:top]
    return {names[i]: round(float(scorer.weights[i]), 4) for i in order if scorer.weights[i] != 0}
