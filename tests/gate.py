"""A gate for scripted LLMs in concurrency tests."""

from __future__ import annotations

import asyncio


class Gate:
    """Holds calls until `size` are in flight together (or 2 s pass), so a peak-concurrency assertion does not
    depend on every call starting within a sleep on a loaded machine; a serialised caller still fails it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.open = asyncio.Event()

    async def wait(self, active: int) -> None:
        if self.size <= 0:
            return
        if active >= self.size:
            self.open.set()
        try:
            await asyncio.wait_for(self.open.wait(), 2.0)
        except TimeoutError:
            pass
