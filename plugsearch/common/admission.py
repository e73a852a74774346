"""Admission control: a concurrency limit that follows latency, and per-caller cost budgets.

`AdaptiveLimit` is what the guard middleware (`plugsearch.common.guard`) admits requests against: a gradient
limiter in the manner of Netflix's concurrency-limits (Gradient2) and Envoy's adaptive concurrency. Each
successful request reports its latency divided by its cost (the units its handler declared, 1 by default),
so a cheap request and an expensive one say the same thing about how loaded the service is. The baseline is
the latency per unit at low load: learned from requests admitted with fewer than `min_limit` others in
flight (the first window's mean stands in until there are some). Every window (at least `MIN_SAMPLES`
requests and `WINDOW_S`) the mean of all samples is compared with it:

    gradient = clamp(tolerance * baseline / mean, 0.5, 1)
    latency over tolerance (gradient < 1): limit = min(limit, peak in flight) * gradient + sqrt(that)
    requests refused while latency is fine: limit += sqrt(limit)        (probe upwards)
    nobody refused, latency fine:           limit <= max(floor, 1.5 * peak in flight + 2)   (headroom)

within [floor, max_limit] (`MAX_IN_FLIGHT`): `floor`, an eighth of the ceiling (at least `min_limit`), is
always admitted, however latency goes (a burst of cheap requests on a small machine raises latency by
queueing alone; the floor keeps such bursts served rather than refused).
After a decrease only requests admitted under the new limit count, so one overload does not shrink the limit
again and again while its backlog drains. A baseline from low load only cannot be dragged up by a sustained
overload (Gradient2's long-term average drifts so); a service that never sees low load keeps the baseline
it started with (or the lower means it has seen).

`FairAdmission`: the same limit shared fairly between callers: with others in flight, a caller holding more
than its share (the limit divided by the callers in flight) is refused first, and a caller under its share
is admitted even when the limit is reached (up to the ceiling), so one flooding key cannot take every slot
while others wait. `FairShare`: the same idea for a scarce upstream (the LLM's slots), per request, with a
queue served across callers in turn.

`TokenBucket` / `RateLimiter`: a cost budget per caller (API key), refilled at `rate` units per second up
to `burst`, kept in Redis when there is one (a Lua script, so every replica and worker spends from the
same bucket) and in process memory otherwise or while Redis is unreachable.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

WINDOW_S = 0.5
MIN_SAMPLES = 8
BASELINE_STEP = 0.5
"""share of the way the baseline moves to a window's low-load mean (or to a lower overall mean)"""


