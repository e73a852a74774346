"""The searcher's admission: what a prepared search (`plugsearch.searcher.serving.PreparedSearch`, priced once)
may spend before it runs.

The per-request bound (`SEARCHER_MAX_REQUEST_COST`), each key's budget (`RateLimiter`, cost units per second),
the door (a key that cannot afford one unit is refused by the guard before its body is read) and the LLM's
slots (`FairShare`, shared between keys in turn). The machinery is `plugsearch.common.admission`'s; this module
applies it to the searcher's callers: API keys, and anonymous callers with `SEARCHER_LIMIT_ANONYMOUS`; the
internal token (the trainer) is never limited.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from plugsearch.common import tracing
from plugsearch.common.admission import Caller, FairShare, RateLimiter
from plugsearch.common.errors import CostLimitExceeded, RateLimited
from plugsearch.searcher.settings import SearcherSettings

REFUSAL_COST = 1.0
"""What a request refused for its cost costs its caller (its reading and refusal)."""
MAX_BLOCKED = 100_000


class SearchAdmission:
    """The bound, the budgets, the door and the LLM's slots of one searcher process (`SearchService.admission`;
    `rate_limiter` None: no budgets)."""

    def __init__(self, settings: SearcherSettings, rate_limiter: RateLimiter | None = None) -> None:
        self.settings = settings
        self.rate_limiter = rate_limiter
        self.llm_share = FairShare(settings.llm_slots)
        self._blocked: dict[str, float] = {}
        """caller id -> until when it cannot afford one cost unit (`door`)"""

    def _limited(self, caller: Caller | None) -> bool:
        return caller is not None and (caller.kind == "key" or (caller.kind == "anonymous"
                                                                and self.settings.limit_anonymous))

    async def check_cost(self, caller: Caller | None, cost: float) -> None:
        """The per-request bound: raises `CostLimitExceeded` for a limited caller's too costly request, which
        costs the caller `REFUSAL_COST` (reading and refusing it is work too: a key that keeps sending such
        requests spends its budget, then is refused at the door, `door`)."""
        limit = self.settings.max_request_cost
        if self._limited(caller) and cost > limit:
            await self.charge_refusal(caller)
            raise CostLimitExceeded(f"the request costs {cost:g} units, over the limit of {limit:g} per request "
                                    "(fewer turns, documents or batch items)", param="items")

    async def charge_refusal(self, caller: Caller | None) -> None:
        """Spend `REFUSAL_COST` of the caller's budget for a request refused for its cost (when the budget cannot
        afford it, the door closes instead: the refusal itself is still the answer)."""
        with contextlib.suppress(RateLimited):
            await self.charge(caller, REFUSAL_COST)

    def door(self, caller: Caller) -> float:
        """Seconds for which `caller` cannot afford even one cost unit (`app.state.door`: the guard refuses its
        requests with 429 before reading their bodies); 0.0 when it may come in."""
        until = self._blocked.get(caller.id)
        left = 0.0 if until is None else until - time.monotonic()
        if until is not None and left <= 0:
            del self._blocked[caller.id]
        return max(0.0, left)

    async def admit(self, caller: Caller | None, cost: float, llm_slots: int) -> Callable[[], None]:
        """Charge `cost` to the caller's budget, then take `llm_slots` of the LLM's slots (the span
        `searcher.admission`); returns the slots' release. Raises `RateLimited` (429) for either."""
        with _admission_span(caller, cost):
            await self.charge(caller, cost)
            return await self.take_llm_slots(caller, llm_slots)

    async def take_llm_slots(self, caller: Caller | None, slots: int = 1) -> Callable[[], None]:
        """Hold `slots` of the LLM's slots for a limited caller (`FairShare`: waiting up to `llm_wait_s` for its
        turn while other keys hold them all), or raise `RateLimited` with when to retry; returns the release
        (call it once, when the LLM work is over)."""
        if slots <= 0 or caller is None or not self._limited(caller):
            return lambda: None
        slots = min(slots, self.llm_share.share(caller.id))  # a batch: at most the key's share, never starved
        wait = await self.llm_share.acquire(caller.id, slots, timeout_s=self.settings.llm_wait_s)
        if wait > 0:
            raise RateLimited(f"this key holds or waits for its share of the LLM ({self.llm_share.share(caller.id)} "
                              f"of {self.llm_share.slots} requests at once while other keys use it), or its turn "
                              f"did not come within {self.settings.llm_wait_s:g} s: retry later", retry_after=wait)
        t0, released = time.monotonic(), False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.llm_share.release(caller.id, time.monotonic() - t0, slots)

        return release

    async def charge(self, caller: Caller | None, cost: float) -> None:
        """Spend `cost` of the caller's budget, or raise `RateLimited` with the seconds until it could."""
        if self.rate_limiter is None or caller is None or not self._limited(caller):
            return
        wait = await self.rate_limiter.take(caller.id, cost)
        if wait > 0:
            broke = wait - (cost - 1) / self.rate_limiter.rate  # until even one unit is affordable
            if broke > 0:
                if len(self._blocked) > MAX_BLOCKED:
                    self._blocked = {k: t for k, t in self._blocked.items() if t > time.monotonic()}
                self._blocked[caller.id] = time.monotonic() + broke
            raise RateLimited(f"rate limit: {self.settings.rate_limit_per_s:g} cost units per second per key "
                              f"(this request: {cost:g})", retry_after=max(1.0, wait))


def _admission_span(caller: Caller | None, cost: float) -> AbstractContextManager[Any]:
    """The span of a search's admission: its cost charged to the caller's budget (a Redis round trip where
    there is one) and the LLM slot it holds; a refusal (429) ends it with the error."""
    return tracing.span("searcher.admission", {"plugsearch.cost": cost,
                                                "plugsearch.caller": caller.kind if caller else "none"}
                        if tracing.enabled() else None)
