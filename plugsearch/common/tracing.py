"""Tracing with OpenTelemetry: off by default, switched on by the standard `OTEL_*` variables.

An entrypoint calls `setup_tracing(service)` once (each service's worker, the trainer). Tracing is on when
`OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`, or both: `otlp,console`), or when an OTLP
endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`: the exporter is then
`otlp`); `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` keep it off. The OTLP exporter speaks
http/protobuf (port 4318; `OTEL_EXPORTER_OTLP_*` as the SDK reads them: endpoint, headers, timeout,
compression); the sampler is the SDK's (`OTEL_TRACES_SAMPLER`, default parent-based always-on, so a caller's
sampling decision is kept); `service.name` is `plugsearch-<service>` unless `OTEL_SERVICE_NAME` (or
`OTEL_RESOURCE_ATTRIBUTES`) names it.

Off, nothing is set up: `span()` hands back one shared no-op context (no SDK, no context switch, no
allocation), servers read no `traceparent` and clients send none. On, the guard (`plugsearch.common.guard`) opens
a server span per request that continues the caller's W3C `traceparent`, every `ServiceClient` call is a
client span whose context goes out in `traceparent` (beside `X-Request-ID`), and the code marks its own
steps with `span()`. A process that never called `setup_tracing` (the public client inside someone's app)
follows that app's OpenTelemetry set-up, if it has one: its calls carry the app's current context.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode

from plugsearch.version import __version__

logger = logging.getLogger(__name__)

TRACER_NAME = "plugsearch"
EXPORTERS = ("otlp", "console")
SUPPORTED_OTLP_PROTOCOL = "http/protobuf"

Attributes = Mapping[str, str | bool | int | float | list[str] | list[int] | list[float]]

_OFF: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)
"""What `span()` returns while tracing is off: reusable, enters to a span whose methods do nothing."""


class _State:
    """Whether this process set tracing up (`configured`), and the tracer when it is on."""

    configured = False
    tracer: trace.Tracer | None = None
    provider: Any = None  # the SDK's TracerProvider (`flush` at each service's shutdown)


_state = _State()


class TracingConfigError(RuntimeError):
    """The OTEL_* variables ask for something this install cannot do (raised at start-up)."""


def _env(name: str) -> str:
    return os.environ.get(name, "").strip()


def requested_exporters(environ: Mapping[str, str] | None = None) -> list[str]:
    """The exporters the environment asks for ([] = tracing off), in order, deduplicated."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip() or \
            env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        return ["otlp"] if endpoint else []
    if "none" in names:
        return []
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER: unknown exporter(s) {', '.join(unknown)} "
                                 f"(this install has {', '.join(EXPORTERS)}, or none)")
    return list(dict.fromkeys(names))


def setup_tracing(service: str) -> bool:
    """Set tracing up for this process from the environment (once; later calls return the first answer).
    Returns whether it is on. Raises `TracingConfigError` when the environment asks for tracing this
    install cannot give (no SDK: `pip install 'plugsearch[otel]'`; OTLP over gRPC)."""
    if _state.configured:
        return _state.tracer is not None
    exporters = requested_exporters()
    if exporters:
        _start_sdk(service, exporters)
    _state.configured = True
    return _state.tracer is not None


def _start_sdk(service: str, exporters: list[str]) -> None:
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError as exc:
        raise TracingConfigError("tracing is switched on (OTEL_* variables) but the OpenTelemetry SDK is not "
                                 "installed: pip install 'plugsearch[otel]'") from exc
    resource = Resource.create({SERVICE_VERSION: __version__})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: f"plugsearch-{service}"}))
    provider = TracerProvider(resource=resource)
    for name in exporters:
        if name == "otlp":
            provider.add_span_processor(BatchSpanProcessor(_otlp_exporter()))
        else:
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    use_provider(provider)
    logger.info("tracing on: service %s, exporters %s", resource.attributes.get(SERVICE_NAME), ",".join(exporters))


def _otlp_exporter() -> Any:
    protocol = (_env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
                or SUPPORTED_OTLP_PROTOCOL).lower()
    if protocol != SUPPORTED_OTLP_PROTOCOL:
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol}: this install exports OTLP over "
                                 f"{SUPPORTED_OTLP_PROTOCOL} only (a collector's port 4318)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: the OTEL_EXPORTER_OTLP_* variables


def use_provider(provider: Any) -> None:
    """Trace into `provider` (an SDK TracerProvider) from now on: `setup_tracing`'s last step."""
    trace.set_tracer_provider(provider)
    _state.provider = provider
    _state.tracer = provider.get_tracer(TRACER_NAME, __version__)
    _state.configured = True


