"""The compact policy's supervised warm start. For every training question a demonstrator that knows the
labels acts in the search environment, driven by the searcher's own driver (`plugsearch.searcher.loop.drive`):
a follow-up query is good when its retrieval brings a new document that is a supporting passage or holds a
gold answer. The document scorers learn those labels on the pools it saw (binary cross-entropy): the `dense`
scorer on the whole pool (BM25 and dense blocks, with the dense evidence), the `lexical` scorer on the same
search without its dense block (what it is served on when the retriever has no dense index); the query
chooser learns the demonstrator's choices (softmax cross-entropy).

The fit starts from random weights (from scratch) or from a policy's (`start`, the shipped one, re-expressed on the
user's feature standardisation: `restandardised`), pulled back toward those by an L2 penalty on the distance (`pull`, L2-SP: Li et al. 2018,
"Explicit inductive bias for transfer learning"); passages a user marked as not helpful weigh `negative_weight`
times in the loss. The demonstrations do not depend on the weights, so they are collected once
(`demonstrations`) and fitted as often as a choice of setting needs (`fit`)."""

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
from plugsearch.trainer.compact.model import SCORER_PREFIX, export, norms_of, torch_model


@dataclass
class Demonstration:
    """What the warm start learns from one demonstrated search: per scorer, the final pool's features and
    labels (`dense` only when the search had a dense block), and each query choice's (candidate features,
    good rows)."""

    pools: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    """Per scorer: features, labels (1 positive) and which passages a user marked as not helpful."""
    choices: list[tuple[np.ndarray, list[int]]]


