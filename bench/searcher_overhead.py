"""Searcher overhead and concurrency: what the searcher itself costs per search, and whether it serialises.

The searcher (cache off, `--workers N` processes), the fake LLM answering with the scripted s3 policy (4
policy calls, 4 retrievals per search) and a fake retriever defined here (k synthetic documents at once), so
retrieval costs only the HTTP round trip. 1. Policy answers instantly: searches/s at 1, 16 and 64 concurrent
clients, and the searcher's own time per search (`timings.overhead_ms`), p50 / p99. 2. Policy latency 50 ms:
one search alone (median of 7) vs 64 at once (median of 5 bursts, after an unmeasured one):
`concurrency_slowdown_64` = t(64) / t(1), <= 2 means no serialisation. `searcher_cpu_ms_per_search`: the
searcher's CPU per search in those bursts; `cpu_bound_slowdown_64` = max(t(1), 64 x that) / t(1), what one
busy core forces without any serialisation (a slowdown close to it is CPU-bound). `loop_only_slowdown_64`: the
same on the loop alone, in-process, no HTTP. 3. Tracing (`--tracing`, on by default): the searcher restarted
with tracing off (no OTEL_* variable: the default) and on (OTLP to a sink defined here that counts the spans),
alternately, rounds of searches at 1 and 16 concurrent clients each: its CPU per search, searches/s at 16
and the mean search at 1 for both, `cpu_ms_per_search_on_minus_off` (what tracing on costs a search) and
`spans_per_search`; `off_path_us_per_search`: what the instrumentation costs with tracing off, measured
directly (the no-op's time per call, in-process, times the spans a search makes).

Final line: {"overhead_ms_p50", "overhead_ms_p99", "throughput": {"1", "16", "64"}, "concurrency_slowdown_64",
..., "tracing": {"off": {...}, "on": {...}, "cpu_ms_per_search_on_minus_off", "off_path_us_per_search", ...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, fake_llm_spec  # noqa: E402
from plugsearch.common.procgroup import ProcessGroup, ProcessSpec  # noqa: E402
from plugsearch.common.schemas.base import Document  # noqa: E402
from plugsearch.common.schemas.retriever import RetrieveRequest  # noqa: E402
from plugsearch.common.workers import free_port  # noqa: E402
from tests.support.procs import children, cpu_seconds  # noqa: E402


def serve_fake_retriever(port: int) -> None:
    """`POST /retrieve` answering k synthetic documents at once, served bare (`tests.support.fake_llm.bare`:
    no validation layer), so that the stand-in takes as little of the machine's CPU as possible."""
    import orjson
    import uvicorn

    from tests.support.fake_llm import bare

    async def answer(_method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        if path != "/retrieve":
            return 200, "application/json", b'{"status": "ready"}'
        request = RetrieveRequest.model_validate_json(body)
        results = [[{"id": f"{abs(hash(q)) % 10_000}-{i}", "title": f"Title {i}",
                     "text": f"Passage {i} about {q}. " * 6, "score": 1.0 / i}
                    for i in range(1, request.k + 1)] for q in request.queries]
        return 200, "application/json", orjson.dumps({"method": request.method or "bm25", "results": results,
                                                      "took_ms": 0.0})

    uvicorn.run(bare(answer), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def serve_otlp_sink(port: int) -> None:
    """`POST /v1/traces` (OTLP/HTTP, protobuf): counts the spans and drops them; `GET /count` says how many."""
    import orjson
    import uvicorn
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from tests.support.fake_llm import bare

    spans = 0

    async def answer(method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        nonlocal spans
        if path == "/v1/traces" and method == "POST":
            request = ExportTraceServiceRequest.FromString(body)
            spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
            return 200, "application/x-protobuf", b""
        return 200, "application/json", orjson.dumps({"spans": spans})

    uvicorn.run(bare(answer), host="127.0.0.1", port=port, log_level="warning", access_log=False)


class Servers(ProcessGroup):
    """Fake LLM + fake retriever + searcher; `start_llm` (re)starts the fake LLM with a latency."""

    def __init__(self, workers: int = 1) -> None:
        super().__init__(cwd=REPO)
        self.workers = workers
        self.retriever_port = free_port()
        self.llm_port = free_port()
        self.searcher_port = free_port()
        self.up(ProcessSpec("retriever", [sys.executable, __file__, "--serve-fake-retriever", str(self.retriever_port)],
                            ready_url=f"http://127.0.0.1:{self.retriever_port}/health/ready"), timeout_s=30)

    def start_llm(self, latency_ms: float) -> None:
        """The one fake LLM (`tests.support.fake_llm`, served bare) answering with the scripted s3 policy."""
        self.stop("llm")
        self.up(fake_llm_spec(self.llm_port, latency_ms), timeout_s=30)

    def start_sink(self) -> str:
        """The OTLP sink the searcher exports to with tracing on; returns its URL."""
        port = free_port()
        self.up(ProcessSpec("otlp-sink", [sys.executable, __file__, "--serve-otlp-sink", str(port)],
                            ready_url=f"http://127.0.0.1:{port}/count"), timeout_s=30)
        return f"http://127.0.0.1:{port}"

    def start_searcher(self, extra_env: dict[str, str] | None = None) -> str:
        """(Re)start the searcher; `extra_env`: more variables (the OTEL_* ones of tracing on)."""
        self.stop("searcher")
        env = {
            "SEARCHER_PORT": str(self.searcher_port),
            "SEARCHER_RETRIEVER__URL": f"http://127.0.0.1:{self.retriever_port}",
            "SEARCHER_POLICY__BASE_URL": f"http://127.0.0.1:{self.llm_port}/v1",
            "SEARCHER_POLICY__MAX_CONCURRENCY": "256",
            "SEARCHER_RETRIEVER__MAX_CONNECTIONS": os.environ.get("BENCH_RETRIEVER_CONNECTIONS", "256"),
            "SEARCHER_CACHE_ENABLED": "false",
            "SEARCHER_LOG_LEVEL": "warning",
            "SEARCHER_WORKERS": str(self.workers),
            **(extra_env or {}),
        }
        url = f"http://127.0.0.1:{self.searcher_port}"
        self.up(ProcessSpec("searcher", [sys.executable, "-m", "plugsearch.searcher"], env=env,
                            ready_url=f"{url}/health/live"), timeout_s=30)
        return url


async def run_searches(url: str, n: int, concurrency: int, tag: str) -> tuple[float, list[float]]:
    """n searches with `concurrency` in flight; returns (wall seconds, overhead_ms per search). The client is
    aiohttp's pool: httpx's (httpcore's) pool costs CPU quadratic in open connections, and at
    64 connections this client alone took ~18 ms CPU per search, more than the searcher it measures."""
    import aiohttp

    overheads: list[float] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as client:
        todo = iter(range(n))  # shared by the workers

        async def worker() -> None:
            for i in todo:
                async with client.post("/search", json={"question": f"question {tag} number {i}?"}) as response:
                    if response.status != 200:
                        raise RuntimeError(f"search answered {response.status}: {(await response.text())[:300]}")
                    body = await response.json()
                if body["degraded"] or len(body["queries"]) != 3:
                    raise RuntimeError(f"unexpected search: {body['stop_reason']} {body['degraded_reason']}")
                overheads.append(body["timings"]["overhead_ms"])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, overheads


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its live children (its workers)."""
    return sum(cpu_seconds(p) for p in [pid, *children(pid)])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


class SleepingPolicy:
    """In-process policy: the scripted s3 answers after `latency_s` (no HTTP, no CPU); only `chat`."""

    model = "sleeping-fake"

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    async def chat(self, messages: list[Any], **kwargs: Any) -> Any:
        from plugsearch.common.llm import ChatResult
        from tests.support.fake_policy import respond

        await asyncio.sleep(self.latency_s)
        return ChatResult(text=respond({"messages": [m.model_dump() for m in messages]}), finish_reason="stop")


class MemoryRetriever:
    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        return [[Document(id=f"{q}-{i}", title=f"Title {i}", text=f"Passage {i} about {q}.") for i in range(1, k + 1)]
                for q in queries]


async def loop_only_slowdown(latency_s: float, repeats: int) -> float:
    """The loop alone (in-process, no HTTP): t(64 searches at once) / t(one search), policy latency 50 ms."""
    from plugsearch.common.schemas.searcher import SearchParams
    from plugsearch.searcher.loop import run_search
    from plugsearch.searcher.policy import ChatPolicy

    policy, retriever, params = ChatPolicy(SleepingPolicy(latency_s)), MemoryRetriever(), SearchParams()  # type: ignore[arg-type]

    async def burst(n: int) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(run_search(f"question {i}?", params, policy=policy,
                                          retriever=retriever) for i in range(n)))
        return time.perf_counter() - t0

    t1 = statistics.median([await burst(1) for _ in range(repeats)])
    t64 = statistics.median([await burst(64) for _ in range(repeats)])
    return t64 / t1


def off_path_ns_per_call(calls: int = 200_000) -> float:
    """Nanoseconds one instrumented step costs with tracing off (set up, off: every service's default): a
    `span()` with attributes, entered and left, in-process."""
    from plugsearch.common import tracing

    assert tracing.setup_tracing("bench") is False, "tracing is on in this process: unset the OTEL_* variables"
    t0 = time.perf_counter_ns()
    for i in range(calls):
        with tracing.span("searcher.retrieve", {"plugsearch.turn": i, "plugsearch.k": 8}) as span:
            span.set_attribute("plugsearch.documents", 8)
    return (time.perf_counter_ns() - t0) / calls


async def tracing_rounds(servers: Servers, quick: bool) -> dict[str, object]:
    """The searcher with tracing off and on, alternately (off, on, off, on ...): CPU per search, searches/s
    at 16 clients, the mean search at 1 client; the sink's spans per traced search."""
    sink = servers.start_sink()
    traced_env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink, "OTEL_BSP_SCHEDULE_DELAY": "200"}
    rounds = 2 if quick else 4
    singles, burst = (20, 64) if quick else (100, 320)
    results: dict[str, dict[str, list[float]]] = {k: {"cpu": [], "c16": [], "c1": [], "ov": []} for k in ("off", "on")}
    spans = 0.0

    def count() -> int:
        import urllib.request

        with urllib.request.urlopen(f"{sink}/count", timeout=10) as response:  # noqa: S310 - the sink, loopback
            return int(json.loads(response.read())["spans"])

    for r in range(rounds):
        for name, env in (("off", None), ("on", traced_env)):
            before = await asyncio.to_thread(count)  # every span of this searcher's life (warm-up included)
            url = servers.start_searcher(env)
            await run_searches(url, 8, 4, f"warm-{name}{r}")
            cpu0 = tree_cpu_seconds(servers.procs["searcher"].pid)
            wall1, ov1 = await run_searches(url, singles, 1, f"t1-{name}{r}")
            wall16, ov16 = await run_searches(url, burst, 16, f"t16-{name}{r}")
            cpu = tree_cpu_seconds(servers.procs["searcher"].pid) - cpu0
            results[name]["cpu"].append(cpu * 1000 / (singles + burst))
            results[name]["c1"].append(wall1 * 1000 / singles)
            results[name]["c16"].append(burst / wall16)
            results[name]["ov"].extend(ov1 + ov16)
            if name == "on":
                servers.stop("searcher")  # exports what it still holds on the way out
                spans += await asyncio.to_thread(count) - before
            print(f"tracing {name}, round {r}: {results[name]['cpu'][-1]:.2f} ms CPU per search, "
                  f"{results[name]['c16'][-1]:.1f}/s at 16, {results[name]['c1'][-1]:.2f} ms at 1", file=sys.stderr)
    servers.stop("otlp-sink")

    def summary(name: str) -> dict[str, float]:
        v = results[name]
        return {"cpu_ms_per_search": round(statistics.median(v["cpu"]), 3),
                "throughput_16": round(statistics.median(v["c16"]), 1),
                "search_ms_at_1": round(statistics.median(v["c1"]), 3),
                "overhead_ms_p50": round(percentile(v["ov"], 0.5), 3)}

    off, on = summary("off"), summary("on")
    spans_per_search = spans / (rounds * (singles + burst + 8))
    off_ns = off_path_ns_per_call()
    return {
        "off": off, "on": on, "rounds": rounds,
        "cpu_ms_per_search_on_minus_off": round(on["cpu_ms_per_search"] - off["cpu_ms_per_search"], 3),
        "cpu_on_over_off": round(on["cpu_ms_per_search"] / off["cpu_ms_per_search"], 3),
        "throughput_16_on_over_off": round(on["throughput_16"] / off["throughput_16"], 3),
        "spans_per_search": round(spans_per_search, 1),
        "off_path_ns_per_span": round(off_ns, 1),
        "off_path_us_per_search": round(off_ns * spans_per_search / 1000, 2),
        "off_path_share_of_cpu": round(off_ns * spans_per_search / 1e6 / off["cpu_ms_per_search"], 5),
    }


async def tracing_only(quick: bool, workers: int) -> dict[str, object]:
    with Servers(workers) as servers:
        servers.start_llm(0)
        traced = await tracing_rounds(servers, quick)
    return {"tracing": traced, "searcher_workers": workers, "load_average_1m": round(os.getloadavg()[0], 2),
            "quick": quick}


async def main_async(quick: bool, workers: int = 1, with_tracing: bool = True) -> dict[str, object]:
    with Servers(workers) as servers:
        servers.start_llm(0)
        url = servers.start_searcher()
        await run_searches(url, 8, 4, "warmup")
        throughput: dict[str, float] = {}
        overheads: list[float] = []
        per_level = {1: 10 if quick else 50, 16: 48 if quick else 320, 64: 128 if quick else 640}
        for concurrency, n in per_level.items():
            wall, ov = await run_searches(url, n, concurrency, f"c{concurrency}")
            throughput[str(concurrency)] = round(n / wall, 1)
            overheads.extend(ov)
            print(f"latency 0 ms, concurrency {concurrency}: {n} searches in {wall:.2f} s, "
                  f"{n / wall:.1f}/s, overhead p50 {percentile(ov, 0.5):.2f} ms", file=sys.stderr)

        servers.start_llm(50)
        singles = 3 if quick else 7
        t1 = statistics.median([(await run_searches(url, 1, 1, f"single{i}"))[0] for i in range(singles)])
        # One burst first, not measured: it opens the 64 connections to the restarted fake LLM.
        await run_searches(url, 64, 64, "burst-warmup")
        cpu0 = tree_cpu_seconds(servers.procs["searcher"].pid)
        bursts = 1 if quick else 5
        t64 = statistics.median([(await run_searches(url, 64, 64, f"burst{i}"))[0] for i in range(bursts)])
        cpu_per_search = (tree_cpu_seconds(servers.procs["searcher"].pid) - cpu0) / (64 * bursts)
        print(f"latency 50 ms: one search {t1 * 1000:.0f} ms, 64 at once {t64 * 1000:.0f} ms", file=sys.stderr)
        traced: dict[str, object] | None = None
        if with_tracing:
            servers.start_llm(0)
            traced = await tracing_rounds(servers, quick)
    loop_slowdown = await loop_only_slowdown(0.05, 3)
    return {
        "overhead_ms_p50": round(percentile(overheads, 0.5), 3),
        "overhead_ms_p99": round(percentile(overheads, 0.99), 3),
        "throughput": throughput,
        "concurrency_slowdown_64": round(t64 / t1, 3),
        "loop_only_slowdown_64": round(loop_slowdown, 3),
        "searcher_cpu_ms_per_search": round(cpu_per_search * 1000, 2),
        "cpu_bound_slowdown_64": round(max(t1, 64 * cpu_per_search) / t1, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "one_search_ms_at_50ms_policy": round(t1 * 1000, 1),
        "searches_64_ms_at_50ms_policy": round(t64 * 1000, 1),
        "policy_calls_per_search": 4,
        "searcher_workers": workers,
        "retriever": "fake retriever server (synthetic documents, no index)",
        "quick": quick,
        "tracing": traced,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer searches (< 1 minute)")
    parser.add_argument("--workers", type=int, default=1, help="searcher worker processes (SEARCHER_WORKERS)")
    parser.add_argument("--no-tracing", action="store_true", help="skip the tracing off / on rounds")
    parser.add_argument("--tracing-only", action="store_true", help="only the tracing off / on rounds")
    parser.add_argument("--serve-fake-retriever", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-otlp-sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake_retriever:
        serve_fake_retriever(args.serve_fake_retriever)
        return
    if args.serve_otlp_sink:
        serve_otlp_sink(args.serve_otlp_sink)
        return
    if any(name.startswith("OTEL_") for name in os.environ):
        sys.exit("unset the OTEL_* variables: the searcher's tracing is switched by this bench")
    if args.tracing_only:
        result = asyncio.run(tracing_only(args.quick, args.workers))
    else:
        result = asyncio.run(main_async(args.quick, args.workers, not args.no_tracing))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
