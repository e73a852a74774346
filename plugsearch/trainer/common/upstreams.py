"""The services the trainer calls (retriever, generator, judge), behind one small Protocol so unit
tests can inject fakes. Batches go out in chunks, the chunks concurrently; everything is async."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

import httpx

from plugsearch.common import tracing
from plugsearch.common.clients import GeneratorClient, JudgeClient, RetrieverClient
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.generator import MAX_DOCS, GenDocument, GenerateRequest
from plugsearch.common.schemas.judge import JudgeRequest, JudgeResult
from plugsearch.common.schemas.retriever import Method
from plugsearch.trainer.common.settings import TrainerSettings


@dataclass(frozen=True)
class Answered:
    """A frozen-generator answer and its judgement."""

    answer: str
    genacc: float
    em: float
    f1: float
    decided_by: str
    model: str = ""
    prompt_version: str = ""


class QAServices(Protocol):
    """What rewards, baselines and eval need from the stack."""

    async def retrieve(self, queries: Sequence[str], k: int, method: Method | None) -> list[list[Document]]: ...

    async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                               ) -> list[Answered]: ...


def to_gen_documents(documents: Sequence[Document]) -> list[GenDocument]:
    return [GenDocument(id=d.id[:256], title=d.title[:1024], text=d.text[:20_000]) for d in documents[:MAX_DOCS]]


class ServiceStack(AbstractAsyncContextManager["ServiceStack"]):
    """Typed clients of the retriever, generator and judge services (`plugsearch.common.clients`)."""

    def __init__(self, settings: TrainerSettings, *,
                 transports: dict[str, httpx.AsyncBaseTransport] | None = None) -> None:
        transports = transports or {}
        self.settings = settings
        self.retriever = RetrieverClient(settings.retriever, transport=transports.get("retriever"))
        self.generator = GeneratorClient(settings.generator, transport=transports.get("generator"))
        self.judge = JudgeClient(settings.judge, transport=transports.get("judge"))
        self._sem = asyncio.Semaphore(settings.concurrency)

    async def aclose(self) -> None:
        await asyncio.gather(self.retriever.aclose(), self.generator.aclose(), self.judge.aclose())

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def retrieve(self, queries: Sequence[str], k: int, method: Method | None) -> list[list[Document]]:
        async with self._sem:
            response = await self.retriever.retrieve(list(queries), k=k, method=method)
        return response.results

    async def _answer_chunk(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]) -> list[Answered]:
        async with self._sem:
            with tracing.span("trainer.generate", {"plugsearch.items": len(items)}):
                generated = await self.generator.generate_batch(
                    [GenerateRequest(question=q, documents=to_gen_documents(docs), max_tokens=None)
                     for q, docs, _ in items], timeout=self.settings.batch_timeout_s)
        answers = [g.answer.strip() for g in generated]
        # The judge refuses a blank prediction (422); an empty answer is simply wrong.
        to_judge = [i for i, a in enumerate(answers) if a]
        judged: dict[int, JudgeResult] = {}
        if to_judge:
            async with self._sem:
                with tracing.span("trainer.judge", {"plugsearch.items": len(to_judge)}):
                    results = await self.judge.judge_batch(
                        [JudgeRequest(prediction=answers[i][:8192], question=items[i][0][:4096], mode="genacc",
                                      golden_answers=[a[:1024] for a in items[i][2][:100]]) for i in to_judge],
                        timeout=self.settings.batch_timeout_s)
            judged = dict(zip(to_judge, results, strict=True))
        out: list[Answered] = []
        for i, gen in enumerate(generated):
            result = judged.get(i)
            if result is None:
                out.append(Answered(answers[i], 0.0, 0.0, 0.0, "empty", gen.model, gen.prompt_version))
            else:
                genacc = result.genacc if result.genacc is not None else (result.score or 0.0)
                out.append(Answered(answers[i], float(genacc), result.em, result.f1, result.decided_by,
                                    gen.model, gen.prompt_version))
        return out

    async def answer_and_judge(self, items: Sequence[tuple[str, Sequence[Document], Sequence[str]]]
                               ) -> list[Answered]:
        """Frozen generator answers `(question, documents, golden answers)` items, the judge scores them
        (with tracing on: one trace, `trainer.answer_and_judge`, over every chunk's generator and judge calls)."""
        size = self.settings.chunk
        with tracing.span("trainer.answer_and_judge", {"plugsearch.items": len(items)}):
            parts = await asyncio.gather(*(self._answer_chunk(items[i:i + size])
                                           for i in range(0, len(items), size)))
        return [a for part in parts for a in part]
