"""Where a search's CPU goes: the searcher and retriever processes of the real local stack, per search and per
component, for the served policy's s3 search and for naive top-k.

Starts the stack as `bench/searcher_latency.py` does (`plugsearch-stack --policy`, result cache off), then runs
closed-loop clients on the evaluation questions (rows 0-99 of hotpotqa, 2wikimultihopqa, nq, popqa; yes/no
left out), a phase per mode and client count. Per phase: searches done, and the CPU time of the searcher and of
the retriever (user + system from /proc, all threads) per search: what a search costs the machine, which other
load on a shared machine moves far less than wall-clock latency. With `--py-spy BIN` (py-spy's binary, e.g.
`pip install --target /tmp/pyspy py-spy` then `/tmp/pyspy/bin/py-spy`) both processes are sampled during each
phase and the samples summed by component (features, JSON, pydantic, HTTP server, middleware, encoder, FAISS,
bm25s, ...: `COMPONENTS`), as CPU ms per search and % of the process; the raw stacks are kept in `--out`.

    python bench/searcher_profile.py [--seconds 15] [--clients 1 16] [--modes s3 naive] [--py-spy /tmp/pyspy/bin/py-spy]

Final line: {"policy_model", "phases": {"s3_c16": {"searches", "cpu_ms_per_search": {"searcher", "retriever"},
"components": {"searcher": {name: {"ms", "pct"}}, "retriever": {...}}}, ...}}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, log  # noqa: E402
from bench.load import run_phase  # noqa: E402
from bench.searcher_latency import questions, start_stack  # noqa: E402
from tests.support.procs import cpu_seconds, descendants  # noqa: E402

COMPONENTS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    # (component, substrings of a frame "function (file:line)"); a sample counts for the first component
    # whose pattern matches its innermost frame that any pattern matches
    "searcher": [
        ("policy: document features", ("doc_features", "doc_columns", "DocText", "PoolTexts", "TextFacts",
                                       "TextCache", "_words (", "_content (", "_joined (", "title_core",
                                       "title_head", "bodies_with", "_incoming", "dense_features", "pool_of",
                                       "block_places", "CompactPolicy.features")),
        ("policy: candidates, scoring", ("searcher/compact/",)),
        ("retriever client: request/response models", ("post_model", "clients.py", "schemas/")),
        ("HTTP client (aiohttp, transport)", ("aiohttp", "transport.py", "plugsearch/common/http.py", "yarl",
                                             "multidict")),
        ("search loop and environment", ("searcher/env.py", "searcher/loop.py", "searcher/retrieval.py")),
        ("search service: params, response, cache key", ("searcher/serving.py", "searcher/parsing.py",
                                                         "common/cache.py", "searcher/api.py")),
        ("middleware: guard, admission, metrics, logging, tracing", ("common/guard.py", "common/app.py", "admission.py", "metrics",
                                                                     "prometheus", "tracing", "logging",
                                                                     "opentelemetry")),
        ("pydantic", ("pydantic",)),
        ("HTTP server (uvicorn, starlette, fastapi)", ("uvicorn", "starlette", "fastapi", "h11", "httptools")),
        ("asyncio event loop", ("asyncio", "uvloop", "selectors")),
    ],
    "retriever": [
        ("dense: query encoder (onnxruntime)", ("onnx_encoder", "onnxruntime", "encode_queries", "tokenizers")),
        ("dense: FAISS search", ("faiss", "dense.py")),
        ("bm25s", ("bm25", "numba", "Stemmer", "scipy")),
        ("documents and JSON render", ("docstore", "render", "documents (", "_rows (")),
        ("micro-batcher", ("batching.py", "concurrent/futures", "threading")),
        ("middleware: guard, admission, metrics, logging, tracing", ("common/guard.py", "common/app.py", "admission.py", "metrics",
                                                                     "prometheus", "tracing", "logging",
                                                                     "opentelemetry")),
        ("request model (pydantic)", ("pydantic", "schemas/")),
        ("HTTP server (uvicorn, starlette, fastapi)", ("uvicorn", "starlette", "fastapi", "h11", "httptools",
                                                       "retriever/api.py")),
        ("asyncio event loop", ("asyncio", "uvloop", "selectors")),
    ],
}


def classify(frames: list[str], rules: list[tuple[str, tuple[str, ...]]]) -> str:
    for frame in reversed(frames):  # innermost first
        for name, patterns in rules:
            if any(p in frame for p in patterns):
                return name
    return "other"


def summarise_stacks(path: Path, rules: list[tuple[str, tuple[str, ...]]], cpu_ms: float) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks summed by component: share of the samples, and that share of the
    process's measured CPU per search."""
    counts: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            stack, _, n = line.rpartition(" ")
            if not stack or not n.isdigit():
                continue
            frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
            counts[classify(frames, rules)] += int(n)
    total = sum(counts.values())
    return {"samples": total, **{name: {"pct": round(100 * n / total, 1), "ms": round(cpu_ms * n / total, 3)}
                                 for name, n in counts.most_common()}} if total else {"samples": 0}


