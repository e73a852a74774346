"""Question sets (FlashRAG / Search-R1 format), splits and the s3 filter; the append-only JSONL records the
trainer resumes from. Here in `common` (pydantic and `common.answers` only) because the searcher reads a user's
question files too (the corpus check's labelled questions), and the searcher never imports the trainer.

Two sources, one discipline (a question is never both trained on and evaluated):
- the shipped sets (`$PLUGSEARCH_DATA/qa/*.jsonl`, dev/test sets): the trainer holds out the first
  `eval_holdout` (200) questions of every file and trains on the rest: rows 0-99 are what the evaluations
  report on, rows 100-199 are reserved (never trained, tuned or chosen on);
- a user's files (`read_qa_file`: `question`, `golden_answers`, optional `supporting_titles`, `id`, `dataset`),
  checked row by row before any work, the questions whose answers occur nowhere in the corpus counted and left
  out (`answerable`), then split into training / RL-dev / evaluation by a recorded seed (`split_items`).
"""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice, zip_longest
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field, model_validator

from plugsearch.common.answers import SimpleTokenizer, is_yes_no, normalize_answer, span_match

DATASETS = ("nq", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle", "triviaqa")
TRAIN_DATASETS = ("nq", "hotpotqa")

T = TypeVar("T")

SOURCES = ("labelled", "feedback", "shipped", "pseudo", "llm")
"""Where a training question comes from: a user's labelled file (`--qa`), the labelled questions exported from
users' marks (`--feedback`), the shipped Wikipedia training rows (`--shipped`), or made up from the corpus's
passages by the trainer (`pseudo`) or by the user's LLM (`llm`)."""
MADE_UP = frozenset({"pseudo", "llm"})
"""Sources of questions that are never evaluated on where real questions exist: a policy is judged on real ones."""


class QAItem(BaseModel):
    id: str
    question: str
    golden_answers: list[str] = Field(default_factory=list, description="gold answers (at least one, unless the "
                                      "question is labelled by `passage_ids`)")
    dataset: str = ""
    supporting_titles: list[str] = Field(default_factory=list, description="titles of the passages that support "
                                         "the answer (multi-hop sets; empty where the file has none)")
    passage_ids: list[str] = Field(default_factory=list, description="ids of the passages that answer it (BEIR / "
                                   "TREC qrels style): a returned passage with one of these ids is a hit")
    negative_ids: list[str] = Field(default_factory=list, description="ids of passages shown for it and marked as "
                                    "not helpful (rows exported from users' marks): hard negatives of the warm start")
    source: str = Field(default="labelled", description="where it comes from (`SOURCES`): a labelled file, users' "
                        "marks, the shipped Wikipedia training rows, or made up from the corpus (pseudo, llm)")

    @model_validator(mode="after")
    def _labelled(self) -> QAItem:
        if not self.golden_answers and not self.passage_ids:
            raise ValueError("a question needs golden_answers or passage_ids")
        return self


def found(documents: Sequence[Any], item: QAItem) -> bool:
    """Whether `documents` answer `item`: one holds a gold answer (GenAcc's span check) or is one of its labelled
    passages (`passage_ids`). What every evaluation, reward and warm-start label here counts as found."""
    ids = item.passage_ids
    for d in documents:
        doc_id, text = (d["id"], d["text"]) if isinstance(d, dict) else (d.id, d.text)
        if (ids and doc_id in ids) or (item.golden_answers and span_match(text, item.golden_answers)):
            return True
    return False


def default_data_dir() -> Path:
    """`$PLUGSEARCH_DATA`, else `<repo>/../shared/data` (the one rule: `plugsearch.common.paths`)."""
    from plugsearch.common.paths import default_data_dir as shared_rule

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


# ------------------------------------------------------------------------------------------ a user's files
class QAFileError(ValueError):
    """A question file that cannot be trained on (the message names the file, the lines and why)."""


MAX_LISTED = 8
"""Bad rows named in an error before the count of the rest."""


PASSAGE_ID_FIELDS = ("passage_ids", "relevant_ids", "gold_passage_ids")
"""Where a row may give the ids of its relevant passages (BEIR / TREC qrels style), in this order."""


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "not a JSON object"
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        return "no `question` (a non-empty string)"
    answers = row.get("golden_answers")
    ids = next((row[k] for k in PASSAGE_ID_FIELDS if k in row), None)
    if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(i, str | int) and str(i).strip()
                                                                        for i in ids)):
        return "`passage_ids` must be a non-empty list of passage ids"
    if answers is None and ids is None:
        return ("no `golden_answers` (a list of its gold answers) and no `passage_ids` (the ids of the passages "
                "that answer it): every row needs one of them")
    if answers is not None and (not isinstance(answers, list) or not answers):
        return "`golden_answers` must be a non-empty list of strings"
    if answers is not None and not all(isinstance(a, str | int | float) and str(a).strip() for a in answers):
        return "`golden_answers` holds an empty or non-text answer"
    titles = row.get("supporting_titles")
    if titles is not None and not (isinstance(titles, list) and all(isinstance(t, str) for t in titles)):
        return "`supporting_titles` must be a list of strings"
    if "id" in row and (row["id"] is None or str(row["id"]).strip() == ""):
        return "an empty `id`"
    return None


