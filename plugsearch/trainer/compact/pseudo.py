"""Training questions made from a corpus alone: what `plugsearch-train compact --corpus FILE` trains on when no
`--qa` file is given (and adds, with `--pseudo N`, to a user's labelled questions).

The questions are the corpus check's (`plugsearch.searcher.pseudo_questions`): a cloze over one sentence of a
passage (a name, a year or a number is the answer; the question keeps `TRAIN_KEEP_SHARE` of the sentence's other
content words, fewer than the check's, so naive retrieval misses some), and, where another document mentions a
passage's title, a two-passage question through that mention. Drawn from a seeded sample of the passages, then
filtered so that naive retrieval does not find every answer at once: every question naive BM25 top-3 misses is
kept, and as many that it finds (the policy must also learn not to lose those), in a seeded order. Written as a
question file (`pseudo_questions.jsonl` in the run's folder, FlashRAG rows with `golden_answers`), so the run
that follows is the labelled flow's: the same split, training, evaluation and report.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from pathlib import Path
from typing import Any

from plugsearch.common.answers import span_match
from plugsearch.common.files import atomic_write_text
from plugsearch.common.qa import QAFileError
from plugsearch.searcher.pseudo_questions import PseudoQuestion, check_questions, sample_positions
from plugsearch.trainer.common.retrieval import IndexRetriever

logger = logging.getLogger(__name__)

PSEUDO_FILE = "pseudo_questions.jsonl"
TRAIN_KEEP_SHARE = 0.25
TRAIN_MIN_KEPT = 2
"""The share of a sentence's content words a training question keeps, and at least how many (the check's
questions keep 0.6 and 3): harder, so that naive BM25 misses some."""
MAX_PASSES = 3
"""On a corpus smaller than the sample wanted, passages are read again (another sentence or answer each time)."""
MIN_PSEUDO = 100
"""Fewer usable pseudo-questions than this: the corpus is refused as too small or too uniform to learn from."""
SAMPLE_FACTOR = 3
"""Passages sampled per question wanted (not every passage gives a question, and the filter drops some)."""


def _rows(questions: list[PseudoQuestion]) -> list[dict[str, Any]]:
    return [{"id": f"pseudo-{i:06d}", "question": q.question, "golden_answers": [q.answer], "dataset": "pseudo",
             "kind": q.kind, "passage_id": q.passage_id} for i, q in enumerate(questions)]


async def _generate(retriever: IndexRetriever, n: int, seed: int) -> tuple[list[PseudoQuestion], dict[str, Any]]:
    store = retriever.service.corpus
    wanted = n * SAMPLE_FACTOR
    made: list[PseudoQuestion] = []
    seen: set[tuple[str, str]] = set()
    sampled = 0
    for turn in range(min(MAX_PASSES, -(-wanted // max(1, len(store))))):
        passages = store.documents(sample_positions(len(store), wanted - sampled, seed=seed + turn))
        sampled += len(passages)
        for q in await check_questions(passages, retriever, len(passages), seed=seed + turn,
                                       keep_share=TRAIN_KEEP_SHARE, min_kept=TRAIN_MIN_KEPT):
            if (q.question, q.answer) not in seen:
                seen.add((q.question, q.answer))
                made.append(q)
        if sampled >= wanted:
            break
    naive = await retriever.retrieve([q.question for q in made], 3, "bm25")
    hit = [any(span_match(d.text, [q.answer]) for d in docs) for q, docs in zip(made, naive, strict=True)]
    missed = [q for q, h in zip(made, hit, strict=True) if not h]
    found = [q for q, h in zip(made, hit, strict=True) if h]
    rng = random.Random(seed)
    rng.shuffle(found)
    kept = missed + found[:len(missed)]
    rng.shuffle(kept)
    kept = kept[:n]
    info = {"sampled_passages": sampled, "made": len(made), "naive_bm25_top3_finds": len(found),
            "naive_bm25_top3_misses": len(missed), "kept": len(kept), "kinds": dict(Counter(q.kind for q in kept)),
            "keep_share": TRAIN_KEEP_SHARE, "seed": seed}
    return kept, info


def pseudo_question_file(out: Path, retriever: IndexRetriever, n: int, *, seed: int = 0, resume: bool = True
                         ) -> tuple[Path, dict[str, Any]]:
    """`<out>/pseudo_questions.jsonl` (made once: a rerun reuses it) and what was made. Raises `QAFileError` when
    the corpus gives fewer than `MIN_PSEUDO` usable questions."""
    path, meta = out / PSEUDO_FILE, out / "pseudo_questions.json"
    if resume and path.is_file() and meta.is_file():
        info = json.loads(meta.read_text())
        if info.get("requested") == n and info.get("seed") == seed:
            logger.info("reusing the %d pseudo-questions in %s", info.get("kept", 0), path)
            return path, info
    questions, info = asyncio.run(_generate(retriever, n, seed))
    info["requested"] = n
    if len(questions) < MIN_PSEUDO:
        raise QAFileError(
            f"only {len(questions)} usable questions could be made from the corpus ({info['made']} made from "
            f"{info['sampled_passages']} sampled passages, {info['naive_bm25_top3_misses']} that naive BM25 top-3 "
            f"misses); at least {MIN_PSEUDO} are needed: the corpus is too small or too uniform to train a searcher "
            "from its passages alone (give labelled questions with --qa, or serve the shipped policy)")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _rows(questions)))
    atomic_write_text(meta, json.dumps(info, indent=1) + "\n")  # after the questions: it says they are whole
    logger.info("pseudo-questions: %s", json.dumps(info))
    return path, info
