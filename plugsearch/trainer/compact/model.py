"""The compact policy's parameters in torch: one MLP per document scorer (`lexical`, `dense`) and the query
head `qv`, to and from the numpy weights the searcher serves (`plugsearch.searcher.compact`), and the
log-probability of a sampled search under them (what REINFORCE differentiates)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from plugsearch.searcher.compact import (
    CANDIDATE_FEATURES,
    DENSE_FEATURES,
    DENSE_PREFIX,
    DENSE_SCORER,
    DOC_FEATURES,
    LEXICAL_SCORER,
)

if TYPE_CHECKING:
    from plugsearch.trainer.compact.rl import Episode

SCORER_FEATURES = {LEXICAL_SCORER: len(DOC_FEATURES), DENSE_SCORER: len(DOC_FEATURES) + len(DENSE_FEATURES)}
SCORER_PREFIX = {LEXICAL_SCORER: "", DENSE_SCORER: DENSE_PREFIX}

Norms = dict[str, tuple[np.ndarray, np.ndarray]]
"""Per scorer, the features' (mean, std) it standardises with."""


def torch_model(hidden: tuple[int, int], scorers: Sequence[str], weights: dict[str, np.ndarray] | None = None
                ) -> Any:
    """One MLP per document scorer (`lexical`, `dense`) and the query head `qv`, optionally from weights."""
    import torch

    def mlp(n: int) -> Any:
        return torch.nn.Sequential(torch.nn.Linear(n, hidden[0]), torch.nn.ReLU(), torch.nn.Linear(hidden[0], hidden[1]),
                                   torch.nn.ReLU(), torch.nn.Linear(hidden[1], 1))

    model: Any = torch.nn.ModuleDict({scorer: mlp(SCORER_FEATURES[scorer]) for scorer in scorers})
    qv = torch.nn.Parameter(torch.zeros(len(CANDIDATE_FEATURES)))
    model.register_parameter("qv", qv)
    if weights is not None:
        with torch.no_grad():
            for scorer in scorers:
                pre, head = SCORER_PREFIX[scorer], model[scorer]
                for j, (w, b) in enumerate((("w1", "b1"), ("w2", "b2"), ("w3", "b3"))):
                    layer: Any = head[2 * j]
                    layer.weight.copy_(torch.from_numpy(weights[pre + w].T.copy()))
                    layer.bias.copy_(torch.from_numpy(weights[pre + b].reshape(-1).copy()))
            qv.copy_(torch.from_numpy(weights["qv"].copy()))
    return model


def export(model: Any, norms: Norms) -> dict[str, np.ndarray]:
    """The numpy weights `CompactPolicy` serves."""
    out = {"qv": model.qv.detach().numpy().copy()}
    for scorer, (mean, std) in norms.items():
        pre, mlp = SCORER_PREFIX[scorer], model[scorer]
        out[pre + "mean"], out[pre + "std"] = mean.astype(np.float32), std.astype(np.float32)
        for j, (w, b) in enumerate((("w1", "b1"), ("w2", "b2"), ("w3", "b3"))):
            out[pre + w] = mlp[2 * j].weight.detach().numpy().T.copy()
            out[pre + b] = mlp[2 * j].bias.detach().numpy().copy()
    return out


def norms_of(weights: dict[str, np.ndarray]) -> Norms:
    return {scorer: (weights[pre + "mean"], weights[pre + "std"]) for scorer, pre in SCORER_PREFIX.items()
            if pre + "mean" in weights}


def doc_logits(model: Any, x: np.ndarray, norms: Norms, scorer: str) -> Any:
    import torch

    mean, std = norms[scorer]
    return model[scorer](torch.from_numpy((x - mean) / std)).reshape(-1)


def log_prob(model: Any, ep: Episode, norms: Norms, temperature: float) -> Any:
    """log P(the episode's sampled actions) under `model`: each query choice (softmax over the candidates) and
    the selection (Plackett-Luce over the pool)."""
    import torch

    total = torch.zeros(())
    for step in ep.steps:
        if step.cand_x is not None and step.choice is not None:
            logits = torch.from_numpy(step.cand_x) @ model.qv / temperature
            total = total + logits[step.choice] - torch.logsumexp(logits, 0)
        if step.selected:
            logits = doc_logits(model, step.doc_x, norms, step.scorer) / temperature
            for j, i in enumerate(step.selected):
                taken = torch.zeros(len(logits), dtype=torch.bool)
                taken[step.selected[:j]] = True
                total = total + logits[i] - torch.logsumexp(logits.masked_fill(taken, float("-inf")), 0)
    return total
