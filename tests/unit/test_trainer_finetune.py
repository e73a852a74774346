"""The few-question learner (`plugsearch.trainer.compact.finetune`): a fit that starts from a policy's weights and
is pulled back toward them stays near them when the labels carry no signal and moves where they do; the pull is
chosen on dev parts of the user's own training questions only, and kept at the start when nothing helps."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from plugsearch.common.qa import QAItem
from plugsearch.searcher.compact import CANDIDATE_FEATURES, DOC_FEATURES, LEXICAL_SCORER, CompactPolicy
from plugsearch.trainer.compact import finetune
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import labeled
from plugsearch.trainer.compact.model import export, torch_model
from plugsearch.trainer.compact.warmstart import Demonstration, fit, restandardised

F = len(DOC_FEATURES)


def start_policy(seed: int = 0) -> CompactPolicy:
    """A lexical-only policy with random weights (the 'shipped' one of these tests), standardising nothing."""
    import torch

    torch.manual_seed(seed)
    model = torch_model((32, 16), [LEXICAL_SCORER])
    weights = export(model, {LEXICAL_SCORER: (np.zeros(F, np.float32), np.ones(F, np.float32))})
    return CompactPolicy(weights, name="start")


def demos(labels_of: Any, n: int = 40, pool: int = 30, seed: int = 1) -> list[Demonstration]:
    """`n` searches' pools of random features, labelled by `labels_of(features)`, and one query choice each."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(pool, F)).astype(np.float32) * 2 + 1
        y = labels_of(x, rng).astype(np.float32)
        cand = rng.normal(size=(3, len(CANDIDATE_FEATURES))).astype(np.float32)
        out.append(Demonstration({LEXICAL_SCORER: (x, y, np.zeros(pool, dtype=bool))}, [(cand, [0])]))
    return out


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    return float((pos[:, None] > neg[None, :]).mean())


def test_the_pull_keeps_the_start_without_signal_and_lets_the_signal_move_it() -> None:
    start = start_policy()
    config = CompactConfig(warm_epochs=30, dense=False)
    noise = demos(lambda x, rng: rng.random(len(x)) < 0.1)
    free, free_info = fit(noise, config, start=start, pull=0.0)
    held, held_info = fit(noise, config, start=start, pull=1.0)
    assert free_info["start"] == "start" and held_info["pull"] == 1.0
    # no signal: pulled, it stays near the start (scores and weights); free, it fits the noise and wanders off
    assert held_info["distance_to_start"] < 0.2 * free_info["distance_to_start"]
    x = np.concatenate([d.pools[LEXICAL_SCORER][0] for d in noise])
    def kept(policy: CompactPolicy) -> float:
        return float(np.corrcoef(policy.doc_logits(x), start.doc_logits(x))[0, 1])

    assert kept(held) > 0.9 and kept(held) > kept(free) + 0.2
    # a signal (a passage is good when feature 3 is high): the same pull lets it learn it
    signal = demos(lambda x, rng: x[:, 3] > 2.5)
    learnt, info = fit(signal, config, start=start, pull=0.01)
    test = demos(lambda x, rng: x[:, 3] > 2.5, seed=7)
    xt = np.concatenate([d.pools[LEXICAL_SCORER][0] for d in test])
    yt = np.concatenate([d.pools[LEXICAL_SCORER][1] for d in test])
    assert auc(learnt.doc_logits(xt), yt) > 0.9 > auc(start.doc_logits(xt), yt) + 0.2
    assert info["distance_to_start"] > held_info["distance_to_start"]


def test_the_start_is_re_expressed_on_the_users_standardisation_without_changing_a_score() -> None:
    start = start_policy(3)
    x = np.random.default_rng(0).normal(size=(50, F)).astype(np.float32) * 5 + 3
    norms = {LEXICAL_SCORER: (x.mean(0), x.std(0) + 1e-3)}
    again = CompactPolicy(restandardised(start.weights, norms), name="again")
    assert np.allclose(again.doc_logits(x), start.doc_logits(x), atol=1e-3)
    assert np.allclose(again.weights["mean"], norms[LEXICAL_SCORER][0])


def items(n: int, source: str, prefix: str) -> list[QAItem]:
    return [QAItem(id=f"{prefix}{i}", question=f"{prefix} {i}?", golden_answers=["a"], source=source) for i in range(n)]


