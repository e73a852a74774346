"""Steady load for a long time: does any service's memory or open files grow?

The stack of `bench/load.py` (the retriever with `--retriever-workers` workers, the searcher with its Redis
cache, capped at `--redis-maxmemory`) under `--clients` (20) closed-loop clients sending distinct NQ questions
for `--minutes` (30). Every `--every-s` (10) seconds the resident memory (VmRSS) and open file descriptors of
every service (a supervisor and its workers summed) are read from /proc. After the warm-up (`--warmup-min`, 3:
caches and pools fill, Redis reaches its cap): growth = the mean of the last 10% of samples over the first
10%; `rss_slope_mb_per_h` = the least-squares slope (a leak shows as a steady one).

    python bench/soak.py [--quick] [--minutes 30] [--clients 20]

Final line: {"rss_growth_pct": {service: ..}, "fd_growth": {service: ..}, "rss_mb": {..}, "fds": {..},
             "rss_slope_mb_per_h": {..}, "requests", "answers", "lost", ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.chaos import unique_questions  # noqa: E402
from bench.load import LocalStack, bench_stack, run_phase  # noqa: E402
from tests.support.procs import rss_and_fds  # noqa: E402

SEARCHER_ENV = {"SEARCHER_CACHE_ENABLED": "true", "SEARCHER_MAX_IN_FLIGHT": "256",
                "SEARCHER_POLICY__MAX_CONCURRENCY": "256", "SEARCHER_RETRIEVER__MAX_CONNECTIONS": "256"}


Samples = list[tuple[float, dict[str, tuple[float, int]]]]
"""(monotonic time, {service: (RSS MB, open fds)}) per sample"""


def sample(stack: LocalStack, every_s: float, done: threading.Event, samples: Samples) -> None:
    while not done.is_set():
        samples.append((time.monotonic(), {name: rss_and_fds(p.pid) for name, p in stack.procs.items()}))
        done.wait(every_s)


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope per hour; None below 3 points or when they all share one time."""
    if len(points) < 3 or len({t for t, _ in points}) < 2:
        return None
    return round(statistics.linear_regression(*zip(*points, strict=True)).slope * 3600, 2)


def growth(samples: Samples, start: float, warmup_s: float) -> dict[str, dict[str, Any]]:
    after = [(t, s) for t, s in samples if t - start >= warmup_s]
    if len(after) < 4:
        raise SystemExit(f"only {len(after)} samples after the warm-up: run longer or sample more often")
    tenth = max(1, len(after) // 10)
    out: dict[str, dict[str, Any]] = {"rss_growth_pct": {}, "fd_growth": {}, "rss_mb": {}, "fds": {},
                                      "rss_slope_mb_per_h": {}}
    for name in after[0][1]:
        first = [s[name] for _, s in after[:tenth] if name in s]
        last = [s[name] for _, s in after[-tenth:] if name in s]
        rss0, rss1 = statistics.fmean(r for r, _ in first), statistics.fmean(r for r, _ in last)
        fd0, fd1 = statistics.fmean(f for _, f in first), statistics.fmean(f for _, f in last)
        out["rss_growth_pct"][name] = round((rss1 - rss0) / rss0 * 100, 2) if rss0 else None
        out["fd_growth"][name] = round(fd1 - fd0, 1)
        out["rss_mb"][name] = [round(rss0, 1), round(rss1, 1)]
        out["fds"][name] = [round(fd0, 1), round(fd1, 1)]
        out["rss_slope_mb_per_h"][name] = slope_per_hour([(t - start, s[name][0]) for t, s in after if name in s])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 minute, 20 s warm-up, a sample every 2 s")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-min", dest="warmup_min", type=float, default=3.0)
    parser.add_argument("--every-s", dest="every_s", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--retriever-workers", dest="retriever_workers", type=int, default=2)
    parser.add_argument("--llm-latency-ms", type=float, default=50.0)
    parser.add_argument("--redis-maxmemory", dest="redis_maxmemory", default="32mb")
    parser.add_argument("--corpus", type=Path, default=None, help="default: the shared combined corpus")
    args = parser.parse_args(argv)
    if args.quick:
        args.minutes, args.warmup_min, args.every_s = 1.0, 1 / 3, 2.0
    stack, questions = bench_stack(args, SEARCHER_ENV, "soak", retriever_workers=args.retriever_workers)
    # a small cache cap, reached during the warm-up: after it Redis evicts as much as it stores, so what it
    # holds no longer grows with the number of distinct searches (the stack's default cap is 512mb)
    stack.specs["redis"].argv += ["--maxmemory", args.redis_maxmemory]
    samples: Samples = []
    done = threading.Event()
    with stack:
        sampler = threading.Thread(target=sample, args=(stack, args.every_s, done, samples), daemon=True)
        start = time.monotonic()
        sampler.start()
        result = asyncio.run(run_phase(stack.url("searcher"), questions, clients=args.clients,
                                       seconds=args.minutes * 60, timeout_s=60, body=unique_questions(questions)))
        done.set()
        sampler.join()
    figures = growth(samples, start, args.warmup_min * 60)
    print(json.dumps({**figures, "requests": len(result.events),
                      "answers": {str(k): v for k, v in result.statuses.items()}, "bodies": dict(result.bodies),
                      "lost": result.lost, "samples": len(samples), "minutes": args.minutes,
                      "warmup_min": args.warmup_min, "clients": args.clients,
                      "retriever_workers": args.retriever_workers, "quick": args.quick, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
