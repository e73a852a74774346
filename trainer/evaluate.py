"""`plugsearch-train eval`: direct, naive RAG, s3 and qagent through the services on the first `n` questions
of every set; GenAcc, EM and F1 per dataset and on average. Resumable: every finished (method, question) is
appended to `<out>/results.jsonl`; the services cache their own results too.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from services.common.clients import SearcherClient
from services.common.schemas.base import Document
from services.common.schemas.searcher import SearchRequest
from trainer.data import QAItem, append_durable, read_jsonl
from trainer.upstreams import QAServices

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
    from trainer.plotting import plot_eval_bars

    table = summarise(records)
    md = markdown_table(table, datasets)
    (out_dir / "table.md").write_text(md + "\n", encoding="utf-8")
    (out_dir / "table.json").write_text(json.dumps(table, indent=1), encoding="utf-8")
    png = plot_eval_bars(table, out_dir / "genacc.png")
    return {"markdown": md, "table": table, "png": str(png)}