def _read_rows(path: Path, what: str, problem_of: Callable[[Any], str | None],
               item_of: Callable[[dict[str, Any], int], QAItem]) -> list[QAItem]:
    """Every row of a JSONL question file: each bad row (not JSON, or `problem_of` says why) is found before
    anything is returned: `QAFileError` names the file, the first few with their line numbers and counts the rest."""
    if not path.is_file():
        raise QAFileError(f"{what} file {path} does not exist")
    items: list[QAItem] = []
    problems: list[str] = []
    bad = 0
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            problem: str | None
            try:
                row = json.loads(line)
            except ValueError:
                row, problem = None, "not valid JSON"
            else:
                problem = problem_of(row)
            if problem is not None:
                bad += 1
                if len(problems) < MAX_LISTED:
                    problems.append(f"line {lineno}: {problem}")
                continue
            items.append(item_of(row, lineno))
    if bad:
        more = f"; and {bad - len(problems)} more" if bad > len(problems) else ""
        raise QAFileError(f"{path}: {bad} bad row(s): " + "; ".join(problems) + more)
    if not items:
        raise QAFileError(f"{path}: no question rows")
    return items


def read_qa_file(path: Path, source: str = "labelled") -> list[QAItem]:
    """Every row of a user's question file (JSONL: `question`, `golden_answers` or `passage_ids`, optional
    `supporting_titles`, `id` (default `<file stem>-<line number>`), `dataset` (default the file's stem)), each
    recorded as coming from `source`. Every bad row is found before anything is returned: `QAFileError` names the
    first few with their line numbers and counts the rest."""
    def item_of(row: dict[str, Any], lineno: int) -> QAItem:
        ids = next((row[k] for k in PASSAGE_ID_FIELDS if k in row), None) or []
        return QAItem(id=str(row.get("id", f"{path.stem}-{lineno}")), question=" ".join(row["question"].split()),
                      golden_answers=[str(a) for a in row.get("golden_answers") or ()],
                      dataset=str(row.get("dataset") or path.stem),
                      supporting_titles=list(row.get("supporting_titles") or ()),
                      passage_ids=[str(i) for i in ids], source=source)

    return _read_rows(path, "question", _row_problem, item_of)


FEEDBACK_FIELDS = ("id", "question", "passage_ids", "negative_ids", "answer", "source", "dataset")
"""A feedback row (`plugsearch-feedback export`, one row per marked search): `question`, `passage_ids` (the passages
marked as helpful), optional `negative_ids` (shown and marked as not helpful), `answer`, `id`, `source`
(`feedback`) and `dataset`."""


