"""A user's question files: every bad row refused with its line before any work, the questions whose answers
occur in no passage counted and left out, and the split into training / RL-dev / evaluation, which never puts
an evaluation question into training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugsearch.common.qa import (
    MIN_SPLIT,
    QAFileError,
    QAItem,
    answerable,
    read_qa_file,
    read_qa_files,
    split_items,
    split_sizes,
)
from plugsearch.trainer.compact.data import user_split


def write(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def items(n: int) -> list[QAItem]:
    return [QAItem(id=f"q{i}", question=f"question {i}?", golden_answers=[f"answer {i}"]) for i in range(n)]


@settings(max_examples=200, deadline=None)
@given(ids=st.sets(st.text(min_size=1, max_size=12), min_size=3, max_size=300), seed=st.integers(0, 10**6),
       data=st.data())
def test_the_split_never_puts_an_evaluation_question_into_training(ids: set[str], seed: int, data: st.DataObject
                                                                    ) -> None:
    rows = [QAItem(id=i, question="q", golden_answers=["a"]) for i in sorted(ids)]
    n_eval = data.draw(st.integers(1, len(rows) - 2))
    n_dev = data.draw(st.integers(0, len(rows) - n_eval - 1))
    split = split_items(rows, seed=seed, n_eval=n_eval, n_dev=n_dev)
    train, dev, evaluation = ({q.id for q in part} for part in (split.train, split.dev, split.eval))
    assert not evaluation & (train | dev) and not dev & train
    assert train | dev | evaluation == ids and (len(evaluation), len(dev)) == (n_eval, n_dev) and train
    # a function of the seed and the ids alone: the files' order changes nothing
    shuffled = data.draw(st.permutations(rows))
    again = split_items(shuffled, seed=seed, n_eval=n_eval, n_dev=n_dev)
    assert again.ids() == split.ids()


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 5000))
def test_split_sizes_leave_every_split_its_minimum_or_refuse(n: int) -> None:
    if n < sum(MIN_SPLIT.values()):
        with pytest.raises(QAFileError, match="too few questions to split"):
            split_sizes(n)
        return
    n_eval, n_dev = split_sizes(n)
    assert n_eval >= MIN_SPLIT["eval"] and n_dev >= MIN_SPLIT["dev"] and n - n_eval - n_dev >= MIN_SPLIT["train"]


def test_bad_rows_are_refused_with_their_lines(tmp_path: Path) -> None:
    good = {"question": "Who wrote Hamlet?", "golden_answers": ["Shakespeare"]}
    path = write(tmp_path / "mine.jsonl", [
        good,
        {"question": "No answers here?"},                                 # line 2
        {"question": "Empty answers?", "golden_answers": []},             # line 3
        "not json",                                                       # line 4
        {"golden_answers": ["x"]},                                        # line 5
        {"question": "Titles?", "golden_answers": ["x"], "supporting_titles": "T"},  # line 6
        {"question": "Blank answer?", "golden_answers": [" "]},           # line 7
    ])
    with pytest.raises(QAFileError) as err:
        read_qa_file(path)
    message = str(err.value)
    assert "6 bad row(s)" in message and str(path) in message
    for line, why in ((2, "no `golden_answers`"), (3, "`golden_answers` must be a non-empty list"),
                      (4, "not valid JSON"), (5, "no `question`"), (6, "`supporting_titles`"),
                      (7, "`golden_answers` holds an empty or non-text answer")):
        assert f"line {line}: {why}" in message
    with pytest.raises(QAFileError, match="does not exist"):
        read_qa_file(tmp_path / "missing.jsonl")
    with pytest.raises(QAFileError, match="no question rows"):
        read_qa_file(write(tmp_path / "empty.jsonl", []))
    # ids default to the file and line; a file's rows carry their file's name as their set
    (first,) = read_qa_file(write(tmp_path / "one.jsonl", [good]))
    assert first.id == "one-1" and first.dataset == "one" and first.golden_answers == ["Shakespeare"]
    twice = write(tmp_path / "twice.jsonl", [{**good, "id": "a"}, {**good, "id": "a"}])
    with pytest.raises(QAFileError, match="more than once"):
        read_qa_files([twice])


def test_answers_are_looked_for_as_the_span_check_does() -> None:
    qs = [QAItem(id="1", question="q", golden_answers=["The Eiffel Tower"]),    # articles and case normalised away
          QAItem(id="2", question="q", golden_answers=["Paris, France", "Lutetia"]),
          QAItem(id="3", question="q", golden_answers=["Berlin"]),              # nowhere
          QAItem(id="4", question="q", golden_answers=["tower eiffel"])]        # words in another order: no span
    passages = ["It stands near eiffel tower.", "Known in Roman times as Lutetia!"]
    assert answerable(qs, passages) == {"1", "2"}


def test_a_users_files_are_checked_split_and_recorded(tmp_path: Path) -> None:
    corpus = write(tmp_path / "corpus.jsonl", [{"id": f"p{i}", "title": f"T{i}", "text": f"the answer is word{i}"}
                                              for i in range(80)])
    rows = [{"id": f"r{i}", "question": f"q {i}?", "golden_answers": [f"word{i}"]} for i in range(70)]
    rows += [{"id": "yn", "question": "is it?", "golden_answers": ["yes"]},
             {"id": "gone", "question": "where?", "golden_answers": ["nowhere at all"]}]
    qa = write(tmp_path / "qa.jsonl", rows)
    data = user_split([qa], corpus, seed=3, out=tmp_path / "run", progress=False)
    assert data.left_out == {"yes_no": ["yn"], "answer_not_in_corpus": ["gone"]}
    record = json.loads((tmp_path / "run" / "split.json").read_text())
    assert record["seed"] == 3 and set(record["eval"]).isdisjoint(record["train"] + record["dev"])
    assert sorted(record["eval"] + record["dev"] + record["train"]) == sorted(f"r{i}" for i in range(70))
    assert record["left_out"]["answer_not_in_corpus"] == {"count": 1, "ids": ["gone"]}
    # the same files and seed: the same split; other files in the same run folder: refused
    assert user_split([qa], corpus, seed=3, out=tmp_path / "run", progress=False).split.ids() == data.split.ids()
    other = write(tmp_path / "other.jsonl", rows[:-1])
    with pytest.raises(QAFileError, match="use a new --out"):
        user_split([other], corpus, seed=3, out=tmp_path / "run", progress=False)
    with pytest.raises(QAFileError, match="too few questions to split: 10 usable"):
        user_split([write(tmp_path / "few.jsonl", rows[:10])], corpus, seed=0, out=tmp_path / "few", progress=False)
    bad_corpus = write(tmp_path / "bad.jsonl", ['{"id": "x"}'])
    with pytest.raises(QAFileError, match="corpus: .*needs 'title'\\+'text' or 'contents'"):
        user_split([qa], bad_corpus, seed=0, out=tmp_path / "bad", progress=False)


def test_feedback_rows_are_read_as_questions_labelled_by_their_marks(tmp_path: Path) -> None:
    """The rows `plugsearch-feedback export` writes: the passages marked as helpful are what counts as found, the
    ones marked as not helpful are kept as hard negatives; every bad row is refused with its file and line."""
    from plugsearch.common.qa import found, read_feedback_file
    from plugsearch.common.schemas.base import Document

    path = write(tmp_path / "marks.jsonl", [
        {"id": "s1", "question": "what is the refund window?", "passage_ids": ["p1"], "negative_ids": ["p2", "p3"],
         "answer": "30 days", "source": "feedback"},
        {"question": "who signs the report?", "passage_ids": ["p7", 8]},
    ])
    first, second = read_feedback_file(path)
    assert (first.id, first.passage_ids, first.negative_ids, first.source) == ("s1", ["p1"], ["p2", "p3"], "feedback")
    assert first.golden_answers == [] and second.id == "marks-2" and second.passage_ids == ["p7", "8"]
    assert found([Document(id="p1", title="", text="x")], first) and not found([Document(id="p2", title="", text="30 days")], first)
    bad = write(tmp_path / "bad.jsonl", [
        {"question": "fine?", "passage_ids": ["p1"], "negative_ids": []},                  # line 1: good
        {"question": "no marks?"},                                                          # line 2
        {"question": "empty?", "passage_ids": []},                                          # line 3
        {"question": "both?", "passage_ids": ["p1"], "negative_ids": ["p1"]},               # line 4
        {"question": "negatives?", "passage_ids": ["p1"], "negative_ids": "p2"},            # line 5
        {"question": "answer?", "passage_ids": ["p1"], "answer": ["30 days"]},              # line 6
        {"passage_ids": ["p1"]},                                                            # line 7
        "{not json",                                                                        # line 8
    ])
    with pytest.raises(QAFileError) as err:
        read_feedback_file(bad)
    message = str(err.value)
    assert message.startswith(f"{bad}: 7 bad row(s)")
    for line, why in ((2, "no `passage_ids`"), (3, "`passage_ids` must be a non-empty list"),
                      (4, "passage 'p1' is marked both helpful"), (5, "`negative_ids` must be a list"), (6, "`answer` must be a string"),
                      (7, "no `question`"), (8, "not valid JSON")):
        assert f"line {line}: {why}" in message
    with pytest.raises(QAFileError, match="feedback file .* does not exist"):
        read_feedback_file(tmp_path / "missing.jsonl")


def test_an_evaluation_file_lets_a_few_questions_train_and_made_up_ones_never_evaluate(tmp_path: Path) -> None:
    from plugsearch.trainer.compact.data import QuestionFile

    corpus = write(tmp_path / "corpus.jsonl", [{"id": f"p{i}", "title": f"T{i}", "text": f"the answer is word{i}"}
                                              for i in range(120)])
    qa = write(tmp_path / "mine.jsonl", [{"id": f"r{i}", "question": f"q {i}?", "golden_answers": [f"word{i}"]}
                                         for i in range(25)])
    marks = write(tmp_path / "marks.jsonl", [{"id": f"m{i}", "question": f"m {i}?", "passage_ids": [f"p{30 + i}"],
                                              "negative_ids": [f"p{90 + i}"]} for i in range(5)])
    made = write(tmp_path / "pseudo.jsonl", [{"id": f"x{i}", "question": f"x {i}?", "golden_answers": [f"word{50 + i}"],
                                              "dataset": "pseudo"} for i in range(30)])
    held = write(tmp_path / "held.jsonl", [{"id": f"e{i}", "question": f"e {i}?", "golden_answers": [f"word{100 + i}"]}
                                           for i in range(12)] + [{"id": "e-again", "question": "q 3?",
                                                                   "golden_answers": ["word3"]}])
    files = [QuestionFile(qa), QuestionFile(marks, "feedback"), QuestionFile(made, "pseudo"),
             QuestionFile(held, evaluation=True)]
    data = user_split(files, corpus, seed=0, out=tmp_path / "run", progress=False)
    assert sorted(q.id for q in data.split.eval) == sorted([f"e{i}" for i in range(12)] + ["e-again"])
    assert data.split.dev == [] and len(data.split.train) == 25 + 5 + 30
    assert data.sources()["train"] == {"labelled": 25, "feedback": 5, "shipped": 0, "pseudo": 30, "llm": 0}
    assert data.sources()["eval"]["labelled"] == 13 and data.eval_in_training == ["e-again"]
    record = json.loads((tmp_path / "run" / "split.json").read_text())
    assert [f["role"] for f in record["files"]] == ["split", "split", "train", "eval"]
    assert record["sizes"] == {"train": 60, "dev": 0, "eval": 13} and "--eval-qa" in record["evaluation"]
    negatives = [q.negative_ids for q in data.split.train if q.source == "feedback"]
    assert sorted(negatives) == [[f"p{90 + i}"] for i in range(5)]
    # the same files in another role are another split: refused in the same folder
    with pytest.raises(QAFileError, match="use a new --out"):
        user_split([QuestionFile(qa), QuestionFile(marks, "feedback"), QuestionFile(made, "pseudo"), QuestionFile(held)],
                   corpus, seed=0, out=tmp_path / "run", progress=False)
    # without an evaluation file, made-up questions only train: the real ones are split (and 30 are too few)
    with pytest.raises(QAFileError, match="too few questions to split: 30 usable.*--eval-qa"):
        user_split(files[:3], corpus, seed=0, out=tmp_path / "no-eval", progress=False)
    more = write(tmp_path / "more.jsonl", [{"id": f"s{i}", "question": f"s {i}?", "golden_answers": [f"word{i}"]}
                                           for i in range(60)])
    split = user_split([QuestionFile(more), QuestionFile(made, "pseudo")], corpus, seed=0, out=tmp_path / "mixed",
                       progress=False).split
    assert not {q.source for q in split.eval + split.dev} & {"pseudo"} and len(split.eval) == 20
    assert sum(q.source == "pseudo" for q in split.train) == 30
    with pytest.raises(QAFileError, match="no usable evaluation question"):
        user_split([QuestionFile(qa), QuestionFile(write(tmp_path / "gone.jsonl", [
            {"question": "where?", "golden_answers": ["nowhere at all"]}]), evaluation=True)], corpus, seed=0,
            out=tmp_path / "gone", progress=False)


def test_the_rows_plugsearch_feedback_export_writes_are_the_rows_the_trainer_reads(tmp_path: Path) -> None:
    """The contract between `plugsearch-feedback export` and `plugsearch-train compact --feedback`."""
    from plugsearch.common.qa import read_feedback_file
    from plugsearch.searcher.feedback.cli import training_row

    marks = [{"search_id": "kq1", "question": "What was the total sales in 2019?", "helpful": ["tatqa-0042-001"],
              "not_helpful": ["tatqa-0107-000"], "answer": "$1,496.5 million"},
             {"search_id": "kq2", "question": "Who audits it?", "helpful": ["p1", "p2"], "not_helpful": [],
              "answer": None}]
    path = write(tmp_path / "marks.jsonl", [training_row(m) for m in marks])
    first, second = read_feedback_file(path)
    assert (first.id, first.passage_ids, first.negative_ids) == ("feedback-kq1", ["tatqa-0042-001"], ["tatqa-0107-000"])
    assert (second.passage_ids, second.negative_ids, second.source) == (["p1", "p2"], [], "feedback")
