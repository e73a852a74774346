"""Questions made from a corpus's own passages, with their answers: what the searcher measures itself on before
it serves a corpus it was not trained for (`plugsearch.searcher.corpus_check`), and what a corpus with no labelled
questions trains a searcher on (`plugsearch-train compact --corpus FILE` without `--qa`).

A pseudo-question is a cloze over one sentence of a passage: a name or a number in the sentence is the answer,
and the question is what a person who half-remembers the sentence would type: a question word fitting the
answer ("when" for a year, "how many" / "how much" for a number, "who or what" for a name) and some of the
sentence's other content words, not all, in their order, without the answer. Retrieval does not find such a
question's passage every time (a real question shares part of its passage's words, not all of them), so
answer recall over them separates a searcher that finds passages from one that does not. Deterministic: the
same passages and seed give the same questions.

Nothing here reads a title as a name (on many corpora every passage of a document carries the document's title);
the answer is never a word of the title, so the title's words cannot give it away.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from plugsearch.common.answers import span_match
from plugsearch.common.schemas.base import Document
from plugsearch.searcher.compact.candidates import _QUERY_WORD as _TOKEN
from plugsearch.searcher.compact.candidates import _names, _sentences
from plugsearch.searcher.compact.text import _STOP, title_core
from plugsearch.searcher.env import RetrieverBackend

MIN_CONTENT = 4
"""Content words a sentence keeps besides the answer for a question to be made from it."""
KEEP_SHARE = 0.6
"""The share of those content words a question keeps (at least `MIN_KEPT`)."""
MIN_KEPT = 3
MAX_KEPT = 8
MIN_ANSWER_CHARS = 2
_NUMBER = re.compile(r"(?<![\w.])(\$?\d[\d,]*(?:\.\d+)?%?)(?![\w])")
_YEAR = re.compile(r"^(1[5-9]\d\d|20\d\d)$")


@dataclass(frozen=True)
class PseudoQuestion:
    """A question made from `passage_id`'s sentence, answered by `answer` (a span of that sentence)."""

    question: str
    answer: str
    passage_id: str
    kind: str
    """`name`, `year` or `number`: what the answer is."""

    def found(self, documents: Sequence[Document]) -> bool:
        """Whether one of `documents` holds the answer (GenAcc's span check): what the corpus check counts."""
        return any(span_match(d.text, [self.answer]) for d in documents)


def _answers(sentence: str, title: str) -> list[tuple[str, str]]:
    """(span, kind) candidates of one sentence: names it introduces (not in the title; only as written there) and
    numbers."""
    out: list[tuple[str, str]] = [(name, "name") for name in _names(sentence, title.lower()) if name in sentence]
    for m in _NUMBER.finditer(sentence):
        span = m.group(1).rstrip(".,")
        digits = re.sub(r"\D", "", span)
        if len(digits) < MIN_ANSWER_CHARS and "%" not in span and "$" not in span:
            continue
        out.append((span, "year" if _YEAR.match(span) else "number"))
    return out


def _content_words(text: str, drop: set[str]) -> list[str]:
    """The distinct content words of `text` in their order, without those in `drop` (lower-cased)."""
    words = [w for w in _TOKEN.findall(text) if w.lower() not in _STOP and w.lower() not in drop and len(w) > 1]
    return list(dict.fromkeys(words))


def _wh(kind: str, rng: random.Random) -> str:
    if kind == "year":
        return "when"
    if kind == "number":
        return rng.choice(("how many", "how much", "what"))
    return rng.choice(("who", "what", "which"))


def question_from(passage_id: str, title: str, text: str, rng: random.Random, *, keep_share: float = KEEP_SHARE, min_kept: int = MIN_KEPT
                  ) -> PseudoQuestion | None:
    """One pseudo-question from a passage (None when no sentence of it has an answer and enough other words)."""
    sentences = [s for s in _sentences(" ".join(text.split())) if len(s) >= 30]
    rng.shuffle(sentences)
    title_words = {w.lower() for w in _TOKEN.findall(title)}
    for sentence in sentences:
        answers = [(a, k) for a, k in _answers(sentence, title)
                   if not {w.lower() for w in _TOKEN.findall(a)} & title_words]
        if not answers:
            continue
        answer, kind = rng.choice(answers)
        start = sentence.find(answer)
        rest = sentence[:start] + " " + sentence[start + len(answer):]
        words = _content_words(rest, {w.lower() for w in _TOKEN.findall(answer)})
        if len(words) < MIN_CONTENT:
            continue
        keep = min(MAX_KEPT, max(min_kept, round(len(words) * keep_share)))
        chosen = sorted(rng.sample(range(len(words)), keep))
        question = f"{_wh(kind, rng)} {' '.join(words[i] for i in chosen)}?"
        return PseudoQuestion(question, answer, passage_id, kind)
    return None


def sample_positions(size: int, n: int, *, seed: int = 0) -> list[int]:
    """`n` distinct passage positions out of `size`, drawn by `seed` (all of them, shuffled, when n >= size): the retriever's
    `POST /passages/sample` draws the same."""
    return random.Random(seed).sample(range(size), min(n, size))


