"""`plugsearch-collector`: a small OpenTelemetry trace collector for one box: OTLP over HTTP in (what every
service exports with tracing on), each trace out as a readable tree of span names and durations, once it
is complete (its root span ended and nothing more came for `COLLECTOR_QUIET_S`).

    plugsearch-collector                          # OTLP on 127.0.0.1:4318, trees on stdout
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 plugsearch-stack   # the services export to it

- `POST /v1/traces`: OTLP/HTTP, binary protobuf (`application/x-protobuf`, what the SDK's exporter sends);
- `GET /v1/traces`: the recent traces (root span, duration, services, spans);
  `GET /v1/traces/{trace_id}`: one trace's spans as JSON (ids in hex, times in nanoseconds);
- `COLLECTOR_FILE`: every span also appended there as a JSON line; `COLLECTOR_MAX_TRACES` kept in memory.
It keeps nothing across restarts and forwards nothing: to keep traces, point `OTEL_EXPORTER_OTLP_ENDPOINT`
at your own collector or backend (Jaeger, Tempo, an OpenTelemetry Collector) instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from plugsearch.common.error_handlers import install_error_handlers
from plugsearch.common.errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from plugsearch.common.tracing import fastapi_options

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
KIND_NAMES = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
SHOWN_PREFIXES = ("plugsearch.", "gen_ai.usage.", "http.response.status_code", "error.type")
"""Attributes a printed tree shows beside each span (the request id and the request's own are left out)."""
HIDDEN = frozenset({"plugsearch.request_id"})
ORPHAN_QUIET_S = 6.0
"""A trace without its root here is printed after this long without news (the SDK's batches go out every 5 s)."""


class CollectorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="COLLECTOR_", extra="ignore")

    host: str = Field("127.0.0.1", description="bind address; 0.0.0.0 only inside containers")
    port: int = Field(4318, ge=1, le=65535, description="OTLP/HTTP's usual port")
    file: Path | None = Field(None, description="append every span here as a JSON line")
    print_traces: bool = Field(True, description="print each complete trace as a tree on stdout")
    quiet_s: float = Field(1.0, gt=0, description="a trace is complete this long after its root span ended "
                                                  "and nothing more came")
    max_traces: int = Field(1000, ge=1, description="traces kept in memory (the oldest dropped first)")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    log_level: str = Field("INFO", pattern=r"^(?i)(debug|info|warning|error|critical)$")


# ------------------------------------------------------------------------------------------------ spans
def _value(any_value: Any) -> Any:
    """An OTLP AnyValue as plain Python."""
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    if kind == "bytes_value":
        return any_value.bytes_value.hex()
    return getattr(any_value, kind) if kind else None


def decode_spans(body: bytes) -> list[dict[str, Any]]:
    """The spans of an OTLP `ExportTraceServiceRequest` (binary protobuf), each a flat dict. Raises
    `BadRequest` for a body that is not one."""
    from google.protobuf.message import DecodeError
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except DecodeError as exc:
        raise BadRequest("the body is not an OTLP ExportTraceServiceRequest (binary protobuf)") from exc
    spans = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
        service = str(resource.get("service.name", "unknown"))
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append({
                    "trace_id": s.trace_id.hex(), "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None, "name": s.name,
                    "kind": KIND_NAMES.get(s.kind, str(s.kind)), "service": service,
                    "start_ns": s.start_time_unix_nano, "end_ns": s.end_time_unix_nano,
                    "status": {0: "unset", 1: "ok", 2: "error"}.get(s.status.code, "unset"),
                    "attributes": {kv.key: _value(kv.value) for kv in s.attributes},
                    "events": [e.name for e in s.events]})
    return spans


def render_tree(spans: Sequence[dict[str, Any]]) -> str:
    """A trace as text: one line per span (start offset, duration, name, service where it changes, the
    attributes worth reading), children under their parent in start order."""
    if not spans:
        return ""
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parent_span_id"] if s["parent_span_id"] in by_id else None
        children.setdefault(parent, []).append(s)
    for group in children.values():
        group.sort(key=lambda s: s["start_ns"])
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(s["end_ns"] for s in spans)
    services = sorted({s["service"] for s in spans})
    lines = [f"trace {spans[0]['trace_id']}: {len(spans)} spans, {len(services)} services "
             f"({', '.join(services)}), {(t1 - t0) / 1e6:.1f} ms"]

    def walk(span: dict[str, Any], depth: int, parent_service: str | None) -> None:
        shown = {k: v for k, v in span["attributes"].items() if k.startswith(SHOWN_PREFIXES) and k not in HIDDEN}
        extra = " ".join(f"{k.removeprefix('plugsearch.')}={v}" for k, v in shown.items())
        service = f" [{span['service']}]" if span["service"] != parent_service else ""
        error = " ERROR" if span["status"] == "error" else ""
        lines.append(f"{(span['start_ns'] - t0) / 1e6:9.1f} ms {(span['end_ns'] - span['start_ns']) / 1e6:9.1f} ms  "
                     f"{'  ' * depth}{span['name']}{service}{error}{'  ' + extra if extra else ''}")
        for child in children.get(span["span_id"], []):
            walk(child, depth + 1, span["service"])

    for root in children.get(None, []):
        walk(root, 0, None)
    return "\n".join(lines)


@dataclass
class _Trace:
    spans: list[dict[str, Any]] = field(default_factory=list)
    last_seen: float = 0.0
    printed: int = 0
    """spans already printed (a trace is printed again when more arrive)"""

    def has_root(self) -> bool:
        """Whether the trace's first span is here (spans arrive when they end: a root ends last)."""
        return any(s["parent_span_id"] is None for s in self.spans)


