"""The searcher's view of the retriever service: `ServiceRetriever`, a `RetrieverBackend` over the typed
client that merges concurrent retrievals of different searches into one request."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from services.common.clients import RetrieverClient
from services.common.errors import ServiceError, UpstreamError
from services.common.http import UpstreamUnavailable
from services.common.schemas.base import Document
from services.common.schemas.retriever import fit_query

_Waiter = tuple[list[str], "asyncio.Future[list[list[Document]]]"]
logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.25
"""The shortest pause between tries while the retriever is unavailable."""


class RetrieverRefused(UpstreamError):
    """The retriever answered a request we built with a 4xx: an upstream problem (502) for our caller."""


class ServiceRetriever:
    """`RetrieverBackend` over the retriever service's typed client.

    Concurrent calls with the same `k` and method in the same event-loop turn go out as one `POST /retrieve`
    (up to `max_batch` queries): under load, one HTTP exchange per retrieval costs both sides. Nothing waits
    for company. A merged request refused as a whole (a 4xx) is sent again per caller, so one caller's bad
    query never fails another's search. Queries are fitted first (`fit_query`); one left blank is not sent.

    A retriever that cannot be reached or is not ready (refused connections, 503 while its index loads, its
    breaker open: `UpstreamUnavailable`) is waited for, up to `wait_s` per retrieval, polling: a supervised
    retriever that died and is being restarted costs its searches that time, not their answer.
    """

    def __init__(self, client: RetrieverClient, *, max_batch: int = 64, wait_s: float = 0.0) -> None:
        self.client = client
        self.max_batch = max_batch
        self.wait_s = wait_s
        self._pending: dict[tuple[int, str | None], list[_Waiter]] = {}
        self._sending: set[asyncio.Task[None]] = set()

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        fitted = [fit_query(q) for q in queries]
        sendable = [q for q in fitted if q]
        if len(sendable) == len(fitted):
            return await self._merged(fitted, k, method)
        found = iter(await self._merged(sendable, k, method) if sendable else [])
        return [next(found) if q else [] for q in fitted]

    async def _merged(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        if self.max_batch <= 1 or len(queries) >= self.max_batch:
            return await self._retrieve(queries, k, method)
        key = (k, method)
        loop = asyncio.get_running_loop()
        group = self._pending.get(key)
        if group is not None and sum(len(q) for q, _ in group) + len(queries) > self.max_batch:
            self._flush(key)
            group = None
        if group is None:
            group = self._pending[key] = []
            loop.call_soon(self._flush, key, group)
        future: asyncio.Future[list[list[Document]]] = loop.create_future()
        group.append((queries, future))
        return await future

    def _flush(self, key: tuple[int, str | None], group: list[_Waiter] | None = None) -> None:
        if group is not None and self._pending.get(key) is not group:
            return  # already sent (it filled up before this scheduled flush ran)
        pending = self._pending.pop(key, None)
        if pending:
            task = asyncio.create_task(self._send(key, pending))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, key: tuple[int, str | None], group: list[_Waiter]) -> None:
        k, method = key
        live = [(queries, future) for queries, future in group if not future.done()]  # callers cancelled: skip
        if not live:
            return
        try:
            results = await self._retrieve([q for queries, _ in live for q in queries], k, method)
        except RetrieverRefused as exc:
            if len(live) == 1:
                _fail(live, exc)
                return
            # Whose query was refused is unknown: each caller's queries go again on their own.
            await asyncio.gather(*(self._send(key, [waiter]) for waiter in live))
            return
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller, who raises it
            _fail(live, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        start = 0
        for queries, future in live:
            if not future.done():
                future.set_result(results[start:start + len(queries)])
            start += len(queries)

    async def _retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return await self._retrieve_once(queries, k, method)
            except UpstreamUnavailable as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                pause = min(left, max(WAIT_POLL_S, min(exc.retry_after or WAIT_POLL_S, 1.0)))
                logger.info("retriever unavailable (%s): retrying in %.2f s, for %.1f s more", exc.message, pause, left)
                await asyncio.sleep(pause * random.uniform(0.8, 1.2))  # noqa: S311 - jitter, not crypto

    async def _retrieve_once(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        try:
            response = await self.client.retrieve(queries, k=k, method=method)  # type: ignore[arg-type]
        except ServiceError as exc:
            if exc.param == "method":
                raise  # a retrieval method this retriever does not serve: the caller's choice, so its 400
            if exc.status < 500 and exc.status != 429:
                # The retriever refused what we built: our caller's input was already valid, so this is
                # an upstream problem (502), not the caller's 4xx.
                raise RetrieverRefused(f"retriever refused the request: {exc.message}") from exc
            raise
        if len(response.results) != len(queries):
            raise UpstreamError(f"retriever answered {len(response.results)} result lists for {len(queries)} queries")
        return response.results


def _fail(group: list[_Waiter], exc: BaseException) -> None:
    for _, future in group:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)
