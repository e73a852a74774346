"""Small asyncio helpers shared by the services, the client and the trainer."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Coroutine, Sequence
from contextlib import ExitStack
from typing import Any, TypeVar

T = TypeVar("T")


async def run_all(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; on the first failure cancel the rest and raise that failure itself."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def _stop(portal: Any, stack: ExitStack, loop_thread: int) -> None:
    """Stop a runner's portal: what still runs is cancelled, the loop and its thread end. Not from the loop's own
    thread (the runner dropped by code running on it): the thread cannot wait for itself, the loop is left."""
    if threading.get_ident() == loop_thread:
        return
    try:
        portal.call(portal.stop, True)  # cancel what still runs, rather than wait for it
    finally:
        stack.close()


class AsyncRunner:
    """Async code run from synchronous code: one asyncio event loop in a background thread, anyio's blocking portal
    (`anyio.from_thread.start_blocking_portal`), for the life of this object. Objects bound to a loop (HTTP
    connection pools) stay on this one, and it works where the calling thread already runs a loop (Jupyter). The
    blocking `SearchClient` and TRL's trainer (calling the rollout and reward functions) run on it.

    `close()` stops it; so does dropping it, or the interpreter's exit (before its threads are frozen, so an
    unclosed runner never hangs the exit)."""

    def __init__(self, name: str = "plugsearch-async") -> None:
        from anyio.from_thread import start_blocking_portal

        stack = ExitStack()
        self._portal = stack.enter_context(start_blocking_portal("asyncio", name=name))
        self._stop = weakref.finalize(self, _stop, self._portal, stack, self._portal.call(threading.get_ident))

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    def run(self, awaitable: Awaitable[T], timeout: float | None = None) -> T:
        """Wait for `awaitable` (a coroutine, typically) on the loop; `timeout`: seconds, then TimeoutError (it goes
        on running)."""
        if self.closed:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise RuntimeError("the async runner is closed")
        return self._portal.start_task_soon(_awaited, awaitable).result(timeout)

    def close(self) -> None:
        """Stop the loop (what still runs on it is cancelled) and its thread."""
        self._stop()

    def __enter__(self) -> AsyncRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