class TraceStore:
    """The recent traces in memory (by trace id, oldest dropped first), and which are complete."""

    def __init__(self, max_traces: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_traces = max_traces
        self.clock = clock
        self.traces: OrderedDict[str, _Trace] = OrderedDict()

    def add(self, spans: Sequence[dict[str, Any]]) -> None:
        now = self.clock()
        for span in spans:
            trace = self.traces.get(span["trace_id"])
            if trace is None:
                trace = self.traces[span["trace_id"]] = _Trace()
            trace.spans.append(span)
            trace.last_seen = now
        while len(self.traces) > self.max_traces:
            self.traces.popitem(last=False)

    def spans(self, trace_id: str) -> list[dict[str, Any]] | None:
        trace = self.traces.get(trace_id.lower())
        return None if trace is None else sorted(trace.spans, key=lambda s: s["start_ns"])

    def complete(self, quiet_s: float, orphan_quiet_s: float = ORPHAN_QUIET_S) -> list[str]:
        """Traces with spans not yet handed out that look complete: their root span is here and nothing came
        for `quiet_s`; a trace continued from a caller that exports elsewhere (no root here) after
        `orphan_quiet_s`. Marks them handed out (more spans later: handed out again)."""
        now = self.clock()
        ready = []
        for trace_id, trace in self.traces.items():
            quiet = now - trace.last_seen
            if len(trace.spans) > trace.printed and quiet >= quiet_s and (trace.has_root() or quiet >= orphan_quiet_s):
                trace.printed = len(trace.spans)
                ready.append(trace_id)
        return ready

    def summary(self) -> list[dict[str, Any]]:
        out = []
        for trace_id, trace in reversed(self.traces.items()):
            ids = {s["span_id"] for s in trace.spans}
            roots = [s for s in trace.spans if s["parent_span_id"] not in ids]
            root = min(roots, key=lambda s: s["start_ns"])
            out.append({"trace_id": trace_id, "root": root["name"], "spans": len(trace.spans),
                        "services": sorted({s["service"] for s in trace.spans}),
                        "duration_ms": (max(s["end_ns"] for s in trace.spans)
                                        - min(s["start_ns"] for s in trace.spans)) / 1e6})
        return out


# ------------------------------------------------------------------------------------------------- app
def create_app(settings: CollectorSettings, *, out: Callable[[str], None] | None = None) -> FastAPI:
    """The collector's app; `out` receives each printed tree (default: stdout, when `print_traces`)."""
    store = TraceStore(settings.max_traces)
    write = out or _stdout

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        printer = asyncio.create_task(_print_complete(store, settings, write)) if settings.print_traces else None
        try:
            yield
        finally:
            if printer is not None:
                printer.cancel()
                await asyncio.gather(printer, return_exceptions=True)

    app = FastAPI(title="plugsearch collector", lifespan=lifespan, **fastapi_options())  # never traces itself
    app.state.store = store
    install_error_handlers(app)

    @app.post("/v1/traces")
    async def export(request: Request) -> Response:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != PROTOBUF:
            raise UnsupportedMediaType(f"OTLP/HTTP traces as {PROTOBUF} only (got {media or 'none'})")
        body = await _read(request, settings.max_body_bytes)
        spans = decode_spans(body)
        store.add(spans)
        if settings.file is not None and spans:
            await asyncio.to_thread(_append, settings.file, spans)
        # an empty ExportTraceServiceResponse: all accepted
        return Response(b"", media_type=PROTOBUF)

    @app.get("/v1/traces")
    async def recent() -> list[dict[str, Any]]:
        return store.summary()

    @app.get("/v1/traces/{trace_id}")
    async def one(trace_id: str) -> dict[str, Any]:
        spans = store.spans(trace_id)
        if spans is None:
            raise NotFound(f"no trace {trace_id[:64]} here (yet)", param="trace_id")
        return {"trace_id": trace_id.lower(), "spans": spans}

    @app.get("/health/live")
    @app.get("/health/ready")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


async def _read(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if request.headers.get("content-encoding", "").lower() == "gzip":  # OTEL_EXPORTER_OTLP_COMPRESSION=gzip
        import gzip
        import zlib

        try:
            body = gzip.decompress(body)
        except (OSError, EOFError, zlib.error) as exc:
            raise BadRequest("the body is not valid gzip") from exc
        if len(body) > limit:
            raise PayloadTooLarge(f"request body over {limit} bytes once decompressed")
    return body


def _append(path: Path, spans: Sequence[dict[str, Any]]) -> None:
    with path.open("ab") as f:
        f.write(b"".join(orjson.dumps(s) + b"\n" for s in spans))


def _stdout(text: str) -> None:
    sys.stdout.write(text + "\n\n")
    sys.stdout.flush()


async def _print_complete(store: TraceStore, settings: CollectorSettings, write: Callable[[str], None]) -> None:
    while True:
        await asyncio.sleep(min(0.25, settings.quiet_s / 2))
        for trace_id in store.complete(settings.quiet_s):
            write(render_tree(store.spans(trace_id) or []))


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    from plugsearch.common.logging import configure_logging

    parser = argparse.ArgumentParser(prog="plugsearch-collector", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--host", help="default: COLLECTOR_HOST or 127.0.0.1")
    parser.add_argument("--port", type=int, help="default: COLLECTOR_PORT or 4318")
    parser.add_argument("--file", type=Path, help="append every span here as a JSON line (COLLECTOR_FILE)")
    args = parser.parse_args(argv)
    settings = CollectorSettings(**{k: v for k, v in vars(args).items() if v is not None})
    configure_logging(settings.log_level, service="collector")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                access_log=False, log_config=None)


if __name__ == "__main__":
    main()
