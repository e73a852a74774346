"""Tracing in tests: spans captured in memory (the SDK's `InMemorySpanExporter`), or tracing set up and off,
each for one block; what `plugsearch.common.tracing` held before comes back afterwards."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plugsearch.common import tracing


@contextmanager
def _state(configured: bool, tracer: object, provider: object) -> Iterator[None]:
    state = tracing._state
    saved = (state.configured, state.tracer, state.provider)
    state.configured, state.tracer, state.provider = configured, tracer, provider  # type: ignore[assignment]
    try:
        yield
    finally:
        state.configured, state.tracer, state.provider = saved


@contextmanager
def captured_spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on inside the block, every finished span kept by the exporter it yields."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with _state(True, provider.get_tracer(tracing.TRACER_NAME), provider):
        yield exporter
    provider.shutdown()


@contextmanager
def tracing_off() -> Iterator[None]:
    """A process that set tracing up with it off (the default of every service)."""
    with _state(True, None, None):
        yield


@contextmanager
def never_set_up() -> Iterator[None]:
    """A process that never set tracing up (the public client in someone else's app)."""
    with _state(False, None, None):
        yield


def by_name(spans: Sequence[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def parent_of(span: ReadableSpan, spans: Sequence[ReadableSpan]) -> ReadableSpan | None:
    """The span's parent among `spans` (None for a root or a remote parent)."""
    if span.parent is None:
        return None
    return next((s for s in spans if s.context is not None and s.context.span_id == span.parent.span_id), None)
