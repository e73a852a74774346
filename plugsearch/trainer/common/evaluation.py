"""The one evaluation of searchers, two ways of scoring the same documents:

- **answer recall at equal document budget** (`BudgetEval`, no LLM): every searcher (naive BM25, dense and
  hybrid top-k; a policy, compact or LLM, driven by the searcher's own loop in-process) returns documents for
  held-out questions; a question scores 1 when one of the first `b` documents holds a gold answer (GenAcc's
  span check), for each budget `b`, and, for a policy, against naive top-n at its own n (`matched`). Means per
  set and over all with 95% bootstrap intervals of each figure and of the paired difference with naive BM25
  (`budget_summary`); `write_budget_report` writes the table (markdown + JSON) and the plot a user reads.
  The compact trainer's RL dev check (`dev_check`), its final report (`plugsearch.trainer.compact.run`) and
  `bench/search_quality.py` all use it.
- **GenAcc through the services** (`run_eval`, `plugsearch-train eval`): direct, naive RAG, s3 and qagent on
  the first `n` questions of every set; GenAcc, EM and F1 per dataset and on average. Resumable: every finished
  (method, question) is appended to `<out>/results.jsonl`; the services cache their own results too.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from plugsearch.common.answers import span_match
from plugsearch.common.clients import SearcherClient
from plugsearch.common.qa import QAItem, append_durable, found, read_jsonl
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams, SearchRequest
from plugsearch.common.stats import bootstrap_interval
from plugsearch.searcher.env import RetrieverBackend
from plugsearch.searcher.loop import ActingPolicy, run_search
from plugsearch.trainer.common.upstreams import QAServices

logger = logging.getLogger(__name__)

EvalMethod = Literal["direct", "naive", "s3", "qagent"]
METRICS = ("genacc", "em", "f1")


class EvalRecord(BaseModel):
    method: str
    dataset: str
    id: str
    genacc: float
    em: float
    f1: float
    answer: str
    doc_ids: list[str]
    queries: list[str] = []
    degraded: bool = False
    """s3/qagent: the searcher fell back (policy error or time budget) to the documents it had."""


class EvalConfig(BaseModel):
    naive_k: int = 3
    max_turns: int = 3
    retrieve_k: int = 8
    select_k: int = 3
    method: Literal["bm25", "dense", "hybrid"] | None = None
    batch: int = 8


def _prepare(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return out_dir / "results.jsonl"


def _done(path: Path) -> dict[tuple[str, str], EvalRecord]:
    return {(r.method, r.id): r for r in read_jsonl(path, EvalRecord.model_validate_json)[0]}


async def _documents(method: EvalMethod, items: Sequence[QAItem], services: QAServices,
                     searcher: SearcherClient | None, config: EvalConfig
                     ) -> list[tuple[list[Document], list[str], bool]]:
    if method == "direct":
        return [([], [], False) for _ in items]
    if method == "naive":
        docs = await services.retrieve([it.question for it in items], config.naive_k, config.method)
        return [(d, [], False) for d in docs]
    if searcher is None:
        raise ValueError(f"method {method} needs the searcher service")
    responses = await searcher.search_batch([SearchRequest(
        question=it.question, mode=method, max_turns=config.max_turns, retrieve_k=config.retrieve_k,
        select_k=config.select_k if method == "s3" else None, method=config.method) for it in items])
    return [([Document(id=d.id, title=d.title, text=d.text, score=d.score) for d in r.documents], list(r.queries),
             r.degraded) for r in responses]


async def run_eval(items_by_dataset: dict[str, list[QAItem]], methods: Sequence[EvalMethod], out_dir: Path, *,
                   services: QAServices, searcher: SearcherClient | None, config: EvalConfig,
                   progress: bool = True) -> list[EvalRecord]:
    from tqdm import tqdm

    path = _prepare(out_dir)
    done = _done(path)
    # Question-major and round-robin over the datasets: a run cut short (killed, or out of time) leaves
    # every dataset with about the same number of questions, each scored by every method.
    order = [it for row in zip_longest(*items_by_dataset.values()) for it in row if it is not None]
    todo = [it for it in order if any((m, it.id) not in done for m in methods)]
    logger.info("eval: %s results done already, %s questions to run", len(done), len(todo))
    bar = tqdm(total=len(todo), desc="eval", unit="question", disable=not progress)
    for start in range(0, len(todo), config.batch):
        chunk = todo[start:start + config.batch]
        for method in methods:
            pending = [it for it in chunk if (method, it.id) not in done]
            if not pending:
                continue
            found = await _documents(method, pending, services, searcher, config)
            answered = await services.answer_and_judge(
                [(it.question, docs, it.golden_answers) for it, (docs, _, _) in zip(pending, found, strict=True)])
            records = [EvalRecord(method=method, dataset=it.dataset, id=it.id, genacc=a.genacc, em=a.em, f1=a.f1,
                                  answer=a.answer, doc_ids=[d.id for d in docs], queries=queries, degraded=degraded)
                       for it, (docs, queries, degraded), a in zip(pending, found, answered, strict=True)]
            append_durable(path, "".join(r.model_dump_json() + "\n" for r in records))
            for r in records:
                done[(r.method, r.id)] = r
        bar.update(len(chunk))
    bar.close()
    wanted = {(m, it.id) for m in methods for items in items_by_dataset.values() for it in items}
    return [r for key, r in done.items() if key in wanted]


def summarise(records: Sequence[EvalRecord]) -> dict[str, dict[str, dict[str, float]]]:
    """table[method][dataset][metric] (x100), plus an `average` over datasets (macro)."""
    sums: dict[str, dict[str, dict[str, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        for metric in METRICS:
            sums[r.method][r.dataset][metric].append(getattr(r, metric))
    table: dict[str, dict[str, dict[str, float]]] = {}
    for method, by_ds in sums.items():
        table[method] = {ds: {**{m: 100 * sum(v) / len(v) for m, v in metrics.items()},
                              "n": float(len(metrics["genacc"]))} for ds, metrics in by_ds.items()}
        table[method]["average"] = {m: sum(table[method][ds][m] for ds in by_ds) / len(by_ds) for m in METRICS}
        table[method]["average"]["n"] = float(sum(len(v["genacc"]) for v in by_ds.values()))
        table[method]["average"]["degraded"] = float(sum(r.degraded for r in records if r.method == method))
    return table


def markdown_table(table: dict[str, dict[str, dict[str, float]]], datasets: Sequence[str]) -> str:
    methods = list(table)
    header = "| dataset | n | " + " | ".join(f"{m} GenAcc | {m} EM | {m} F1" for m in methods) + " |"
    rule = "|---|---:|" + "---:|" * (3 * len(methods))
    rows = [header, rule]
    for ds in [*datasets, "average"]:
        counted = table[methods[0]].get(ds) if methods else None
        cells = [f"{counted['n']:.0f}" if counted else "0"]
        for m in methods:
            values = table[m].get(ds)
            cells += [f"{values[k]:.1f}" if values else "-" for k in METRICS]
        rows.append(f"| {ds} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def load_results(out_dir: Path, items_by_dataset: dict[str, list[QAItem]], methods: Sequence[str], *,
                 complete_only: bool = True) -> list[EvalRecord]:
    """The finished results of these questions and methods in `<out>/results.jsonl` (a run may be going
    on or cut short). `complete_only`: only questions every method has finished, so that the methods
    are compared on the same questions."""
    done = _done(out_dir / "results.jsonl")
    records = [r for it in (it for items in items_by_dataset.values() for it in items) for m in methods
               if (r := done.get((m, it.id))) is not None]
    if not complete_only:
        return records
    methods_of: dict[str, set[str]] = defaultdict(set)
    for r in records:
        methods_of[r.id].add(r.method)
    return [r for r in records if methods_of[r.id] >= set(methods)]


def write_report(records: Sequence[EvalRecord], datasets: Sequence[str], out_dir: Path) -> dict[str, Any]:
    from plugsearch.trainer.common.plotting import plot_eval_bars

    table = summarise(records)
    md = markdown_table(table, datasets)
    (out_dir / "table.md").write_text(md + "\n", encoding="utf-8")
    (out_dir / "table.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    png = plot_eval_bars(table, out_dir / "genacc.png")
    return {"markdown": md, "table": table, "png": str(png) if png else None}


# ------------------------------------------------------------------------------- answer recall at equal budget
REFERENCE = "naive_bm25"
"""What every gain is measured against: naive BM25 top-b at the same budget b."""
BUDGET_METRICS = {"answer_recall": "hit", "all_supporting": "all_gold"}
"""Report name -> per-question score: a gold answer in the documents; every supporting title among them."""


def documents_hit(documents: Sequence[Document] | Sequence[dict[str, Any]], golden_answers: Sequence[str]) -> bool:
    """A document's text holds a gold answer (GenAcc's span check)."""
    return any(span_match(d["text"] if isinstance(d, dict) else d.text, golden_answers) for d in documents)


def scores(documents: Sequence[Document], item: QAItem) -> dict[str, float]:
    """One question's scores of one searcher's documents: `hit` (a gold answer or a labelled passage among them,
    `plugsearch.common.qa.found`) and `all_gold` (every supporting title among them)."""
    titles = {d.title for d in documents}
    gold_titles = frozenset(item.supporting_titles)
    return {"hit": float(found(documents, item)), "all_gold": float(bool(gold_titles) and gold_titles <= titles)}


@dataclass
class PolicyRun:
    """A policy evaluated as the searcher serves it: `params` its search setting; `per_budget`: searched again
    with `select_k` = each budget (the compact policy chooses that many), else its documents are cut to the
    budget (an LLM policy's marked documents)."""

    policy: ActingPolicy
    params: SearchParams
    per_budget: bool = True


Ranker = Callable[[QAItem], Awaitable[list[Document]]]
"""Another searcher: a question -> its ranked documents (cut to each budget)."""


@dataclass
class BudgetEval:
    """Answer recall of several searchers on the same questions at equal document budgets."""

    retriever: RetrieverBackend
    naive: Sequence[str] = ("bm25",)
    """Naive top-b of these methods (systems `naive_<method>`); bm25 is the reference."""
    policies: Mapping[str, PolicyRun] = field(default_factory=dict)
    budgets: Sequence[int] = (3,)
    rankers: Mapping[str, Ranker] = field(default_factory=dict)
    matched: bool = False
    """Also each policy's own documents against naive BM25 top-n at its own n."""

    @property
    def systems(self) -> list[str]:
        return [*(f"naive_{m}" for m in self.naive), *self.rankers, *self.policies]

    async def question(self, item: QAItem) -> dict[str, Any]:
        """One question's row: `scores[budget][system]` (+ `docs` and `searches` of policies), `matched`."""
        depth = max([*self.budgets, 1])
        ranked: dict[str, list[Document]] = {}
        for method in self.naive:
            ranked[f"naive_{method}"] = (await self.retriever.retrieve([item.question], depth, method))[0]
        for name, rank in self.rankers.items():
            ranked[name] = await rank(item)
        row: dict[str, Any] = {"dataset": item.dataset, "id": item.id, "scores": {}, "matched": {}}
        once: dict[str, list[Any]] = {}
        for name, run in self.policies.items():
            if not run.per_budget or self.matched:
                outcome = await run_search(item.question, run.params, policy=run.policy, retriever=self.retriever)
                once[name] = list(outcome.documents)
                if self.matched:
                    n = len(outcome.documents) or 1
                    naive = (await self.retriever.retrieve([item.question], n, "bm25"))[0]
                    row["matched"][name] = {"hit": float(found(outcome.documents, item)),
                                            "naive": float(found(naive, item)),
                                            "docs": len(outcome.documents), "searches": len(outcome.queries)}
        for budget in self.budgets:
            cell: dict[str, Any] = {name: scores(docs[:budget], item) for name, docs in ranked.items()}
            for name, run in self.policies.items():
                if run.per_budget:
                    params = run.params.model_copy(update={"select_k": min(budget, run.params.retrieve_k)})
                    outcome = await run_search(item.question, params, policy=run.policy, retriever=self.retriever)
                    docs: list[Any] = list(outcome.documents)
                    cell[name] = {**scores(docs, item), "docs": len(docs), "searches": len(outcome.queries)}
                else:
                    cell[name] = {**scores(once[name][:budget], item), "docs": len(once[name][:budget])}
            row["scores"][str(budget)] = cell
        return row

    async def rows(self, items: Iterable[QAItem], *, progress: Callable[[int], Any] | None = None
                   ) -> list[dict[str, Any]]:
        out = []
        for item in items:
            out.append(await self.question(item))
            if progress is not None:
                progress(1)
        return out

    def run_rows(self, items_by_set: Mapping[str, Sequence[QAItem]], *, progress: bool = False
                 ) -> list[dict[str, Any]]:
        """Every set's questions' rows (`question`), in a fresh event loop, with a progress bar."""
        from tqdm import tqdm

        bar = tqdm(total=sum(len(v) for v in items_by_set.values()), desc="evaluation", disable=not progress)
        try:
            return asyncio.run(self.rows([it for items in items_by_set.values() for it in items],
                                         progress=bar.update))
        finally:
            bar.close()

    def summary(self, rows: Sequence[Mapping[str, Any]], sets: Sequence[str]) -> dict[str, Any]:
        """`budget_summary` of rows this evaluation made."""
        return budget_summary(rows, self.systems, self.budgets, sets=sets,
                              policies=list(self.policies) if self.matched else ())

    def run(self, items_by_set: Mapping[str, Sequence[QAItem]], *, progress: bool = False) -> dict[str, Any]:
        """Every set's questions (in a fresh event loop), summarised by `budget_summary`."""
        return self.summary(self.run_rows(items_by_set, progress=progress), list(items_by_set))


def metric_block(rows: Sequence[Mapping[str, Any]], systems: Sequence[str], key: str,
                 reference: str = REFERENCE) -> dict[str, Any]:
    """Each system's mean of `key` with its 95% interval, and its paired difference with the reference's
    (`<system>_minus_naive`, interval `<system>_minus_naive_ci95`)."""
    out: dict[str, Any] = {}
    for name in systems:
        values = [float(r[name][key]) for r in rows]
        out[name] = round(statistics.fmean(values), 3) if values else None
        out[f"{name}_ci95"] = bootstrap_interval(values)
        if name != reference and all(reference in r for r in rows):
            diff = [float(r[name][key]) - float(r[reference][key]) for r in rows]
            out[f"{name}_minus_naive"] = round(statistics.fmean(diff), 3) if diff else None
            out[f"{name}_minus_naive_ci95"] = bootstrap_interval(diff)
    return out


def _matched_block(rows: Sequence[Mapping[str, Any]], policies: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in policies:
        own = [float(r["matched"][name]["hit"]) for r in rows]
        naive = [float(r["matched"][name]["naive"]) for r in rows]
        out[name] = {"recall": round(statistics.fmean(own), 4) if own else None,
                     "naive": round(statistics.fmean(naive), 4) if naive else None,
                     "gain_ci95": bootstrap_interval([a - b for a, b in zip(own, naive, strict=True)]),
                     "docs": round(statistics.fmean(r["matched"][name]["docs"] for r in rows), 2) if rows else None,
                     "searches": round(statistics.fmean(r["matched"][name]["searches"] for r in rows), 2)
                     if rows else None}
    return out


def _blocks(rows: Sequence[Mapping[str, Any]], systems: Sequence[str], budgets: Sequence[int],
            policies: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": len(rows)}
    for b in budgets:
        cells = [r["scores"][str(b)] for r in rows]
        out[f"budget{b}"] = {metric: metric_block(cells, systems, key) for metric, key in BUDGET_METRICS.items()}
    if policies:
        out["matched"] = _matched_block(rows, policies)
    return out


def budget_summary(rows: Sequence[Mapping[str, Any]], systems: Sequence[str], budgets: Sequence[int], *,
                   sets: Sequence[str] | None = None, policies: Sequence[str] = ()) -> dict[str, Any]:
    """`{"datasets": {set: {"n", "budget<b>": {"answer_recall": metric_block, "all_supporting": ...},
    "matched": ...}}, "all": {...}}` over the questions' rows."""
    names = list(sets) if sets is not None else sorted({r["dataset"] for r in rows})
    return {"datasets": {name: _blocks([r for r in rows if r["dataset"] == name], systems, budgets, policies)
                         for name in names},
            "all": _blocks(rows, systems, budgets, policies)}


def beats_naive(result: Mapping[str, Any], key: str = "compact_rl", budget: int = 3, *, tolerance: float = 0.02) -> bool:
    """The verdict a policy's evaluation records (`beats_naive`): at `budget` documents, the gain over naive
    BM25 pooled over every question has its 95% interval above 0, and no set loses more than `tolerance`."""
    pooled = result.get("all", {}).get(f"budget{budget}", {}).get("answer_recall", {})
    low = (pooled.get(f"{key}_minus_naive_ci95") or [0.0])[0]
    per_set = [d[f"budget{budget}"]["answer_recall"].get(f"{key}_minus_naive")
               for d in result.get("datasets", {}).values()]
    return bool(per_set) and low > 0 and all(g is not None and g >= -tolerance for g in per_set)


def dev_check(policy: ActingPolicy, items: Sequence[QAItem], retriever: RetrieverBackend,
              params: SearchParams) -> dict[str, Any]:
    """A policy's greedy searches on held-out questions against naive BM25 top-n at its own n, per set:
    `{set: {"n", "recall", "naive"}, "mean_gain"}` (the compact trainer's check of each stage)."""
    by_set: dict[str, list[QAItem]] = {}
    for item in items:
        by_set.setdefault(item.dataset, []).append(item)
    evaluation = BudgetEval(retriever, naive=("bm25",), policies={"policy": PolicyRun(policy, params, per_budget=False)},
                            budgets=(), matched=True)
    result = evaluation.run(by_set)
    out: dict[str, Any] = {name: {"n": block["n"], "recall": block["matched"]["policy"]["recall"],
                                  "naive": block["matched"]["policy"]["naive"]}
                           for name, block in result["datasets"].items() if block["n"]}
    out["mean_gain"] = round(float(statistics.fmean(o["recall"] - o["naive"] for o in out.values())), 4) if out \
        else 0.0
    return out


SYSTEM_LABELS = {"naive_bm25": "naive BM25", "naive_dense": "naive dense", "naive_hybrid": "naive hybrid",
                 "compact_warm": "compact, warm start", "compact_rl": "compact, + RL (served)",
                 "compact_shipped": "shipped compact policy"}


def budget_markdown(result: Mapping[str, Any], systems: Sequence[str], *, budget: int = 3, key: str | None = None
                    ) -> str:
    """The table a user reads: answer recall at `budget` documents per set (n) and over all, each system with
    its 95% interval, and `key` (the policy) minus naive BM25 with the interval of the paired difference."""
    head = [SYSTEM_LABELS.get(s, s) + (f" top-{budget}" if s.startswith("naive_") else "") for s in systems]
    lines = ["| set (n) | " + " | ".join(head) + (f" | {SYSTEM_LABELS.get(key, key)} - naive BM25 [95% CI] |"
                                                   if key else " |"),
             "|---|" + "---:|" * (len(systems) + (1 if key else 0))]
    blocks = [*result.get("datasets", {}).items(), ("all", result.get("all", {}))]
    for name, block in blocks:
        recall = block.get(f"budget{budget}", {}).get("answer_recall", {})
        if not recall:
            continue
        cells = []
        for s in systems:
            mean, ci = recall.get(s), recall.get(f"{s}_ci95") or [float("nan")] * 2
            text = f"{mean:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]" if mean is not None else "-"
            cells.append(f"**{text}**" if s == key else text)
        if key:
            gain, ci = recall.get(f"{key}_minus_naive"), recall.get(f"{key}_minus_naive_ci95") or [float("nan")] * 2
            cells.append(f"{gain:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]" if gain is not None else "-")
        lines.append(f"| {name} ({block.get('n', 0)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_budget_report(result: Mapping[str, Any], systems: Sequence[str], out_dir: Path, *, key: str,
                        budget: int = 3, title: str = "", notes: Sequence[str] = ()) -> dict[str, str | None]:
    """`report.md` (the table, the verdict, `notes`), `report.json` (everything) and `report.png` (answer recall
    per set with 95% intervals) in `out_dir`."""
    from plugsearch.trainer.common.plotting import plot_recall_bars

    out_dir.mkdir(parents=True, exist_ok=True)
    verdict = beats_naive(result, key, budget)
    table = budget_markdown(result, systems, budget=budget, key=key)
    text = [f"# {title or 'Evaluation'}", "",
            f"Answer recall at {budget} documents (a returned document holds a gold answer, GenAcc's span check) "
            "on the evaluation split, never trained or tuned on; 95% bootstrap intervals.", "", table, "",
            f"**beats_naive: {str(verdict).lower()}** (the gain over naive BM25 top-{budget} has its 95% interval "
            "above 0 over all questions and no set loses more than 2 points).", ""]
    text += [f"- {n}" for n in notes]
    md = out_dir / "report.md"
    md.write_text("\n".join(text) + "\n", encoding="utf-8")
    js = out_dir / "report.json"
    js.write_text(json.dumps({**result, "beats_naive": verdict, "key": key, "budget": budget}, indent=1) + "\n",
                  encoding="utf-8")
    png = plot_recall_bars(result, systems, out_dir / "report.png", budget=budget,
                           title=title or f"answer recall at {budget} documents",
                           labels={s: SYSTEM_LABELS.get(s, s) + (f" top-{budget}" if s.startswith("naive_") else "")
                                   for s in systems})
    return {"markdown": str(md), "json": str(js), "png": str(png) if png else None}
