"""Training of the compact searcher policy (`services.searcher.compact`): a supervised warm start, then
reinforcement learning with the Gain-Beyond-RAG reward, both in `SearchEnv`, the environment the searcher
serves.

- Warm start: for every training question the environment is driven by a demonstrator that knows the
  labels (a follow-up query is good when its retrieval brings a new document that is a supporting passage
  or holds a gold answer); the document scorers learn those labels on the pools it saw (binary
  cross-entropy): the `dense` scorer on the whole pool (BM25 and dense blocks, with the dense evidence), the
  `lexical` scorer on the same search without its dense block (what it is served on when the retriever has
  no dense index); the query chooser learns the demonstrator's choices (softmax cross-entropy).
- RL: groups of sampled searches per question (queries from the candidates' softmax, the selection by
  Plackett-Luce), reward `recall` (GBR without an LLM: hit(selected documents) - hit(naive top-n at the same
  n), GenAcc's span check) or `gbr` (generator + judge GenAcc through the services, `--local`); the
  advantage is the reward minus its group's mean (REINFORCE with a group baseline). Resumable: the state is
  saved every `--save-every` steps and a rerun of the same command continues.

Training questions are rows `--offset` (200) and later of nq, hotpotqa, 2wikimultihopqa and popqa only: rows
0-99 are the evaluation split, rows 100-199 are reserved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from services.common.answers import is_yes_no, span_match
from services.common.schemas.base import Document
from services.common.schemas.searcher import SearchParams
from services.searcher.compact import (
    CANDIDATE_FEATURES,
    DENSE,
    DENSE_FEATURES,
    DENSE_PREFIX,
    DENSE_SCORER,
    DOC_FEATURES,
    LEXICAL_SCORER,
    CompactPolicy,
    Decision,
    QuestionInfo,
    candidates,
    dense_features,
    doc_features,
    pool_of,
    softmax,
)
from services.searcher.env import Action, InfoBlock, RetrieverBackend, SearchEnv
from trainer.data import QAItem, append_durable, load_qa, qa_path, read_jsonl
from trainer.rewards import documents_hit
from trainer.upstreams import QAServices

logger = logging.getLogger(__name__)

TRAIN_SETS = ("nq", "hotpotqa", "2wikimultihopqa", "popqa")
NEVER_TRAIN = frozenset({"musique", "bamboogle", "triviaqa"})
FIRST_TRAIN_ROW = 200


@dataclass
class CompactConfig:
    datasets: tuple[str, ...] = TRAIN_SETS
    offset: int = FIRST_TRAIN_ROW
    per_dataset: int = 750
    dev_per_dataset: int = 50
    """The last this many of each set's training rows are held out to watch the RL stage (never trained on)."""
    retrieve_k: int = 30
    select_k: int = 3
    max_turns: int = 2
    hidden: tuple[int, int] = (32, 16)
    warm_epochs: int = 30
    warm_lr: float = 3e-3
    rl_steps: int = 600
    questions_per_step: int = 32
    group: int = 4
    rl_lr: float = 1e-3
    temperature: float = 0.5
    save_every: int = 10
    seed: int = 0
    dense: bool = True
    """The pool adds the dense retriever's top `retrieve_k` (the `dense` scorer is trained and RL runs with it)."""

    def search_params(self) -> SearchParams:
        return SearchParams(mode="s3", retrieve_k=self.retrieve_k, select_k=self.select_k, max_turns=self.max_turns,
                            method="bm25", pool_methods=["bm25", DENSE] if self.dense else ["bm25"])


@dataclass
class LabeledItem:
    item: QAItem
    supporting: frozenset[str] = field(default_factory=frozenset)

    def positive(self, doc: Document) -> bool:
        return doc.title in self.supporting or span_match(doc.text, self.item.golden_answers)