def labelled_pools(item: LabeledItem, question: QuestionInfo, blocks: Sequence[InfoBlock]
                   ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The pool's features, labels and marked negatives for each scorer: `lexical` without the dense block,
    `dense` with it."""
    out = {}
    lexical = [b for b in blocks if b.method != DENSE]
    for wanted, these in ((LEXICAL_SCORER, lexical), (DENSE_SCORER, blocks)):
        pool = pool_of(these)
        _, x, scorer = scoring_features(question, pool, these)
        if scorer == wanted:  # the dense scorer's row only where the search had a dense block
            labels = np.array([float(item.positive(p.doc)) for p in pool], dtype=np.float32)
            marked = np.array([not label and item.negative(p.doc) for p, label in zip(pool, labels, strict=True)])
            out[scorer] = (x, labels, marked)
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


def demonstrations(train: Sequence[LabeledItem], retriever: RetrieverBackend, params: SearchParams,
                   progress: bool = True) -> list[Demonstration]:
    """One demonstrated search per training question (each over its own corpus's retriever where it has one)."""
    from tqdm import tqdm

    async def collect() -> list[Demonstration]:
        return [await demonstrate(item, item.retriever or retriever, params)
                for item in tqdm(train, desc="warm start: demonstrations", disable=not progress)]

    return asyncio.run(collect())


def restandardised(weights: dict[str, np.ndarray], norms: dict[str, tuple[np.ndarray, np.ndarray]]
                   ) -> dict[str, np.ndarray]:
    """The same scorers on features standardised by `norms` (each scorer's mean and std on the user's pools):
    the first layer absorbs the change, so every score is what it was. A fine-tune then moves in the user's
    units, as a fit from scratch does (in the shipped policy's Wikipedia units, measured on tatqa's training
    part, it ended 3-4 points lower at 100 and 400 questions)."""
    out = dict(weights)
    for scorer, (mean, std) in norms.items():
        pre = SCORER_PREFIX[scorer]
        old_mean, old_std, w1 = weights[pre + "mean"], weights[pre + "std"], weights[pre + "w1"]
        out[pre + "w1"] = ((std / old_std)[:, None] * w1).astype(np.float32)
        out[pre + "b1"] = (weights[pre + "b1"].reshape(-1) + ((mean - old_mean) / old_std) @ w1).astype(np.float32) \
            .reshape(weights[pre + "b1"].shape)
        out[pre + "mean"], out[pre + "std"] = mean.astype(np.float32), std.astype(np.float32)
    return out


def hidden_of(weights: dict[str, np.ndarray]) -> tuple[int, int]:
    """The hidden sizes of a policy's scorers."""
    return int(weights["w1"].shape[1]), int(weights["w2"].shape[1])


def fit(demos: Sequence[Demonstration], config: CompactConfig, *, start: CompactPolicy | None = None,
        pull: float = 0.0, negative_weight: float = 1.0, progress: bool = False, name: str = "compact-warmstart",
        query_steps: int = 0) -> tuple[CompactPolicy, dict[str, Any]]:
    """The supervised fit of the scorers (binary cross-entropy on the pools' labels, positives weighted by
    sqrt(negatives / positives), marked negatives by `negative_weight`) and the query head (softmax
    cross-entropy on the demonstrator's choices), `config.warm_epochs` epochs. From random weights, or from
    `start`'s (re-expressed on the user's standardisation) with `pull` * the squared distance to them added to every step's loss
    (over the parameters that step fits). `query_steps`: then that many more steps of the query head alone on
    all its choices (its loss is convex: enough steps reach its optimum, which one step per epoch does not)."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    scorers = [s for s in (LEXICAL_SCORER, DENSE_SCORER) if any(s in d.pools for d in demos)]
    anchor = norms_of(start.weights) if start is not None else {}
    data, norms = {}, {}
    for scorer in scorers:
        xs = np.concatenate([d.pools[scorer][0] for d in demos if scorer in d.pools])
        ys = np.concatenate([d.pools[scorer][1] for d in demos if scorer in d.pools])
        marked = np.concatenate([d.pools[scorer][2] for d in demos if scorer in d.pools])
        norms[scorer] = (xs.mean(0), xs.std(0) + 1e-3)
        weight = np.where(marked, negative_weight, 1.0).astype(np.float32)
        data[scorer] = (torch.from_numpy(((xs - norms[scorer][0]) / norms[scorer][1]).astype(np.float32)),
                        torch.from_numpy(ys), torch.from_numpy(weight),
                        torch.tensor(float((1 - ys).sum() / max(1.0, ys.sum())) ** 0.5))
    if start is not None:
        weights = restandardised(start.weights, {s: n for s, n in norms.items() if s in anchor})
        model = torch_model(hidden_of(start.weights), [s for s in scorers if s in anchor], weights)
        for scorer in scorers:
            if scorer not in anchor:  # a scorer the start lacks: learnt from scratch beside it
                model[scorer] = torch_model(hidden_of(start.weights), [scorer])[scorer]
        reference = {k: v.detach().clone() for k, v in model.named_parameters()
                     if k == "qv" or k.split(".", 1)[0] in anchor}
    else:
        model, reference = torch_model(config.hidden, scorers), {}

    def penalty(prefix: str) -> Any:
        """`pull` * the squared distance to the start of the parameters named `prefix...`."""
        if not pull or not reference:
            return torch.zeros(())
        return pull * sum(((p - reference[k]) ** 2).sum() for k, p in model.named_parameters()
                          if k in reference and (k == prefix or k.startswith(prefix + ".")))

    opt = torch.optim.Adam(model.parameters(), lr=config.warm_lr)
    choices = [(torch.from_numpy(cx), good) for d in demos for cx, good in d.choices]
    losses = []
    for _ in tqdm(range(config.warm_epochs), desc="warm start: fit", disable=not progress):
        epoch: dict[str, float] = {}
        for scorer, (x_t, y_t, w_t, pos_weight) in data.items():
            perm = torch.randperm(len(x_t))
            for i in range(0, len(perm), 512):
                idx = perm[i:i + 512]
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    model[scorer](x_t[idx]).reshape(-1), y_t[idx], weight=w_t[idx], pos_weight=pos_weight)
                opt.zero_grad()
                (loss + penalty(scorer)).backward()
                opt.step()
            epoch[f"{scorer}_bce"] = float(loss.detach())
        q_loss = torch.stack([-(torch.logsumexp((cx @ model.qv)[good], 0) - torch.logsumexp(cx @ model.qv, 0))
                              for cx, good in choices]).mean() if choices else torch.tensor(0.0)
        opt.zero_grad()
        (q_loss + penalty("qv")).backward()
        opt.step()
        losses.append({**epoch, "query_ce": float(q_loss.detach())})
    if query_steps and choices:
        cand_x, cand_in, good_in = _padded(choices)
        q_opt = torch.optim.Adam([model.qv], lr=0.02)
        for _ in range(query_steps):
            logits = cand_x @ model.qv
            q_loss = -(torch.logsumexp(logits.masked_fill(~good_in, float("-inf")), 1)
                       - torch.logsumexp(logits.masked_fill(~cand_in, float("-inf")), 1)).mean()
            q_opt.zero_grad()
            (q_loss + penalty("qv")).backward()
            q_opt.step()
        losses[-1]["query_ce"] = float(q_loss.detach())
    policy = CompactPolicy(export(model, norms), name=name)
    policy.check()
    moved = {k: round(float(((p.detach() - reference[k]) ** 2).sum() ** 0.5), 4) for k, p in model.named_parameters()
             if k in reference}
    return policy, {"documents": {s: int(len(data[s][0])) for s in scorers},
                    "positives": {s: int(data[s][1].sum()) for s in scorers},
                    "marked_negatives": {s: int(sum(d.pools[s][2].sum() for d in demos if s in d.pools))
                                         for s in scorers},
                    "query_choices": len(choices),
                    "searches_demonstrated": sum(1 for d in demos for _, good in d.choices if good != [0]),
                    "start": start.model if start is not None else "random", "pull": pull,
                    "negative_weight": negative_weight,
                    "distance_to_start": round(float(sum(v ** 2 for v in moved.values()) ** 0.5), 4) if moved else None,
                    "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}


def _padded(choices: Sequence[tuple[Any, list[int]]]) -> tuple[Any, Any, Any]:
    """The query choices as one batch: candidate features (choices x most candidates x features), which rows
    are candidates, which are good."""
    import torch

    most = max(len(cx) for cx, _ in choices)
    x = torch.zeros((len(choices), most, choices[0][0].shape[1]), dtype=choices[0][0].dtype)
    cand_in = torch.zeros((len(choices), most), dtype=torch.bool)
    good_in = torch.zeros((len(choices), most), dtype=torch.bool)
    for i, (cx, good) in enumerate(choices):
        x[i, :len(cx)] = cx
        cand_in[i, :len(cx)] = True
        good_in[i, good] = True
    return x, cand_in, good_in


def warm_start(train: Sequence[LabeledItem], retriever: RetrieverBackend, config: CompactConfig,
               progress: bool = True, *, start: CompactPolicy | None = None, pull: float = 0.0,
               negative_weight: float = 1.0) -> tuple[CompactPolicy, dict[str, Any]]:
    """Demonstrations for every training question, then the supervised fit of the scorers and the query head
    (`fit`: from scratch, or from `start` pulled back toward it by `pull`)."""
    demos = demonstrations(train, retriever, config.search_params(), progress=progress)
    return fit(demos, config, start=start, pull=pull, negative_weight=negative_weight, progress=progress)
