"""`plugsearch.common.tracing`: off unless the OTEL_* variables switch it on; when off, no-ops that set no
context and send no header; when on, nested spans, client spans whose context goes out as `traceparent`,
server spans that continue a caller's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags

from plugsearch.common import tracing
from tests.support.tracing import captured_spans, never_set_up, parent_of, tracing_off

OTEL_VARIABLES = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
                  "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES")
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with never_set_up():
        yield monkeypatch


@pytest.mark.parametrize(("env", "expected"), [
    ({}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "console, otlp,console"}, ["console", "otlp"]),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
])
def test_the_environment_switches_tracing_on(env: dict[str, str], expected: list[str]) -> None:
    assert tracing.requested_exporters(env) == expected


def test_an_exporter_this_install_lacks_is_refused() -> None:
    with pytest.raises(tracing.TracingConfigError, match="jaeger"):
        tracing.requested_exporters({"OTEL_TRACES_EXPORTER": "jaeger"})


def test_off_by_default_nothing_is_set_up_and_no_header_goes_out(clean_env: pytest.MonkeyPatch) -> None:
    assert tracing.setup_tracing("searcher") is False
    assert not tracing.enabled()
    assert tracing.span("searcher.search") is tracing._OFF  # the one shared no-op: no SDK, no context change
    assert tracing.server_span({"type": "http", "method": "POST", "path": "/search"}, "rid") is tracing._OFF
    headers: dict[str, str] = {}
    with tracing.client_span("POST /retrieve", headers) as span:
        assert not span.is_recording()
    assert headers == {}
    # even inside a caller's trace: a service with tracing off neither continues nor forwards it
    with _in_remote_trace():
        with tracing.client_span("POST /retrieve", headers):
            pass
    assert headers == {}


def test_otlp_over_grpc_is_refused_at_start_up(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(tracing.TracingConfigError, match="http/protobuf"):
        tracing.setup_tracing("searcher")


@pytest.mark.parametrize(("service_name", "expected"), [(None, "plugsearch-retriever"), ("rag-retriever", "rag-retriever")])
def test_setup_names_the_service_unless_otel_service_name_does(clean_env: pytest.MonkeyPatch, service_name: str | None,
                                                               expected: str) -> None:
    clean_env.setenv("OTEL_TRACES_EXPORTER", "otlp")
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nothing is exported in this test
    if service_name:
        clean_env.setenv("OTEL_SERVICE_NAME", service_name)
    clean_env.setattr(trace, "set_tracer_provider", lambda provider: None)  # leave the process's global alone
    try:
        assert tracing.setup_tracing("retriever") is True
        assert tracing.enabled() and tracing.setup_tracing("other") is True  # once per process
        assert tracing._state.provider.resource.attributes["service.name"] == expected
    finally:
        tracing._state.provider.shutdown()


def test_spans_nest_and_a_client_span_sends_its_own_context() -> None:
    with captured_spans() as exporter:
        with tracing.span("outer", {"plugsearch.k": 8}) as outer:
            outer.set_attribute("plugsearch.documents", 3)
            headers: dict[str, str] = {"X-Request-ID": "r1"}
            with tracing.client_span("POST /retrieve", headers, {"peer.service": "retriever"}) as client:
                tracing.answered(client, 503)
            # the client span was never current: what follows is the outer span's child, not its
            with tracing.span("inner"):
                pass
        spans = exporter.get_finished_spans()
    outer_span, client_span, inner = (next(s for s in spans if s.name == n) for n in ("outer", "POST /retrieve", "inner"))
    assert parent_of(client_span, spans) is outer_span and parent_of(inner, spans) is outer_span
    assert client_span.kind is SpanKind.CLIENT and client_span.attributes is not None
    assert client_span.attributes["http.response.status_code"] == 503
    assert client_span.status.status_code is trace.StatusCode.ERROR
    assert outer_span.attributes == {"plugsearch.k": 8, "plugsearch.documents": 3}
    assert headers["X-Request-ID"] == "r1"
    trace_id, span_id = format(client_span.context.trace_id, "032x"), format(client_span.context.span_id, "016x")
    version, sent_trace, sent_span, flags = headers["traceparent"].split("-")
    assert (version, sent_trace, sent_span) == ("00", trace_id, span_id) and int(flags, 16) & 1  # sampled


def test_a_failure_inside_a_span_is_recorded() -> None:
    with captured_spans() as exporter:
        with pytest.raises(ValueError), tracing.span("searcher.search"):
            raise ValueError("boom")
        (span,) = exporter.get_finished_spans()
    assert span.status.status_code is trace.StatusCode.ERROR and span.events[0].name == "exception"


def scope(headers: dict[str, str], path: str = "/search") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "scheme": "http",
            "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}


def test_a_server_span_continues_the_callers_traceparent() -> None:
    with captured_spans() as exporter:
        request = scope({"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "content-type": "application/json"})
        with tracing.server_span(request, "rid-1") as span:
            assert tracing.current_trace_id() == CALLER_TRACE
            tracing.finish_server_span(span, {**request, "route": type("R", (), {"path": "/search"})()}, 502)
        with tracing.server_span(scope({}), "rid-2"):  # no traceparent: a trace of its own
            pass
        continued, fresh = exporter.get_finished_spans()
    assert format(continued.context.trace_id, "032x") == CALLER_TRACE
    assert continued.parent is not None and continued.parent.is_remote
    assert format(continued.parent.span_id, "016x") == CALLER_SPAN
    assert continued.kind is SpanKind.SERVER and continued.name == "POST /search"
    assert continued.attributes is not None and continued.attributes["plugsearch.request_id"] == "rid-1"
    assert continued.attributes["http.route"] == "/search" and continued.attributes["http.response.status_code"] == 502
    assert continued.status.status_code is trace.StatusCode.ERROR
    assert fresh.parent is None and fresh.context.trace_id != continued.context.trace_id


def test_a_caller_that_is_not_sampling_gets_no_spans() -> None:
    with captured_spans() as exporter:
        with tracing.server_span(scope({"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00"}), "rid"):
            with tracing.span("searcher.search"):
                pass
        assert exporter.get_finished_spans() == ()


def test_the_public_client_carries_a_traced_apps_context() -> None:
    """In an app with its own OpenTelemetry set-up (tracing never set up here), the client's calls carry
    that app's current context, so the searcher's spans join the app's trace."""
    with never_set_up(), _in_remote_trace():
        headers: dict[str, str] = {}
        with tracing.client_span("POST /search", headers):
            pass
    assert headers["traceparent"] == f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"


class _in_remote_trace:
    """The current context inside a caller's sampled span (what an app's own tracing would make current)."""

    def __enter__(self) -> None:
        parent = SpanContext(int(CALLER_TRACE, 16), int(CALLER_SPAN, 16), is_remote=True,
                             trace_flags=TraceFlags(TraceFlags.SAMPLED))
        self.token = context.attach(trace.set_span_in_context(NonRecordingSpan(parent)))

    def __exit__(self, *exc: object) -> None:
        context.detach(self.token)


def test_tracing_off_keeps_the_no_op_even_inside_a_trace() -> None:
    with tracing_off(), _in_remote_trace():
        assert tracing.span("x") is tracing._OFF
        tracing.annotate({"plugsearch.cached": True})  # nothing to annotate, nothing raised
