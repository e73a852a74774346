"""Search quality with the local SmolLM2 policy: answer recall of the returned documents, per mode.

Real components: the retriever service (bm25s over ../shared/data/corpus/combined.jsonl, index cached under
var/indexes) and llama.cpp's server with SmolLM2-135M-Instruct as the policy; the loop is the searcher's own
(`services.searcher.loop.run_search`, called in-process; the HTTP layer does not change quality).

For the first N HotpotQA and N NQ questions (yes/no questions skipped: substring recall cannot judge them):
- naive: top-k of the question (the baseline);
- s3 and qagent, each with constrained decoding (llama.cpp GBNF grammar) and free decoding.
Answer recall = share of questions with at least one returned document whose text contains a gold answer
(s3's normalisation on both sides + DrQA tokens: `services.common.answers.span_match`). Valid action rate =
valid / (valid + invalid) policy actions over all s3 and qagent searches of that decoding.
`recall` reports s3/qagent with constrained decoding (`recall_free` the same with free decoding, on the
first `--free-n` questions of each set: SmolLM2 on 2 CPU cores takes ~12 s per s3 search, so the full
run with both decodings on 100 + 100 questions would take over 2 hours).

Every finished search is appended to var/bench/search_quality/searches-<settings>.jsonl; a killed or
stopped run started again with the same settings resumes from there (degraded searches, where the policy
failed, run again; `--restart` discards everything; `--report` summarises a partial run).

Final line: {"recall": {mode: {dataset: r}}, "docs_returned": {mode: avg}, "valid_action_rate":
{"constrained": .., "free": ..}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from services.common.answers import span_match
from services.common.clients import RetrieverClient
from services.common.http import ClientSettings
from services.common.llm import LLMSettings, OpenAIChatClient
from services.common.schemas.searcher import SearchParams
from services.searcher.env import SearchOutcome
from services.searcher.loop import run_search
from services.searcher.prompts import PROMPT_VERSION
from services.searcher.retrieval import ServiceRetriever
from services.searcher.testing import ensure_bm25_index, load_questions, retriever_process

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("PLUGSEARCH_DATA", REPO.parent / "shared" / "data"))
VAR = REPO / "var"
DATASETS = ("hotpotqa", "nq")


def hit(outcome: SearchOutcome, answers: list[str]) -> bool:
    return any(span_match(doc.text, answers) for doc in outcome.documents)


def results_path(args: argparse.Namespace, model: str) -> Path:
    """One JSONL of finished searches per setting (a killed run resumes from it; other settings start anew)."""
    settings = {"max_turns": args.max_turns, "retrieve_k": args.retrieve_k, "select_k": args.select_k,
                "doc_chars": args.doc_chars, "max_new_tokens": args.max_new_tokens, "model": model,
                "prompt_version": PROMPT_VERSION}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(args.out) / f"searches-{digest}.jsonl"


def read_results(path: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Finished searches by (dataset, id, label); the last line of a search run again wins, and a line cut
    short by a kill is skipped (that search runs again)."""
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        latest[(row["dataset"], row["id"], row["label"])] = row
    return latest


