"""Answer normalisation, the GenAcc span check (`span_match`, s3's), EM and F1: one implementation, shared by
the judge, the retriever benches and the trainer.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence

import regex

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD / s3 normalisation: lower, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


class SimpleTokenizer:
    """DrQA's SimpleTokenizer (as vendored in pyserini): alphanumeric runs, or single non-space chars."""

    ALPHA_NUM = r"[\p{L}\p{N}\p{M}]+"
    NON_WS = r"[^\p{Z}\p{C}]"

    def __init__(self) -> None:
        self._regexp = regex.compile(f"({self.ALPHA_NUM})|({self.NON_WS})",
                                     flags=regex.IGNORECASE + regex.UNICODE + regex.MULTILINE)

    def words(self, text: str, uncased: bool = True) -> list[str]:
        tokens = [m.group() for m in self._regexp.finditer(text)]
        return [t.lower() for t in tokens] if uncased else tokens


_TOKENIZER = SimpleTokenizer()


def has_answers(text: str, answers: Iterable[str], tokenizer: SimpleTokenizer = _TOKENIZER) -> bool:
    """pyserini.eval.evaluate_dpr_retrieval.has_answers (regex=False), reproduced exactly.

    Like pyserini, an answer with no tokens (e.g. a gold answer that s3's normalisation empties, such
    as "The" or "A") matches any text, including an empty one: the empty sequence occurs at offset 0.
    `tests/unit/test_answers_pyserini.py` checks agreement with pyserini's own function.
    """
    words = tokenizer.words(unicodedata.normalize("NFD", text), uncased=True)
    for answer in answers:
        ans = tokenizer.words(unicodedata.normalize("NFD", answer), uncased=True)
        if any(words[i:i + len(ans)] == ans for i in range(len(words) - len(ans) + 1)):
            return True
    return False


def span_match(prediction: str, golden_answers: Sequence[str]) -> bool:
    """s3's span check (`answer_span_check` in s3's reward code): normalise both sides, then `has_answers`.

    Faithful to s3, including its traps: "not true" contains gold "true"; a gold answer that
    normalises to nothing ("The", "A") matches every prediction (see `has_answers`).
    """
    return has_answers(normalize_answer(prediction), [normalize_answer(a) for a in golden_answers])


def exact_match(prediction: str, golden_answers: Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in golden_answers))


def f1_score(prediction: str, golden_answers: Sequence[str]) -> float:
    """Token F1 (SQuAD), max over gold answers."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for answer in golden_answers:
        gold_tokens = normalize_answer(answer).split()
        same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if not pred_tokens or not gold_tokens:
            score = float(pred_tokens == gold_tokens)
        elif same == 0:
            score = 0.0
        else:
            precision = same / len(pred_tokens)
            recall = same / len(gold_tokens)
            score = 2 * precision * recall / (precision + recall)
        best = max(best, score)
    return best


YES_NO = frozenset({"yes", "no", "true", "false"})


def is_yes_no(golden_answers: Sequence[str]) -> bool:
    """True for yes/no and true/false questions, which span checks cannot judge (s3 drops them)."""
    return bool(golden_answers) and all(normalize_answer(a) in YES_NO for a in golden_answers)
