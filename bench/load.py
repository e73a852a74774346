"""Load on the local stack: N concurrent clients on `POST /search` for S seconds, then 4N to show overload.

`LocalStack`: redis-server, the retriever (BM25 over the shared combined corpus), the searcher (result cache
off) and, as the policy, the fake LLM answering with the scripted s3 policy after `--llm-latency-ms` (50 ms),
started as `plugsearch-stack` starts them: each search = 4 policy calls + 4 retrievals. Baseline: `--clients`
(50) closed-loop clients sending NQ questions (every non-200 answer or failure is an error). Overload: 4x the
clients against the searcher's adaptive concurrency limit under `SEARCHER_MAX_IN_FLIGHT` (`--max-in-flight`;
`--fixed`: the ceiling alone); clients honour Retry-After. `lost`: requests with no HTTP answer within
`--timeout`; `overload.p99_ratio` / `rps_ratio`: the admitted (200) searches' p99 / searches/s under overload
over the baseline's (`unloaded_p99_ms`); `admission_limit`: `searcher_admission_limit` after each phase.

    python bench/load.py [--quick] [--clients 50] [--seconds 60] [--fixed] [--max-in-flight N]

Final line: {"clients", "seconds", "requests", "errors", "rps", "p50_ms", "p99_ms",
             "overload": {"admitted_p99_ms", "unloaded_p99_ms", "p99_ratio", "status_429", "lost", ...}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, REPO, fake_llm_spec, load_questions  # noqa: E402
from plugsearch.common.procgroup import ProcessGroup, ProcessSpec  # noqa: E402
from plugsearch.stack.corpus import index_dir_for  # noqa: E402
from plugsearch.stack.specs import (  # noqa: E402
    StackOptions,
    allocate_ports,
    build_specs,
    index_command,
)

START_ORDER = ("redis", "llm", "retriever", "searcher")  # dependencies first


class LocalStack(ProcessGroup):
    """Redis, fake-LLM policy, retriever and searcher as one process group whose members can be killed and
    restarted (`stop(name, signal)`, `start(name)`, `wait_ready(name)`, `revive()`)."""

    def __init__(self, corpus: Path, var_dir: Path, *, llm_latency_ms: float = 50.0,
                 searcher_env: dict[str, str] | None = None, redis: bool = True, log_dir: Path | None = None,
                 llm_slots: int = 0, dense: bool = False) -> None:
        super().__init__(log_dir=log_dir, cwd=REPO)
        ports = allocate_ports(free_ports=True)
        redis_server = shutil.which("redis-server") if redis else None
        self.options = StackOptions(ports=ports, corpus=corpus, index_dir=index_dir_for(corpus, var_dir),
                                    redis=redis_server is not None, llm_url=f"http://127.0.0.1:{ports['llm']}/v1",
                                    llm_model="fake-policy", log_level="WARNING", dense=dense)
        specs = {spec.name: spec for spec in build_specs(self.options, redis_server=redis_server)}
        specs["searcher"].env.update(searcher_env or {})
        specs["llm"] = fake_llm_spec(ports["llm"], llm_latency_ms, slots=llm_slots)
        self.add(*(specs[name] for name in START_ORDER if name in specs))

    def url(self, name: str) -> str:
        return self.options.url(name)

    def __enter__(self) -> LocalStack:
        argv, env = index_command(self.options)  # a no-op when the cached index is current
        if self.run(ProcessSpec("index", argv, env=env)) != 0:
            raise RuntimeError(f"index build failed: {self.tail('index')}")
        self.up(*self.specs.values())
        return self


def bench_stack(args: argparse.Namespace, searcher_env: dict[str, str], logs: str,
                retriever_workers: int = 0, llm_slots: int = 0, dense: bool = False) -> tuple[LocalStack, list[str]]:
    """A bench's stack over its `--corpus` (default the shared combined corpus), the policy answering after
    `--llm-latency-ms` (`llm_slots` at once, 0: any number), the retriever serving dense search too with
    `dense` (its index built on the first run), logs in var/logs/<logs>; and the NQ questions its clients send."""
    stack = LocalStack((args.corpus or CORPUS).resolve(), REPO / "var", llm_latency_ms=args.llm_latency_ms,
                       searcher_env=searcher_env, log_dir=REPO / "var" / "logs" / logs, llm_slots=llm_slots,
                       dense=dense)
    if retriever_workers:
        stack.specs["retriever"].env["RETRIEVER_WORKERS"] = str(retriever_workers)
    return stack, [r.question for r in load_questions("nq", 1000)]


@dataclass
class PhaseResult:
    clients: int
    seconds: float
    """the load window; requests still in flight at its end are waited for (they count in `statuses`)"""
    statuses: Counter[int]
    failures: Counter[str]
    latencies_ms: list[float]
    ok_in_window: int
    """200 answers completed inside the window: the throughput numerator (the drain is not counted)"""
    events: list[tuple[float, float, int | str]] = field(default_factory=list)
    """(sent, answered, status, "degraded" for a degraded 200, or the failure kind) of every request, monotonic
    seconds (for timelines)"""
    bodies: Counter[str] = field(default_factory=Counter)
    """200 answers by kind: "ok", "degraded"; non-200 by error type"""
    client_cpu_s: float = 0.0
    """CPU the load generator itself used (its own process): a busy client inflates what it measures"""
    no_retry_after: int = 0
    """429 / 503 answers without Retry-After (a client cannot tell when to come back)"""

    @property
    def answered(self) -> int:
        return sum(self.statuses.values())

    @property
    def lost(self) -> int:
        return sum(self.failures.values())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


Body = Callable[[int], "dict[str, Any] | bytes"]
"""The request body of the i-th request (bytes: JSON already encoded, for large bodies sent often)."""


async def run_phase(url: str, questions: list[str], *, clients: int, seconds: float, timeout_s: float,
                    offset: int = 0, body: Body | None = None, path: Callable[[int], str] | None = None,
                    headers: dict[str, str] | None = None, honour_retry_after: bool = True,
                    pause_s: float = 0.0) -> PhaseResult:
    """`clients` closed-loop clients for `seconds` (default body: the next question, s3, to `/search`;
    `path(i)`: the i-th request's path), with `headers` (an API key); latencies of 200 answers only; each
    client pauses `pause_s` after an answer (think time). A client waits Retry-After after a refusal unless
    `honour_retry_after` is off (then 50 ms). The clients
    use aiohttp's pool directly (httpx's pool cost the load generator more CPU than the searcher under 200
    clients, and its queue showed up as latency)."""
    import aiohttp

    statuses: Counter[int] = Counter()
    failures: Counter[str] = Counter()
    bodies: Counter[str] = Counter()
    latencies: list[float] = []
    events: list[tuple[float, float, int | str]] = []
    ok_in_window = 0
    no_retry_after = 0
    counter = offset
    cpu0 = time.process_time()
    # Idle connections expire on the client before the server's keep-alive timeout closes them, so a
    # request is never written into a connection the server is closing (which would read as "lost").
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout, headers=headers) as http:
        stop_at = time.monotonic() + seconds

        async def client(make: Body) -> None:
            nonlocal counter, ok_in_window, no_retry_after
            while time.monotonic() < stop_at:
                payload = make(counter)
                where = "/search" if path is None else path(counter)
                counter += 1
                sent = time.monotonic()
                try:
                    send = {"data": payload, "headers": {"Content-Type": "application/json"}} \
                        if isinstance(payload, bytes) else {"json": payload}
                    async with http.post(where, **send) as response:
                        status = response.status
                        retry_after = response.headers.get("retry-after")
                        data = await response.json(content_type=None)
                except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                    failures[type(exc).__name__] += 1
                    events.append((sent, time.monotonic(), type(exc).__name__))
                    continue
                answered = time.monotonic()
                degraded = status == 200 and isinstance(data, dict) and bool(data.get("degraded"))
                events.append((sent, answered, "degraded" if degraded else status))
                statuses[status] += 1
                no_retry_after += status in (429, 503) and retry_after is None
                if status == 200:
                    bodies["degraded" if degraded else "ok"] += 1
                    latencies.append((answered - sent) * 1000)
                    ok_in_window += answered <= stop_at
                    if pause_s:
                        await asyncio.sleep(pause_s)
                else:
                    error = data.get("error", {}) if isinstance(data, dict) else {}
                    bodies[str(error.get("type", status))] += 1
                    if retry_after is not None and honour_retry_after:
                        await asyncio.sleep(float(retry_after))
                    elif not honour_retry_after:
                        await asyncio.sleep(0.05)

        make = body or (lambda i: {"question": questions[i % len(questions)], "mode": "s3"})
        await asyncio.gather(*(client(make) for _ in range(clients)))
    return PhaseResult(clients, seconds, statuses, failures, latencies, ok_in_window, events, bodies,
                       time.process_time() - cpu0, no_retry_after)


def scrape(url: str) -> dict[str, float]:
    """The searcher's admission limit and its cumulative `/search` latency histogram (bucket -> count)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("searcher_admission_limit "):
            found["limit"] = float(line.split()[1])
        elif line.startswith('searcher_http_request_seconds_bucket{le="') and 'route="/search"' in line:
            le = line.split('le="', 1)[1].split('"', 1)[0]
            found[le] = float(line.rsplit(" ", 1)[1])
    return found


