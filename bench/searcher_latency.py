"""`POST /search` end to end on the running local stack: the served searcher policy against naive top-k in
the same run.

Starts `plugsearch-stack` (the README's first command: Redis, llama.cpp, retriever, generator, judge,
searcher; `--policy` as given, default auto = what a new user gets) on free ports with the searcher's result
cache off, then runs closed-loop clients on the evaluation questions in turn (rows 0-99 of hotpotqa,
2wikimultihopqa, nq, popqa; with the cache off a repeated question is searched again): 1 client (p50 / p95 latency) and `--clients`
(16) clients (searches/s), each for `--seconds`, for the served policy's s3 search and for naive top-k with
as many documents. Also reads, from traced searches, how many documents the policy scored per search (the
compact policy's cost: its features are read from every document of every block) and the searches issued.

    python bench/searcher_latency.py [--seconds 20] [--clients 16] [--policy auto]

Final line: {"policy_model", "corpus_check" (the searcher's verdict on the corpus: s3 is the policy only where it
says policy), "s3": {"p50_ms", "p95_ms", "rps_16", ...}, "naive": {...},
"ratios": {"p50_s3_over_naive", "rps_s3_over_naive"}, "documents_scored_per_search", ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, load_questions, log  # noqa: E402
from bench.load import percentile, run_phase  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402

SETS = ("hotpotqa", "2wikimultihopqa", "nq", "popqa")


def questions() -> list[str]:
    out: list[str] = []
    for name in SETS:
        out.extend(q.question for q in load_questions(name, 100) if not is_yes_no(q.golden_answers))
    return out


def start_stack(policy: str, folder: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any], Path]:
    ready, log_path = folder / "ready.json", folder / "stack.log"
    env = {**os.environ, "SEARCHER_CACHE_ENABLED": "false", "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.stack", "--free-ports", "--no-color",
                                 "--ready-file", str(ready), "--policy", policy], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit(f"the stack did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(0.5)
    return proc, json.loads(ready.read_text()), log_path


def summary(result: Any) -> dict[str, Any]:
    lat = result.latencies_ms
    return {"requests_ok": len(lat), "errors": result.answered - result.statuses.get(200, 0) + result.lost,
            "degraded": result.bodies.get("degraded", 0), "p50_ms": round(percentile(lat, 0.5), 1),
            "p95_ms": round(percentile(lat, 0.95), 1), "rps": round(result.ok_in_window / result.seconds, 2),
            "statuses": {str(k): v for k, v in sorted(result.statuses.items())}, "failures": dict(result.failures),
            "refused": dict(result.bodies - Counter({"ok": result.bodies["ok"], "degraded": result.bodies["degraded"]}))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase's load window")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--policy", default="auto", help="plugsearch-stack --policy")
    parser.add_argument("--traced", type=int, default=40, help="traced searches to count documents scored")
    args = parser.parse_args()
    qs = questions()
    with tempfile.TemporaryDirectory() as tmp:
        proc, info, _ = start_stack(args.policy, Path(tmp))
        url = info["searcher"]
        try:
            version = httpx.get(f"{url}/version", timeout=10).json().get("details", {})
            policy_model = version.get("policy_model")
            defaults = version.get("defaults", {})
            log(f"stack ready: policy {policy_model}, defaults {defaults}")
            n_docs = int(defaults.get("select_k", 3))
            offset = 0
            check = version.get("corpus_check") or {}
            verdict = (check.get("last") or {}).get("decision")
            if verdict == "naive":
                log("the corpus check serves naive BM25 for s3 searches on this stack: s3 is timed as that")
            out: dict[str, Any] = {"policy_model": policy_model, "defaults": defaults,
                                   "corpus_check": {k: (check.get("last") or {}).get(k) for k in
                                                    ("decision", "difference", "interval", "questions", "seconds")}}
            for mode in ("s3", "naive"):
                def body(i: int, mode: str = mode) -> dict[str, Any]:
                    extra = {"retrieve_k": n_docs} if mode == "naive" else {}
                    return {"question": qs[i % len(qs)], "mode": mode, **extra}

                asyncio.run(run_phase(url, qs, clients=1, seconds=2.0, timeout_s=120, offset=offset, body=body))
                one = asyncio.run(run_phase(url, qs, clients=1, seconds=args.seconds, timeout_s=120,
                                            offset=offset, body=body))
                offset += one.answered + 10
                many = asyncio.run(run_phase(url, qs, clients=args.clients, seconds=args.seconds, timeout_s=120,
                                             offset=offset, body=body))
                offset += many.answered + 10
                out[mode] = {"one_client": summary(one), f"clients_{args.clients}": summary(many)}
                log(f"{mode}: {json.dumps(out[mode])}")
            scored, searches = [], []
            with httpx.Client(timeout=120) as client:
                for q in qs[:args.traced]:
                    body = client.post(f"{url}/search", json={"question": q, "mode": "s3", "return_trace": True}).json()
                    scored.append(sum(len(b["document_ids"]) for b in body["trace"]["blocks"]))
                    searches.append(len(body["queries"]))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    s3, naive = out["s3"], out["naive"]
    many = f"clients_{args.clients}"
    out["documents_scored_per_search"] = round(statistics.fmean(scored), 1) if scored else None
    out["searches_per_search"] = round(statistics.fmean(searches), 2) if searches else None
    out["ratios"] = {"p50_s3_over_naive": round(s3["one_client"]["p50_ms"] / naive["one_client"]["p50_ms"], 2),
                     "rps_s3_over_naive": round(s3[many]["rps"] / naive[many]["rps"], 3)}
    out["settings"] = {"seconds": args.seconds, "clients": args.clients, "questions": len(qs), "cache": "off"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
