"""Tracing across real processes: the searcher, the retriever (bm25s over the shared corpus) and the policy
LLM (`tests.support.fake_llm` answering as the scripted policy) export over OTLP/HTTP to a real
`plugsearch-collector`, each with only the standard OTEL_* variables set.

- one `/search` is one trace: one root (the searcher's request), every other span's parent in the trace,
  spans from all three processes, each process's server span under the searcher's client span that called it,
  and the request id forwarded beside the trace context;
- a caller's `traceparent` is continued (its trace id, its span as the parent), and a caller that does not
  sample gets no trace;
- a searcher that is stopped exports what it still holds first.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugsearch.common.workers import free_port
from tests.support.services import (
    ensure_bm25_index,
    python_process,
    retriever_process,
    scripted_policy_process,
    searcher_process,
)

pytestmark = pytest.mark.e2e

QUESTION = "who wrote the novel the call of the wild"
SERVICES = {"plugsearch-searcher", "plugsearch-retriever", "plugsearch-fake-llm"}


@dataclass
class Traced:
    searcher: str
    collector: str
    retriever: str
    policy: str
    logs: Path

    def trace(self, trace_id: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.collector}/v1/traces/{trace_id}", timeout=5)
        return response.json()["spans"] if response.status_code == 200 else []

    def wait_for(self, trace_id: str, done: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 30.0
                 ) -> list[dict[str, Any]]:
        """The trace's spans once `done` says they are all there (each process exports on its own)."""
        deadline = time.monotonic() + timeout_s
        spans: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if spans and done(spans):
                return spans
            time.sleep(0.2)
        raise AssertionError(f"trace {trace_id} incomplete after {timeout_s} s: {[s['name'] for s in spans]}")


@pytest.fixture(scope="module")
def traced(data_dir: Path, var_dir: Path) -> Iterator[Traced]:
    corpus = data_dir / "corpus" / "combined.jsonl"
    index = ensure_bm25_index(corpus, var_dir)
    logs = var_dir / "logs"
    port = free_port()
    collector = f"http://127.0.0.1:{port}"
    with python_process(["-m", "plugsearch.collector", "--port", str(port)], f"{collector}/health/ready",
                        logs / "tracing_collector.log"), pytest.MonkeyPatch.context() as env:
        # what an operator sets: the standard variables only (batches every 100 ms to keep the test short)
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        with retriever_process(corpus, index, logs / "tracing_retriever.log") as retriever, \
                scripted_policy_process(logs / "tracing_policy.log") as policy, \
                searcher_process(retriever, policy, logs / "tracing_searcher.log", policy_model="scripted-policy",
                                 extra={"cache_enabled": "false"}) as searcher:
            yield Traced(searcher, collector, retriever, policy, logs)


def by_id(spans: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["span_id"]: s for s in spans}


def complete(spans: list[dict[str, Any]]) -> bool:
    """All of one s3 search: its request span (ended last in the searcher) and 4 LLM calls served."""
    return (any(s["name"] == "POST /search" for s in spans)
            and sum(s["name"] == "POST /v1/chat/completions" for s in spans) == 4
            and sum(s["name"] == "retriever.search" for s in spans) == 4)


def check_connected(spans: list[dict[str, Any]], request_id: str) -> dict[str, Any]:
    """One connected trace; returns its root (the searcher's request span)."""
    ids = by_id(spans)
    assert len({s["trace_id"] for s in spans}) == 1
    roots = [s for s in spans if s["parent_span_id"] not in ids]
    assert len(roots) == 1, [r["name"] for r in roots]
    (root,) = roots
    assert root["name"] == "POST /search" and root["service"] == "plugsearch-searcher" and root["kind"] == "server"
    assert root["attributes"]["plugsearch.request_id"] == request_id
    assert {s["service"] for s in spans} == SERVICES
    for span in spans:  # every process's server span hangs under the searcher's call to it
        if span["kind"] == "server" and span is not root:
            caller = ids[span["parent_span_id"]]
            assert caller["kind"] == "client" and caller["service"] == "plugsearch-searcher", (span, caller)
            assert caller["start_ns"] <= span["start_ns"] and span["end_ns"] <= caller["end_ns"] + 5_000_000
    retrieved = [s for s in spans if s["name"] == "POST /retrieve" and s["service"] == "plugsearch-retriever"]
    assert len(retrieved) == 4
    for server in retrieved:
        client = ids[server["parent_span_id"]]
        assert client["name"] == "POST /retrieve" and ids[client["parent_span_id"]]["name"] == "searcher.retrieve"
        assert server["attributes"]["plugsearch.request_id"] == request_id  # X-Request-ID kept beside the trace
    served = [s for s in spans if s["service"] == "plugsearch-fake-llm"]
    assert len(served) == 4
    for server in served:
        client = ids[server["parent_span_id"]]
        chat = ids[client["parent_span_id"]]
        assert client["name"] == "POST /chat/completions" and chat["name"] == "chat scripted-policy"
        assert ids[chat["parent_span_id"]]["name"] == "searcher.policy_step"
    return root