def _ids_problem(value: Any, name: str, *, empty: bool) -> str | None:
    if not isinstance(value, list) or (not value and not empty) or not all(
            isinstance(i, str | int) and not isinstance(i, bool) and str(i).strip() for i in value):
        return f"`{name}` must be a {'' if empty else 'non-empty '}list of passage ids"
    return None


def _feedback_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return "not a JSON object"
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        return "no `question` (a non-empty string)"
    if "passage_ids" not in row:
        return "no `passage_ids` (the ids of the passages marked as helpful)"
    problem = _ids_problem(row["passage_ids"], "passage_ids", empty=False)
    if problem is None and row.get("negative_ids") is not None:
        problem = _ids_problem(row["negative_ids"], "negative_ids", empty=True)
    if problem is not None:
        return problem
    both = {str(i) for i in row["passage_ids"]} & {str(i) for i in row.get("negative_ids") or ()}
    if both:
        return f"passage {sorted(both)[0]!r} is marked both helpful (`passage_ids`) and not (`negative_ids`)"
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        return "`answer` must be a string (or absent)"
    if "id" in row and (row["id"] is None or str(row["id"]).strip() == ""):
        return "an empty `id`"
    return None


def read_feedback_file(path: Path) -> list[QAItem]:
    """Every row of a file of labelled questions exported from users' marks (`FEEDBACK_FIELDS`): each a question
    labelled by the passages marked as helpful (`passage_ids`: what counts as found), with the passages marked as
    not helpful (`negative_ids`) kept as hard negatives; `answer` is checked but not used to label (the marks are
    the labels). Bad rows are refused with the file and their lines, as `read_qa_file` does."""
    def item_of(row: dict[str, Any], lineno: int) -> QAItem:
        return QAItem(id=str(row.get("id", f"{path.stem}-{lineno}")), question=" ".join(row["question"].split()),
                      dataset=str(row.get("dataset") or path.stem), passage_ids=[str(i) for i in row["passage_ids"]],
                      negative_ids=[str(i) for i in row.get("negative_ids") or ()], source="feedback")

    return _read_rows(path, "feedback", _feedback_problem, item_of)


def read_source_file(path: Path, source: str) -> list[QAItem]:
    """`read_feedback_file` for `feedback`, else `read_qa_file` with that source."""
    if source not in SOURCES:
        raise ValueError(f"unknown question source {source!r} (one of {', '.join(SOURCES)})")
    return read_feedback_file(path) if source == "feedback" else read_qa_file(path, source)


def read_qa_files(paths: Sequence[Path], sources: Sequence[str] | None = None) -> list[list[QAItem]]:
    """`read_source_file` of each (`sources`: each file's, default labelled); an id used twice (in one file or
    across them) is refused."""
    per_file = [read_source_file(path, source) for path, source in
                zip(paths, sources or ["labelled"] * len(paths), strict=True)]
    items = [item for rows in per_file for item in rows]
    seen: dict[str, int] = {}
    for item in items:
        seen[item.id] = seen.get(item.id, 0) + 1
    twice = [qid for qid, n in seen.items() if n > 1]
    if twice:
        raise QAFileError(f"{len(twice)} question id(s) occur more than once (e.g. {', '.join(twice[:3])}): ids "
                          "must be unique across the question files")
    return per_file


_TOKENS = SimpleTokenizer()


def _answer_tokens(text: str) -> tuple[str, ...]:
    """GenAcc's span check's tokens (`span_match`: s3's normalisation, NFD, DrQA's tokenizer)."""
    return tuple(_TOKENS.words(unicodedata.normalize("NFD", normalize_answer(text)), uncased=True))


