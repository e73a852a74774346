"""Micro-batching: concurrent requests for one method are merged into one library call.

No timer: a request that finds the backend idle starts a call at once; those that arrive meanwhile go
together in the next call (up to `max_batch` queries): no added latency at low load, large batches (where
BM25, FAISS and the encoder are fastest) under load. Calls run on `workers` dedicated threads per backend,
never on the event loop; with two, a batch is searched while the previous one's responses are written.

Long queries do not hold short ones (`max_chars`): a library call carries at most `max_chars` characters of
queries (or one query), a request with more is searched in parts, and a request of at most `max_chars // 8`
characters (a search's question or follow-up query) goes before the parts and long requests waiting, one of
which goes next after each call of short ones. A short query therefore waits for at most one call of long ones
(the encoder and BM25 work of `max_chars` characters), whatever another caller queued; the long ones wait for
at most one call of short ones per call of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from plugsearch.common.errors import Overloaded
from plugsearch.retriever.backends.base import Hits

logger = logging.getLogger(__name__)

SearchFn = Callable[[Sequence[str], int], Hits]
Observer = Callable[[int, float], None]


@dataclass
class _Item:
    queries: Sequence[str]
    k: int
    future: asyncio.Future[Hits]
    chars: int


class MicroBatcher:
    def __init__(self, name: str, fn: SearchFn, *, max_batch: int = 512, max_queue: int = 8192,
                 observe: Observer | None = None, workers: int = 1, max_chars: int = 0) -> None:
        self.name = name
        self.fn = fn
        self.max_batch = max_batch
        self.max_chars = max_chars
        """characters of queries in one library call, at least one query (module docstring); 0: no limit"""
        self.light_chars = max_chars // 8
        """a request of at most this many characters goes before longer ones waiting"""
        self._long_next = False
        """the last call was of short requests while long ones waited: one of those goes next"""
        self.max_queue = max_queue
        self.observe = observe
        self._pending: deque[_Item] = deque()
        self.queued = 0  # queries waiting for a library call
        self.workers = workers
        self._drains: set[asyncio.Task[None]] = set()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"search-{name}")
        self._closed = False

    async def submit(self, queries: Sequence[str], k: int) -> Hits:
        if self._closed:
            raise RuntimeError(f"batcher {self.name} is closed")
        if self.queued and self.queued + len(queries) > self.max_queue:
            raise Overloaded(f"{self.name} search queue is full ({self.queued} queries); retry later",
                             retry_after=1.0)
        chars = sum(len(q) for q in queries)
        if self.max_chars and chars > self.max_chars and len(queries) > 1:
            return await self._in_parts(queries, k)
        loop = asyncio.get_running_loop()
        item = _Item(queries, k, loop.create_future(), chars)
        self._pending.append(item)
        self.queued += len(queries)
        # live drains only: one that just finished is done() already, and must not block a new one
        self._drains = {task for task in self._drains if not task.done()}
        if len(self._drains) < self.workers:
            self._drains.add(loop.create_task(self._drain()))
        return await item.future

    async def _in_parts(self, queries: Sequence[str], k: int) -> Hits:
        """A request of more than `max_chars` characters, searched in consecutive parts of at most that many
        (or one query), queued as requests of their own; their hits joined back in order."""
        parts: list[list[str]] = [[]]
        chars = 0
        for query in queries:
            if parts[-1] and chars + len(query) > self.max_chars:
                parts.append([])
                chars = 0
            parts[-1].append(query)
            chars += len(query)
        found = await asyncio.gather(*(self.submit(part, k) for part in parts))
        width = max(h.k for h in found)
        ids = np.full((len(queries), width), -1, dtype=np.int64)
        scores = np.zeros((len(queries), width), dtype=np.float32)
        start = 0
        for h in found:
            ids[start:start + len(h), :h.k], scores[start:start + len(h), :h.k] = h.ids, h.scores
            start += len(h)
        return Hits(ids, scores)

    def _take(self) -> list[_Item]:
        pending = self._pending
        if self.max_chars:
            light = [it for it in pending if it.chars <= self.light_chars]
            waiting_long = len(light) < len(pending)
            short_turn = bool(light) and not (waiting_long and self._long_next)
            self._long_next = short_turn and waiting_long
            # short requests first, in order; else the long ones (or parts): as many as one call takes
            batch: list[_Item] = []
            size = chars = 0
            for item in light if short_turn else (it for it in pending if it.chars > self.light_chars):
                if batch and (size + len(item.queries) > self.max_batch or chars + item.chars > self.max_chars):
                    break
                batch.append(item)
                size += len(item.queries)
                chars += item.chars
            taken = {id(it) for it in batch}
            self._pending = deque(it for it in pending if id(it) not in taken)
            self.queued -= size
            return batch
        batch = [pending.popleft()]
        size = len(batch[0].queries)
        while pending and size + len(pending[0].queries) <= self.max_batch:
            item = pending.popleft()
            batch.append(item)
            size += len(item.queries)
        self.queued -= size
        return batch

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            batch = [it for it in self._take() if not it.future.done()]  # drop requests already cancelled
            if not batch:
                continue
            queries = [q for it in batch for q in it.queries]
            k = max(it.k for it in batch)
            t0 = time.perf_counter()
            try:
                hits = await loop.run_in_executor(self._executor, self.fn, queries, k)
            except Exception as exc:
                for it in batch:
                    if not it.future.done():
                        it.future.set_exception(exc)
                continue
            if self.observe is not None:
                self.observe(len(queries), time.perf_counter() - t0)
            start = 0
            for it in batch:
                stop = start + len(it.queries)
                if not it.future.done():
                    it.future.set_result(hits.rows(start, stop, it.k))
                start = stop

    async def aclose(self) -> None:
        self._closed = True
        drains = set(self._drains)
        if drains:
            _, late = await asyncio.wait(drains, timeout=10)
            for task in late:
                task.cancel()
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
