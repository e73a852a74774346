"""Search quality at equal cost: answer recall of the searcher's documents against naive top-k with as many
documents, for the untrained and the trained local searcher, on held-out questions.

The retriever service (bm25s) and llama.cpp's server with SmolLM2-135M-Instruct, plain (`s3_base`) and with
the trained LoRA adapter (`s3_trained`, `--adapter`); the searcher's own loop in-process, both policies in the
trained searcher's setting with constrained decoding, so only the adapter differs. Questions: the first `--n`
of each set (the evaluation hold-out), yes/no ones skipped. Answer recall = 1 when a document contains a gold
answer (`span_match`), averaged. matched: each policy's documents against naive top-n at the n it returned;
budget3 / budget5: the first 3 / 5 documents against naive top-3 / top-5; ci95: 95% bootstrap intervals over
questions (2,000 resamples, fixed seed) for every figure and for the paired difference trained - naive.

`--compact FOLDER` (and `--compact-warm FOLDER`) compares the compact policy instead, with the trainer's
equal-budget evaluation (`plugsearch.trainer.common.evaluation.BudgetEval`, what `plugsearch-train compact --qa` reports),
in-process over the retriever's own backends and the stack's indexes (bm25s and the MiniLM flat FAISS index, built when missing),
per set (hotpotqa, 2wikimultihopqa, nq, popqa): naive bm25, dense and hybrid (RRF) top-n, the untrained
MiniLM re-ranking the policy's own pool (cosine), and the policy as served (a BM25 + dense pool) and on a BM25
pool alone; answer recall and all-supporting-passages recall at 3 and 5 documents (the policy's own n is 3:
`budget3` is the matched comparison), with the same intervals; HotpotQA also split by its gold passages
(full paragraphs, or only the supporting sentences as most are in combined.jsonl).

Every finished search is appended to var/bench/search_quality/searches-<settings>.jsonl; a killed run started
again with the same settings resumes (`--restart` discards, `--report` summarises a partial run).

Final line: {"datasets": {name: {"matched": {...}, "budget3": {...}, "budget5": {...}, "docs": {...},
"n": ..}}, "all": {...}, "settings": {...}}
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, REPO, load_questions, log  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402
from plugsearch.common.clients import RetrieverClient  # noqa: E402
from plugsearch.common.http import ClientSettings  # noqa: E402
from plugsearch.common.llm import LLMSettings, OpenAIChatClient  # noqa: E402
from plugsearch.common.schemas.base import Document  # noqa: E402
from plugsearch.common.schemas.searcher import SearchParams  # noqa: E402
from plugsearch.common.stats import bootstrap_interval  # noqa: E402
from plugsearch.searcher.loop import run_search  # noqa: E402
from plugsearch.searcher.policy import ChatPolicy  # noqa: E402
from plugsearch.searcher.prompts import PromptSet  # noqa: E402
from plugsearch.searcher.retrieval import ServiceRetriever  # noqa: E402
from plugsearch.searcher.trained import LORA_DIR, TrainedSearcher, sha256  # noqa: E402
from plugsearch.trainer.common.evaluation import documents_hit as hit  # noqa: E402
from tests.support.services import ensure_bm25_index, retriever_process  # noqa: E402

VAR = REPO / "var"
DATASETS = ("hotpotqa", "nq", "2wikimultihopqa")
BUDGETS = (3, 5)
POLICIES = ("s3_base", "s3_trained")


def results_path(args: argparse.Namespace, params: SearchParams, prompts: PromptSet, adapter_digest: str) -> Path:
    settings = {"params": params.model_dump(), "prompts": prompts.version, "adapter": adapter_digest,
                "n": args.n, "budgets": BUDGETS}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    return Path(args.out) / f"searches-{digest}.jsonl"


def read_results(path: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Finished searches by (dataset, id, policy); a line cut by a kill is skipped (searched again)."""
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    if not path.exists():
        return latest
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        latest[(row["dataset"], row["id"], row["policy"])] = row
    return latest


