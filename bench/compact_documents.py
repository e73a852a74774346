"""The compact policy's documents on the evaluation questions: what it returns, saved, so a change to its code can
be checked to return exactly the same.

The packaged compact policy (`plugsearch/searcher/trained/compact`, or `--policy FOLDER`) searches each of the 388
evaluation questions (rows 0-99 of hotpotqa, 2wikimultihopqa, nq and popqa, yes/no questions left out, as
`bench/search_quality.py --compact` does) in the setting it was trained in and is served with (its manifest's
`search`: a BM25 top-30 + MiniLM dense top-30 pool, up to 2 follow-up BM25 searches, 3 documents). The retriever is
`bench/search_quality.py`'s: the retriever service's own backends and the stack's indexes in-process (bm25s and the
MiniLM flat FAISS index, `var/indexes/<corpus>-<sha256>`, built when missing); `--searcher URL` asks a running
searcher's `POST /search` instead (the policy as served, over HTTP: a stack started with `plugsearch-stack` and its
result cache off gives the same documents).

    python bench/compact_documents.py [--out var/bench/compact_documents/reference.json]
    python bench/compact_documents.py --check var/bench/compact_documents/reference.json [--out ...]

Writes {"policy", "setting", "questions": [{"dataset", "id", "question", "documents": [3 ids], "queries"}]} to
`--out`; with `--check FILE` compares every question's document ids and queries with that file's.
Final line: {"questions", "policy", "seconds", "ms_per_search", "cpu_ms_per_search" (both with the indexes'
loading, in-process), "policy_ms_per_search" and "policy_cpu_ms_per_search" (in-process: the policy's own steps,
wall-clock and its thread's CPU time)[, "same_documents",
"same_queries", "differences"]}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, REPO, load_questions, log  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402
from plugsearch.common.schemas.searcher import SearchParams  # noqa: E402

SETS = ("hotpotqa", "2wikimultihopqa", "nq", "popqa")
DEFAULT_OUT = REPO / "var" / "bench" / "compact_documents" / "documents.json"


def evaluation_questions(n: int) -> list[tuple[str, str, str]]:
    """(dataset, id, question) of the first `n` rows of each set, yes/no ones left out."""
    return [(name, q.id, q.question) for name in SETS for q in load_questions(name, n)
            if not is_yes_no(q.golden_answers)]


def final_ranking(policy: Any, question: str, blocks: Any, n: int = 10) -> list[str]:
    """The ids of the `n` best-scored documents of the search's final pool (the policy's last step)."""
    import numpy as np

    from plugsearch.searcher.compact import QuestionInfo, pool_of

    pool = pool_of(blocks)
    _, x, scorer = policy.features(QuestionInfo.of(question), pool, blocks)
    return [pool[i].doc.id for i in np.argsort(-policy.doc_logits(x, scorer), kind="stable")[:n]]


class Recording:
    """A retriever wrapper that keeps every retrieval's (id, score) lists by method and query (`--fixture`)."""

    def __init__(self, retriever: Any) -> None:
        self.retriever = retriever
        self.seen: dict[str, dict[str, list[list[Any]]]] = {}

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Any]]:
        found = await self.retriever.retrieve(queries, k, method)
        for query, docs in zip(queries, found, strict=True):
            self.seen.setdefault(method or "bm25", {})[query] = [[d.id, d.score] for d in docs]
        return found


