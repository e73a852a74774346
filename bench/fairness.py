"""Two API keys on the local stack: one floods the LLM (s3 searches and chat answers), one sends ordinary
searches. Does the ordinary key keep its latency, and is the flood told to come back later?

`LocalStack` (bench/load.py): redis-server, the retriever (BM25 over the shared combined corpus), the searcher
(result cache off, both keys, the answering proxy on) and a fake LLM that serves one completion at a time
after `--llm-latency-ms` (200 ms), as llama.cpp's server does, with `SEARCHER_LLM_SLOTS=1` as
`plugsearch-stack` sets it for its llama.cpp, and per-key budgets high enough that the ordinary key's
closed-loop clients never spend theirs (the flood is held back by its share of the LLM alone). Phase 1 (unloaded): the ordinary key alone, `--clients` (8)
closed-loop clients sending naive searches (NQ questions). Phase 2 (loaded): the same, while the flood key's
`--flood-clients` (32) alternate s3 `/search` and `/v1/chat/completions` (naive search, max_tokens 64); the
flood honours Retry-After unless `--hostile` (then it retries after 50 ms). Both phases in the same run:
`ordinary.p99_ratio` = loaded p99 / unloaded p99 of the ordinary key's 200 answers.

    python bench/fairness.py [--quick] [--seconds 30] [--clients 8] [--flood-clients 32] [--hostile]

Final line: {"ordinary": {"unloaded_p99_ms", "loaded_p99_ms", "p99_ratio", "status_5xx", "non_200", ...},
             "flood": {"requests", "status_200", "status_429", "status_429_without_retry_after", "status_5xx",
                       ...}, ...}
Figures are indicative on a shared machine: compare the ratio, not the milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import PhaseResult, bench_stack, percentile, run_phase  # noqa: E402

FLOOD_KEY = "bench-flood-key-0001"
ORDINARY_KEY = "bench-ordinary-key-0002"


def five_xx(result: PhaseResult) -> int:
    return sum(v for k, v in result.statuses.items() if k >= 500)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="10 s phases")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=8, help="the ordinary key's clients")
    parser.add_argument("--flood-clients", type=int, default=32)
    parser.add_argument("--hostile", action="store_true", help="the flood ignores Retry-After (retries in 50 ms)")
    parser.add_argument("--llm-latency-ms", type=float, default=200.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    parser.add_argument("--corpus", type=Path, default=None, help="default: the shared combined corpus")
    args = parser.parse_args(argv)
    seconds = 10.0 if args.quick else args.seconds
    searcher_env = {"SEARCHER_API_KEYS": f"{FLOOD_KEY},{ORDINARY_KEY}", "SEARCHER_CACHE_ENABLED": "false",
                    "SEARCHER_LLM_SLOTS": "1", "SEARCHER_CHAT__MODE": "naive",
                    # budgets high enough for the ordinary key's closed-loop clients: what is measured is
                    # the sharing of admission and of the LLM, not a key's own budget
                    "SEARCHER_RATE_LIMIT_PER_S": "10000", "SEARCHER_RATE_LIMIT_BURST": "10000",
                    "SEARCHER_CHAT__ANSWER__MODEL": "fake-policy", "SEARCHER_CHAT__ANSWER__MAX_RETRIES": "0"}
    stack, questions = bench_stack(args, searcher_env, "bench_fairness", llm_slots=1)
    stack.specs["searcher"].env["SEARCHER_CHAT__ANSWER__BASE_URL"] = stack.options.url("llm") + "/v1"
    ordinary = {"Authorization": f"Bearer {ORDINARY_KEY}"}
    flood = {"Authorization": f"Bearer {FLOOD_KEY}"}

    def naive(i: int) -> dict[str, Any]:
        return {"question": questions[i % len(questions)], "mode": "naive"}

    def flood_body(i: int) -> dict[str, Any]:
        question = questions[i % len(questions)]
        if i % 2:
            return {"messages": [{"role": "user", "content": question}], "max_tokens": 64}
        return {"question": question, "mode": "s3"}

    def flood_path(i: int) -> str:
        return "/v1/chat/completions" if i % 2 else "/search"

    t_start = time.monotonic()
    with stack:
        url = stack.url("searcher")
        startup_s = time.monotonic() - t_start
        asyncio.run(run_phase(url, questions, clients=2, seconds=1.0, timeout_s=args.timeout, body=naive,
                              headers=ordinary))  # warm-up

        async def loaded() -> tuple[PhaseResult, PhaseResult]:
            return await asyncio.gather(
                run_phase(url, questions, clients=args.clients, seconds=seconds, timeout_s=args.timeout,
                          offset=3000, body=naive, headers=ordinary),
                run_phase(url, questions, clients=args.flood_clients, seconds=seconds, timeout_s=args.timeout,
                          offset=5000, body=flood_body, path=flood_path, headers=flood,
                          honour_retry_after=not args.hostile))

        alone = asyncio.run(run_phase(url, questions, clients=args.clients, seconds=seconds, timeout_s=args.timeout,
                                      offset=1000, body=naive, headers=ordinary))
        print(f"unloaded: ordinary {dict(alone.statuses)} failures {dict(alone.failures)}", file=sys.stderr)
        with_flood, flooding = asyncio.run(loaded())
        print(f"loaded: ordinary {dict(with_flood.statuses)} failures {dict(with_flood.failures)}; flood "
              f"{dict(flooding.statuses)} {dict(flooding.bodies)} failures {dict(flooding.failures)}", file=sys.stderr)
    unloaded_p99 = percentile(alone.latencies_ms, 0.99)
    loaded_p99 = percentile(with_flood.latencies_ms, 0.99)
    result: dict[str, Any] = {
        "ordinary": {
            "clients": args.clients, "unloaded_requests": alone.answered + alone.lost,
            "loaded_requests": with_flood.answered + with_flood.lost,
            "unloaded_p50_ms": round(percentile(alone.latencies_ms, 0.5), 1),
            "loaded_p50_ms": round(percentile(with_flood.latencies_ms, 0.5), 1),
            "unloaded_p99_ms": round(unloaded_p99, 1), "loaded_p99_ms": round(loaded_p99, 1),
            "p99_ratio": round(loaded_p99 / unloaded_p99, 2) if unloaded_p99 else None,
            "status_5xx": five_xx(alone) + five_xx(with_flood),
            "non_200": {str(k): v for k, v in (alone.statuses + with_flood.statuses).items() if k != 200},
            "lost": alone.lost + with_flood.lost,
        },
        "flood": {
            "clients": args.flood_clients, "hostile": args.hostile, "requests": flooding.answered + flooding.lost,
            "status_200": flooding.statuses.get(200, 0), "status_429": flooding.statuses.get(429, 0),
            "status_429_without_retry_after": flooding.no_retry_after, "status_5xx": five_xx(flooding),
            "by_type": dict(flooding.bodies), "lost": flooding.lost,
        },
        "seconds": seconds, "llm_latency_ms": args.llm_latency_ms, "startup_s": round(startup_s, 1),
        "quick": args.quick, "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
