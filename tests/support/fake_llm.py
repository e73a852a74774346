"""The fake OpenAI-compatible chat-completions server: configurable latency, a scripted responder.

Used by api/e2e tests and benchmarks in place of vLLM or llama.cpp. It speaks the same wire format
(`POST /v1/chat/completions`, streamed with `stream: true`; `GET /v1/models`), so the real
`OpenAIChatClient` is exercised. In-process tests use `create_fake_llm_app` (a FastAPI app whose state
records the calls); as a process (`main`) it is a bare ASGI app around the same answers, so that a stand-in
takes as little of a small machine's CPU as possible while a bench measures the services beside it.

    python -m tests.support.fake_llm --port 9100 --latency-ms 100 --responder tests.support.fake_policy:respond
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plugsearch.common import tracing

Responder = Callable[[dict[str, Any]], "str | Awaitable[str]"]


def last_user(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages", [])):
        if message.get("role") == "user":
            return str(message.get("content", ""))
    return ""


def echo(body: dict[str, Any]) -> str:
    """Answers with the first line of the last user message (deterministic)."""
    return last_user(body).strip().splitlines()[0][:200] if last_user(body).strip() else ""


def yes(body: dict[str, Any]) -> str:
    return "yes"


def no(body: dict[str, Any]) -> str:
    return "no"


def load_responder(spec: str) -> Responder:
    """`module:function` or a preset name from this module (echo, yes, no)."""
    if ":" not in spec:
        spec = f"{__name__}:{spec}"
    module, _, attr = spec.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise ValueError(f"{spec} is not callable")
    return fn  # type: ignore[no-any-return]


def create_fake_llm_app(responder: Responder = echo, *, latency_s: float = 0.0, model: str = "fake-llm",
                        fail_status: int | None = None, record: bool = True) -> FastAPI:
    """`app.state.calls` counts completions, `app.state.bodies` keeps each request body (unless `record`
    is off: benchmarks), `app.state.fail_status` (settable) makes every call fail."""
    app = FastAPI(title="fake OpenAI-compatible LLM")
    app.state.calls = 0
    app.state.bodies = []
    app.state.latency_s = latency_s
    app.state.fail_status = fail_status

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model"}]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = orjson.loads(await request.body())
        app.state.calls += 1
        if record:
            app.state.bodies.append(body)
        if app.state.latency_s:
            await asyncio.sleep(app.state.latency_s)
        if app.state.fail_status:
            return JSONResponse({"error": {"message": "injected failure", "type": "fake"}},
                                status_code=app.state.fail_status)
        text = await answer(responder, body)
        if body.get("stream"):
            return StreamingResponse(_chunks(f"fake-{app.state.calls}", body.get("model", model), text),
                                     media_type="text/event-stream")
        return Response(completion(f"fake-{app.state.calls}", body, model, text), media_type="application/json")

    return app


async def answer(responder: Responder, body: dict[str, Any]) -> str:
    text = responder(body)
    if inspect.isawaitable(text):
        text = await text
    return str(text)


def completion(completion_id: str, body: dict[str, Any], model: str, text: str) -> bytes:
    """A whole `chat.completion` (usage: about 4 characters per token)."""
    prompt_tokens = sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4
    completion_tokens = max(1, len(text) // 4)
    return orjson.dumps({
        "id": completion_id, "object": "chat.completion", "created": int(time.time()),
        "model": body.get("model", model),
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    })


Handler = Callable[[str, str, bytes], Awaitable[tuple[int, str, bytes]]]
"""(method, path, body) -> (status, content type, payload)"""


def bare(handle: Handler) -> Any:
    """An ASGI app with no routing or validation layer: `handle` answers every HTTP request (stand-ins that
    take as little CPU as possible)."""
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        request_id = dict(scope.get("headers", ())).get(b"x-request-id", b"-").decode("latin-1")
        with tracing.server_span(scope, request_id) as span:  # with OTEL_* set: joins the caller's trace
            status, media, payload = await handle(scope["method"], scope["path"], raw)
            tracing.finish_server_span(span, scope, status)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", media.encode())]})
        await send({"type": "http.response.body", "body": payload})

    return app


def bare_app(responder: Responder, *, latency_s: float = 0.0, model: str = "fake-llm", slots: int = 0) -> Any:
    """The same answers as `create_fake_llm_app`, bare (what `main` serves); `slots` > 0: at most that many
    completions at once, the others queue (llama.cpp's server serves one at a time)."""
    models = orjson.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})
    calls = 0
    gate = asyncio.Semaphore(slots) if slots > 0 else None

    async def handle(method: str, path: str, raw: bytes) -> tuple[int, str, bytes]:
        nonlocal calls
        if path == "/v1/chat/completions" and method == "POST":
            body = orjson.loads(raw)
            calls += 1
            if gate is not None:
                async with gate:
                    await asyncio.sleep(latency_s)
            elif latency_s:
                await asyncio.sleep(latency_s)
            text = await answer(responder, body)
            if body.get("stream"):
                chunks = [chunk async for chunk in _chunks(f"fake-{calls}", body.get("model", model), text)]
                return 200, "text/event-stream", b"".join(chunks)
            return 200, "application/json", completion(f"fake-{calls}", body, model, text)
        if path == "/health":
            return 200, "application/json", b'{"status": "ok"}'
        if path == "/v1/models":
            return 200, "application/json", models
        return 404, "application/json", b'{"error": {"message": "not found", "type": "fake"}}'

    return bare(handle)


async def _chunks(completion_id: str, model: str, text: str) -> AsyncIterator[bytes]:
    """The answer as OpenAI's server-sent events: a role chunk, one chunk per word, a finish chunk."""
    def event(delta: dict[str, Any], finish: str | None = None) -> bytes:
        chunk = {"id": completion_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    yield event({"role": "assistant", "content": ""})
    for i, word in enumerate(text.split(" ")):
        yield event({"content": word if i == 0 else " " + word})
    yield event({}, "stop")
    yield b"data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9100)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--responder", default="echo", help="preset (echo, yes, no) or module:function")
    parser.add_argument("--model", default="fake-llm")
    parser.add_argument("--slots", type=int, default=0, help="completions served at once (0: no limit)")
    parser.add_argument("--no-record", action="store_true", help="ignored: the served fake keeps no request bodies")
    args = parser.parse_args(argv)
    app = bare_app(load_responder(args.responder), latency_s=args.latency_ms / 1000, model=args.model,
                   slots=args.slots)
    tracing.setup_tracing("fake-llm")  # off unless OTEL_* variables switch it on
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