def pids_of(stack_pid: int, module: str) -> list[int]:
    """The processes (workers included) of `python -m plugsearch.<module>` under the stack."""
    out = []
    for pid in descendants(stack_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"plugsearch.{module}".encode() in cmd:
            out += [p for p in descendants(pid)]
    return sorted(set(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=15.0, help="each phase's load window")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--modes", nargs="+", default=["s3", "naive"], choices=["s3", "naive"])
    parser.add_argument("--policy", default="compact", help="plugsearch-stack --policy")
    parser.add_argument("--py-spy", default=None, help="py-spy's binary: sample both processes in every phase")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--out", type=Path, default=REPO / "var" / "bench" / "searcher_profile")
    args = parser.parse_args()
    qs = questions()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc, info, _ = start_stack(args.policy, Path(tmp))
        url = info["searcher"]
        result: dict[str, Any] = {"phases": {}}
        try:
            version = httpx.get(f"{url}/version", timeout=10).json().get("details", {})
            result["policy_model"] = version.get("policy_model")
            n_docs = int(version.get("defaults", {}).get("select_k", 3))
            procs = {name: pids_of(proc.pid, name) for name in ("searcher", "retriever")}
            log(f"stack ready: policy {result['policy_model']}, processes {procs}")
            offset = 0
            for mode in args.modes:
                def body(i: int, mode: str = mode) -> dict[str, Any]:
                    extra = {"retrieve_k": n_docs} if mode == "naive" else {}
                    return {"question": qs[i % len(qs)], "mode": mode, **extra}

                asyncio.run(run_phase(url, qs, clients=1, seconds=2.0, timeout_s=120, offset=offset, body=body))
                for clients in args.clients:
                    name = f"{mode}_c{clients}"
                    spies = []
                    if args.py_spy:
                        for service, pids in procs.items():
                            spies.append(subprocess.Popen(
                                [args.py_spy, "record", "-p", str(pids[0]), "-d", str(int(args.seconds)), "-r",
                                 str(args.rate), "-f", "raw", "-o", str(args.out / f"{name}-{service}.txt"),
                                 "--nonblocking", "--subprocesses"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                        time.sleep(0.5)
                    cpu0 = {s: sum(cpu_seconds(p) for p in pids) for s, pids in procs.items()}
                    phase = asyncio.run(run_phase(url, qs, clients=clients, seconds=args.seconds, timeout_s=120,
                                                  offset=offset, body=body))
                    cpu1 = {s: sum(cpu_seconds(p) for p in pids) for s, pids in procs.items()}
                    for spy in spies:
                        spy.wait(timeout=args.seconds + 60)
                    offset += phase.answered + 10
                    done = max(1, phase.statuses.get(200, 0))
                    cpu_ms = {s: round(1000 * (cpu1[s] - cpu0[s]) / done, 3) for s in procs}
                    entry: dict[str, Any] = {"searches": done, "errors": phase.answered - done + phase.lost,
                                             "cpu_ms_per_search": cpu_ms}
                    if args.py_spy:
                        entry["components"] = {s: summarise_stacks(args.out / f"{name}-{s}.txt", COMPONENTS[s],
                                                                   cpu_ms[s]) for s in procs}
                    result["phases"][name] = entry
                    log(f"{name}: {json.dumps(entry)}")
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