def describe(questions: Sequence[PseudoQuestion]) -> dict[str, int]:
    """How many questions of each answer kind."""
    return dict(Counter(q.kind for q in questions))


BRIDGE_KEEP_FROM_ANSWER = 2
"""Content words a bridge question keeps from the answer's sentence (the rest come from the bridging passage)."""
BRIDGE_KEEP_FROM_BRIDGE = 4
MIN_TITLE_CHARS = 4


def bridge_question(answer_passage: tuple[str, str, str], bridge: tuple[str, str, str], rng: random.Random, *,
                    keep_share: float = KEEP_SHARE, min_kept: int = MIN_KEPT) -> PseudoQuestion | None:
    """A two-passage question: the answer lies in `answer_passage` (title T), and `bridge` (another document)
    mentions T. The question keeps a few words of the answer's sentence and more of the bridge's sentence that
    names T, never T itself: a searcher must find the bridge, read T there and search it, as for "Which city is
    the director of Big Stone Gap based in?". None when the pair gives no such question."""
    pid, title, text = answer_passage
    name = title_core(title)
    _, bridge_title, bridge_text = bridge
    if len(name) < MIN_TITLE_CHARS or name not in bridge_text or title_core(bridge_title) == name:
        return None
    name_words = {w.lower() for w in _TOKEN.findall(title)}
    mention = next((s for s in _sentences(" ".join(bridge_text.split())) if name in s), None)
    if mention is None:
        return None
    from_bridge = _content_words(mention.replace(name, " "), name_words)
    single = question_from(pid, title, text, rng, keep_share=keep_share, min_kept=min_kept)
    if single is None or single.answer in bridge_text or len(from_bridge) < min_kept:
        return None
    from_answer = [w for w in single.question.rstrip("?").split()[1:] if w.lower() not in name_words
                   and w.lower() not in ("many", "much")]
    kept_answer = [from_answer[i] for i in sorted(rng.sample(range(len(from_answer)),
                                                             min(BRIDGE_KEEP_FROM_ANSWER, len(from_answer))))]
    kept_bridge = [from_bridge[i] for i in sorted(rng.sample(range(len(from_bridge)),
                                                             min(BRIDGE_KEEP_FROM_BRIDGE, len(from_bridge))))]
    wh = single.question.split()[0] if not single.question.startswith("how") else " ".join(single.question.split()[:2])
    return PseudoQuestion(f"{wh} {' '.join(kept_answer + kept_bridge)}?", single.answer, pid, "bridge")


async def bridge_questions(passages: Sequence[tuple[str, str, str]], retriever: RetrieverBackend, n: int, *,
                           seed: int = 0, batch: int = 32, keep_share: float = KEEP_SHARE, min_kept: int = MIN_KEPT) -> list[PseudoQuestion]:
    """Up to `n` bridge questions (`bridge_question`): for each passage whose title is a name, BM25's top 10 for
    that name are searched for another document that mentions it. Few or none on a corpus whose titles are not
    names mentioned elsewhere (headings, a document's title repeated on each of its passages)."""
    rng = random.Random(seed + 1)
    usable = [p for p in passages if len(title_core(p[1])) >= MIN_TITLE_CHARS]
    out: list[PseudoQuestion] = []
    for start in range(0, len(usable), batch):
        chunk = usable[start:start + batch]
        found = await retriever.retrieve([title_core(p[1]) for p in chunk], 10, "bm25")
        for passage, docs in zip(chunk, found, strict=True):
            name = title_core(passage[1])
            for doc in docs:
                if doc.id == passage[0] or name not in doc.text:
                    continue
                q = bridge_question(passage, (doc.id, doc.title, doc.text), rng, keep_share=keep_share, min_kept=min_kept)
                if q is not None:
                    out.append(q)
                    break
            if len(out) >= n:
                return out
    return out


async def check_questions(passages: Sequence[tuple[str, str, str]], retriever: RetrieverBackend, n: int, *,
                          seed: int = 0, keep_share: float = KEEP_SHARE, min_kept: int = MIN_KEPT) -> list[PseudoQuestion]:
    """The corpus check's questions: one per sampled passage, in order, until `n`: a bridge question where
    another document mentions the passage's title (`bridge_questions`), else a single-passage one. The share of
    bridge questions is the corpus's own (how often a passage's title is a name other documents mention): high
    on Wikipedia, low on reports and articles whose titles are headings."""
    bridges = {q.passage_id: q for q in await bridge_questions(passages, retriever, len(passages), seed=seed,
                                                               keep_share=keep_share, min_kept=min_kept)}
    rng = random.Random(seed)
    out: list[PseudoQuestion] = []
    for pid, title, text in passages:
        if len(out) >= n:
            break
        q = bridges.get(pid) or question_from(pid, title, text, rng, keep_share=keep_share, min_kept=min_kept)
        if q is not None:
            out.append(q)
    return out