async def evaluate(args: argparse.Namespace, retriever_url: str, policies: dict[str, tuple[str, str]],
                   params: SearchParams, prompts: PromptSet, path: Path,
                   done: dict[tuple[str, str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    client = RetrieverClient(ClientSettings(url=retriever_url, timeout_s=60))
    retriever = ServiceRetriever(client)
    llms = {name: OpenAIChatClient(LLMSettings(base_url=url, model=model, timeout_s=600, max_retries=1))
            for name, (url, model) in policies.items()}
    records: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    sets = {d: [r for r in load_questions(d, args.n) if not is_yes_no(r.golden_answers)]
            for d in args.datasets}
    order = [(i, d) for i in range(args.n) for d in args.datasets if i < len(sets[d])]
    try:
        with path.open("a") as sink:
            for i, dataset in order:
                row = sets[dataset][i]
                qid = row.id
                naive: list[Document] | None = None
                for name, llm in llms.items():
                    record = done.get((dataset, qid, name))
                    if record is None:
                        if naive is None:
                            depth = max(20, *BUDGETS)
                            naive = (await retriever.retrieve([row.question], depth, params.method))[0]
                        out = await run_search(row.question, params, policy=ChatPolicy(llm), retriever=retriever,
                                               prompts=prompts)
                        answers = row.golden_answers
                        n = len(out.documents)
                        if n > len(naive):
                            naive = (await retriever.retrieve([row.question], n, params.method))[0]
                        record = {
                            "dataset": dataset, "id": qid, "policy": name, "docs": n,
                            "hit": hit(out.documents, answers), "naive_hit_n": hit(naive[:n], answers),
                            **{f"hit_{b}": hit(out.documents[:b], answers) for b in BUDGETS},
                            **{f"naive_hit_{b}": hit(naive[:b], answers) for b in BUDGETS},
                            "queries": out.queries, "stop_reason": out.stop_reason, "degraded": out.degraded,
                            "valid": out.valid_actions, "invalid": out.invalid_actions}
                        sink.write(json.dumps(record) + "\n")
                        sink.flush()
                    records.append(record)
                log(f"{dataset} {i + 1}/{len(sets[dataset])} done, {time.perf_counter() - t0:.0f} s")
    finally:
        for llm in llms.values():
            await llm.aclose()
        await client.aclose()
    return records


def summarise(records: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    def mean(values: Sequence[float]) -> float:
        return round(statistics.mean(values), 3) if values else float("nan")

    def block(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
        by = {name: [r for r in rows if r["policy"] == name] for name in names}
        ids = set.intersection(*({(r["dataset"], r["id"]) for r in v} for v in by.values())) if by else set()
        by = {k: sorted((r for r in v if (r["dataset"], r["id"]) in ids), key=lambda r: (r["dataset"], r["id"]))
              for k, v in by.items()}
        out: dict[str, Any] = {"n": len(ids), "matched": {}, "docs": {}}
        ci: dict[str, Any] = {}
        for name, rs in by.items():
            own, naive = [float(r["hit"]) for r in rs], [float(r["naive_hit_n"]) for r in rs]
            out["matched"][name] = mean(own)
            out["matched"][f"naive_at_{name}_n"] = mean(naive)
            out["matched"][f"gain_{name}"] = round(mean(own) - mean(naive), 3)
            ci[name] = bootstrap_interval(own)
            ci[f"naive_at_{name}_n"] = bootstrap_interval(naive)
            ci[f"gain_{name}"] = bootstrap_interval([a - b for a, b in zip(own, naive, strict=True)])
            out["docs"][name] = mean([r["docs"] for r in rs])
        out["matched"]["ci95"] = ci
        for b in BUDGETS:
            first = next(iter(by.values()), [])
            fixed: dict[str, Any] = {"naive": mean([float(r[f"naive_hit_{b}"]) for r in first])}
            fixed_ci: dict[str, Any] = {"naive": bootstrap_interval([float(r[f"naive_hit_{b}"]) for r in first])}
            for name, rs in by.items():
                vals = [float(r[f"hit_{b}"]) for r in rs]
                fixed[name] = mean(vals)
                fixed_ci[name] = bootstrap_interval(vals)
                fixed_ci[f"gain_{name}"] = bootstrap_interval([a - float(r[f"naive_hit_{b}"])
                                                       for a, r in zip(vals, rs, strict=True)])
            fixed["ci95"] = fixed_ci
            out[f"budget{b}"] = fixed
        out["valid_action_rate"] = {name: round(sum(r["valid"] for r in rs) / max(1, sum(r["valid"] + r["invalid"]
                                                                                         for r in rs)), 3)
                                    for name, rs in by.items()}
        out["searched"] = {name: mean([float(bool(r["queries"])) for r in rs]) for name, rs in by.items()}
        return out

    datasets = sorted({r["dataset"] for r in records})
    return {"datasets": {d: block([r for r in records if r["dataset"] == d]) for d in datasets},
            "all": block(records)}


COMPACT_SETS = ("hotpotqa", "2wikimultihopqa", "nq", "popqa")
FULL_PARAGRAPH_CHARS = 400
"""A HotpotQA gold passage this long or longer counts as a full paragraph: in combined.jsonl most are only the
supporting sentences (gold median ~170 characters, distractor paragraphs ~490; see ../shared/data/README.md)."""


def compact_main(args: argparse.Namespace) -> None:
    """The compact policy against naive BM25, dense and hybrid top-n and the untrained MiniLM re-ranking the
    policy's own pool, at 3 and 5 documents (the policy's own n is 3: `budget3` is the matched comparison),
    in-process over the retriever's own backends and indexes (the stack's: `var/indexes/<corpus>-<sha256>`,
    built when missing); answer recall and all-supporting-passages recall with 95% intervals: the trainer's
    evaluation (`plugsearch.trainer.common.evaluation.BudgetEval`, what `plugsearch-train compact --qa` reports). Each
    policy is served as the searcher serves it: a BM25 + dense pool where it has the dense scorer; the last one
    is also run on a BM25 pool alone (`<name>_bm25_pool`, its lexical scorer: a retriever without dense)."""
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.evaluation import BudgetEval, PolicyRun, budget_summary
    from plugsearch.trainer.common.retrieval import IndexRetriever

    t0 = time.perf_counter()
    policies = {name: CompactPolicy.load(Path(folder)) for name, folder in
                (("compact_warm", args.compact_warm), ("compact_rl", args.compact)) if folder}
    retriever = IndexRetriever(CORPUS, index_dir_for(CORPUS, VAR), dense=not args.no_dense)
    served = list(retriever.methods)
    pools = {name: p.pool_methods(served, retriever.encoder) for name, p in policies.items()}
    last = list(policies)[-1]
    served_pool = pools[last] or []
    if len(served_pool) > 1:
        policies[f"{last}_bm25_pool"], pools[f"{last}_bm25_pool"] = policies[last], ["bm25"]
    setting = policies[last].search_setting()
    pool_k = setting.get("retrieve_k", 30)
    rankers = {}
    if not args.no_minilm:
        from sentence_transformers import SentenceTransformer

        from plugsearch.retriever.encoders.encoder import resolve_encoder_path

        encoder = SentenceTransformer(resolve_encoder_path("all-MiniLM-L6-v2"), device="cpu")

        async def minilm_rerank(item: Any) -> list[Document]:
            """The untrained MiniLM re-ranking the policy's first pool (BM25, with the dense top-k when it uses
            one) by cosine."""
            pool = list({d.id: d for m in (pools[last] or ["bm25"])
                         for d in (await retriever.retrieve([item.question], pool_k, m))[0]}.values())
            vecs = encoder.encode([item.question] + [f"{d.title}\n{d.text}" for d in pool], normalize_embeddings=True,
                                  batch_size=32)
            order = sorted(range(len(pool)), key=lambda i: -float(vecs[0] @ vecs[i + 1]))
            return [pool[i] for i in order]

        rankers["minilm_rerank"] = minilm_rerank
    runs = {name: PolicyRun(policy, SearchParams(mode="s3", method=args.compact_method, pool_methods=pools[name],
                                                 **policy.search_setting()))
            for name, policy in policies.items()}
    evaluation = BudgetEval(retriever, naive=[m for m in ("bm25", "dense", "hybrid") if m in served],
                            policies=runs, budgets=BUDGETS, rankers=rankers)
    systems = evaluation.systems
    lengths = _gold_lengths()
    all_rows: list[dict[str, Any]] = []
    result: dict[str, Any] = {"datasets": {}}
    for name in args.datasets:
        items = [q for q in load_questions(name, args.n) if not is_yes_no(q.golden_answers)]
        bar = tqdm(total=len(items), desc=name, disable=args.quiet)
        rows = asyncio.run(evaluation.rows(items, progress=bar.update))
        bar.close()
        all_rows += rows
        result["datasets"][name] = budget_summary(rows, systems, BUDGETS, sets=[name])["datasets"][name]
        if name == "hotpotqa":
            kinds = {q.id: "full_paragraph" if q.supporting_titles and all(
                lengths.get(t, 0) >= FULL_PARAGRAPH_CHARS for t in q.supporting_titles) else "short_extract"
                for q in items}
            by_kind = [{**r, "dataset": kinds[r["id"]]} for r in rows]
            result["datasets"][name]["by_gold_passage"] = budget_summary(by_kind, systems, BUDGETS)["datasets"]
        log(f"{name}: {json.dumps(result['datasets'][name]['budget3']['answer_recall'])}")
    result["all"] = budget_summary(all_rows, systems, BUDGETS, sets=[])["all"]
    result["settings"] = {"n_per_set": args.n, "yes_no": "left out", "pool_k": pool_k, "retriever": "bm25s",
                          "dense": retriever.encoder, "pool_methods": pools, "compact_method": args.compact_method,
                          "full_paragraph_chars": FULL_PARAGRAPH_CHARS,
                          "policies": {k: p.model for k, p in policies.items()},
                          "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))


def _gold_lengths() -> dict[str, int]:
    """The length of each HotpotQA passage title's longest passage in the corpus (for the full-paragraph
    split: a title whose passages are all short is an extract)."""
    out: dict[str, int] = {}
    with CORPUS.open(encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if str(row.get("id", "")).startswith("hotpotqa-"):
                out[row["title"]] = max(out.get(row["title"], 0), len(row.get("text", "")))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--n", type=int, default=100, help="first n questions of every set (the eval hold-out)")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--trained", default=str(LORA_DIR), help="the LoRA searcher's folder (manifest, adapter)")
    parser.add_argument("--adapter", default=None, help="GGUF adapter instead of the folder's (same setting)")
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads per server")
    parser.add_argument("--out", default=str(VAR / "bench" / "search_quality"))
    parser.add_argument("--restart", action="store_true")
    parser.add_argument("--report", action="store_true", help="summarise what is finished; run nothing")
    parser.add_argument("--quick", action="store_true", help="2 questions of one set (a smoke run)")
    parser.add_argument("--compact", help="compare this compact policy folder (and --compact-warm) against naive "
                        "top-n and the untrained MiniLM re-ranker instead of the LLM policies")
    parser.add_argument("--compact-warm", help="the compact policy after its warm start only")
    parser.add_argument("--no-minilm", action="store_true", help="--compact: skip the MiniLM re-ranker")
    parser.add_argument("--no-dense", action="store_true", help="--compact: no dense index (naive dense and hybrid "
                        "left out, the policies on BM25 pools)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--compact-method", choices=["bm25", "dense", "hybrid"], default=None,
                        help="--compact: the retrieval method the policies search with (default bm25, as trained)")
    args = parser.parse_args()
    if args.compact:
        if args.datasets == list(DATASETS):
            args.datasets = list(COMPACT_SETS)
        compact_main(args)
        return
    if args.quick:
        args.n, args.datasets, args.restart = 2, ["hotpotqa"], True
    trained = TrainedSearcher.load(Path(args.trained))
    adapter = Path(args.adapter) if args.adapter else trained.adapter
    params = trained.search.model_copy(update={"constrained": True})
    prompts = PromptSet.load(trained.prompts_dir)
    path = results_path(args, params, prompts, sha256(adapter)[:16])
    if args.report:
        records = list(read_results(path).values())
        print(json.dumps({**summarise(records, args.policies), "partial": True, "results_file": str(path)}))
        return
    if args.restart:
        path.unlink(missing_ok=True)
    # degraded searches (the policy failed: infrastructure, not quality) run again
    done = {k: v for k, v in read_results(path).items() if not v["degraded"]}
    if done:
        log(f"resuming: {len(done)} searches already in {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
    index_dir = ensure_bm25_index(CORPUS, VAR)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        retriever_log = VAR / "logs" / "bench_retriever.log"
        retriever_url = stack.enter_context(retriever_process(CORPUS, index_dir, retriever_log))
        from plugsearch.common.llama_server import LlamaServer

        policies: dict[str, tuple[str, str]] = {}
        for name in args.policies:
            extra = ["--lora_path", str(adapter)] if name == "s3_trained" else []
            server = stack.enter_context(LlamaServer(n_threads=args.threads, extra_args=extra,
                                                     log_path=VAR / "logs" / f"bench_{name}.log"))
            policies[name] = (server.base_url, server.model_alias)
        records = asyncio.run(evaluate(args, retriever_url, policies, params, prompts, path, done))
    result = summarise(records, args.policies)
    result["settings"] = {"params": params.model_dump(exclude_none=True), "prompts": prompts.version,
                          "adapter": str(adapter.relative_to(REPO)) if adapter.is_relative_to(REPO) else adapter.name,
                          "retriever": "bm25s", "n_per_set": args.n, "policies": args.policies,
                          "results_file": str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path),
                          "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