def test_one_search_is_one_trace_across_three_processes(traced: Traced) -> None:
    response = httpx.post(f"{traced.searcher}/search", json={"question": QUESTION, "mode": "s3"}, timeout=60)
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    # the searcher does not say its trace id; the collector's list finds the trace by its request id
    deadline = time.monotonic() + 30
    trace_id = None
    while trace_id is None and time.monotonic() < deadline:
        for summary in httpx.get(f"{traced.collector}/v1/traces", timeout=5).json():
            spans = traced.trace(summary["trace_id"])
            if any(s["attributes"].get("plugsearch.request_id") == request_id and s["name"] == "POST /search"
                   for s in spans):
                trace_id = summary["trace_id"]
        time.sleep(0.2)
    assert trace_id is not None, "no trace with the search's request id"
    spans = traced.wait_for(trace_id, complete)
    root = check_connected(spans, request_id)
    assert root["parent_span_id"] is None  # nobody's trace to continue: it starts one


def test_a_callers_traceparent_is_continued(traced: Traced) -> None:
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = httpx.post(f"{traced.searcher}/search", json={"question": QUESTION, "mode": "s3"},
                          headers={"traceparent": f"00-{trace_id}-{parent}-01", "X-Request-ID": "caller-rid-1"},
                          timeout=60)
    assert response.status_code == 200 and response.headers["x-request-id"] == "caller-rid-1"
    spans = traced.wait_for(trace_id, complete)
    root = check_connected(spans, "caller-rid-1")
    assert root["parent_span_id"] == parent and root["trace_id"] == trace_id


def test_a_caller_that_does_not_sample_gets_no_trace(traced: Traced) -> None:
    unsampled, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    response = httpx.post(f"{traced.searcher}/search", json={"question": QUESTION, "mode": "s3"},
                          headers={"traceparent": f"00-{unsampled}-{parent}-00"}, timeout=60)
    assert response.status_code == 200
    # a sampled search after it: once its trace is all in, anything of the first would be too
    sampled = uuid.uuid4().hex
    httpx.post(f"{traced.searcher}/search", json={"question": QUESTION, "mode": "s3"},
               headers={"traceparent": f"00-{sampled}-{parent}-01"}, timeout=60).raise_for_status()
    traced.wait_for(sampled, complete)
    assert traced.trace(unsampled) == []


def test_a_stopped_searcher_exports_its_last_spans_first(traced: Traced) -> None:
    """Batches every minute: only the flush at shutdown can deliver this search's spans in time."""
    trace_id = uuid.uuid4().hex
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
        with searcher_process(traced.retriever, traced.policy, traced.logs / "tracing_searcher_stopped.log",
                              policy_model="scripted-policy", extra={"cache_enabled": "false"}) as searcher:
            response = httpx.post(f"{searcher}/search", json={"question": QUESTION, "mode": "naive"},
                                  headers={"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"}, timeout=60)
            assert response.status_code == 200
            time.sleep(0.5)
            assert not [s for s in traced.trace(trace_id) if s["service"] == "plugsearch-searcher"]
    # stopped (SIGTERM): its spans are at the collector
    spans = traced.wait_for(trace_id, lambda found: any(s["name"] == "searcher.search" for s in found), timeout_s=10)
    assert {"POST /search", "searcher.search", "searcher.retrieve"} <= {s["name"] for s in spans}