@pytest.mark.parametrize("better", [None, 0.01])
def test_the_pull_is_chosen_on_the_users_own_training_questions(monkeypatch: pytest.MonkeyPatch,
                                                                 better: float | None) -> None:
    """Each candidate pull is fitted without a dev part and judged on it; dev parts hold the user's own questions
    only (shipped and made-up ones always train); a tie keeps the stronger pull, so with no gain anywhere the
    start is kept."""
    start = start_policy()
    train = labeled([*items(10, "labelled", "r"), *items(5, "feedback", "f"), *items(6, "shipped", "w"),
                     *items(4, "pseudo", "x")])
    fitted_on: dict[float, list[set[str]]] = {}
    judged: list[tuple[str, list[str]]] = []

    def fake_fit(demos: list[Any], config: CompactConfig, *, start: CompactPolicy, pull: float, **_: Any
                 ) -> tuple[CompactPolicy, dict[str, Any]]:
        fitted_on.setdefault(pull, []).append(set(demos))
        return CompactPolicy(dict(start.weights), name=f"pull-{pull:g}"), {}

    def fake_hits(policy: CompactPolicy, part: list[Any], *_: Any) -> list[float]:
        judged.append((policy.name, [it.item.id for it in part]))
        return [1.0 if policy.name == f"pull-{better:g}" else 0.0 for _ in part] if better is not None else \
            [0.5 for _ in part]

    monkeypatch.setattr(finetune, "fit", fake_fit)
    monkeypatch.setattr(finetune, "greedy_hits", fake_hits)
    choice = finetune.choose_pull(train, [it.item.id for it in train], start, None, CompactConfig())  # type: ignore[arg-type]
    if better is None:
        assert math.isinf(choice.pull) and choice.record()["pull"] == "keep"
    else:
        assert choice.pull == better and choice.recall["0.01"] == 1.0 and choice.recall["keep"] == 0.0
    own = {it.item.id for it in train if it.item.source in ("labelled", "feedback")}
    for name in {n for n, _ in judged}:
        ids = [i for n, part in judged if n == name for i in part]
        assert sorted(ids) == sorted(own)  # every one of the user's questions judged once per candidate
    for folds in fitted_on.values():  # each fit: every shipped / made-up question, and the user's minus a fold
        assert len(folds) == 5 and all({f"w{i}" for i in range(6)} | {f"x{i}" for i in range(4)} <= f for f in folds)
        assert all(len(f & own) == 12 for f in folds)
    assert choice.how == "5-fold over 15 training questions" and choice.dev_questions == 15


def test_fewer_than_two_questions_of_the_users_keep_the_start() -> None:
    train = labeled([*items(1, "labelled", "r"), *items(8, "shipped", "w")])
    choice = finetune.choose_pull(train, list(range(9)), start_policy(), None, CompactConfig())  # type: ignore[arg-type]
    assert math.isinf(choice.pull) and "fewer than 2" in choice.how


def test_a_run_on_made_up_questions_alone_judges_on_them(monkeypatch: pytest.MonkeyPatch) -> None:
    train = labeled([*items(10, "pseudo", "x"), *items(4, "shipped", "w")])
    monkeypatch.setattr(finetune, "fit", lambda demos, config, *, start, pull, **_: (
        CompactPolicy(dict(start.weights), name=f"pull-{pull:g}"), {}))
    monkeypatch.setattr(finetune, "greedy_hits", lambda policy, part, *_: [float(policy.name == "pull-0")] * len(part))
    choice = finetune.choose_pull(train, list(range(14)), start_policy(), None, CompactConfig())  # type: ignore[arg-type]
    assert choice.pull == 0.0 and choice.how == "5-fold over 10 training questions made from the corpus"


def test_marked_questions_are_judged_on_the_passages_users_marked() -> None:
    from plugsearch.common.schemas.base import Document

    item = QAItem(id="s1", question="refunds?", passage_ids=["good"], negative_ids=["bad"], source="feedback")

    def docs(*ids: str) -> list[Document]:
        return [Document(id=i, title="", text="") for i in ids]

    assert finetune.judged_hit(docs("unseen", "good", "bad"), item) == 1.0  # unmarked passages are skipped
    assert finetune.judged_hit(docs("bad", "good"), item) == 0.0
    assert finetune.judged_hit(docs("unseen", "other"), item) == 0.0
