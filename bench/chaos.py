"""Faults in the middle of a heavy load: does every request still get an answer, and how fast does
throughput come back?

The stack of `bench/load.py` (the retriever with two workers, the searcher with its Redis cache) under
`--clients` (50) closed-loop clients sending distinct NQ questions for `--seconds` (60), beside one hostile
client alternating a 3,000-character question (the searcher cuts it to the retriever's 2,048) and a
5,000-character one (422). In turn: `retriever_worker` (SIGKILL of a retriever worker; its supervisor starts
another), `policy_llm` and `redis` (SIGKILL, restarted `--down-s` (3) seconds later). Every request must end
in 200 (whole or `degraded`), a 4xx, or 429/503 with Retry-After. Per fault, until the next: `errors`
(anything but a whole 200), `lost` (no HTTP answer), `hung` (none within the client timeout, above the
searcher's deadline), `recovery_s` (seconds until whole 200s per second, averaged over two, are back at 90% of
the 5 s before it; null: not in the window). `no_retry_after`: 429/503 answers without Retry-After.

    python bench/chaos.py [--quick] [--clients 50] [--seconds 60]

Final line: {"faults": {name: {"errors", "lost", "hung", "recovery_s", ...}}, "hostile": {...}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import LocalStack, PhaseResult, bench_stack, run_phase  # noqa: E402
from tests.support.procs import children  # noqa: E402

SEARCHER_ENV = {
    "SEARCHER_CACHE_ENABLED": "true", "SEARCHER_MAX_IN_FLIGHT": "256",
    "SEARCHER_POLICY__MAX_CONCURRENCY": "256", "SEARCHER_RETRIEVER__MAX_CONNECTIONS": "256",
    # a dead upstream fails fast and is tried again soon: a short breaker, no retries of a dead policy
    "SEARCHER_POLICY__TIMEOUT_S": "3", "SEARCHER_POLICY__MAX_RETRIES": "0",
    "SEARCHER_POLICY__BREAKER_FAILURES": "2", "SEARCHER_POLICY__BREAKER_RESET_S": "1",
    "SEARCHER_RETRIEVER__MAX_RETRIES": "1", "SEARCHER_RETRIEVER__BREAKER_RESET_S": "1",
    "SEARCHER_SEARCH_TIMEOUT_S": "15", "SEARCHER_REQUEST_TIMEOUT_S": "20",
}
CLIENT_TIMEOUT_S = 30.0
"""above the searcher's 20 s deadline: a request without an answer by then hung"""
WHOLE = 200


@dataclass
class Fault:
    name: str
    at: float
    """seconds into the window"""
    injected: float = 0.0
    """monotonic time it happened"""


def inject(stack: LocalStack, fault: Fault, down_s: float) -> None:
    """The fault, then (for a process nothing restarts by itself) its restart after `down_s`."""
    if fault.name == "retriever_worker":
        workers = children(stack.procs["retriever"].pid)
        if not workers:
            raise RuntimeError("the retriever runs no worker processes (RETRIEVER_WORKERS=2 expected)")
        fault.injected = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        return
    name = {"policy_llm": "llm", "redis": "redis"}[fault.name]
    fault.injected = time.monotonic()
    stack.stop(name, signal.SIGKILL)
    time.sleep(down_s)
    stack.start(name)
    stack.wait_ready(name, timeout_s=60)


async def run_faults(stack: LocalStack, faults: list[Fault], start: float, down_s: float) -> None:
    for fault in faults:
        await asyncio.sleep(max(0.0, start + fault.at - time.monotonic()))
        await asyncio.to_thread(inject, stack, fault, down_s)
        print(f"{fault.name} at {fault.injected - start:.1f} s", file=sys.stderr)


def per_second(events: list[tuple[float, float, int | str]], start: float, seconds: int) -> list[int]:
    """Whole 200 answers completed in each second of the window."""
    buckets = [0] * seconds
    for _sent, answered, status in events:
        i = int(answered - start)
        if status == WHOLE and 0 <= i < seconds:
            buckets[i] += 1
    return buckets


def recovery(buckets: list[int], at: float, before_s: int = 5) -> float | None:
    first = int(at)
    before = buckets[max(0, first - before_s):first]
    if not before:
        return None
    target = 0.9 * sum(before) / len(before)
    for i in range(first, len(buckets) - 1):
        if (buckets[i] + buckets[i + 1]) / 2 >= target:
            return round(max(0.0, i - at), 1)
    return None


