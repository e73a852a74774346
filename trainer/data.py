"""Question sets (`../shared/data/qa/*.jsonl`, FlashRAG / Search-R1 format), splits and the s3 filter; the
append-only JSONL records the trainer resumes from.

The shared files are dev/test sets; the trainer holds out the first `eval_holdout` (200) questions of every
file and trains on the rest: rows 0-99 are what `eval` reports on, rows 100-199 are reserved (never trained,
tuned or chosen on), so a question is never both trained on and evaluated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice, zip_longest
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, Field

from services.common.answers import is_yes_no

DATASETS = ("nq", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "triviaqa")
TRAIN_DATASETS = ("nq", "hotpotqa")

T = TypeVar("T")


class QAItem(BaseModel):
    id: str
    question: str
    golden_answers: list[str] = Field(min_length=1)
    dataset: str = ""
    supporting_titles: list[str] = Field(default_factory=list, description="titles of the passages that support "
                                         "the answer (multi-hop sets; empty where the file has none)")


def default_data_dir() -> Path:
    """`$PLUGSEARCH_DATA`, else `<repo>/../shared/data` (the one rule: `services.common.paths`)."""
    from services.common.paths import default_data_dir as shared_rule

    return shared_rule()


def load_qa(path: Path, limit: int | None = None, offset: int = 0) -> list[QAItem]:
    """Rows `offset .. offset+limit` of one QA file, in file order (deterministic)."""
    items: list[QAItem] = []
    with path.open(encoding="utf-8") as fh:
        for line in islice(fh, offset, None):
            if not line.strip():
                continue
            if limit is not None and len(items) >= limit:
                break
            row = json.loads(line)
            items.append(QAItem(id=str(row["id"]), question=row["question"],
                                golden_answers=[str(a) for a in row["golden_answers"]],
                                dataset=str(row.get("dataset") or path.stem),
                                supporting_titles=[str(t) for t in row.get("supporting_titles") or ()]))
    return items


def qa_path(data_dir: Path, dataset: str) -> Path:
    path = data_dir / "qa" / f"{dataset}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"question set {dataset!r} not found at {path}")
    return path


def eval_split(data_dir: Path, dataset: str, n: int) -> list[QAItem]:
    """The first `n` questions of a set: what `eval` reports on."""
    return load_qa(qa_path(data_dir, dataset), limit=n)


def train_split(data_dir: Path, datasets: Sequence[str] = TRAIN_DATASETS, *, per_dataset: int | None = None,
                eval_holdout: int = 200) -> list[QAItem]:
    """Training candidates: each set's questions after its first `eval_holdout`, interleaved by set
    (nq, hotpotqa, nq, ...) so any prefix mixes single-hop and multi-hop questions."""
    per_set = [load_qa(qa_path(data_dir, name), limit=per_dataset, offset=eval_holdout) for name in datasets]
    return [item for row in zip_longest(*per_set) for item in row if item is not None]


def s3_filter(items: Iterable[QAItem], baseline_genacc: Mapping[str, float]) -> list[QAItem]:
    """s3's training filter: keep questions naive RAG gets wrong (baseline GenAcc == 0) that are not
    yes/no or true/false questions. A question without a baseline is an error, never silently kept."""
    kept: list[QAItem] = []
    for item in items:
        if item.id not in baseline_genacc:
            raise KeyError(f"no naive-RAG baseline for question {item.id}: run `plugsearch-train baseline` first")
        if is_yes_no(item.golden_answers):
            continue
        if baseline_genacc[item.id] == 0:
            kept.append(item)
    return kept


def read_jsonl(path: Path, parse: Callable[[bytes], T]) -> tuple[list[T], int]:
    """(parsed lines of `path`, none when it is missing; how many lines did not parse: cut by a kill
    mid-write, their work is redone)."""
    if not path.is_file():
        return [], 0
    out: list[T] = []
    lines = [line for line in path.read_bytes().split(b"\n") if line.strip()]
    for line in lines:
        try:
            out.append(parse(line))
        except ValueError:
            continue
    return out, len(lines) - len(out)


def append_durable(path: Path, text: str) -> None:
    """Append `text` to `path` and fsync it: once this returns, a kill loses none of it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
