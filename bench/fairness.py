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

`--attack heavy-batch` (issue 39): the attacker key sends `--attack-clients` (4) concurrent `POST /search/batch`
of `--attack-items` (64) items `{"mode": "naive", "method": "hybrid", "retrieve_k": 50, "question": <4,096
characters>}`, each again as soon as the last one is answered (after a 429 it waits Retry-After; with
`--hostile` 50 ms). The ordinary key sends what it sends on `plugsearch-stack`: s3 searches of the shipped compact
policy over the retriever's BM25 + dense pool (the retriever serves dense: its MiniLM index is built on the
first run, minutes for the shared corpus), `--clients` (2) clients pausing `--think-ms` (1,000) after each
answer. The searcher keeps its default budgets (`SEARCHER_RATE_LIMIT_PER_S` 20, burst 256, 128 units per
request): what is measured is whether the price of the heavy items keeps them from slowing the other key.
Priced at 19.1 units an item, a batch of 64 is refused (422 `cost_limit_exceeded`) before any work;
`--attack-items 6` (114.6 units) is the largest such batch admitted, held back by the key's rate limit instead.
Target: `ordinary.p99_ratio` at most 2.

    python bench/fairness.py [--quick] [--seconds 30] [--clients 8] [--flood-clients 32] [--hostile]
    python bench/fairness.py --attack heavy-batch [--seconds 30] [--clients 2] [--attack-items 64]

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

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import PhaseResult, bench_stack, percentile, run_phase  # noqa: E402

FLOOD_KEY = "bench-flood-key-0001"
ORDINARY_KEY = "bench-ordinary-key-0002"
HEAVY_QUESTION_CHARS = 4096


def five_xx(result: PhaseResult) -> int:
    return sum(v for k, v in result.statuses.items() if k >= 500)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="10 s phases")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=None, help="the ordinary key's clients (8; heavy-batch: 2)")
    parser.add_argument("--flood-clients", type=int, default=32)
    parser.add_argument("--hostile", action="store_true", help="the flood ignores Retry-After (retries in 50 ms)")
    parser.add_argument("--llm-latency-ms", type=float, default=200.0)
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (s)")
    parser.add_argument("--corpus", type=Path, default=None, help="default: the shared combined corpus")
    parser.add_argument("--attack", choices=["flood", "heavy-batch"], default="flood",
                        help="flood: s3 and chat against the LLM (default); heavy-batch: batches of long hybrid "
                        "searches against the retriever")
    parser.add_argument("--attack-clients", type=int, default=4, help="heavy-batch: batches in flight at once")
    parser.add_argument("--attack-items", type=int, default=64, help="heavy-batch: items per batch")
    parser.add_argument("--think-ms", type=float, default=1000.0,
                        help="heavy-batch: the ordinary clients' pause after each answer")
    args = parser.parse_args(argv)
    if args.attack == "heavy-batch":
        args.clients = args.clients or 2
        heavy_batch(args)
        return
    args.clients = args.clients or 8
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


def heavy_question(i: int, questions: list[str]) -> str:
    """A distinct question of exactly `HEAVY_QUESTION_CHARS` characters (NQ questions run together)."""
    text = " ".join(questions[(i + j) % len(questions)] for j in range(120))
    return f"{i} {text}"[:HEAVY_QUESTION_CHARS]


