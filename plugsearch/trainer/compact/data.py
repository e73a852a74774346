"""The compact trainer's questions: the shipped sets' training rows (`load_items`), or a user's files split by
a recorded seed (`user_split`), each with the labels the warm start learns from."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from plugsearch.common.answers import is_yes_no
from plugsearch.common.qa import (
    MADE_UP,
    MIN_SPLIT,
    SOURCES,
    QAFileError,
    QAItem,
    Split,
    answerable,
    found,
    load_qa,
    qa_path,
    read_qa_files,
    split_items,
    split_rank,
    split_sizes,
)
from plugsearch.common.schemas.base import Document
from plugsearch.trainer.compact.config import FIRST_TRAIN_ROW, NEVER_TRAIN, CompactConfig

logger = logging.getLogger(__name__)


@dataclass
class LabeledItem:
    item: QAItem
    supporting: frozenset[str] = field(default_factory=frozenset)
    retriever: Any = None
    """The retriever of the corpus the question is asked over where it is not the run's (the shipped Wikipedia
    questions mixed into a user's run with `--shipped`); None: the run's."""
    negatives: frozenset[str] = field(default_factory=frozenset)
    """Ids of passages a user was shown for it and marked as not helpful (`negative_ids` of a feedback row)."""

    def positive(self, doc: Document) -> bool:
        """A passage the warm start labels good: a supporting passage (by title, where the row names them) or
        one that holds a gold answer (GenAcc's span check) or is one of its labelled passages."""
        return doc.title in self.supporting or found(documents=[doc], item=self.item)

    def negative(self, doc: Document) -> bool:
        """A passage a user marked as not helpful for it (a hard negative)."""
        return doc.id in self.negatives


def labeled(items: Sequence[QAItem], retriever: Any = None) -> list[LabeledItem]:
    return [LabeledItem(q, frozenset(q.supporting_titles), retriever, frozenset(q.negative_ids)) for q in items]


def source_counts(items: Sequence[QAItem | LabeledItem]) -> dict[str, int]:
    """How many questions come from each source (`SOURCES`, every one named, 0 where none): what a policy's
    manifest records as `trained_on`."""
    counts = dict.fromkeys(SOURCES, 0)
    for it in items:
        source = it.item.source if isinstance(it, LabeledItem) else it.source
        counts[source] = counts.get(source, 0) + 1
    return counts


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


@dataclass(frozen=True)
class QuestionFile:
    """One of a user's question files: where its rows come from (`SOURCES`: `labelled` for `--qa`, `feedback` for
    `--feedback`, `pseudo` / `llm` for questions made from the corpus) and whether it is the evaluation part
    (`--eval-qa`: its questions are only ever evaluated on, never trained or tuned on)."""

    path: Path
    source: str = "labelled"
    evaluation: bool = False

    @property
    def role(self) -> str:
        return "eval" if self.evaluation else ("train" if self.source in MADE_UP else "split")


@dataclass
class UserData:
    """A user's questions, checked and split: `split`, and what was left out and why (`left_out`)."""

    split: Split
    rows: int
    left_out: dict[str, list[str]]
    files: list[dict[str, Any]]
    eval_in_training: list[str] = field(default_factory=list)
    """Evaluation questions whose text is also a training question's (asked again, e.g. templated questions)."""

    @property
    def eval_given(self) -> bool:
        """The evaluation part was given as its own file (`--eval-qa`), not split from the others."""
        return any(f.get("role") == "eval" for f in self.files)

    def sources(self) -> dict[str, dict[str, int]]:
        """Per part (train, dev, eval), how many questions come from each source."""
        return {"train": source_counts(self.split.train), "dev": source_counts(self.split.dev),
                "eval": source_counts(self.split.eval)}

    def record(self) -> dict[str, Any]:
        """`split.json`: the seed, every split's ids, what was left out, the files (name, sha256, rows, source,
        role), the sources of each part."""
        return {"seed": self.split.seed, "files": self.files, "rows": self.rows,
                "sizes": {k: len(v) for k, v in self.split.ids().items()}, "sources": self.sources(),
                "evaluation": "the --eval-qa file(s)" if self.eval_given else "split from the question files by the seed",
                "eval_in_training": self.eval_in_training,
                "left_out": {k: {"count": len(v), "ids": v} for k, v in self.left_out.items()}, **self.split.ids()}

    def summary(self) -> str:
        sizes = {k: len(v) for k, v in self.split.ids().items()}
        why = {"yes_no": "yes/no (the span check cannot judge them)",
               "answer_not_in_corpus": "whose answers occur in no passage of the corpus"}
        gone = ", ".join(f"{len(v)} {why.get(k, k)}" for k, v in self.left_out.items() if v) or "none"
        train = source_counts(self.split.train)
        made = ", ".join(f"{n} {s}" for s, n in train.items() if n) or "none"
        evaluation = (f"{sizes['eval']} evaluation (the --eval-qa file)" if self.eval_given else
                      f"{sizes['eval']} evaluation (seed {self.split.seed})")
        return (f"{self.rows} questions: {sizes['train']} train ({made}), {sizes['dev']} RL-dev, {evaluation}; left "
                f"out: {gone}")


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _same_text(text: str) -> str:
    return " ".join(text.lower().split())


def user_split(qa_files: Sequence[Path | QuestionFile], corpus: Path, *, seed: int, out: Path, progress: bool = True,
               eval_fraction: float = 0.2, dev_fraction: float = 0.05,
               check: Callable[[Sequence[QAItem]], None] | None = None) -> UserData:
    """Read and check the question files (every bad row refused with its file and line, before any work), leave
    out the yes/no questions (the span check cannot judge them) and those whose answers occur in no passage of the
    corpus (no searcher can find them: counted and reported), and split the rest:

    - with an evaluation file (`QuestionFile(evaluation=True)`, `--eval-qa`): its questions are the evaluation
      part, every other question trains (no RL-dev part: the learner carves its own dev part from the training
      questions), however few;
    - else the real questions (labelled and feedback) are split by `seed` (`split_sizes`: at least 45 usable),
      and questions made from the corpus (pseudo, llm) only ever train; a run on made-up questions alone splits
      them (its evaluation then says so: `questions: pseudo`).

    The split is recorded in `<out>/split.json`; a rerun with the same files and seed reuses it, other files are
    refused. `check` sees every row first (and raises to refuse them)."""
    from tqdm import tqdm

    from plugsearch.retriever.store.corpus import CorpusError, iter_corpus

    given = [f if isinstance(f, QuestionFile) else QuestionFile(f) for f in qa_files]
    per_file = read_qa_files([f.path for f in given], [f.source for f in given])
    files = [{"name": f.path.name, "sha256": _sha256(f.path), "rows": len(rows), "source": f.source, "role": f.role}
             for f, rows in zip(given, per_file, strict=True)]
    role_of = {item.id: f.role for f, rows in zip(given, per_file, strict=True) for item in rows}
    items = [item for rows in per_file for item in rows]
    if check is not None:
        check(items)
    saved = out / SPLIT_FILE
    if saved.is_file():
        old = json.loads(saved.read_text())
        if [(f["sha256"], f.get("role", "split")) for f in old["files"]] != [(f["sha256"], f["role"]) for f in files] \
                or old["seed"] != seed:
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
    left_out = {"yes_no": yes_no, "answer_not_in_corpus": unanswerable}
    why = f"({len(items)} rows: {len(yes_no)} yes/no, {len(unanswerable)} whose answers occur in no passage of " \
          f"{corpus.name})"
    by_role: dict[str, list[QAItem]] = {"eval": [], "split": [], "train": []}
    for it in usable:
        by_role[role_of[it.id]].append(it)
    if any(f.evaluation for f in given):
        if not by_role["eval"]:
            raise QAFileError(f"no usable evaluation question in {', '.join(f.path.name for f in given if f.evaluation)} "
                              f"{why}")
        train = by_role["split"] + by_role["train"]
        if not train:
            raise QAFileError(f"no usable training question besides the evaluation file(s) {why}")
        if len(by_role["eval"]) < MIN_SPLIT["eval"]:
            logger.warning("only %s evaluation questions: the report's intervals will be wide (%s or more tell more)",
                           len(by_role["eval"]), MIN_SPLIT["eval"])
        ordered = sorted(train, key=lambda it: split_rank(seed, it.id))
        split = Split(train=ordered, dev=[], eval=sorted(by_role["eval"], key=lambda it: split_rank(seed, it.id)),
                      seed=seed)
    else:
        real = by_role["split"]
        pool = real or by_role["train"]  # questions made up from the corpus alone: split them (and say so)
        try:
            n_eval, n_dev = split_sizes(len(pool), eval_fraction=eval_fraction, dev_fraction=dev_fraction)
        except QAFileError as exc:
            raise QAFileError(f"{exc} {why}; or give the evaluation questions as their own file (--eval-qa FILE): "
                              "then every other question trains, however few") from exc
        split = split_items(pool, seed=seed, n_eval=n_eval, n_dev=n_dev)
        if real:
            split = replace(split, train=split.train + by_role["train"])
    trained = {_same_text(q.question) for q in split.train}
    data = UserData(split, rows=len(items), left_out=left_out, files=files,
                    eval_in_training=[q.id for q in split.eval if _same_text(q.question) in trained])
    if data.eval_in_training:
        logger.warning("%s evaluation questions are asked in the same words as a training question (e.g. %s): "
                       "their figures are not of new questions", len(data.eval_in_training), data.eval_in_training[0])
    out.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(data.record(), indent=1) + "\n", encoding="utf-8")
    return data