def load_items(data_dir: Path, config: CompactConfig) -> tuple[list[LabeledItem], list[LabeledItem]]:
    """(training, dev) questions: rows offset.. of each set, yes/no dropped; dev = each set's last rows."""
    bad = NEVER_TRAIN.intersection(config.datasets)
    if bad:
        raise ValueError(f"{sorted(bad)} are never trained on")
    if config.offset < FIRST_TRAIN_ROW:
        raise ValueError(f"training starts at row {FIRST_TRAIN_ROW} (rows 0-99 evaluate, 100-199 are reserved)")
    train: list[LabeledItem] = []
    dev: list[LabeledItem] = []
    for name in config.datasets:
        items = [LabeledItem(q, frozenset(q.supporting_titles))
                 for q in load_qa(qa_path(data_dir, name), limit=config.per_dataset + config.dev_per_dataset,
                                  offset=config.offset)
                 if not is_yes_no(q.golden_answers)]
        cut = max(0, len(items) - config.dev_per_dataset)
        train.extend(items[:cut])
        dev.extend(items[cut:])
    return train, dev


# ------------------------------------------------------------------------------------------ retrieval
class IndexRetriever:
    """The retriever service's own indexes and backends in-process, memoised per query: the same documents the
    service returns, without HTTP in the training loop. The indexes are the stack's (`index_dir`, by default
    `var/indexes/<corpus>-<sha256>`, as `plugsearch-stack` names it): bm25s, and with `dense` the encoder's flat
    FAISS index (`RETRIEVER_ENCODER__*`, default MiniLM), built by `plugsearch-index build`'s code when missing.
    Methods: bm25, and with `dense` dense and hybrid (RRF)."""

    def __init__(self, corpus_path: Path, index_dir: Path, *, dense: bool = False, progress: bool = True) -> None:
        from services.retriever.cli import build
        from services.retriever.fusion import HybridRetriever
        from services.retriever.serving import RetrieverService, check_indexes
        from services.retriever.settings import RetrieverSettings

        settings = RetrieverSettings(corpus=corpus_path, index_dir=index_dir, bm25=True, bm25_backend="bm25s",
                                     dense=dense, dense_backend="faiss")
        settings.faiss.index_type = "flat"
        build(settings, bm25=["bm25s"], dense=dense, force=False, show_progress=progress)
        self.service = RetrieverService.load(settings, check_indexes(settings))
        self.methods = dict(self.service.retrievers)
        if dense:
            self.methods["hybrid"] = HybridRetriever(self.methods["bm25"], self.methods["dense"],
                                                     depth=settings.fusion_depth, rrf_k=settings.rrf_k)
        self.encoder: str | None = settings.encoder.name if dense else None
        """The dense encoder (what a policy's dense scorer is trained with), None without dense."""
        self._memo: dict[tuple[str, int, str], list[Document]] = {}

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        name = method or "bm25"
        backend = self.methods.get(name)
        if backend is None:
            raise ValueError(f"method {name!r} is not loaded here (have {sorted(self.methods)})")
        missing = [q for q in dict.fromkeys(queries) if (q, k, name) not in self._memo]
        if missing:
            found = self.service.documents(backend.batch_search(missing, k))
            for q, docs in zip(missing, found, strict=True):
                self._memo[(q, k, name)] = [Document.model_construct(**d) for d in docs]
        return [self._memo[(q, k, name)] for q in queries]


# ------------------------------------------------------------------------------------------ episodes
@dataclass
class Step:
    doc_x: np.ndarray
    cand_x: np.ndarray | None
    choice: int | None
    selected: list[int]
    scorer: str = LEXICAL_SCORER


@dataclass
class Episode:
    item: LabeledItem
    steps: list[Step]
    documents: list[Document]


async def run_episode(policy: CompactPolicy, item: LabeledItem, retriever: RetrieverBackend, params: SearchParams,
                      rng: np.random.Generator | None, temperature: float = 1.0) -> Episode:
    """One search in the environment with the policy (sampled when `rng` is given)."""
    env = SearchEnv(item.item.question, params, retriever)
    await env.reset()
    steps: list[Step] = []
    while not env.done:
        d: Decision = policy.decide(env, rng=rng, temperature=temperature)
        steps.append(Step(d.doc_x, d.cand_x, d.choice, d.selected, d.scorer))
        await env.act(d.action)
    return Episode(item, steps, list(env.documents()))


@dataclass
class Demonstration:
    """What the warm start learns from one demonstrated search: per scorer, the final pool's features and
    labels (`dense` only when the search had a dense block), and each query choice's (candidate features,
    good rows)."""

    pools: dict[str, tuple[np.ndarray, np.ndarray]]
    choices: list[tuple[np.ndarray, list[int]]]