def summarise(result: PhaseResult, faults: list[Fault], start: float, end: float) -> dict[str, Any]:
    buckets = per_second(result.events, start, int(end - start) + 1)
    out: dict[str, Any] = {}
    for i, fault in enumerate(faults):
        until = faults[i + 1].injected if i + 1 < len(faults) else end + CLIENT_TIMEOUT_S
        window = [e for e in result.events if fault.injected <= e[1] < until]
        kinds = Counter(str(status) for _, _, status in window)
        out[fault.name] = {
            "at_s": round(fault.injected - start, 1),
            "errors": sum(n for k, n in kinds.items() if k != str(WHOLE)),
            "lost": sum(n for k, n in kinds.items() if not k.isdigit() and k not in ("degraded", "TimeoutError")),
            "hung": kinds.get("TimeoutError", 0),
            "recovery_s": recovery(buckets, fault.injected - start),
            "answers": dict(kinds),
        }
    out["_buckets"] = buckets
    return out


def hostile_body(i: int) -> dict[str, Any]:
    size = 3000 if i % 2 == 0 else 5000
    return {"question": ("who wrote the song " * 300)[:size], "mode": "s3"}


def unique_questions(questions: list[str]) -> Callable[[int], dict[str, Any]]:
    """Distinct questions (a number after each repeat), so the cache does not answer them all."""
    return lambda i: {"question": questions[i % len(questions)] + ("" if i < len(questions) else f" ({i})"),
                      "mode": "s3"}


async def drive(stack: LocalStack, questions: list[str], args: argparse.Namespace, faults: list[Fault]
                ) -> tuple[PhaseResult, PhaseResult, float, float]:
    url = stack.url("searcher")
    start = time.monotonic()
    load = run_phase(url, questions, clients=args.clients, seconds=args.seconds, timeout_s=CLIENT_TIMEOUT_S,
                     offset=2000, body=unique_questions(questions))
    hostile = run_phase(url, questions, clients=1, seconds=args.seconds, timeout_s=CLIENT_TIMEOUT_S,
                        body=hostile_body)
    main, bad, _ = await asyncio.gather(load, hostile, run_faults(stack, faults, start, args.down_s))
    return main, bad, start, start + args.seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="20 clients, 24 s, faults 6 s apart")
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--down-s", dest="down_s", type=float, default=3.0, help="seconds a killed process stays down")
    parser.add_argument("--llm-latency-ms", type=float, default=50.0)
    parser.add_argument("--corpus", type=Path, default=None, help="default: the shared combined corpus")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.seconds = 20, 24.0
    gap = args.seconds / 4
    faults = [Fault("retriever_worker", gap), Fault("policy_llm", 2 * gap), Fault("redis", 3 * gap)]
    stack, questions = bench_stack(args, SEARCHER_ENV, "chaos", retriever_workers=2)
    with stack:
        asyncio.run(run_phase(stack.url("searcher"), questions, clients=4, seconds=1.0, timeout_s=10))  # warm-up
        result, hostile, start, end = asyncio.run(drive(stack, questions, args, faults))
    summary = summarise(result, faults, start, end)
    buckets = summary.pop("_buckets")
    hostile_kinds = Counter(str(status) for _, _, status in hostile.events)
    out = {
        "faults": summary,
        "hostile": {"requests": len(hostile.events), "answers": dict(hostile_kinds),
                    "lost": sum(n for k, n in hostile_kinds.items() if not k.isdigit() and k != "TimeoutError"),
                    "hung": hostile_kinds.get("TimeoutError", 0),
                    "server_errors": sum(n for k, n in hostile_kinds.items() if k.isdigit() and int(k) >= 500)},
        "requests": len(result.events), "answers": {str(k): v for k, v in result.statuses.items()},
        "bodies": dict(result.bodies), "lost": result.lost, "no_retry_after": result.no_retry_after,
        "whole_per_second": buckets, "clients": args.clients, "seconds": args.seconds, "down_s": args.down_s,
        "llm_latency_ms": args.llm_latency_ms, "quick": args.quick, "cpus": os.cpu_count(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
