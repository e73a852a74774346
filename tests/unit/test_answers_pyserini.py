"""The span check agrees with pyserini's own `has_answers` (and s3's `answer_span_check`) on real data.

Pairs are built from ../shared/data/qa with predictions cut from corpus passages: the gold passage,
a window around the answer, the same window with the answer cut off, and a distractor passage.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

import pytest

from plugsearch.common.answers import SimpleTokenizer, has_answers, normalize_answer, span_match

pyserini_eval = pytest.importorskip("pyserini.eval.evaluate_dpr_retrieval")

QA_CORPUS = {"nq": "nq_gold", "hotpotqa": "hotpotqa", "popqa": "popqa", "2wikimultihopqa": "2wikimultihopqa",
             "musique": "musique"}
PER_SET = 150


def _jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _pairs(data_dir: Path) -> list[tuple[str, list[str]]]:
    rng = random.Random(13)
    pairs: list[tuple[str, list[str]]] = []
    for qa_name, corpus_name in QA_CORPUS.items():
        passages = _jsonl(data_dir / "corpus" / f"{corpus_name}.jsonl")
        by_title: dict[str, list[str]] = defaultdict(list)
        for p in passages:
            by_title[p["title"]].append(p["text"])
        questions = _jsonl(data_dir / "qa" / f"{qa_name}.jsonl")[:PER_SET]
        for q in questions:
            answers = q["golden_answers"]
            gold = [t for title in q["supporting_titles"] for t in by_title.get(title, [])]
            distractor = rng.choice(passages)["text"]
            preds = [distractor[:300]]
            for text in gold[:2]:
                preds.append(text)
                lowered = text.lower()
                for answer in answers[:3]:
                    at = lowered.find(answer.lower())
                    if at >= 0:
                        start = max(0, at - rng.randint(0, 60))
                        preds.append(text[start:at + len(answer) + rng.randint(0, 40)])
                        preds.append(text[start:at + max(1, len(answer) // 2)])  # answer cut off
            pairs.extend((pred, answers) for pred in preds if pred.strip())
    return pairs


def test_span_check_agrees_with_pyserini_on_shared_data(data_dir: Path) -> None:
    theirs = pyserini_eval.SimpleTokenizer()
    pairs = _pairs(data_dir)
    assert len(pairs) > 1500
    hits = misses = 0
    for prediction, answers in pairs:
        # s3's answer_span_check: normalise both sides, then pyserini's has_answers(regex=False)
        expected = pyserini_eval.has_answers(normalize_answer(prediction), [normalize_answer(a) for a in answers],
                                             theirs, regex=False)
        assert span_match(prediction, answers) == expected, (prediction, answers)
        # and the raw has_answers (no SQuAD normalisation) agrees too
        raw = pyserini_eval.has_answers(prediction, answers, theirs, regex=False)
        assert has_answers(prediction, answers) == raw, (prediction, answers)
        hits += expected
        misses += not expected
    assert hits > 400 and misses > 400  # both outcomes well represented


@pytest.mark.parametrize(("text", "answers"), [
    ("", [""]), ("anything at all", ["The"]), ("anything", ["..."]), ("Café au lait", ["cafe\u0301"]),
    ("ＡＢＣ １２３", ["abc"]), ("don't stop", ["don", "t"]), ("e.g. U.S.A.", ["u.s"]), ("x" * 5, []),
    ("naïve résumé", ["naive"]), ("3-4 kg", ["3 - 4"]), ("İstanbul", ["istanbul"]),
])
def test_edge_cases_agree_with_pyserini(text: str, answers: list[str]) -> None:
    theirs = pyserini_eval.SimpleTokenizer()
    assert has_answers(text, answers) == pyserini_eval.has_answers(text, answers, theirs, regex=False)
    normalised = [normalize_answer(a) for a in answers]
    assert span_match(text, answers) == pyserini_eval.has_answers(normalize_answer(text), normalised, theirs)


def test_tokenizer_matches_drqa_tokens() -> None:
    theirs = pyserini_eval.SimpleTokenizer()
    for text in ["Hello, world! It's 3.5 kg (approx.)", "Émile Zola — 1840–1902", "a\u0301b  c\td\n"]:
        assert SimpleTokenizer().words(text) == theirs.tokenize(text).words(uncased=True)


def test_s3_worked_examples_of_the_span_check() -> None:
    assert span_match("Barack Obama was the 44th president.", ["Obama"])  # span success
    assert span_match("It is not true.", ["true"])  # the documented false positive
    assert not span_match("The first black US president", ["Barack Obama"])  # paraphrase: span fails
    assert not span_match("twenty-five", ["25"]) and not span_match("3 kilograms", ["3 kg"])
    assert not span_match("Marseille", ["Paris"])
