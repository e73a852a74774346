"""A gate, and a base, for scripted LLMs in concurrency tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


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


class ScriptedBase:
    """A base for scripted LLMs: `async with self.in_flight():` counts the calls in flight (`peak`: the most at
    once), holds each at a `Gate(gate)`, then sleeps `delay_s`; always healthy, nothing to close."""

    def __init__(self, delay_s: float = 0.0, gate: int = 0) -> None:
        self.delay_s = delay_s
        self.active = self.peak = 0
        self.gate = Gate(gate)

    @asynccontextmanager
    async def in_flight(self) -> AsyncIterator[None]:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await self.gate.wait(self.active)
            await asyncio.sleep(self.delay_s)
            yield
        finally:
            self.active -= 1

    async def check_health(self) -> str:
        return "ok"

    async def aclose(self) -> None:
        return None
