"""The eval command's bookkeeping against the scripted fake stack: resumable results, the table's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugsearch.common.qa import QAItem
from plugsearch.trainer.common.evaluation import (
    EvalConfig,
    EvalRecord,
    load_results,
    markdown_table,
    run_eval,
    summarise,
    write_report,
)
from tests.unit.test_trainer_rewards import FakeStack, _item


async def test_eval_is_resumable_and_scores_every_method(tmp_path: Path) -> None:
    stack = FakeStack({"q1": "Paris", "q2": "nothing useful"})
    items = {"nq": [_item("1", "q1", ["Paris"]), _item("2", "q2", ["Berlin"])]}
    records = await run_eval(items, ["direct", "naive"], tmp_path, services=stack, searcher=None,
                             config=EvalConfig(batch=1), progress=False)
    assert sorted((r.method, r.id, r.genacc) for r in records) == [
        ("direct", "1", 0.0), ("direct", "2", 0.0), ("naive", "1", 1.0), ("naive", "2", 0.0)]
    calls = len(stack.answer_calls)
    with (tmp_path / "results.jsonl").open("a") as fh:
        fh.write('{"method": "naive", "dataset"')  # a kill mid-write: the line is ignored
    again = await run_eval(items, ["direct", "naive"], tmp_path, services=stack, searcher=None,
                           config=EvalConfig(batch=1), progress=False)
    assert len(again) == 4 and len(stack.answer_calls) == calls  # nothing recomputed


def test_table_averages_per_dataset_then_over_datasets(tmp_path: Path) -> None:
    def rec(method: str, ds: str, qid: str, genacc: float) -> EvalRecord:
        return EvalRecord(method=method, dataset=ds, id=qid, genacc=genacc, em=0.0, f1=0.5, answer="a", doc_ids=[])

    records = [rec("naive", "nq", "1", 1.0), rec("naive", "nq", "2", 0.0), rec("naive", "popqa", "3", 1.0)]
    table = summarise(records)
    assert table["naive"]["nq"]["genacc"] == 50.0 and table["naive"]["popqa"]["genacc"] == 100.0
    assert table["naive"]["average"]["genacc"] == 75.0  # macro average over datasets
    md = markdown_table(table, ["nq", "popqa"])
    assert "| nq | 2 | 50.0 | 0.0 | 50.0 |" in md and "| popqa | 1 | 100.0 | 0.0 | 50.0 |" in md
    assert "| average | 3 | 75.0 | 0.0 | 50.0 |" in md
    report = write_report(records, ["nq", "popqa"], tmp_path)
    assert Path(report["png"]).stat().st_size > 0
    assert json.loads((tmp_path / "table.json").read_text())["naive"]["average"]["genacc"] == 75.0


async def test_a_run_cut_short_has_every_dataset_scored_by_every_method(tmp_path: Path) -> None:
    class Cut(Exception):
        pass

    class CutStack(FakeStack):
        async def answer_and_judge(self, items):  # type: ignore[no-untyped-def]
            if len(self.answer_calls) == 4:  # two chunks x two methods, then the run dies
                raise Cut
            return await super().answer_and_judge(items)

    items = {ds: [QAItem(id=f"{ds}-{i}", question=f"q{i}", golden_answers=["x"], dataset=ds) for i in range(5)]
             for ds in ("nq", "popqa", "musique")}
    stack = CutStack({})
    with pytest.raises(Cut):
        await run_eval(items, ["direct", "naive"], tmp_path, services=stack, searcher=None,
                       config=EvalConfig(batch=3), progress=False)
    done = [EvalRecord.model_validate_json(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert sorted(r.id for r in done if r.method == "direct") == sorted(r.id for r in done if r.method == "naive")
    per_dataset = {ds: sum(r.dataset == ds for r in done if r.method == "naive") for ds in items}
    assert per_dataset == {"nq": 2, "popqa": 2, "musique": 2}
    # `eval --report` of the cut run: only questions every method finished (one more has `direct` only)
    with (tmp_path / "results.jsonl").open("a") as fh:
        fh.write(EvalRecord(method="direct", dataset="nq", id="nq-4", genacc=1, em=1, f1=1, answer="x",
                            doc_ids=[]).model_dump_json() + "\n")
    partial = load_results(tmp_path, items, ["direct", "naive"])
    assert len(partial) == 12 and "nq-4" not in {r.id for r in partial}
    assert len(load_results(tmp_path, items, ["direct", "naive"], complete_only=False)) == 13
    # the rerun finishes the rest and recomputes nothing
    records = await run_eval(items, ["direct", "naive"], tmp_path, services=FakeStack({}), searcher=None,
                             config=EvalConfig(batch=3), progress=False)
    assert len(records) == 30 and len({(r.method, r.id) for r in records}) == 30


def test_eval_llm_threads_option() -> None:
    from plugsearch.trainer.cli import build_parser
    from plugsearch.trainer.cli.common import LLM_THREADS_DEFAULT

    parser = build_parser()
    assert parser.parse_args(["eval", "--local"]).llm_threads == LLM_THREADS_DEFAULT >= 1
    assert parser.parse_args(["eval", "--local", "--llm-threads", "2"]).llm_threads == 2
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["eval", "--llm-threads", bad])
