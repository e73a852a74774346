"""GenAcc reward throughput: a batch judged concurrently vs one item at a time (as s3's reward loop does).

120 items whose span check fails (predictions are other NQ questions' gold answers), so each needs the LLM
judge: the fake LLM in its own process, 100 ms per call, behind the judge service (a fresh in-process app per
run, so no verdict comes from the other run's cache). Sequential: one POST /judge per item, awaited in turn
(s3's `check_answer_correct` loop); concurrent: one POST /judge/batch (the LLM client's concurrency limit
bounds the fan-out). Both must return the same scores, all decided by the LLM. The stderr line also times s3's
loop in-process (no service hop), the CPU of the concurrent run and the load average (on a shared 2-core
machine the concurrent run is CPU-bound, not latency-bound).

Final line: {"items": 120, "sequential_s": .., "concurrent_s": .., "speedup": ..}

    python bench/reward_throughput.py [--quick] [--items 120] [--latency-ms 100] [--concurrency 64]
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

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, fake_llm_spec, load_questions  # noqa: E402
from plugsearch.common.answers import span_match  # noqa: E402
from plugsearch.common.clients import JudgeClient  # noqa: E402
from plugsearch.common.http import ClientSettings  # noqa: E402
from plugsearch.common.llm import LLMSettings  # noqa: E402
from plugsearch.common.procgroup import ProcessGroup  # noqa: E402
from plugsearch.common.schemas.judge import JudgeRequest, JudgeResult  # noqa: E402
from plugsearch.common.workers import free_port  # noqa: E402
from plugsearch.judge.api import create_app  # noqa: E402
from plugsearch.judge.settings import JudgeSettings  # noqa: E402
from tests.support.procs import cpu_seconds  # noqa: E402


def build_items(n: int) -> list[JudgeRequest]:
    """Predictions that are another question's gold answer: the span check fails on every one."""
    rows = load_questions("nq")
    items: list[JudgeRequest] = []
    for i, row in enumerate(rows):
        prediction = rows[(i + 1) % len(rows)].golden_answers[0]
        if not span_match(prediction, row.golden_answers):
            items.append(JudgeRequest(prediction=prediction, golden_answers=row.golden_answers,
                                      question=row.question))
        if len(items) == n:
            return items
    raise SystemExit(f"only {len(items)} items whose span check fails")


async def run(items: list[JudgeRequest], llm_url: str, concurrency: int, batched: bool,
              via_service: bool = True) -> tuple[float, list[JudgeResult]]:
    settings = JudgeSettings(llm=LLMSettings(base_url=llm_url, model="fake-llm", max_concurrency=concurrency),
                             max_in_flight=1024)
    app = create_app(settings)  # fresh app: fresh in-process cache
    async with app.router.lifespan_context(app):
        client = JudgeClient(ClientSettings(url="http://judge", timeout_s=300),
                             transport=httpx.ASGITransport(app=app))
        try:
            t0 = time.perf_counter()
            if batched:
                results = await client.judge_batch(items)
            elif via_service:
                results = [await client.judge(item) for item in items]
            else:  # s3's loop exactly: the judging function called in-process, one item after another
                results = [await app.state.judge.judge(item) for item in items]
            elapsed = time.perf_counter() - t0
        finally:
            await client.aclose()
    return elapsed, results


def check(results: list[JudgeResult], n: int) -> list[float | None]:
    assert len(results) == n
    assert all(r.decided_by == "llm" and not r.cached for r in results), "every item must reach the LLM judge"
    return [r.score for r in results]


async def main_async(args: argparse.Namespace) -> dict[str, float | int]:
    items = build_items(args.items)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    llm = fake_llm_spec(port, args.latency_ms, "no", model="fake-llm")  # every verdict "no"
    with ProcessGroup(cwd=REPO).up(llm, timeout_s=30) as group:
        proc = group.procs["llm"]
        seq_times, con_times, con_cpu, local_times = [], [], [], []
        for _ in range(1 if args.quick else 3):
            seq_s, seq = await run(items, url, args.concurrency, batched=False)
            local_s, local = await run(items, url, args.concurrency, batched=False, via_service=False)
            assert check(local, len(items)) == check(seq, len(items))
            local_times.append(round(local_s, 3))
            cpu0 = time.process_time() + cpu_seconds(proc.pid)
            con_s, con = await run(items, url, args.concurrency, batched=True)
            con_cpu.append(round(time.process_time() + cpu_seconds(proc.pid) - cpu0, 3))
            assert check(seq, len(items)) == check(con, len(items)), "both runs must score the same"
            seq_times.append(seq_s)
            con_times.append(con_s)
    sequential_s = statistics.median(seq_times)
    concurrent_s = statistics.median(con_times)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"judge LLM latency {args.latency_ms:g} ms, client concurrency {args.concurrency}, "
          f"runs {len(seq_times)}: sequential via POST /judge {seq_times}, sequential in-process (s3's loop "
          f"without the service hop) {local_times}, concurrent {con_times}; CPU seconds used by the "
          f"concurrent runs (bench + fake LLM) {con_cpu}; load average {load:.1f} on {os.cpu_count()} CPUs",
          file=sys.stderr)
    return {"items": len(items), "sequential_s": round(sequential_s, 3), "concurrent_s": round(concurrent_s, 3),
            "speedup": round(sequential_s / concurrent_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="one run instead of the median of three (< 1 min)")
    parser.add_argument("--items", type=int, default=120)
    parser.add_argument("--latency-ms", type=float, default=100.0)
    parser.add_argument("--concurrency", type=int, default=64,
                        help="judge LLM client concurrency limit (64: what a vLLM-served judge takes)")
    parser.add_argument("--min-speedup", type=float, default=8.0, help="exit 1 below this ratio")
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))
    if result["speedup"] < args.min_speedup:
        sys.exit(1)


if __name__ == "__main__":
    main()