def heavy_batch(args: argparse.Namespace) -> None:
    """The `--attack heavy-batch` scenario (module docstring)."""
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.trained import COMPACT_DIR

    seconds = 10.0 if args.quick else args.seconds
    compact = CompactPolicy.load(COMPACT_DIR)
    # the policy named: the bench stack also configures its fake LLM, which `auto` would pick for s3 searches
    searcher_env = {"SEARCHER_API_KEYS": f"{FLOOD_KEY},{ORDINARY_KEY}", "SEARCHER_CACHE_ENABLED": "false",
                    "SEARCHER_POLICY_KIND": "compact", "SEARCHER_COMPACT_POLICY": str(COMPACT_DIR),
                    "SEARCHER_COMPACT_DENSE": "auto"}
    stack, questions = bench_stack(args, searcher_env, "bench_fairness_heavy", dense=True)
    ordinary = {"Authorization": f"Bearer {ORDINARY_KEY}"}
    attacker = {"Authorization": f"Bearer {FLOOD_KEY}"}

    def search(i: int) -> dict[str, Any]:
        return {"question": questions[i % len(questions)], "mode": "s3"}

    # built once (a few distinct batches, sent in turn): the load generator shares the machine, and encoding
    # 64 x 4 KB per request would cost it more CPU than the searcher spends refusing it
    batches = [orjson.dumps({"items": [{"mode": "naive", "method": "hybrid", "retrieve_k": 50,
                                        "question": heavy_question(b * args.attack_items + j, questions)}
                                       for j in range(args.attack_items)]}) for b in range(16)]

    def batch(i: int) -> bytes:
        return batches[i % len(batches)]

    t_start = time.monotonic()
    with stack:
        url = stack.url("searcher")
        startup_s = time.monotonic() - t_start
        pause = args.think_ms / 1000
        asyncio.run(run_phase(url, questions, clients=1, seconds=2.0, timeout_s=args.timeout, body=search,
                              headers=ordinary))  # warm-up (the encoder's first calls)
        served = httpx.post(f"{url}/search", json=search(0), headers=ordinary, timeout=args.timeout).json()
        if served.get("policy_model") != compact.model or served.get("degraded"):
            raise SystemExit(f"the ordinary key is not served by {compact.model}: policy_model "
                             f"{served.get('policy_model')!r}, degraded {served.get('degraded')}")
        alone = asyncio.run(run_phase(url, questions, clients=args.clients, seconds=seconds, timeout_s=args.timeout,
                                      offset=1000, body=search, headers=ordinary, pause_s=pause))
        print(f"alone: ordinary {dict(alone.statuses)} failures {dict(alone.failures)}", file=sys.stderr)

        async def loaded() -> tuple[PhaseResult, PhaseResult]:
            return await asyncio.gather(
                run_phase(url, questions, clients=args.clients, seconds=seconds, timeout_s=args.timeout,
                          offset=3000, body=search, headers=ordinary, pause_s=pause),
                run_phase(url, questions, clients=args.attack_clients, seconds=seconds, timeout_s=args.timeout,
                          offset=0, body=batch, path=lambda i: "/search/batch", headers=attacker,
                          honour_retry_after=not args.hostile))

        beside, attack = asyncio.run(loaded())
        print(f"beside the attacker: ordinary {dict(beside.statuses)} failures {dict(beside.failures)}; attacker "
              f"{dict(attack.statuses)} {dict(attack.bodies)} failures {dict(attack.failures)}", file=sys.stderr)
    alone_p99, beside_p99 = percentile(alone.latencies_ms, 0.99), percentile(beside.latencies_ms, 0.99)
    result: dict[str, Any] = {
        "scenario": "heavy-batch",
        "ordinary": {
            "clients": args.clients, "think_ms": args.think_ms, "policy": served["policy_model"],
            "alone_requests": alone.answered + alone.lost, "beside_requests": beside.answered + beside.lost,
            "alone_p50_ms": round(percentile(alone.latencies_ms, 0.5), 1),
            "beside_p50_ms": round(percentile(beside.latencies_ms, 0.5), 1),
            "alone_p99_ms": round(alone_p99, 1), "beside_p99_ms": round(beside_p99, 1),
            "p99_ratio": round(beside_p99 / alone_p99, 2) if alone_p99 else None,
            "non_200": {str(k): v for k, v in (alone.statuses + beside.statuses).items() if k != 200},
            "lost": alone.lost + beside.lost,
        },
        "attacker": {
            "clients": args.attack_clients, "items_per_batch": args.attack_items, "hostile": args.hostile,
            "question_chars": HEAVY_QUESTION_CHARS, "requests": attack.answered + attack.lost,
            "status_200": attack.statuses.get(200, 0), "status_422": attack.statuses.get(422, 0),
            "status_429": attack.statuses.get(429, 0), "status_5xx": five_xx(attack), "by_type": dict(attack.bodies),
            "p50_ms_of_its_200s": round(percentile(attack.latencies_ms, 0.5), 1) if attack.latencies_ms else None,
            "lost": attack.lost, "load_generator_cpu_s": round(attack.client_cpu_s, 1),
        },
        "target": "ordinary.p99_ratio <= 2", "seconds": seconds, "startup_s": round(startup_s, 1),
        "quick": args.quick, "cpus": os.cpu_count(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