def flush(timeout_s: float = 5.0) -> None:
    """Export the spans still pending (at most `timeout_s`): each service at shutdown."""
    if _state.provider is not None:
        _state.provider.force_flush(int(timeout_s * 1000))


def enabled() -> bool:
    return _state.tracer is not None


def fastapi_options() -> dict[str, Any]:
    """`FastAPI(...)` keywords that switch off FastAPI's own telemetry where it has some (newer releases
    trace every request, its dependencies and endpoint, and count requests, into the global providers):
    the guard's server span and the services' Prometheus metrics are the ones kept, so a request is
    one span, not two."""
    import inspect

    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False,
                          "auto_configure": False}}


# ------------------------------------------------------------------------------------------------ spans
def span(name: str, attributes: Attributes | None = None, *, kind: SpanKind = SpanKind.INTERNAL
         ) -> AbstractContextManager[Span]:
    """A span around a step of this process, current inside the block (its children nest under it); an
    exception leaving the block is recorded and sets the span's status to error. Off: a no-op."""
    tracer = _state.tracer
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name, kind=kind, attributes=attributes)


def client_span(name: str, headers: MutableMapping[str, str], attributes: Attributes | None = None
                ) -> AbstractContextManager[Span]:
    """A client span around one outgoing call; its context goes into `headers` (`traceparent`). Never made
    current: a stream read across tasks cannot leave a context attached to the wrong one. Off: nothing, no
    header; in a process that never set tracing up (the public client inside someone's app), the app's
    current context goes out, if its own OpenTelemetry set-up made one."""
    if _state.tracer is None:
        if not _state.configured:
            propagate.inject(headers)
        return _OFF
    return _client_span(_state.tracer, name, headers, attributes)


@contextmanager
def _client_span(tracer: trace.Tracer, name: str, headers: MutableMapping[str, str],
                 attributes: Attributes | None) -> Iterator[Span]:
    current = tracer.start_span(name, kind=SpanKind.CLIENT, attributes=attributes)
    try:
        propagate.inject(headers, context=trace.set_span_in_context(current))
        yield current
    except BaseException as exc:
        if isinstance(exc, Exception):
            current.record_exception(exc)
        current.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        raise
    finally:
        current.end()


def server_span(scope: Mapping[str, Any], request_id: str) -> AbstractContextManager[Span]:
    """The span of one request to a service (the guard opens it): continues the caller's `traceparent`,
    named `<METHOD> <path>` (`finish_server_span` renames it after the route). Off: a no-op."""
    tracer = _state.tracer
    if tracer is None:
        return _OFF
    carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope.get("headers", ())
               if name in (b"traceparent", b"tracestate", b"baggage")}
    method, path = scope.get("method", ""), scope.get("path", "")
    return tracer.start_as_current_span(
        f"{method} {path}", context=propagate.extract(carrier) if carrier else None, kind=SpanKind.SERVER,
        attributes={"http.request.method": method, "url.path": path, "url.scheme": scope.get("scheme", "http"),
                    "plugsearch.request_id": request_id})


def finish_server_span(current: Span, scope: Mapping[str, Any], status: int) -> None:
    """The route and the final status on the request's span (5xx: an error)."""
    if not current.is_recording():
        return
    route = getattr(scope.get("route"), "path", None)
    if route:
        current.update_name(f"{scope.get('method', '')} {route}")
        current.set_attribute("http.route", route)
    current.set_attribute("http.response.status_code", status)
    if status >= 500:
        current.set_status(Status(StatusCode.ERROR))


def answered(current: Span, status: int) -> None:
    """A client span's answer: its status code (4xx and 5xx: an error)."""
    if current.is_recording():
        current.set_attribute("http.response.status_code", status)
        if status >= 400:
            current.set_status(Status(StatusCode.ERROR))
            current.set_attribute("error.type", str(status))


def failed(current: Span, error_type: str) -> None:
    """A client span that got no answer (refused, reset, timed out)."""
    if current.is_recording():
        current.set_status(Status(StatusCode.ERROR, error_type))
        current.set_attribute("error.type", error_type)


def annotate(attributes: Attributes) -> None:
    """Add attributes to the current span (e.g. the search's outcome). Off: nothing."""
    if _state.tracer is None:
        return
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


def current_trace_id() -> str | None:
    """The current trace's id (32 hex digits), or None outside a trace."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None
