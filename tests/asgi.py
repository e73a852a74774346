"""Run a real app in-process: lifespan started, requests through httpx's ASGI transport; or served by
uvicorn on a free localhost port in a background thread (for clients that open real connections)."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import httpx
from fastapi import FastAPI


@asynccontextmanager
async def app_client(app: FastAPI, base_url: str = "http://testserver") -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=base_url, timeout=60) as client:
            yield client


@contextmanager
def served_in_thread(app: FastAPI, timeout_s: float = 30.0) -> Iterator[str]:
    """`app` (lifespan included) served by uvicorn on 127.0.0.1:<free port> in a thread, as `serve` runs a
    service (its uvicorn options, the guarded HTTP protocol) when the app has plugsearch settings; yields
    its URL."""
    import uvicorn

    from plugsearch.common.process import uvicorn_options
    from plugsearch.common.settings import ServiceSettings
    from plugsearch.common.workers import free_port

    port = free_port()
    settings = getattr(app.state, "settings", None)
    options = uvicorn_options(settings) if isinstance(settings, ServiceSettings) else {}
    options.update(host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(uvicorn.Config(app, **options))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the app did not start on port {port}")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_s)
