"""The identity of the index the retriever serves, for the searcher's cache keys.

After a re-index a shared Redis would otherwise serve documents of the old corpus for the cache's whole TTL, and
after a document is deleted a cached answer would still hold it. The retriever's `index_id` moves with every
change (a re-index, every change acknowledged while it serves). Before the searcher answers from its cache it reads
the identity as it is now (`fresh`: `GET /index`, which applies every change any retriever worker acknowledged
first), and the key holds it: a search that starts after a change was acknowledged never gets an answer cached
before it. One read serves every search that arrived before it began (one read at a time, a few hundred
microseconds on one machine). The rest of what the retriever says of its index (methods, encoder, corpus, changes)
is read from `GET /version` at most every `ttl_s` seconds. While no identity is known, searches bypass the cache
instead of guessing.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time

import orjson

from plugsearch.common.errors import ServiceError
from plugsearch.common.http import ServiceClient

logger = logging.getLogger(__name__)


class IndexIdentity:
    """`await current()` -> the retriever's `index_id` (refreshed after `ttl_s`), or None when unknown;
    `await served()` -> the methods it serves and its dense encoder, read from the same `/version`."""

    def __init__(self, client: ServiceClient, *, ttl_s: float = 10.0, timeout_s: float = 2.0) -> None:
        self.client = client
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._value: str | None = None
        self._details: dict[str, object] = {}
        self._checked = float("-inf")
        self._lock = asyncio.Lock()
        self._reads = 0
        self._read_lock = asyncio.Lock()
        self._fresh: str | None = None
        self._no_route = False
        """An older retriever without `GET /index`: `fresh` is `current`."""

    async def fresh(self) -> str | None:
        """The retriever's `index_id` now, from a read that began after this call (calls that arrive while one runs
        share the next); None when the retriever cannot say (the caller then bypasses the cache)."""
        if self._no_route:
            return await self.current()
        wanted = self._reads + 1
        async with self._read_lock:
            if self._reads >= wanted:  # a read that began after this call arrived has finished meanwhile
                return self._fresh
            self._reads += 1
            try:
                response = await self.client.request("GET", "/index", timeout=self.timeout_s, retries=0)
                value = response.json().get("index_id")
                self._fresh = value if isinstance(value, str) else None
            except ServiceError as exc:
                if exc.upstream_status in (404, 405):
                    self._no_route = True
                    return await self.current()
                logger.warning("cannot read the retriever's index identity (%s): this search bypasses the cache",
                               exc.message)
                self._fresh = None
            except (ValueError, AttributeError):
                self._fresh = None
            if self._fresh is not None and self._fresh != self._value:
                self._value = self._fresh
            return self._fresh

    async def current(self) -> str | None:
        if time.monotonic() - self._checked < self.ttl_s:
            return self._value
        async with self._lock:  # one refresh at a time; the others wait for it and read its answer
            if time.monotonic() - self._checked >= self.ttl_s:
                await self._refresh()
        return self._value

    async def served(self) -> tuple[list[str] | None, str | None]:
        """(methods, dense encoder) of the retriever as its `/version` last said, (None, None) while unknown."""
        await self.current()
        methods, encoder = self._details.get("methods"), self._details.get("encoder")
        return ([str(m) for m in methods] if isinstance(methods, list) else None,
                encoder if isinstance(encoder, str) else None)

    async def details(self) -> dict[str, object]:
        """Everything the retriever's `/version` last said of its index ({} while unknown): `corpus_checksum`,
        `methods`, `encoder`, `dense_index`, ..."""
        await self.current()
        return dict(self._details)

    async def _refresh(self) -> None:
        try:
            response = await self.client.request("GET", "/version", timeout=self.timeout_s, retries=0)
            details = response.json().get("details") or {}
        except (ServiceError, ValueError, AttributeError) as exc:
            # keep the last identity (the retriever may be restarting); retry on the next search
            logger.warning("cannot read the retriever's index identity (%s); %s", getattr(exc, "message", exc),
                           "keeping the last one" if self._value else "searches bypass the cache meanwhile")
            self._checked = time.monotonic() - max(0.0, self.ttl_s - 1.0)  # ask again in a second
            return
        if not isinstance(details, dict) or details.get("loading"):
            return  # not ready yet: nothing to identify, ask again on the next search
        value = details.get("index_id")
        if not isinstance(value, str):  # an older retriever: everything it says about its index
            value = "details-" + hashlib.sha256(orjson.dumps(details, option=orjson.OPT_SORT_KEYS)).hexdigest()[:20]
        if value != self._value:
            logger.info("retriever index identity: %s (was %s)", value, self._value)
        self._value = value
        self._details = details
        self._checked = time.monotonic()
