"""The share of the compact searcher's follow-up queries a person would not accept ("junk"), on the evaluation
rows (rows 0-99 of hotpotqa, 2wikimultihopqa, nq and popqa, yes/no left out), with the policy's own pool (the
BM25 + dense blocks when it has the dense scorer), in-process over the stack's indexes.

The rule (its own code, not the candidate code it judges). A `title` query (a document's title with the
question's words) is junk when it
  (f) copies the question: every word of the question, function words included, in its order ("Which city is
      the director of Big Stone Gap based in? Big Stone Gap (film)").
A `name` query (a name a passage introduces) is junk when its text
  (a) spans a sentence boundary: ".", "!" or "?" followed by another word ("European Union. Tickets"), except
      after an initial or an abbreviation ("J. R. R. Tolkien", "St. Louis", "U.S. Army");
  (b) has no word that names anything: every word is a function word (articles, prepositions, conjunctions,
      pronouns, discourse words such as "Although", "However", "Later"), a date part (a month or weekday
      name, a year or another number, an ordinal) ("Although", "October", "In 1990"); or
  (c) is one capitalised word that its passage uses only at the start of a sentence (a common word
      capitalised by its position, e.g. "Tickets"), never inside one.

Measured: the queries the policy issued (greedy, as served) and, independent of the policy's choice, every
candidate it was offered. Final line: {"issued": {"n", "junk", "share", "by_rule"}, "offered": {...},
"examples": [...], "policy": ..., "questions": ...}.

    python bench/junk_queries.py                     # the shipped policy (plugsearch/searcher/trained/compact)
    python bench/junk_queries.py --policy var/runs/compact/final
    python bench/junk_queries.py --domain tatqa      # a development set (<data>/domain): its corpus, the
                                                     # evaluation part of its questions (bench/domain_quality.py's)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, REPO, load_questions, log  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402
from plugsearch.common.schemas.searcher import SearchParams  # noqa: E402
from plugsearch.searcher.compact import CompactPolicy, QuestionInfo, candidates, pool_of, softmax  # noqa: E402
from plugsearch.searcher.env import Action, SearchEnv  # noqa: E402
from plugsearch.searcher.loop import run_search  # noqa: E402
from plugsearch.searcher.trained import COMPACT_DIR  # noqa: E402

SETS = ("hotpotqa", "2wikimultihopqa", "nq", "popqa")

FUNCTION = frozenset("""
a an the of in on at to for and or but nor so yet is was were are be been being by with from as that this these
those which who whom whose what when where why how it its his her hers their theirs he she they we i you our your my
me him them us there here then than also although though however therefore thus hence meanwhile moreover
furthermore nevertheless nonetheless after before during while since until unless because despite following
according about above across against along among around between beyond into onto over through throughout toward
towards under upon within without both each either neither every all any some many most other such only not no
born died later early late former currently today now once twice if whether instead besides rather
""".split())
DATE_PARTS = frozenset("""
january february march april may june july august september october november december jan feb mar apr jun jul aug
sep sept oct nov dec monday tuesday wednesday thursday friday saturday sunday first second third fourth fifth sixth
seventh eighth ninth tenth century centuries year years
""".split())
ABBREVIATIONS = frozenset("st mt mr mrs ms dr jr sr co inc ltd vs ft gen col lt sgt capt rev prof no jan feb".split())
_BOUNDARY = re.compile(r"([.!?])\s+(?=\S)")
_WORD = re.compile(r"[^\W_][\w'&-]*")
_NUMBER = re.compile(r"^\d+(st|nd|rd|th|s)?$")


def crosses_sentence(text: str) -> bool:
    """Rule (a)."""
    for m in _BOUNDARY.finditer(text):
        before = text[:m.start()].split()
        last = (before[-1] if before else "").rstrip(".")
        if m.group(1) == "." and (len(last) <= 1 or last.lower() in ABBREVIATIONS or "." in last):
            continue
        return True
    return False


def names_nothing(text: str) -> bool:
    """Rule (b)."""
    words = [w.lower() for w in _WORD.findall(text)]
    return all(w in FUNCTION or w in DATE_PARTS or _NUMBER.match(w) for w in words)


def sentence_initial_only(word: str, passage: str) -> bool:
    """Rule (c): `word` occurs in `passage` only where a sentence starts (never capitalised inside one)."""
    starts = inside = 0
    for m in re.finditer(rf"(?<![\w'-]){re.escape(word)}(?![\w'-])", passage):
        head = passage[:m.start()].rstrip().rstrip("\"'(\u201c\u2018").rstrip()  # an opening quote starts no sentence
        if not head or head[-1] in ".!?:" or head.endswith((".\"", ".'", ".\u201d")):
            starts += 1
        else:
            inside += 1
    return starts > 0 and inside == 0


NATIONALITIES = frozenset("""
american british english french german italian spanish portuguese dutch belgian swiss austrian swedish norwegian
danish finnish icelandic irish scottish welsh polish czech slovak hungarian romanian bulgarian greek turkish russian
ukrainian serbian croatian bosnian slovenian albanian chinese japanese korean vietnamese thai indian pakistani
bangladeshi nepali indonesian malaysian filipino australian canadian mexican brazilian argentine argentinian
chilean peruvian colombian venezuelan cuban egyptian moroccan algerian nigerian kenyan ethiopian african asian
european arab arabic latin hispanic persian iranian iraqi israeli jewish hebrew syrian lebanese saudi soviet
yugoslav roman ottoman byzantine hindi urdu bengali tamil swahili cantonese mandarin creole gaelic celtic norse
scandinavian nordic slavic caribbean western eastern northern southern central
""".split())


def question_copy(query: str, question: str) -> bool:
    """Rule (f): the query holds every word of the question, in order."""
    q = [w.lower() for w in _WORD.findall(question)]
    words = [w.lower() for w in _WORD.findall(query)]
    return bool(q) and any(words[i:i + len(q)] == q for i in range(len(words) - len(q) + 1))


def junk_rules(added: str, passage: str) -> list[str]:
    """Which rules call `added` (what the query adds to the question) junk; [] when a person would accept it."""
    rules = []
    if crosses_sentence(added):
        rules.append("a_sentence_boundary")
    if names_nothing(added):
        rules.append("b_no_name")
    words = _WORD.findall(added)
    if len(words) == 1 and words[0][:1].isupper() and passage and sentence_initial_only(words[0], passage):
        rules.append("c_capitalised_common_word")
    if len(words) == 1 and words[0].lower().rstrip("s") in NATIONALITIES | {w.rstrip("s") for w in NATIONALITIES}:
        rules.append("d_nationality_or_language")
    if len(words) == 1 and words[0][:1].isupper() and re.search(rf"(?<![\w'-]){re.escape(words[0].lower())}(?![\w'-])",
                                                                passage):
        rules.append("e_common_word")
    return rules


class Recorder:
    """The policy (greedy), recording each decision's offered follow-ups and the one it took."""

    def __init__(self, policy: CompactPolicy, sink: list[dict[str, Any]], question_id: str) -> None:
        self.policy = policy
        self.sink = sink
        self.question_id = question_id

    @property
    def model(self) -> str:
        return self.policy.model

    async def act(self, env: SearchEnv) -> Action:
        decision = self.policy.decide(env)
        if decision.cand_x is not None:
            question = QuestionInfo.of(env.question)  # the candidates `decide` chose among, again
            pool = pool_of(env.blocks)
            doc_x, score_x, scorer = self.policy.features(question, pool, env.blocks)
            probs = softmax(self.policy.doc_logits(score_x, scorer))
            offered, _ = candidates(question, pool, probs, env.seen_queries, doc_x)
            for i, cand in enumerate(offered):
                if cand.kind == "stop":
                    continue
                passage = pool[cand.source].doc.text if cand.source >= 0 else ""
                added = cand.query if cand.kind == "name" else pool[cand.source].doc.title
                rules = junk_rules(added, passage) if cand.kind == "name" else \
                    (["f_question_copy"] if question_copy(cand.query, env.question) else [])
                self.sink.append({"id": self.question_id, "kind": cand.kind, "query": cand.query, "added": added,
                                  "issued": i == decision.choice, "rules": rules})
        return decision.action


