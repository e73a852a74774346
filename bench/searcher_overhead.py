"""Searcher overhead and concurrency: what the searcher itself costs per search, and whether it serialises.

The searcher (cache off, `--workers N` processes), the fake LLM answering with the scripted s3 policy (4
policy calls, 4 retrievals per search) and a fake retriever defined here (k synthetic documents at once), so
retrieval costs only the HTTP round trip. 1. Policy answers instantly: searches/s at 1, 16 and 64 concurrent
clients, and the searcher's own time per search (`timings.overhead_ms`), p50 / p99. 2. Policy latency 50 ms:
one search alone (median of 7) vs 64 at once (median of 5 bursts, after an unmeasured one):
`concurrency_slowdown_64` = t(64) / t(1), <= 2 means no serialisation. `searcher_cpu_ms_per_search`: the
searcher's CPU per search in those bursts; `cpu_bound_slowdown_64` = max(t(1), 64 x that) / t(1), what one
busy core forces without any serialisation (a slowdown close to it is CPU-bound). `loop_only_slowdown_64`: the
same on the loop alone, in-process, no HTTP.

Final line: {"overhead_ms_p50", "overhead_ms_p99", "throughput": {"1", "16", "64"}, "concurrency_slowdown_64", ...}
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
from services.common.procgroup import ProcessGroup, ProcessSpec  # noqa: E402
from services.common.schemas.base import Document  # noqa: E402
from services.common.schemas.retriever import RetrieveRequest  # noqa: E402
from services.common.workers import free_port  # noqa: E402
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

    def start_searcher(self) -> str:
        env = {
            "SEARCHER_PORT": str(self.searcher_port),
            "SEARCHER_RETRIEVER__URL": f"http://127.0.0.1:{self.retriever_port}",
            "SEARCHER_POLICY__BASE_URL": f"http://127.0.0.1:{self.llm_port}/v1",
            "SEARCHER_POLICY__MAX_CONCURRENCY": "256",
            "SEARCHER_RETRIEVER__MAX_CONNECTIONS": os.environ.get("BENCH_RETRIEVER_CONNECTIONS", "256"),
            "SEARCHER_CACHE_ENABLED": "false",
            "SEARCHER_LOG_LEVEL": "warning",
            "SEARCHER_WORKERS": str(self.workers),
        }
        url = f"http://127.0.0.1:{self.searcher_port}"
        self.up(ProcessSpec("searcher", [sys.executable, "-m", "services.searcher"], env=env,
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
        from services.common.llm import ChatResult
        from tests.support.fake_policy import respond

        await asyncio.sleep(self.latency_s)
        return ChatResult(text=respond({"messages": [m.model_dump() for m in messages]}), finish_reason="stop")


class MemoryRetriever:
    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        return [[Document(id=f"{q}-{i}", title=f"Title {i}", text=f"Passage {i} about {q}.") for i in range(1, k + 1)]
                for q in queries]


async def loop_only_slowdown(latency_s: float, repeats: int) -> float:
    """The loop alone (in-process, no HTTP): t(64 searches at once) / t(one search), policy latency 50 ms."""
    from services.common.schemas.searcher import SearchParams
    from services.searcher.loop import run_search

    policy, retriever, params = SleepingPolicy(latency_s), MemoryRetriever(), SearchParams()

    async def burst(n: int) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(run_search(f"question {i}?", params, policy=policy,  # type: ignore[arg-type]
                                          retriever=retriever) for i in range(n)))
        return time.perf_counter() - t0

    t1 = statistics.median([await burst(1) for _ in range(repeats)])
    t64 = statistics.median([await burst(64) for _ in range(repeats)])
    return t64 / t1


async def main_async(quick: bool, workers: int = 1) -> dict[str, object]:
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
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer searches (< 1 minute)")
    parser.add_argument("--workers", type=int, default=1, help="searcher worker processes (SEARCHER_WORKERS)")
    parser.add_argument("--serve-fake-retriever", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake_retriever:
        serve_fake_retriever(args.serve_fake_retriever)
        return
    result = asyncio.run(main_async(args.quick, args.workers))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