async def in_process(policy_dir: Path, questions: list[tuple[str, str, str]], no_dense: bool,
                     fixture: tuple[Path, int] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.loop import run_search
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.retrieval import IndexRetriever

    policy = CompactPolicy.load(policy_dir)
    retriever = IndexRetriever(CORPUS, index_dir_for(CORPUS, REPO / "var"), dense=not no_dense)
    decide, cpu = policy.decide, [0.0]

    def timed(*args: Any, **kwargs: Any) -> Any:  # the policy's CPU time (its thread's), whatever else runs
        t0 = time.thread_time()
        try:
            return decide(*args, **kwargs)
        finally:
            cpu[0] += time.thread_time() - t0

    policy.decide = timed  # type: ignore[method-assign]
    setting = policy.search_setting()
    params = SearchParams(mode="s3", pool_methods=policy.pool_methods(list(retriever.methods), retriever.encoder),
                          **setting)
    rows = []
    sample = set() if fixture is None else {
        (d, q) for name in SETS for d, _, q in [x for x in questions if x[0] == name][:fixture[1]]}
    pinned = []
    for dataset, qid, question in questions:
        recording = Recording(retriever) if fixture is not None and (dataset, question) in sample else None
        outcome = await run_search(question, params, policy=policy, retriever=recording or retriever)
        if recording is not None:
            pinned.append({"dataset": dataset, "id": qid, "question": question, "retrievals": recording.seen,
                           "documents": [d.id for d in outcome.documents], "queries": list(outcome.queries),
                           "ranking": final_ranking(policy, question, outcome.blocks)})
        rows.append({"dataset": dataset, "id": qid, "question": question,
                     "documents": [d.id for d in outcome.documents], "queries": list(outcome.queries),
                     "policy_ms": outcome.timings.policy_ms})
    rows[0]["policy_cpu_ms_total"] = 1000 * cpu[0]
    if fixture is not None:
        fixture[0].write_text(json.dumps({"policy": policy.model, "corpus": CORPUS.name,
                                          "setting": params.model_dump(include={"retrieve_k", "select_k",
                                                                                "max_turns", "pool_methods"}),
                                          "questions": pinned}, separators=(",", ":")) + "\n")
    return rows, {**params.model_dump(include={"retrieve_k", "select_k", "max_turns", "pool_methods"})}, policy.model


async def served(url: str, questions: list[tuple[str, str, str]]) -> tuple[list[dict[str, Any]], dict[str, Any], str]:
    import httpx

    rows, model, defaults = [], "", {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        defaults = (await http.get("/version")).json().get("details", {}).get("defaults", {})
        for dataset, qid, question in questions:
            response = await http.post("/search", json={"question": question, "mode": "s3"})
            response.raise_for_status()
            body = response.json()
            model = body.get("policy_model") or model
            rows.append({"dataset": dataset, "id": qid, "question": question,
                         "documents": [d["id"] for d in body["documents"]], "queries": body["queries"]})
    return rows, defaults, model


def compare(rows: list[dict[str, Any]], reference: dict[str, Any]) -> dict[str, Any]:
    ref = {(r["dataset"], r["id"]): r for r in reference["questions"]}
    differences = []
    same_docs = same_queries = 0
    for row in rows:
        old = ref.get((row["dataset"], row["id"]))
        if old is None:
            differences.append({"dataset": row["dataset"], "id": row["id"], "missing_in_reference": True})
            continue
        docs_ok, queries_ok = old["documents"] == row["documents"], old["queries"] == row["queries"]
        same_docs += docs_ok
        same_queries += queries_ok
        if not (docs_ok and queries_ok):
            differences.append({"dataset": row["dataset"], "id": row["id"], "reference": old["documents"],
                                "now": row["documents"], "reference_queries": old["queries"],
                                "queries": row["queries"]})
    return {"same_documents": same_docs, "same_queries": same_queries, "of": len(rows),
            "differences": differences[:20], "n_differences": len(differences)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--policy", type=Path, default=None, help="compact policy folder (default: the packaged one)")
    parser.add_argument("--n", type=int, default=100, help="first n rows of every set (the evaluation rows)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", type=Path, default=None, help="compare with this earlier output")
    parser.add_argument("--searcher", default=None, help="a running searcher's URL (cache off) instead of in-process")
    parser.add_argument("--no-dense", action="store_true", help="in-process: BM25 pool only (the lexical scorer)")
    parser.add_argument("--profile", type=Path, default=None, help="in-process: write a cProfile dump here")
    parser.add_argument("--fixture", type=Path, default=None, help="in-process: also write the first "
                        "--fixture-n questions of each set with every retrieval's (id, score) lists here (the "
                        "sample tests/unit/test_compact_pinned.py replays)")
    parser.add_argument("--fixture-n", type=int, default=3)
    args = parser.parse_args()
    if args.n > 100:
        raise SystemExit("--n: rows 0-99 are the evaluation rows; 100-199 are reserved")
    from plugsearch.searcher.trained import COMPACT_DIR

    questions = evaluation_questions(args.n)
    log(f"{len(questions)} questions")
    fixture = (args.fixture, args.fixture_n) if args.fixture is not None else None
    t0, cpu0 = time.perf_counter(), time.process_time()
    if args.searcher:
        rows, setting, model = asyncio.run(served(args.searcher, questions))
    elif args.profile is not None:
        import cProfile

        profiler = cProfile.Profile()
        rows, setting, model = profiler.runcall(asyncio.run, in_process(args.policy or COMPACT_DIR, questions,
                                                                        args.no_dense, fixture))
        args.profile.parent.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(args.profile))
    else:
        rows, setting, model = asyncio.run(in_process(args.policy or COMPACT_DIR, questions, args.no_dense, fixture))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    policy_ms = [row.pop("policy_ms") for row in rows if "policy_ms" in row]
    policy_cpu_ms = rows[0].pop("policy_cpu_ms_total", None) if rows else None
    args.out.write_text(json.dumps({"policy": model, "setting": setting, "n_per_set": args.n,
                                    "questions": rows}, indent=1) + "\n")
    summary: dict[str, Any] = {"questions": len(rows), "policy": model, "out": str(args.out),
                               "seconds": round(seconds, 1), "ms_per_search": round(1000 * seconds / len(rows), 2),
                               "cpu_ms_per_search": round(1000 * cpu / len(rows), 2)}
    if policy_ms:  # in-process: the policy's own time (features, scoring, candidates) per search
        summary["policy_ms_per_search"] = round(sum(policy_ms) / len(policy_ms), 2)
    if policy_cpu_ms is not None:  # its CPU time (thread time): what other load on the machine barely moves
        summary["policy_cpu_ms_per_search"] = round(policy_cpu_ms / len(rows), 2)
    if args.check is not None:
        summary.update(compare(rows, json.loads(args.check.read_text())))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
