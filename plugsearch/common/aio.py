"""Small asyncio helpers shared by the services."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
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