def _labelled(item: LabeledItem, question: QuestionInfo, blocks: Sequence[InfoBlock]
              ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The pool's features and labels for each scorer: `lexical` without the dense block, `dense` with it."""
    out = {}
    lexical = [b for b in blocks if b.method != DENSE]
    for scorer, these in ((LEXICAL_SCORER, lexical), (DENSE_SCORER, blocks)):
        pool = pool_of(these)
        x = doc_features(question, pool)
        if scorer == DENSE_SCORER:
            dense_x = dense_features(pool, these)
            if dense_x is None:
                continue
            x = np.concatenate([x, dense_x], axis=1)
        out[scorer] = (x, np.array([float(item.positive(p.doc)) for p in pool], dtype=np.float32))
    return out


async def demonstrate(item: LabeledItem, retriever: RetrieverBackend, params: SearchParams) -> Demonstration:
    """The warm start's demonstrator in the environment: candidates ranked as the untrained policy would
    (BM25 order), a follow-up query taken when its retrieval brings a new positive document (else stop)."""
    env = SearchEnv(item.item.question, params, retriever)
    await env.reset()
    question = QuestionInfo.of(item.item.question)
    choices: list[tuple[np.ndarray, list[int]]] = []
    while env.can_search and not env.done:
        pool = pool_of(env.blocks)
        if not pool:
            break
        doc_x = doc_features(question, pool)
        prior = softmax(np.array([p.score_rel for p in pool]))
        cands, cand_x = candidates(question, pool, prior, env.seen_queries, doc_x)
        have = {p.doc.id for p in pool}
        results = await retriever.retrieve([c.query for c in cands[1:]], params.retrieve_k, params.method)
        good = [i + 1 for i, docs in enumerate(results)
                if any(d.id not in have and item.positive(d) for d in docs)]
        choices.append((cand_x, good or [0]))
        if not good:
            break
        await env.act(Action("search", query=cands[good[0]].query))
    return Demonstration(_labelled(item, question, env.blocks), choices)


# ------------------------------------------------------------------------------------------ the model
SCORER_FEATURES = {LEXICAL_SCORER: len(DOC_FEATURES), DENSE_SCORER: len(DOC_FEATURES) + len(DENSE_FEATURES)}
SCORER_PREFIX = {LEXICAL_SCORER: "", DENSE_SCORER: DENSE_PREFIX}


def _torch_model(hidden: tuple[int, int], scorers: Sequence[str], weights: dict[str, np.ndarray] | None = None
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


Norms = dict[str, tuple[np.ndarray, np.ndarray]]
"""Per scorer, the features' (mean, std) it standardises with."""


def _export(model: Any, norms: Norms) -> dict[str, np.ndarray]:
    out = {"qv": model.qv.detach().numpy().copy()}
    for scorer, (mean, std) in norms.items():
        pre, mlp = SCORER_PREFIX[scorer], model[scorer]
        out[pre + "mean"], out[pre + "std"] = mean.astype(np.float32), std.astype(np.float32)
        for j, (w, b) in enumerate((("w1", "b1"), ("w2", "b2"), ("w3", "b3"))):
            out[pre + w] = mlp[2 * j].weight.detach().numpy().T.copy()
            out[pre + b] = mlp[2 * j].bias.detach().numpy().copy()
    return out


def _norms(weights: dict[str, np.ndarray]) -> Norms:
    return {scorer: (weights[pre + "mean"], weights[pre + "std"]) for scorer, pre in SCORER_PREFIX.items()
            if pre + "mean" in weights}


def _doc_logits(model: Any, x: np.ndarray, norms: Norms, scorer: str) -> Any:
    import torch

    mean, std = norms[scorer]
    return model[scorer](torch.from_numpy((x - mean) / std)).reshape(-1)


def warm_start(train: Sequence[LabeledItem], retriever: RetrieverBackend, config: CompactConfig,
               progress: bool = True) -> tuple[CompactPolicy, dict[str, Any]]:
    """Demonstrations for every training question, then the supervised fit of the scorers and the query head."""
    import torch
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    params = config.search_params()

    async def collect() -> list[Demonstration]:
        return [await demonstrate(item, retriever, params)
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
    model = _torch_model(config.hidden, scorers)
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
    policy = CompactPolicy(_export(model, norms), name="compact-warmstart")
    policy.check()
    return policy, {"documents": {s: int(len(data[s][0])) for s in scorers},
                    "positives": {s: int(data[s][1].sum()) for s in scorers}, "query_choices": len(choices),
                    "searches_demonstrated": sum(1 for d in demos for _, good in d.choices if good != [0]),
                    "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None}


async def evaluate(policy: CompactPolicy, items: Sequence[LabeledItem], retriever: RetrieverBackend,
                   config: CompactConfig) -> dict[str, Any]:
    """Greedy searches: answer recall of the selection against naive top-n at the same n, per set."""
    params = config.search_params()
    per: dict[str, list[tuple[float, float]]] = {}
    for item in items:
        ep = await run_episode(policy, item, retriever, params, rng=None)
        naive = (await retriever.retrieve([item.item.question], len(ep.documents) or 1, "bm25"))[0]
        per.setdefault(item.item.dataset, []).append(
            (documents_hit(ep.documents, item.item.golden_answers), documents_hit(naive, item.item.golden_answers)))
    out: dict[str, Any] = {name: {"n": len(v), "recall": round(float(np.mean([a for a, _ in v])), 4),
                                  "naive": round(float(np.mean([b for _, b in v])), 4)} for name, v in per.items()}
    out["mean_gain"] = round(float(np.mean([o["recall"] - o["naive"] for o in out.values()])), 4) if out else 0.0
    return out


# ------------------------------------------------------------------------------------------ RL
def _log_prob(model: Any, ep: Episode, norms: Norms, temperature: float) -> Any:
    import torch

    total = torch.zeros(())
    for step in ep.steps:
        if step.cand_x is not None and step.choice is not None:
            logits = torch.from_numpy(step.cand_x) @ model.qv / temperature
            total = total + logits[step.choice] - torch.logsumexp(logits, 0)
        if step.selected:
            logits = _doc_logits(model, step.doc_x, norms, step.scorer) / temperature
            for j, i in enumerate(step.selected):
                taken = torch.zeros(len(logits), dtype=torch.bool)
                taken[step.selected[:j]] = True
                total = total + logits[i] - torch.logsumexp(logits.masked_fill(taken, float("-inf")), 0)
    return total


class RecallReward:
    """GBR without an LLM: hit(selected documents) - hit(naive top-n at the same n), GenAcc's span check."""

    kind = "recall"

    def __init__(self, retriever: RetrieverBackend) -> None:
        self.retriever = retriever
        self._naive: dict[tuple[str, int], float] = {}

    async def naive(self, item: LabeledItem, n: int) -> float:
        key = (item.item.id, n)
        if key not in self._naive:
            docs = (await self.retriever.retrieve([item.item.question], n, "bm25"))[0]
            self._naive[key] = documents_hit(docs, item.item.golden_answers)
        return self._naive[key]

    async def aclose(self) -> None:
        return None

    async def score(self, episodes: Sequence[Episode]) -> list[tuple[float, float]]:
        """(reward, what the searched documents scored) of every episode."""
        out = []
        for ep in episodes:
            hit = documents_hit(ep.documents, ep.item.item.golden_answers)
            out.append((hit - await self.naive(ep.item, len(ep.documents) or 1), hit))
        return out


class GenAccReward(RecallReward):
    """s3's GBR: GenAcc(generator(q, selected)) - GenAcc(generator(q, naive top-n)), the frozen generator and
    the GenAcc judge through the services (`--reward gbr`); every answer of a step in one concurrent batch."""

    kind = "gbr"

    def __init__(self, retriever: RetrieverBackend, services: Callable[[], QAServices]) -> None:
        super().__init__(retriever)
        self._make = services
        self._services: QAServices | None = None
        self._baseline: dict[tuple[str, int], float] = {}

    @property
    def services(self) -> QAServices:
        if self._services is None:  # built in the training loop's event loop, which its clients belong to
            self._services = self._make()
        return self._services

    async def aclose(self) -> None:
        if self._services is not None and hasattr(self._services, "aclose"):
            await self._services.aclose()

    async def score(self, episodes: Sequence[Episode]) -> list[tuple[float, float]]:
        missing = sorted({(ep.item.item.id, len(ep.documents) or 1) for ep in episodes} - set(self._baseline))
        by_id = {ep.item.item.id: ep.item for ep in episodes}
        naive = [(await self.retriever.retrieve([by_id[i].item.question], n, "bm25"))[0] for i, n in missing]
        answered = await self.services.answer_and_judge(
            [(ep.item.item.question, ep.documents, ep.item.item.golden_answers) for ep in episodes]
            + [(by_id[i].item.question, docs, by_id[i].item.golden_answers)
               for (i, _), docs in zip(missing, naive, strict=True)])
        for key, a in zip(missing, answered[len(episodes):], strict=True):
            self._baseline[key] = a.genacc
        return [(a.genacc - self._baseline[(ep.item.item.id, len(ep.documents) or 1)], a.genacc)
                for ep, a in zip(episodes, answered, strict=True)]


def reinforce(policy: CompactPolicy, train: Sequence[LabeledItem], retriever: RetrieverBackend,
              config: CompactConfig, out: Path, progress: bool = True,
              reward: RecallReward | None = None) -> tuple[CompactPolicy, list[dict[str, Any]]]:
    """GRPO-style REINFORCE on both heads; `rewards.jsonl` + `state.pt` in `out` make it resumable."""
    reward = reward or RecallReward(retriever)

    async def go() -> tuple[CompactPolicy, list[dict[str, Any]]]:
        try:
            return await _reinforce(policy, train, retriever, config, out, progress, reward)
        finally:
            await reward.aclose()

    return asyncio.run(go())


async def _reinforce(policy: CompactPolicy, train: Sequence[LabeledItem], retriever: RetrieverBackend,
                     config: CompactConfig, out: Path, progress: bool, reward: RecallReward
                     ) -> tuple[CompactPolicy, list[dict[str, Any]]]:
    import torch
    from tqdm import tqdm

    params = config.search_params()
    norms = _norms(policy.weights)
    model = _torch_model(config.hidden, list(norms), policy.weights)
    opt = torch.optim.Adam(model.parameters(), lr=config.rl_lr)
    state_path, log_path = out / "state.pt", out / "rewards.jsonl"
    entries, _ = read_jsonl(log_path, json.loads)
    start = 0
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    entries = [e for e in entries if e["step"] < start]  # steps after the last save are redone
    log_path.write_text("".join(json.dumps(e) + "\n" for e in entries))

    bar = tqdm(range(start, config.rl_steps), desc=f"RL ({reward.kind})", disable=not progress, initial=start,
               total=config.rl_steps)
    for step in bar:
        batch = random.Random(config.seed * 100_003 + step).sample(list(train), min(config.questions_per_step,
                                                                                    len(train)))
        current = CompactPolicy(_export(model, norms), name="compact")
        rng = np.random.default_rng(config.seed * 7919 + step)
        t0 = time.perf_counter()
        episodes = [await run_episode(current, item, retriever, params, rng, config.temperature)
                    for item in batch for _ in range(config.group)]
        scored = await reward.score(episodes)
        rewards = np.array([r for r, _ in scored]).reshape(len(batch), config.group)
        adv = (rewards - rewards.mean(1, keepdims=True)).reshape(-1)
        loss = torch.zeros(())
        for ep, a in zip(episodes, adv, strict=True):
            if a != 0:
                loss = loss - float(a) * _log_prob(model, ep, norms, config.temperature)
        loss = loss / len(episodes)
        opt.zero_grad()
        if loss.requires_grad:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        searches = float(np.mean([sum(1 for st in ep.steps if not st.selected) for ep in episodes]))
        entry = {"step": step, "kind": reward.kind, "mean_reward": round(float(rewards.mean()), 4),
                 "mean_genacc": round(float(np.mean([h for _, h in scored])), 4),
                 "searches": round(searches, 3), "seconds": round(time.perf_counter() - t0, 2)}
        entries.append(entry)
        append_durable(log_path, json.dumps(entry) + "\n")
        bar.set_postfix(reward=entry["mean_reward"], hit=entry["mean_genacc"])
        if (step + 1) % config.save_every == 0 or step + 1 == config.rl_steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, state_path)
    final = CompactPolicy(_export(model, norms), name="compact-gbr")
    final.check()
    return final, entries


def config_dict(config: CompactConfig) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