async def evaluate(args: argparse.Namespace, retriever_url: str, llm_url: str, model: str) -> dict[str, Any]:
    policy = OpenAIChatClient(LLMSettings(base_url=llm_url, model=model, timeout_s=600, max_retries=0))
    client = RetrieverClient(ClientSettings(url=retriever_url, timeout_s=60))
    retriever = ServiceRetriever(client)
    runs = [("naive", None), ("s3", True), ("s3", False), ("qagent", True), ("qagent", False)]
    path = results_path(args, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    done: dict[tuple[str, str, str], dict[str, Any]] = {}
    if path.exists() and not args.restart:
        # degraded searches (the policy failed: infrastructure, not quality) run again
        done = {key: row for key, row in read_results(path).items() if not row["degraded"]}
        log(f"resuming: {len(done)} searches already in {path}")
    elif path.exists():
        path.unlink()
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        with path.open("a") as sink:
            sets = {d: load_questions(DATA / "qa" / f"{d}.jsonl", args.n) for d in DATASETS}
            # question by question across the sets, so a partial run covers both of them evenly
            order = [(qi, d) for qi in range(args.n) for d in DATASETS if qi < len(sets[d])]
            for qi, dataset in order:
                row = sets[dataset][qi]
                qid = str(row.get("id", qi))
                for mode, constrained in runs:
                    if constrained is False and qi >= args.free_n:
                        continue
                    label = mode if constrained is not False else f"{mode}_free"
                    record = done.get((dataset, qid, label))
                    if record is None:
                        params = SearchParams(mode=mode, max_turns=args.max_turns, retrieve_k=args.retrieve_k,
                                              select_k=args.select_k, doc_chars=args.doc_chars,
                                              max_new_tokens=args.max_new_tokens, constrained=bool(constrained))
                        out = await run_search(row["question"], params, policy=policy, retriever=retriever)
                        record = {"dataset": dataset, "id": qid, "label": label,
                                  "hit": hit(out, row["golden_answers"]), "docs": len(out.documents),
                                  "valid": out.valid_actions, "invalid": out.invalid_actions,
                                  "degraded": out.degraded, "stop_reason": out.stop_reason}
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                    records.append(record)
                log(f"{dataset} {qi + 1}/{len(sets[dataset])} done, {time.perf_counter() - t0:.0f} s")
    finally:
        await policy.aclose()
        await client.aclose()
    return summarise(records, args, model, path, time.perf_counter() - t0)


def summarise(records: list[dict[str, Any]], args: argparse.Namespace, model: str, path: Path,
              seconds: float) -> dict[str, Any]:
    def of(label: str) -> list[dict[str, Any]]:
        return [r for r in records if r["label"] == label]

    def recall_of(label: str) -> dict[str, float]:
        return {d: round(statistics.mean(r["hit"] for r in of(label) if r["dataset"] == d), 3)
                for d in DATASETS if any(r["dataset"] == d for r in of(label))}

    def docs_of(label: str) -> float:
        return round(statistics.mean(r["docs"] for r in of(label)), 2)

    def searched(free: bool) -> list[dict[str, Any]]:  # s3 and qagent runs of one decoding
        return [r for r in records if r["label"] != "naive" and r["label"].endswith("_free") == free]

    def rate(free: bool) -> float | None:
        rows = searched(free)
        total = sum(r["valid"] + r["invalid"] for r in rows)
        return round(sum(r["valid"] for r in rows) / total, 3) if total else None

    def all_valid(free: bool) -> float | None:
        rows = searched(free)
        return round(statistics.mean(r["invalid"] == 0 and r["valid"] > 0 for r in rows), 3) if rows else None

    return {
        "recall": {mode: recall_of(mode) for mode in ("s3", "qagent", "naive")},
        "docs_returned": {mode: docs_of(mode) for mode in ("s3", "qagent", "naive")},
        "valid_action_rate": {"constrained": rate(False), "free": rate(True)},
        "recall_free": {mode: recall_of(f"{mode}_free") for mode in ("s3", "qagent")},
        "docs_returned_free": {mode: docs_of(f"{mode}_free") for mode in ("s3", "qagent")},
        "searches_all_actions_valid": {"constrained": all_valid(False), "free": all_valid(True)},
        "degraded_searches": sum(bool(r["degraded"]) for r in records),
        "questions_per_dataset": args.n,
        "free_decoding_questions_per_dataset": min(args.free_n, args.n),
        "settings": {"max_turns": args.max_turns, "retrieve_k": args.retrieve_k, "select_k": args.select_k,
                     "doc_chars": args.doc_chars, "max_new_tokens": args.max_new_tokens, "retriever": "bm25s",
                     "policy": model},
        "results_file": str(path),
        "seconds_this_run": round(seconds, 1),
        "quick": args.quick,
    }


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 question per dataset, 1 turn, k=3 (< 1 minute on "
                        "an idle machine)")
    parser.add_argument("--n", type=int, default=100, help="questions per dataset")
    parser.add_argument("--free-n", type=int, default=None,
                        help="questions per dataset also searched with free decoding (default: all --n); the "
                             "constrained runs give `recall`, the free ones only `recall_free` and the valid rate")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--retrieve-k", type=int, default=8)
    parser.add_argument("--select-k", type=int, default=3)
    parser.add_argument("--doc-chars", type=int, default=300, help="document characters shown to the policy "
                        "(SmolLM2 serves a 4096-token context)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads")
    parser.add_argument("--llm-url", default=None, help="use this OpenAI-compatible server instead of starting one")
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default=str(VAR / "bench" / "search_quality"),
                        help="finished searches are appended here; a rerun with the same settings resumes")
    parser.add_argument("--restart", action="store_true", help="discard finished searches of these settings")
    parser.add_argument("--report", action="store_true", help="only summarise the searches finished so far "
                        "(a partial run: says `partial` and how many questions are done)")
    args = parser.parse_args()
    if args.free_n is None:
        args.free_n = args.n
    if args.quick:
        args.free_n, args.restart = 1, True
        args.n, args.max_turns, args.retrieve_k, args.select_k, args.doc_chars = 1, 1, 3, 2, 200
        args.max_new_tokens = 64

    if args.report:
        model = args.model or "smollm2-135m-instruct"
        path = results_path(args, model)
        if not path.exists():
            parser.error(f"no finished searches for these settings ({path})")
        records = list(read_results(path).values())
        print(json.dumps({**summarise(records, args, model, path, 0.0), "partial": True,
                          "questions_done": {d: len({r["id"] for r in records if r["dataset"] == d})
                                             for d in DATASETS}}))
        return
    corpus = DATA / "corpus" / "combined.jsonl"
    index_dir = ensure_bm25_index(corpus, VAR)
    with ExitStack() as stack:
        retriever_url = stack.enter_context(retriever_process(corpus, index_dir, VAR / "logs" / "bench_retriever.log"))
        if args.llm_url:
            llm_url, model = args.llm_url, args.model or "smollm2-135m-instruct"
        else:
            from services.common.llama_server import LlamaServer

            server = stack.enter_context(LlamaServer(n_threads=args.threads, n_ctx=4096,
                                                     log_path=VAR / "logs" / "bench_llama.log"))
            llm_url, model = server.base_url, server.model_alias
        result = asyncio.run(evaluate(args, retriever_url, llm_url, model))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