def answerable(items: Sequence[QAItem], passages: Iterable[str | tuple[str, str]], *,
               progress: Callable[[int], Any] | None = None) -> set[str]:
    """Ids of the questions whose gold answer occurs in some passage text under GenAcc's span check, or one of
    whose labelled passages (`passage_ids`) is in the corpus (what every reward and evaluation here counts as
    found): one pass over the passages (texts, or (id, text) pairs to find labelled ids)."""
    first: dict[str, list[tuple[tuple[str, ...], str]]] = {}
    found: set[str] = set()
    by_id: dict[str, list[str]] = {}
    for item in items:
        for pid in item.passage_ids:
            by_id.setdefault(pid, []).append(item.id)
        for answer in item.golden_answers:
            tokens = _answer_tokens(answer)
            if not tokens:  # empties to nothing: the span check matches any text
                found.add(item.id)
                break
            first.setdefault(tokens[0], []).append((tokens, item.id))
    for count, passage in enumerate(passages, start=1):
        if isinstance(passage, tuple):
            pid, text = passage
            found.update(by_id.get(pid, ()))
        else:
            text = passage
        words = _answer_tokens(text)
        for i, word in enumerate(words):
            for tokens, qid in first.get(word, ()):
                if qid not in found and words[i:i + len(tokens)] == tokens:
                    found.add(qid)
        if progress is not None and count % 1000 == 0:
            progress(1000)
    return found


@dataclass(frozen=True)
class Split:
    """Questions split for training: `train` (warm start and RL), `dev` (watched during RL, never trained on),
    `eval` (the report; never trained or tuned on)."""

    train: list[QAItem]
    dev: list[QAItem]
    eval: list[QAItem]
    seed: int

    def ids(self) -> dict[str, list[str]]:
        return {"train": [q.id for q in self.train], "dev": [q.id for q in self.dev],
                "eval": [q.id for q in self.eval]}


MIN_SPLIT = {"eval": 20, "dev": 5, "train": 20}
"""The smallest split that trains and says something: fewer questions are refused."""


def split_sizes(n: int, *, eval_fraction: float = 0.2, dev_fraction: float = 0.05, max_eval: int = 500,
                max_dev: int = 200) -> tuple[int, int]:
    """(evaluation, dev) sizes for `n` usable questions; raises `QAFileError` when `n` is too few."""
    need = sum(MIN_SPLIT.values())
    if n < need:
        raise QAFileError(f"too few questions to split: {n} usable, at least {need} are needed "
                          f"({MIN_SPLIT['eval']} evaluation, {MIN_SPLIT['dev']} RL-dev, {MIN_SPLIT['train']} training)")
    n_eval = min(max_eval, max(MIN_SPLIT["eval"], round(eval_fraction * n)))
    n_dev = min(max_dev, max(MIN_SPLIT["dev"], round(dev_fraction * n)))
    n_eval = min(n_eval, n - n_dev - MIN_SPLIT["train"])
    return n_eval, n_dev


def split_rank(seed: int, qid: str) -> str:
    """A question's place in the seeded order every split of a user's questions follows."""
    return hashlib.sha256(f"{seed}:{qid}".encode()).hexdigest()


def split_items(items: Sequence[QAItem], *, seed: int, n_eval: int, n_dev: int) -> Split:
    """Deterministic by `seed` and the ids alone: the questions ordered by sha256(seed:id); the first `n_eval`
    evaluate, the next `n_dev` watch RL, the rest train. A question's place does not depend on the file order
    or on the other rows (appending rows never moves a question out of the evaluation split into training
    unless a new one outranks it)."""
    ids = [it.id for it in items]
    if len(set(ids)) != len(ids):
        raise QAFileError("question ids must be unique to split")
    if n_eval < 1 or n_dev < 0 or n_eval + n_dev >= len(items):
        raise QAFileError(f"cannot split {len(items)} questions into {n_eval} evaluation and {n_dev} dev and a "
                          "training rest")
    ordered = sorted(items, key=lambda it: split_rank(seed, it.id))
    return Split(train=ordered[n_eval + n_dev:], dev=ordered[n_eval:n_eval + n_dev], eval=ordered[:n_eval],
                 seed=seed)
