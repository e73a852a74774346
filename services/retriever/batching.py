"""Micro-batching: concurrent requests for one method are merged into one library call.

No timer: a request that finds the backend idle starts a call at once; those that arrive meanwhile go
together in the next call (up to `max_batch` queries): no added latency at low load, large batches (where
BM25, FAISS and the encoder are fastest) under load. Calls run on `workers` dedicated threads per backend,
never on the event loop; with two, a batch is searched while the previous one's responses are written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.common.errors import Overloaded
from services.retriever.base import Hits

logger = logging.getLogger(__name__)

SearchFn = Callable[[Sequence[str], int], Hits]
Observer = Callable[[int, float], None]


@dataclass
class _Item:
    queries: Sequence[str]
    k: int
    future: asyncio.Future[Hits]


class MicroBatcher:
    def __init__(self, name: str, fn: SearchFn, *, max_batch: int = 512, max_queue: int = 8192,
                 observe: Observer | None = None, workers: int = 1) -> None:
        self.name = name
        self.fn = fn
        self.max_batch = max_batch
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
        loop = asyncio.get_running_loop()
        item = _Item(queries, k, loop.create_future())
        self._pending.append(item)
        self.queued += len(queries)
        # live drains only: one that just finished is done() already, and must not block a new one
        self._drains = {task for task in self._drains if not task.done()}
        if len(self._drains) < self.workers:
            self._drains.add(loop.create_task(self._drain()))
        return await item.future

    def _take(self) -> list[_Item]:
        batch = [self._pending.popleft()]
        size = len(batch[0].queries)
        while self._pending and size + len(self._pending[0].queries) <= self.max_batch:
            item = self._pending.popleft()
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
