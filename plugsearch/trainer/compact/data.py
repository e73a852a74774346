"""The compact trainer's questions: the shipped sets' training rows (`load_items`), or a user's files split by
a recorded seed (`user_split`), each with the labels the warm start learns from."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plugsearch.common.answers import is_yes_no
from plugsearch.common.schemas.base import Document
from plugsearch.trainer.common.data import (
    QAFileError,
    QAItem,
    Split,
    answerable,
    found,
    load_qa,
    qa_path,
    read_qa_files,
    split_items,
    split_sizes,
)
from plugsearch.trainer.compact.config import FIRST_TRAIN_ROW, NEVER_TRAIN, CompactConfig

logger = logging.getLogger(__name__)


@dataclass
class LabeledItem:
    item: QAItem
    supporting: frozenset[str] = field(default_factory=frozenset)
    retriever: Any = None
    """The retriever of the corpus the question is asked over where it is not the run's (the shipped Wikipedia
    questions mixed into a user's run with `--shipped`); None: the run's."""

    def positive(self, doc: Document) -> bool:
        """A passage the warm start labels good: a supporting passage (by title, where the row names them) or
        one that holds a gold answer (GenAcc's span check)."""
        return doc.title in self.supporting or found(documents=[doc], item=self.item)


def labeled(items: Sequence[QAItem], retriever: Any = None) -> list[LabeledItem]:
    return [LabeledItem(q, frozenset(q.supporting_titles), retriever) for q in items]


def load_items(data_dir: Path, config: CompactConfig) -> tuple[list[LabeledItem], list[LabeledItem]]:
    """The shipped sets: (training, dev) questions, rows offset.. of each set, yes/no dropped; dev = each set's
    last rows."""
    bad = NEVER_TRAIN.intersection(config.datasets)
    if bad:
        raise ValueError(f"{sorted(bad)} are never trained on")
    if config.offset < FIRST_TRAIN_ROW:
        raise ValueError(f"training starts at row {FIRST_TRAIN_ROW} (rows 0-99 evaluate, 100-199 are reserved)")
    train: list[LabeledItem] = []
    dev: list[LabeledItem] = []
    for name in config.datasets:
        items = labeled([q for q in load_qa(qa_path(data_dir, name), limit=config.per_dataset + config.dev_per_dataset,
                                            offset=config.offset)
                         if not is_yes_no(q.golden_answers)])
        cut = max(0, len(items) - config.dev_per_dataset)
        train.extend(items[:cut])
        dev.extend(items[cut:])
    return train, dev


SPLIT_FILE = "split.json"


@dataclass
class UserData:
    """A user's questions, checked and split: `split`, and what was left out and why (`left_out`)."""

    split: Split
    rows: int
    left_out: dict[str, list[str]]
    files: list[dict[str, Any]]

    def record(self) -> dict[str, Any]:
        """`split.json`: the seed, every split's ids, what was left out, the files (name, sha256, rows)."""
        return {"seed": self.split.seed, "files": self.files, "rows": self.rows,
                "sizes": {k: len(v) for k, v in self.split.ids().items()},
                "left_out": {k: {"count": len(v), "ids": v} for k, v in self.left_out.items()}, **self.split.ids()}

    def summary(self) -> str:
        sizes = {k: len(v) for k, v in self.split.ids().items()}
        why = {"yes_no": "yes/no (the span check cannot judge them)",
               "answer_not_in_corpus": "whose answers occur in no passage of the corpus"}
        gone = ", ".join(f"{len(v)} {why.get(k, k)}" for k, v in self.left_out.items() if v) or "none"
        return (f"{self.rows} questions: {sizes['train']} train, {sizes['dev']} RL-dev, {sizes['eval']} evaluation "
                f"(seed {self.split.seed}); left out: {gone}")


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def user_split(qa_files: Sequence[Path], corpus: Path, *, seed: int, out: Path, progress: bool = True,
               eval_fraction: float = 0.2, dev_fraction: float = 0.05,
               check: Callable[[Sequence[QAItem]], None] | None = None) -> UserData:
    """Read and check the question files (every bad row refused with its line, before any work), leave out the
    yes/no questions (the span check cannot judge them) and those whose answers occur in no passage of the
    corpus (no searcher can find them: counted and reported), and split the rest by `seed`. The split is
    recorded in `<out>/split.json`; a rerun with the same files and seed reuses it, other files are refused.
    `check` sees every row first (and raises to refuse them)."""
    from tqdm import tqdm

    from plugsearch.retriever.store.corpus import CorpusError, iter_corpus

    per_file = read_qa_files(list(qa_files))
    files = [{"name": p.name, "sha256": _sha256(p), "rows": len(rows)} for p, rows in zip(qa_files, per_file, strict=True)]
    items = [item for rows in per_file for item in rows]
    if check is not None:
        check(items)
    saved = out / SPLIT_FILE
    if saved.is_file():
        old = json.loads(saved.read_text())
        if [f["sha256"] for f in old["files"]] != [f["sha256"] for f in files] or old["seed"] != seed:
            raise QAFileError(f"{out} was split from other question files or another seed ({saved}): use a new --out "
                              "(a run's evaluation split must never change under it)")
        logger.info("reusing the split of %s (seed %d, the same question files)", saved, seed)
    yes_no = [it.id for it in items if is_yes_no(it.golden_answers)]
    candidates = [it for it in items if not is_yes_no(it.golden_answers)]
    with tqdm(desc="checking answers against the corpus", unit="passage", disable=not progress) as bar:
        try:
            hits = answerable(candidates, ((pid, text) for pid, _, text in iter_corpus(corpus)), progress=bar.update)
        except CorpusError as exc:
            raise QAFileError(f"corpus: {exc}") from exc
    unanswerable = [it.id for it in candidates if it.id not in hits]
    usable = [it for it in candidates if it.id in hits]
    if candidates and len(unanswerable) > 0.5 * len(candidates):
        logger.warning("%s of %s questions have no gold answer in any passage of %s: is it their corpus?",
                       len(unanswerable), len(candidates), corpus)
    try:
        n_eval, n_dev = split_sizes(len(usable), eval_fraction=eval_fraction, dev_fraction=dev_fraction)
    except QAFileError as exc:
        raise QAFileError(f"{exc} ({len(items)} rows: {len(yes_no)} yes/no, {len(unanswerable)} whose answers occur "
                          f"in no passage of {corpus.name})") from exc
    data = UserData(split_items(usable, seed=seed, n_eval=n_eval, n_dev=n_dev), rows=len(items),
                    left_out={"yes_no": yes_no, "answer_not_in_corpus": unanswerable}, files=files)
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(data.record(), indent=1) + "\n", encoding="utf-8")
    return data