class AdaptiveLimit:
    """How many requests may be in flight now. Not thread-safe: one per event loop (per worker)."""

    def __init__(self, max_limit: int, *, min_limit: int = 4, tolerance: float = 1.5, adaptive: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_limit = max_limit
        self.min_limit = min(min_limit, max_limit)
        self.floor = max(self.min_limit, max_limit // 8)
        self.tolerance = tolerance
        self.adaptive = adaptive
        self.clock = clock
        self.limit = float(max_limit)
        self.baseline: float | None = None
        self.epoch = 0
        """Changes at every decrease: requests admitted in an older epoch no longer report."""
        self._reset_window(clock())

    def _reset_window(self, now: float) -> None:
        self._started = now
        self._sum = 0.0
        self._count = 0
        self._low_sum = 0.0
        self._low_count = 0
        self._refused = False
        self._peak = 0

    @property
    def current(self) -> int:
        return max(1, int(self.limit))

    def admits(self, in_flight: int) -> bool:
        """Whether one more request may start with `in_flight` already running; a refusal is remembered
        (it is what tells the limiter that requests press against the limit)."""
        if in_flight < self.current:
            self._peak = max(self._peak, in_flight + 1)
            return True
        self._refused = True
        return False

    def observe(self, seconds: float, cost: float = 1.0, epoch: int | None = None, in_flight: int = 0) -> None:
        """A successful request admitted in `epoch` (default: the current one) with `in_flight` others
        running took `seconds` for `cost` units of work."""
        if not self.adaptive or seconds <= 0 or not math.isfinite(seconds):
            return
        if epoch is not None and epoch != self.epoch:
            return
        sample = seconds / max(cost, 1e-6)
        self._sum += sample
        self._count += 1
        if in_flight < self.min_limit:
            self._low_sum += sample
            self._low_count += 1
        now = self.clock()
        if self._count >= MIN_SAMPLES and now - self._started >= WINDOW_S:
            self._update(self._sum / self._count)
            self._reset_window(now)

    def _update(self, mean: float) -> None:
        pressed = self._refused
        if self._low_count:
            low = self._low_sum / self._low_count
            self.baseline = low if self.baseline is None else self.baseline + BASELINE_STEP * (low - self.baseline)
        elif self.baseline is None:
            self.baseline = mean  # provisional: lenient until low-load requests say better
        elif mean < self.baseline:
            self.baseline += BASELINE_STEP * (mean - self.baseline)
        gradient = min(1.0, max(0.5, self.tolerance * self.baseline / mean))
        if gradient < 1.0:
            used = min(self.limit, max(self._peak, self.min_limit))
            limit = used * gradient + math.sqrt(used)
            if limit < self.limit:
                self.epoch += 1
        elif pressed:
            limit = self.limit + math.sqrt(self.limit)
        else:
            limit = min(self.limit, max(self.floor, 1.5 * self._peak + 2))
        self.limit = min(self.max_limit, max(self.floor, limit))


class FairAdmission:
    """`AdaptiveLimit` shared fairly between callers (by id). Not thread-safe: one per event loop."""

    def __init__(self, limit: AdaptiveLimit) -> None:
        self.limit = limit
        self.in_flight = 0
        self.by_caller: dict[str, int] = {}

    def admits(self, caller: str) -> bool:
        """Whether `caller`'s next request may start: under the limit; or, at the limit (below the ceiling),
        while `caller` holds less than its share of it (limit / callers in flight, this one counted)."""
        if self.limit.admits(self.in_flight):
            return True
        held = self.by_caller.get(caller, 0)
        callers = len(self.by_caller) + (0 if held else 1)
        return self.in_flight < self.limit.max_limit and held < max(1, self.limit.current // callers)

    def enter(self, caller: str) -> int:
        """Count one more in flight for `caller`; returns the others in flight (for `AdaptiveLimit.observe`)."""
        others = self.in_flight
        self.in_flight += 1
        self.by_caller[caller] = self.by_caller.get(caller, 0) + 1
        return others

    def leave(self, caller: str) -> None:
        self.in_flight -= 1
        left = self.by_caller.get(caller, 1) - 1
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)


class FairShare:
    """Slots of a scarce upstream (the LLM) shared between callers, served in turn.

    At most `slots` are held at once, whoever holds them. A caller alone may use all of them; with others
    holding or waiting, it may hold or wait for at most its share, max(1, slots / active callers) (this one
    counted): more is refused at once with the seconds after which to retry (the caller's own requests in
    flight times the mean seconds a slot was held, learned; `initial_hold_s` until then). A request within its
    share that finds every slot held waits; a freed slot goes to the callers with waiting requests in turn
    (round robin, each caller's requests in arrival order), so one caller's long request delays another's by
    at most the requests it holds, never by a queue of them. Not thread-safe: one per event loop."""

    def __init__(self, slots: int, *, initial_hold_s: float = 5.0, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.slots = slots
        self.held: dict[str, int] = {}
        self.hold_s = initial_hold_s
        self.clock = clock
        self._turns: OrderedDict[str, deque[_Waiter]] = OrderedDict()
        """Callers with waiting requests, in the order their turn comes."""

    @property
    def free(self) -> int:
        return self.slots - sum(self.held.values())

    def waiting(self, caller: str | None = None) -> int:
        """Slots asked for by waiting requests (of `caller`, or of everyone)."""
        queues = [self._turns.get(caller, ())] if caller is not None else list(self._turns.values())
        return sum(w.n for queue in queues for w in queue if not w.future.done())

    def share(self, caller: str) -> int:
        others = len((set(self.held) | set(self._turns)) - {caller})
        return self.slots if others == 0 else max(1, self.slots // (others + 1))

    def retry_after(self, caller: str) -> float:
        """When to ask again: about when one of the caller's requests has ended, by the mean hold time."""
        return max(1.0, self.hold_s * max(1, self.held.get(caller, 0)) / max(1, self.share(caller)))

    def _over_share(self, caller: str, n: int) -> bool:
        return self.held.get(caller, 0) + self.waiting(caller) + n > self.share(caller)

    def _take(self, caller: str, n: int) -> None:
        self.held[caller] = self.held.get(caller, 0) + n

    def try_acquire(self, caller: str, n: int = 1) -> float:
        """Take `n` slots for `caller` now if it may and they are free with nobody waiting: 0.0 when taken,
        else the seconds after which to retry."""
        if self._over_share(caller, n) or self._turns or self.free < n:
            return self.retry_after(caller)
        self._take(caller, n)
        return 0.0

    async def acquire(self, caller: str, n: int = 1, *, timeout_s: float = 60.0) -> float:
        """Take `n` slots for `caller`, waiting up to `timeout_s` for its turn: 0.0 when taken, else the seconds
        after which to retry (over its share, or no turn within the timeout). Cancelled while waiting, it
        takes nothing."""
        if self._over_share(caller, n):
            return self.retry_after(caller)
        if not self._turns and self.free >= n:
            self._take(caller, n)
            return 0.0
        waiter = _Waiter(n, asyncio.get_running_loop().create_future())
        self._turns.setdefault(caller, deque()).append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(waiter.future)
        except TimeoutError:
            if not waiter.future.done():
                waiter.future.cancel()
                self._forget(caller, waiter)
                return self.retry_after(caller)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(caller, 0.0, n)  # granted as the caller left: hand it on
            else:
                waiter.future.cancel()
                self._forget(caller, waiter)
            raise
        return 0.0

    def _forget(self, caller: str, waiter: _Waiter) -> None:
        queue = self._turns.get(caller)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._turns[caller]
        self._dispatch()  # a large request at the head may have blocked smaller ones behind it

    def _dispatch(self) -> None:
        """Hand free slots to waiting requests, one caller's turn after another."""
        while self._turns:
            caller, queue = next(iter(self._turns.items()))
            while queue and queue[0].future.done():
                queue.popleft()  # gave up
            if not queue:
                del self._turns[caller]
                continue
            waiter = queue[0]
            if self.free < waiter.n:
                return
            queue.popleft()
            self._take(caller, waiter.n)
            waiter.future.set_result(None)
            if queue:
                self._turns.move_to_end(caller)  # its next request waits for the others' turns
            else:
                del self._turns[caller]

    def release(self, caller: str, seconds: float, n: int = 1) -> None:
        left = self.held.get(caller, n) - n
        if left > 0:
            self.held[caller] = left
        else:
            self.held.pop(caller, None)
        if seconds > 0 and math.isfinite(seconds):
            self.hold_s += 0.2 * (seconds - self.hold_s)
        self._dispatch()


@dataclass(eq=False)
class _Waiter:
    n: int
    future: asyncio.Future[None]


# ------------------------------------------------------------------------------------------- callers
@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the guard authenticated it: `kind` "key" (a public API key), "internal" (the
    internal token) or "anonymous" (no keys configured); `id` a digest prefix of the key (never the key) or
    the client's address."""

    kind: str
    id: str


CALLER_STATE = "plugsearch_caller"
"""Key of the `Caller` in the ASGI scope's `state` (`request.state.plugsearch_caller`)."""
COST_STATE = "plugsearch_cost"
"""Key a handler sets in the scope's `state` to say how many cost units its request was (default 1)."""


def key_id(digest: bytes) -> str:
    return digest.hex()[:16]


def address_id(scope: Mapping[str, Any]) -> str:
    client = scope.get("client")
    return hashlib.sha256(str(client[0] if client else "").encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------- rate limits
class TokenBucket:
    """In-process token buckets, one per caller id (least recently used forgotten past `max_callers`)."""

    def __init__(self, rate: float, burst: float, *, max_callers: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self.max_callers = max_callers
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, caller: str, cost: float) -> float:
        """Spend `cost` units: 0.0 when granted, else the seconds until they would be."""
        now = self.clock()
        tokens, at = self._buckets.get(caller, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0 if tokens >= cost else (cost - tokens) / self.rate
        self._buckets[caller] = (tokens - cost if tokens >= cost else tokens, now)
        self._buckets.move_to_end(caller)
        while len(self._buckets) > self.max_callers:
            self._buckets.popitem(last=False)
        return wait


# KEYS[1] bucket; ARGV rate, burst, cost. Redis's own clock, so replicas with skewed clocks agree.
_TAKE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= cost then tokens = tokens - cost else wait = (cost - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""


class RateLimiter:
    """Cost units per caller per second. `take` answers the seconds to wait (0.0 = granted). With a Redis
    URL the buckets live there (shared by every replica); a Redis failure falls back to this process's
    buckets for that request (logged), so an outage never refuses or fails requests by itself."""

    def __init__(self, rate: float, burst: float, *, redis_url: str | None = None, namespace: str = "searcher",
                 timeout_s: float = 0.5) -> None:
        self.rate = rate
        self.burst = burst
        self.namespace = namespace
        self.local = TokenBucket(rate, burst)
        self._redis: Any = None
        self._script: Any = None
        if redis_url:
            import redis.asyncio as aioredis

            self._redis = aioredis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry_on_timeout=False)
            self._script = self._redis.register_script(_TAKE_SCRIPT)

    async def take(self, caller: str, cost: float) -> float:
        if cost > self.burst:
            return math.inf  # never affordable: the request's own bound should have refused it
        if self._script is not None:
            try:
                return float(await self._script(keys=[f"plugsearch:ratelimit:{self.namespace}:{caller}"],
                                                args=[self.rate, self.burst, cost]))
            except Exception as exc:  # Redis down or slow: this process's buckets stand in
                logger.warning("rate limit store unreachable, using local buckets: %s", type(exc).__name__)
        return self.local.take(caller, cost)

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