def summary(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    junk = [r for r in rows if r["rules"]]
    by_rule = Counter(rule for r in junk for rule in r["rules"])
    by_kind = Counter(r["kind"] for r in rows)
    return {"n": len(rows), "junk": len(junk), "share": round(len(junk) / len(rows), 4) if rows else None,
            "by_rule": dict(sorted(by_rule.items())), "by_kind": dict(sorted(by_kind.items())),
            "junk_by_kind": dict(sorted(Counter(r["kind"] for r in junk).items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--policy", default=str(COMPACT_DIR), help="compact policy folder (default: the shipped one)")
    parser.add_argument("--n", type=int, default=100, help="first n rows of every set (the evaluation rows)")
    parser.add_argument("--datasets", nargs="+", default=list(SETS))
    parser.add_argument("--no-dense", action="store_true", help="BM25 pool only (a retriever without dense)")
    parser.add_argument("--examples", type=int, default=25, help="junk queries to list")
    parser.add_argument("--out", help="also write every offered candidate (JSONL) here")
    parser.add_argument("--domain", help="a development set of <data>/domain (tatqa, policyqa, realtimeqa) instead of "
                        "the shared sets: its corpus and the evaluation part of its questions")
    args = parser.parse_args()
    from bench.domain_quality import corpus_and_questions
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.retrieval import IndexRetriever

    t0 = time.perf_counter()
    policy = CompactPolicy.load(Path(args.policy))
    corpus = CORPUS
    if args.domain:
        corpus, questions = corpus_and_questions(args.domain)
        if args.n:
            questions = questions[:args.n * 4]
    else:
        questions = [q for name in args.datasets for q in load_questions(name, args.n)
                     if not is_yes_no(q.golden_answers)]
    retriever = IndexRetriever(corpus, index_dir_for(corpus, REPO / "var"), dense=not args.no_dense)
    pool = policy.pool_methods(list(retriever.methods), retriever.encoder)
    params = SearchParams(mode="s3", method="bm25", pool_methods=pool, **policy.search_setting())
    rows: list[dict[str, Any]] = []

    async def go() -> None:
        for q in questions:
            await run_search(q.question, params, policy=Recorder(policy, rows, q.id), retriever=retriever)

    asyncio.run(go())
    issued = [r for r in rows if r["issued"]]
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = [{"query": r["query"], "added": r["added"], "rules": r["rules"]} for r in issued if r["rules"]]
    log(f"{len(questions)} questions, {len(issued)} follow-up queries issued, {len(rows)} offered")
    print(json.dumps({"issued": summary(issued), "offered": summary(rows), "examples": examples[:args.examples],
                      "policy": policy.model, "pool_methods": pool, "questions": len(questions),
                      "corpus": corpus.name,
                      "seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
