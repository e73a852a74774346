"""Result caches: Redis when a URL is configured, an in-process LRU otherwise.

A Redis failure never fails a request: the cache is bypassed, the error logged and counted, and the
caller recomputes. An entry that does not decode (or, with `get_model`, does not validate) is a miss,
counted as `corrupt`: whoever wrote it, it is never served and is replaced by the next result. Keys are
namespaced SHA-256 digests of a canonical JSON payload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from plugsearch.common.metrics import ServiceMetrics

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

logger = logging.getLogger(__name__)


def cache_key(namespace: str, payload: Any) -> str:
    canonical = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return f"plugsearch:{namespace}:{hashlib.sha256(canonical.encode()).hexdigest()}"


class Cache(Protocol):
    kind: str

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes) -> None: ...

    async def aclose(self) -> None: ...


class MemoryCache:
    kind = "memory"

    def __init__(self, max_items: int = 100_000, ttl_s: int | None = None) -> None:
        self.max_items = max_items
        self.ttl_s = ttl_s
        self._data: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (monotonic expiry, value)

    async def get(self, key: str) -> bytes | None:
        expires, value = self._data.get(key, (math.inf, None))
        if value is None or expires < time.monotonic():
            self._data.pop(key, None)
            return None
        self._data.move_to_end(key)
        return value

    async def set(self, key: str, value: bytes) -> None:
        if self.max_items <= 0:
            return
        self._data[key] = (time.monotonic() + self.ttl_s if self.ttl_s else math.inf, value)
        self._data.move_to_end(key)
        while len(self._data) > self.max_items:
            self._data.popitem(last=False)

    async def aclose(self) -> None:
        self._data.clear()


class RedisCache:
    kind = "redis"

    def __init__(self, url: str, ttl_s: int | None = None, timeout_s: float = 0.5) -> None:
        import redis.asyncio as aioredis

        self.ttl_s = ttl_s
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        retry_on_timeout=False, health_check_interval=30)

    async def get(self, key: str) -> bytes | None:
        value = await self._redis.get(key)
        if value is None:
            return None
        return value.encode() if isinstance(value, str) else bytes(value)

    async def set(self, key: str, value: bytes) -> None:
        await self._redis.set(key, value, ex=self.ttl_s or None)

    async def aclose(self) -> None:
        await self._redis.aclose()


class ResultCache:
    """What services use: JSON get/set that counts hits/misses and bypasses a broken backend."""

    def __init__(self, backend: Cache, *, name: str, metrics: ServiceMetrics | None = None) -> None:
        self.backend = backend
        self.name = name
        self.metrics = metrics

    def _count(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.cache_events.labels(self.name, event).inc()

    async def _get(self, key: str, decode: Callable[[bytes], T]) -> T | None:
        try:
            raw = await self.backend.get(key)
        except Exception as exc:  # Redis down or slow: bypass, never fail the request
            self._count("error")
            logger.warning("cache %s get failed, bypassing: %s", self.name, type(exc).__name__)
            return None
        if raw is None:
            self._count("miss")
            return None
        try:
            value = decode(raw)
        except ValueError:  # not JSON, or not the model (UnicodeDecodeError, ValidationError are ValueErrors)
            self._count("corrupt")
            logger.warning("cache %s: ignoring a corrupt entry under %s", self.name, key)
            return None
        self._count("hit")
        return value

    async def get_json(self, key: str) -> Any | None:
        return await self._get(key, json.loads)

    async def get_model(self, key: str, model: type[M]) -> M | None:
        """The entry as `model`, or None when absent, unreadable or not a valid `model`."""
        return await self._get(key, model.model_validate_json)

    async def set_json(self, key: str, value: Any) -> None:
        try:
            await self.backend.set(key, json.dumps(value, ensure_ascii=False).encode())
        except Exception as exc:
            self._count("error")
            logger.warning("cache %s set failed, bypassing: %s", self.name, type(exc).__name__)

    async def aclose(self) -> None:
        await self.backend.aclose()


def make_cache(redis_url: str | None, *, name: str, ttl_s: int | None = None, max_items: int = 100_000,
               metrics: ServiceMetrics | None = None) -> ResultCache:
    backend: Cache = RedisCache(redis_url, ttl_s=ttl_s) if redis_url else MemoryCache(max_items, ttl_s)
    return ResultCache(backend, name=name, metrics=metrics)
