"""A user's question files: every bad row refused with its line before any work, the questions whose answers
occur in no passage counted and left out, and the split into training / RL-dev / evaluation, which never puts
an evaluation question into training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plugsearch.trainer.common.data import (
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