def server_quantiles(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """p50 / p99 (ms, bucket upper bounds) of the searcher's own `/search` latency between two scrapes:
    the time inside the service, next to what clients measure (which adds queues outside it)."""
    buckets = sorted((float(le), after[le] - before.get(le, 0.0)) for le in after if le != "limit")
    total = buckets[-1][1] if buckets else 0.0
    out: dict[str, float | None] = {}
    for name, q in (("server_p50_ms", 0.5), ("server_p99_ms", 0.99)):
        out[name] = next((le * 1000 for le, count in buckets if total and count >= q * total), None)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="8 s phases (the whole run well under a minute "
                        "once the index is cached)")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--overload-factor", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="the searcher's admission ceiling; default: the service's (256)")
    parser.add_argument("--fixed", action="store_true",
                        help="no adaptive limit: admit up to --max-in-flight (default then 1.25x the clients)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="SEARCHER_LATENCY_TOLERANCE of the adaptive limit (default: the service's)")
    parser.add_argument("--llm-latency-ms", type=float, default=50.0)
    parser.add_argument("--timeout", type=float, default=30.0, help="client timeout per request (s)")
    parser.add_argument("--corpus", type=Path, default=None, help="default: the shared combined corpus")
    args = parser.parse_args(argv)
    seconds = 8.0 if args.quick else args.seconds
    overload_clients = args.clients * args.overload_factor
    max_in_flight = args.max_in_flight or (args.clients + max(1, args.clients // 4) if args.fixed else 256)
    searcher_env = {"SEARCHER_MAX_IN_FLIGHT": str(max_in_flight), "SEARCHER_CACHE_ENABLED": "false",
                    "SEARCHER_ADAPTIVE_CONCURRENCY": "false" if args.fixed else "true",
                    **({"SEARCHER_LATENCY_TOLERANCE": str(args.tolerance)} if args.tolerance else {}),
                    "SEARCHER_POLICY__MAX_CONCURRENCY": "256", "SEARCHER_RETRIEVER__MAX_CONNECTIONS": "256"}
    stack, questions = bench_stack(args, searcher_env, "bench_load")
    t_start = time.monotonic()
    with stack:
        url = stack.url("searcher")
        startup_s = time.monotonic() - t_start
        asyncio.run(run_phase(url, questions, clients=4, seconds=1.0, timeout_s=args.timeout))  # warm-up
        scraped = [scrape(url)]

        def phase(label: str, clients: int, offset: int) -> tuple[PhaseResult, dict[str, float | None], float | None]:
            """One phase, then the searcher's own quantiles over it and its admission limit after it."""
            result = asyncio.run(run_phase(url, questions, clients=clients, seconds=seconds, timeout_s=args.timeout,
                                           offset=offset))
            scraped.append(scrape(url))
            server, limit = server_quantiles(scraped[-2], scraped[-1]), scraped[-1].get("limit")
            print(f"{label}: {result.clients} clients {result.seconds:.1f} s window statuses {dict(result.statuses)} "
                  f"failures {dict(result.failures)} limit {limit} server {server}", file=sys.stderr)
            return result, server, limit

        base, base_server, base_limit = phase("baseline", args.clients, 100)
        over, over_server, over_limit = phase("overload", overload_clients, 500)
    unloaded_p99 = percentile(base.latencies_ms, 0.99)
    admitted_p99 = percentile(over.latencies_ms, 0.99)
    base_rps = base.ok_in_window / base.seconds
    over_rps = over.ok_in_window / over.seconds
    result: dict[str, Any] = {
        "clients": args.clients, "seconds": round(base.seconds, 1), "requests": base.answered + base.lost,
        "errors": base.answered - base.statuses.get(200, 0) + base.lost, "rps": round(base_rps, 1),
        "p50_ms": round(percentile(base.latencies_ms, 0.5), 1), "p99_ms": round(percentile(base.latencies_ms, 0.99), 1),
        "overload": {
            "clients": overload_clients, "seconds": round(over.seconds, 1),
            "requests": over.answered + over.lost, "status_200": over.statuses.get(200, 0),
            "status_429": over.statuses.get(429, 0),
            "other_status": {str(k): v for k, v in over.statuses.items() if k not in (200, 429)},
            "lost": over.lost, "lost_by_kind": dict(over.failures),
            "rps": round(over_rps, 1), "rps_ratio": round(over_rps / base_rps, 2) if base_rps else None,
            "p50_ms": round(percentile(over.latencies_ms, 0.5), 1),
            "admitted_p99_ms": round(admitted_p99, 1), "unloaded_p99_ms": round(unloaded_p99, 1),
            "p99_ratio": round(admitted_p99 / unloaded_p99, 2) if unloaded_p99 else None,
            "admission_limit": over_limit, **over_server, "client_cpu_s": round(over.client_cpu_s, 1),
        },
        "client_cpu_s": round(base.client_cpu_s, 1),
        **base_server, "admission_limit": base_limit, "adaptive": not args.fixed, "tolerance": args.tolerance, "max_in_flight": max_in_flight, "llm_latency_ms": args.llm_latency_ms, "client_timeout_s": args.timeout,
        "startup_s": round(startup_s, 1), "quick": args.quick, "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
