"""The compact policy's supervised warm start. For every training question a demonstrator that knows the
labels acts in the search environment, driven by the searcher's own driver (`plugsearch.searcher.loop.drive`):
a follow-up query is good when its retrieval brings a new document that is a supporting passage or holds a
gold answer. The document scorers learn those labels on the pools it saw (binary cross-entropy): the `dense`
scorer on the whole pool (BM25 and dense blocks, with the dense evidence), the `lexical` scorer on the same
search without its dense block (what it is served on when the retriever has no dense index); the query
chooser learns the demonstrator's choices (softmax cross-entropy)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.compact import (
    DENSE,
    DENSE_SCORER,
    LEXICAL_SCORER,
    CompactPolicy,
    QuestionInfo,
    candidates,
    doc_features,
    pool_of,
    scoring_features,
    softmax,
)
from plugsearch.searcher.env import Action, InfoBlock, RetrieverBackend, SearchEnv
from plugsearch.searcher.loop import drive
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import LabeledItem
from plugsearch.trainer.compact.model import export, torch_model


@dataclass
class Demonstration:
    """What the warm start learns from one demonstrated search: per scorer, the final pool's features and
    labels (`dense` only when the search had a dense block), and each query choice's (candidate features,
    good rows)."""

    pools: dict[str, tuple[np.ndarray, np.ndarray]]
    choices: list[tuple[np.ndarray, list[int]]]


def labelled_pools(item: LabeledItem, question: QuestionInfo, blocks: Sequence[InfoBlock]
                   ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The pool's features and labels for each scorer: `lexical` without the dense block, `dense` with it."""
    out = {}
    lexical = [b for b in blocks if b.method != DENSE]
    for wanted, these in ((LEXICAL_SCORER, lexical), (DENSE_SCORER, blocks)):
        pool = pool_of(these)
        _, x, scorer = scoring_features(question, pool, these)
        if scorer == wanted:  # the dense scorer's row only where the search had a dense block
            out[scorer] = (x, np.array([float(item.positive(p.doc)) for p in pool], dtype=np.float32))
    return out


class Demonstrator:
    """The warm start's demonstrator, an `ActingPolicy`: candidates ranked as the untrained policy would (BM25
    order), a follow-up query taken when its retrieval brings a new positive document, else the end. It
    records each query choice (`choices`)."""

    model = "compact-demonstrator"

    def __init__(self, item: LabeledItem, retriever: RetrieverBackend) -> None:
        self.item = item
        self.retriever = retriever
        self.question = QuestionInfo.of(item.item.question)
        self.choices: list[tuple[np.ndarray, list[int]]] = []

    async def act(self, env: SearchEnv) -> Action:
        pool = pool_of(env.blocks)
        if not env.can_search or not pool:
            return Action("complete")
        doc_x = doc_features(self.question, pool)
        prior = softmax(np.array([p.score_rel for p in pool]))
        cands, cand_x = candidates(self.question, pool, prior, env.seen_queries, doc_x)
        have = {p.doc.id for p in pool}
        results = await self.retriever.retrieve([c.query for c in cands[1:]], env.params.retrieve_k, env.params.method)
        good = [i + 1 for i, docs in enumerate(results) if any(d.id not in have and self.item.positive(d) for d in docs)]
        self.choices.append((cand_x, good or [0]))
        return Action("search", query=cands[good[0]].query) if good else Action("complete")


async def demonstrate(item: LabeledItem, retriever: RetrieverBackend, params: SearchParams) -> Demonstration:
    """One demonstrated search and what the warm start learns from it."""
    demonstrator = Demonstrator(item, retriever)
    outcome = await drive(SearchEnv(item.item.question, params, retriever), demonstrator)
    return Demonstration(labelled_pools(item, demonstrator.question, outcome.blocks), demonstrator.choices)


def warm_start(train: Sequence[LabeledItem], retriever: RetrieverBackend, config: CompactConfig,
               progress: bool = True) -> tuple[CompactPolicy, dict[str, Any]]:
    """Demonstrations for every training question, then the supervised fit of the scorers and the query head."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    params = config.search_params()

    async def collect() -> list[Demonstration]:
        return [await demonstrate(item, item.retriever or retriever, params)
                for item in tqdm(train, desc="warm start: demonstrations", disable=not progress)]

    demos = asyncio.run(collect())
    scorers = [s for s in (LEXICAL_SCORER, DENSE_SCORER) if any(s in d.pools for d in demos)]
    data, norms = {}, {}
    for scorer in scorers:
        xs = np.concatenate([d.pools[scorer][0] for d in demos if scorer in d.pools])
        ys = np.concatenate([d.pools[scorer][1] for d in demos if scorer in d.pools])
        norms[scorer] = (xs.mean(0), xs.std(0) + 1e-3)
        data[scorer] = (torch.from_numpy((xs - norms[scorer][0]) / norms[scorer][1]), torch.from_numpy(ys),
                        torch.tensor(float((1 - ys).sum() / max(1.0, ys.sum())) ** 0.5))
    model = torch_model(config.hidden, scorers)
    opt = torch.optim.Adam(model.parameters(), lr=config.warm_lr)
    choices = [(torch.from_numpy(cx), good) for d in demos for cx, good in d.choices]
    losses = []
    for _ in tqdm(range(config.warm_epochs), desc="warm start: fit", disable=not progress):
        epoch: dict[str, float] = {}
        for scorer, (x_t, y_t, pos_weight) in data.items():
            perm = torch.randperm(len(x_t))
            for i in range(0, len(perm), 512):
                idx = perm[i:i + 512]
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    model[scorer](x_t[idx]).reshape(-1), y_t[idx], pos_weight=pos_weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
            epoch[f"{scorer}_bce"] = float(loss.detach())
        q_loss = torch.stack([-(torch.logsumexp((cx @ model.qv)[good], 0) - torch.logsumexp(cx @ model.qv, 0))
                              for cx, good in choices]).mean() if choices else torch.tensor(0.0)
        opt.zero_grad()
        q_loss.backward()
        opt.step()
        losses.append({**epoch, "query_ce": float(q_loss.detach())})
    policy = CompactPolicy(export(model, norms), name="compact-warmstart")
    policy.check()
    return policy, {"documents": {s: int(len(data[s][0])) for s in scorers},
                    "positives": {s: int(data[s][1].sum()) for s in scorers}, "query_choices": len(choices),
                    "searches_demonstrated": sum(1 for d in demos for _, good in d.choices if good != [0]),
                    "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}
