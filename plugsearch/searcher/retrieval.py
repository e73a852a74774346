"""The searcher's view of the retriever service: `ServiceRetriever`, a `RetrieverBackend` over the typed
client that merges concurrent retrievals of different searches into one request."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from plugsearch.common.clients import RetrieverClient
from plugsearch.common.errors import ServiceError, UpstreamError
from plugsearch.common.http import UpstreamUnavailable
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.retriever import fit_query

_Waiter = tuple[list[str], "str | None", "asyncio.Future[list[list[Document]]]"]
"""One caller's queries, their method and where their results go."""
_ANY = "*"
"""The group key's method when retrievals of every method go out together (`mixed_methods`)."""
logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.25
"""The shortest pause between tries while the retriever is unavailable."""


class RetrieverRefused(UpstreamError):
    """The retriever answered a request we built with a 4xx: an upstream problem (502) for our caller."""


class _MixedRefused(Exception):
    """The retriever refused a request with several methods (`methods`): sent again, one request per method."""


class ServiceRetriever:
    """`RetrieverBackend` over the retriever service's typed client.

    Concurrent calls with the same `k` in the same event-loop turn go out as one `POST /retrieve` (up to
    `max_batch` queries): under load, one HTTP exchange per retrieval costs both sides. With `mixed_methods`
    (the default) calls of different methods go together too (the request's `methods`, one per query): the
    compact policy's pool (the question with bm25 and with dense) is one round trip; without it, or once a
    retriever refuses `methods` (one that predates it), only calls of the same method merge. Nothing waits for
    company. A merged request refused as a whole (a 4xx) is sent again per method, then per caller, so one
    caller's bad query never fails another's search. Queries are fitted first (`fit_query`); one left blank
    is not sent.

    A retriever that cannot be reached or is not ready (refused connections, 503 while its index loads, its
    breaker open: `UpstreamUnavailable`) is waited for, up to `wait_s` per request, polling: a supervised
    retriever that died and is being restarted costs its searches that time, not their answer.
    """

    def __init__(self, client: RetrieverClient, *, max_batch: int = 64, mixed_methods: bool = True,
                 wait_s: float = 0.0) -> None:
        self.client = client
        self.max_batch = max_batch
        self.mixed_methods = mixed_methods
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
        key = (k, _ANY if self.mixed_methods else method)
        loop = asyncio.get_running_loop()
        group = self._pending.get(key)
        if group is not None and sum(len(q) for q, _, _ in group) + len(queries) > self.max_batch:
            self._flush(key)
            group = None
        if group is None:
            group = self._pending[key] = []
            loop.call_soon(self._flush, key, group)
        future: asyncio.Future[list[list[Document]]] = loop.create_future()
        group.append((queries, method, future))
        return await future

    def _flush(self, key: tuple[int, str | None], group: list[_Waiter] | None = None) -> None:
        if group is not None and self._pending.get(key) is not group:
            return  # already sent (it filled up before this scheduled flush ran)
        pending = self._pending.pop(key, None)
        if pending:
            task = asyncio.create_task(self._send(key[0], pending))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, k: int, group: list[_Waiter]) -> None:
        live = [waiter for waiter in group if not waiter[2].done()]  # callers cancelled: skip
        if not live:
            return
        methods = list(dict.fromkeys(method for _, method, _ in live))
        try:
            queries = [q for qs, _, _ in live for q in qs]
            if len(methods) == 1:
                results = await self._retrieve(queries, k, methods[0])
            else:
                results = await self._retrieve_each(queries, k, [m for qs, m, _ in live for _ in qs])
        except _MixedRefused:
            await asyncio.gather(*(self._send(k, [w for w in live if w[1] == m]) for m in methods))
            return
        except RetrieverRefused as exc:
            if len(live) == 1:
                _fail(live, exc)
                return
            # Whose query was refused is unknown: each caller's queries go again on their own.
            await asyncio.gather(*(self._send(k, [waiter]) for waiter in live))
            return
        except BaseException as exc:  # noqa: BLE001 - handed to every waiting caller, who raises it
            _fail(live, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        start = 0
        for qs, _, future in live:
            if not future.done():
                future.set_result(results[start:start + len(qs)])
            start += len(qs)

    async def _waiting(self, send: Callable[[], Awaitable[list[list[Document]]]]) -> list[list[Document]]:
        """`send()`, tried again while the retriever is unavailable, for up to `wait_s`."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                return await send()
            except UpstreamUnavailable as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                pause = min(left, max(WAIT_POLL_S, min(exc.retry_after or WAIT_POLL_S, 1.0)))
                logger.info("retriever unavailable (%s): retrying in %.2f s, for %.1f s more", exc.message, pause, left)
                await asyncio.sleep(pause * random.uniform(0.8, 1.2))  # noqa: S311 - jitter, not crypto

    async def _retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        return await self._waiting(lambda: self._retrieve_once(queries, k, method))

    async def _retrieve_once(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        try:
            response = await self.client.retrieve(queries, k=k, method=method)  # type: ignore[arg-type]
        except ServiceError as exc:
            if exc.param == "method":
                raise  # a retrieval method this retriever does not serve: the caller's choice, so its 400
            _raise_refused(exc)
            raise
        if len(response.results) != len(queries):
            raise UpstreamError(f"retriever answered {len(response.results)} result lists for {len(queries)} queries")
        return response.results

    async def _retrieve_each(self, queries: list[str], k: int, methods: list[str | None]) -> list[list[Document]]:
        """One request, a method per query (the retriever's default where None)."""
        return await self._waiting(lambda: self._retrieve_each_once(queries, k, methods))

    async def _retrieve_each_once(self, queries: list[str], k: int, methods: list[str | None]
                                  ) -> list[list[Document]]:
        try:
            response = await self.client.retrieve(queries, k=k, methods=methods)  # type: ignore[arg-type]
        except ServiceError as exc:
            if exc.param is not None and exc.param.split(".")[0] == "methods" and exc.status < 500:
                if exc.status == 422:  # a retriever that does not know `methods`: one method per request from now
                    self.mixed_methods = False
                raise _MixedRefused from exc  # (or a method it does not serve: whose is told per method)
            _raise_refused(exc)
            raise
        if len(response.results) != len(queries):
            raise UpstreamError(f"retriever answered {len(response.results)} result lists for {len(queries)} queries")
        return response.results


def _raise_refused(exc: ServiceError) -> None:
    """A 4xx other than 429: the retriever refused what we built from our caller's valid input, so it is an
    upstream problem (502, `RetrieverRefused`), not the caller's 4xx. Anything else is raised as it is."""
    if exc.status < 500 and exc.status != 429:
        raise RetrieverRefused(f"retriever refused the request: {exc.message}") from exc


def _fail(group: list[_Waiter], exc: BaseException) -> None:
    for _, _, future in group:
        if future.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(exc)
