"""Naive-RAG baselines: GenAcc(generator(q, top-k of q)) per question, the subtrahend of GBR (the reward
computer's `top_k` baseline reads the store's k; `same_n` one store per n, `BaselineStore.with_k`).

Stored in an append-only JSONL file (one fsync'd line per question: a SIGKILL loses at most the one in
flight) and optionally Redis (shared with other jobs). Resumable: what the file holds is skipped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from plugsearch.common.cache import ResultCache, cache_key, make_cache
from plugsearch.common.files import atomic_write_text
from plugsearch.common.qa import QAItem, append_durable, read_jsonl
from plugsearch.common.schemas.retriever import Method
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.trainer.common.upstreams import QAServices

logger = logging.getLogger(__name__)

BASELINE_VERSION = "1"


class BaselineRecord(BaseModel):
    id: str
    question: str
    golden_answers: list[str]
    dataset: str = ""
    genacc: float
    em: float
    f1: float
    answer: str
    doc_ids: list[str]
    k: int
    method: str | None = None
    model: str = ""
    prompt_version: str = ""


class BaselineConfig(BaseModel):
    k: int = 3
    method: Method | None = None
    tag: str = ""
    """Free text that separates baselines of different generators (e.g. the generator model)."""

    def digest(self) -> str:
        payload = json.dumps({"v": BASELINE_VERSION, **self.model_dump()}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


class BaselineStore:
    """JSONL file + optional Redis mirror, keyed by question id within one `BaselineConfig`."""

    def __init__(self, directory: Path, config: BaselineConfig, *, redis_url: str | None = None) -> None:
        self.config = config
        self.directory = directory
        self.redis_url = redis_url
        self.path = directory / f"baseline-{config.digest()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._cache: ResultCache | None = make_cache(redis_url, name="baseline") if redis_url else None
        self._records: dict[str, BaselineRecord] = {}
        self._lock = asyncio.Lock()
        self._siblings: dict[int, BaselineStore] = {config.k: self}
        self._load()

    def with_k(self, k: int) -> BaselineStore:
        """The store of the same config at naive top-`k` (itself at its own k), kept beside it."""
        if k not in self._siblings:
            sibling = BaselineStore(self.directory, self.config.model_copy(update={"k": k}), redis_url=self.redis_url)
            sibling._siblings = self._siblings
            self._siblings[k] = sibling
        return self._siblings[k]

    def _load(self) -> None:
        records, bad = read_jsonl(self.path, BaselineRecord.model_validate_json)
        self._records = {r.id: r for r in records}
        if bad:  # rewritten, so the next appended line does not continue the cut one
            logger.warning("baseline file %s: skipped %s incomplete line(s)", self.path, bad)
            self._rewrite()

    def _rewrite(self) -> None:
        atomic_write_text(self.path, "".join(r.model_dump_json() + "\n" for r in self._records.values()))

    def _key(self, qid: str) -> str:
        return cache_key("baseline", {"v": BASELINE_VERSION, "cfg": self.config.model_dump(), "id": qid})

    def __contains__(self, qid: object) -> bool:
        return qid in self._records

    def genacc_by_id(self) -> dict[str, float]:
        return {qid: r.genacc for qid, r in self._records.items()}

    async def get(self, qid: str) -> BaselineRecord | None:
        record = self._records.get(qid)
        if record is not None or self._cache is None:
            return record
        raw = await self._cache.get_json(self._key(qid))
        if raw is None:
            return None
        record = BaselineRecord.model_validate(raw)
        await self._append(record)  # keep the durable file complete
        return record

    async def put(self, record: BaselineRecord) -> None:
        await self._append(record)
        if self._cache is not None:
            await self._cache.set_json(self._key(record.id), record.model_dump())

    async def _append(self, record: BaselineRecord) -> None:
        async with self._lock:
            if record.id in self._records:
                return
            append_durable(self.path, record.model_dump_json() + "\n")
            self._records[record.id] = record

    async def aclose(self) -> None:
        for store in self._siblings.values():
            if store._cache is not None:
                await store._cache.aclose()
                store._cache = None


async def compute_baselines(services: QAServices, items: Sequence[QAItem], config: BaselineConfig, *,
                            retriever: RetrieverBackend | None = None) -> list[BaselineRecord]:
    """Naive RAG for a batch: one batched retrieval (`retriever`, else the services'), then generator + judge
    (chunked, concurrent)."""
    if not items:
        return []
    docs = await (retriever or services).retrieve([it.question for it in items], config.k, config.method)
    answered = await services.answer_and_judge(
        [(it.question, d, it.golden_answers) for it, d in zip(items, docs, strict=True)])
    return [BaselineRecord(id=it.id, question=it.question, golden_answers=it.golden_answers, dataset=it.dataset,
                           genacc=a.genacc, em=a.em, f1=a.f1, answer=a.answer, doc_ids=[x.id for x in d],
                           k=config.k, method=config.method, model=a.model, prompt_version=a.prompt_version)
            for it, d, a in zip(items, docs, answered, strict=True)]


async def _stored(store: BaselineStore, items: Sequence[QAItem]
                  ) -> tuple[dict[str, BaselineRecord], list[QAItem]]:
    """(the stored baselines of `items` by id, the items that have none)."""
    found: dict[str, BaselineRecord] = {}
    missing: list[QAItem] = []
    for item in items:
        record = await store.get(item.id)
        if record is None:
            missing.append(item)
        else:
            found[item.id] = record
    return found, missing


async def ensure_baselines(services: QAServices, store: BaselineStore, items: Sequence[QAItem], *,
                           batch: int = 8, progress: Callable[[int], Any] | None = None,
                           retriever: RetrieverBackend | None = None) -> dict[str, int]:
    """Compute every missing baseline, `batch` questions per round; each finished record is durable
    before the next round starts. Returns counts: already done, computed now."""
    _, todo = await _stored(store, items)
    done = len(items) - len(todo)
    logger.info("baselines: %s done already, %s to compute", done, len(todo))
    for start in range(0, len(todo), batch):
        chunk = todo[start:start + batch]
        for record in await compute_baselines(services, chunk, store.config, retriever=retriever):
            await store.put(record)
        if progress is not None:
            progress(len(chunk))
    return {"done_before": done, "computed": len(todo), "total": len(items)}


async def baselines_for(services: QAServices, store: BaselineStore, items: Sequence[QAItem], *,
                        retriever: RetrieverBackend | None = None) -> dict[str, BaselineRecord]:
    """Baselines of a batch (ids may repeat: GRPO samples each question several times). Missing ones
    are computed together, once per question, and stored."""
    found, missing = await _stored(store, list({it.id: it for it in items}.values()))
    if missing:
        logger.warning("no naive-RAG baseline for %s question(s): computing them now", len(missing))
        for record in await compute_baselines(services, missing, store.config, retriever=retriever):
            await store.put(record)
            found[record.id] = record
    return found
