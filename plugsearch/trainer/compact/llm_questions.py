"""Questions written by the user's own LLM: `plugsearch-train compact --corpus FILE --llm-url URL --llm-model NAME`.

For a seeded sample of the corpus's passages, the LLM (any OpenAI-compatible chat-completions endpoint, through the
project's one client, `plugsearch.common.llm.OpenAIChatClient`) is asked for one question a person would ask of
that passage and the answer it expects, a span of the passage, as a JSON object. Few-shot: up to `FEW_SHOT`
questions of the user's labelled training split (`--qa`: each shown with a passage that answers it), else a fixed
instruction with `GENERIC_EXAMPLES`. A question is kept only if it passes, in this order:

- `bad_json`: the reply holds a JSON object with a non-empty `question` and `answer` (strings);
- `yes_no`: the answer is not yes / no / true / false (the span check cannot judge them);
- `answer_not_in_passage`: the answer occurs in the passage (GenAcc's span check, `span_match`);
- `answer_in_question`: the question does not already hold its answer;
- `copied`: the question does not copy the passage: no run of `COPY_RUN` or more consecutive tokens (lowercased
  words) of the question occurs in the passage, and for a question of `COPY_SHARE_MIN_TOKENS` tokens or more, its
  longest run found in the passage is under `COPY_SHARE` of its tokens (a sentence of the passage with a question
  mark is refused; a question that shares a name and a few words with its passage, as real questions do, is not);
- `duplicate`: the same question was not kept already;
- `not_found_again`: the round trip: naive BM25 top-`roundtrip_k` for the question returns its passage (a question
  retrieval cannot lead back to its passage teaches nothing about finding it).

The LLM's call has a timeout, and a timed-out call is asked again (`retries`, with backoff; the client retries
refused connections and 5xx itself); a call that still fails is counted (`failed`) and asked again on a rerun. At
most `concurrency` calls run at once; a progress bar counts the passages. Every reply is cached
(`<out>/llm_questions.cache.jsonl`, keyed by the model and the whole request), so a rerun does not ask again.

The kept questions are labelled by their passage (`passage_ids`) and their answer (`golden_answers`), written to
`<out>/llm_questions.jsonl` (`dataset: llm`), with the counts of kept and refused by reason and the first kept
examples in `<out>/llm_questions.json`. They are training questions only: with labelled questions (`--qa`) they
join the training split and never the RL-dev or evaluation split; without any, the run has no real evaluation and
says so (the searcher keeps serving naive BM25 with such a policy, as with pseudo-questions).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import SecretStr

from plugsearch.common.answers import is_yes_no, span_match
from plugsearch.common.errors import ServiceError, UpstreamTimeout
from plugsearch.common.files import atomic_write_text
from plugsearch.common.llm import ChatMessage, LLMBackend, LLMSettings, OpenAIChatClient
from plugsearch.common.qa import QAFileError, QAItem, append_durable, read_jsonl
from plugsearch.searcher.pseudo_questions import sample_positions
from plugsearch.trainer.common.retrieval import IndexRetriever

logger = logging.getLogger(__name__)

QUESTIONS_FILE = "llm_questions.jsonl"
INFO_FILE = "llm_questions.json"
CACHE_FILE = "llm_questions.cache.jsonl"
DATASET = "llm"
COPY_RUN = 8
"""A question sharing this many consecutive tokens with its passage copies it."""
COPY_SHARE = 0.75
COPY_SHARE_MIN_TOKENS = 6
"""A question of at least this many tokens whose longest run found in the passage is this share of it copies it."""
MIN_PASSAGE_WORDS = 12
"""Passages shorter than this are not asked about (nothing to ask in a heading or a caption)."""
PROMPT_PASSAGE_CHARS = 1500
"""A passage is cut to this many characters in the prompt (a small model's context holds the examples too)."""
FEW_SHOT = 3
REASONS = ("failed", "bad_json", "yes_no", "answer_not_in_passage", "answer_in_question", "copied", "duplicate",
           "not_found_again")
"""Why a passage gave no kept question, in the order the checks run."""
EXAMPLES_SHOWN = 10

INSTRUCTION = (
    "You write one question that a person could ask and that the given passage answers. The question must make "
    "sense on its own, without the passage; use your own words (do not copy a sentence of the passage) and do not "
    "put the answer in the question. The answer is a short span copied exactly from the passage: a name, a number, "
    "a date or a few words. Reply with one JSON object only, no other text: "
    '{"question": "...", "answer": "..."}')

GENERIC_EXAMPLES: tuple[tuple[str, str, str, str], ...] = (
    ("Lake Baikal", "Lake Baikal is a rift lake in the south of the Russian region of Siberia. It is the deepest "
     "lake in the world, with a maximum depth of 1,642 metres, and holds about 22% of the world's fresh surface "
     "water.", "How deep is Lake Baikal at its deepest point?", "1,642 metres"),
    ("Annual report 2021", "Revenue from the services segment rose to $4.2 million in 2021, up from $3.1 million in "
     "2020, mainly because of new maintenance contracts signed in the second half of the year.",
     "What was the services segment's revenue in 2021?", "$4.2 million"),
    ("Privacy notice", "We keep account records for seven years after an account is closed, unless a longer period "
     "is required by law or by an ongoing dispute.", "How long are account records kept after an account is "
     "closed?", "seven years"),
)
"""(title, passage, question, answer): the examples shown when the user gave no labelled questions."""

_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass
class LLMQuestions:
    """How to ask the user's LLM (`plugsearch-train compact --llm-url ... --llm-model ...`)."""

    url: str
    model: str
    passages: int = 1000
    """Passages asked about (a seeded sample of the corpus)."""
    api_key_env: str = "OPENAI_API_KEY"
    """The environment variable holding the endpoint's API key (never given on the command line); unset: none."""
    roundtrip_k: int = 10
    concurrency: int = 4
    timeout_s: float = 120.0
    retries: int = 2
    json_mode: Literal["object", "off"] = "object"
    """object: ask for `response_format: {"type": "json_object"}` (OpenAI, vLLM, llama.cpp's server); off: the
    instruction alone."""
    temperature: float = 0.0
    max_tokens: int = 160
    seed: int = 0

    def api_key(self) -> SecretStr | None:
        value = os.environ.get(self.api_key_env) if self.api_key_env else None
        return SecretStr(value) if value else None

    def client(self) -> OpenAIChatClient:
        return OpenAIChatClient(LLMSettings(base_url=self.url, model=self.model, api_key=self.api_key(),
                                            timeout_s=self.timeout_s, max_concurrency=self.concurrency,
                                            max_retries=self.retries, breaker_failures=100), name="question_llm")

    def identity(self) -> dict[str, Any]:
        """What the question file depends on (a rerun with the same reuses it); no key."""
        return {"url": self.url, "model": self.model, "passages": self.passages, "roundtrip_k": self.roundtrip_k,
                "json_mode": self.json_mode, "temperature": self.temperature, "max_tokens": self.max_tokens,
                "seed": self.seed}


@dataclass(frozen=True)
class Example:
    """A few-shot example: a passage, and the question and answer written for it."""

    title: str
    passage: str
    question: str
    answer: str


@dataclass
class Written:
    """One passage asked about: what the LLM replied and what became of it."""

    passage_id: str
    question: str = ""
    answer: str = ""
    reason: str | None = None
    """Why it was refused (one of `REASONS`), None: kept."""
    cached: bool = False
    reply: str = ""
    """The reply as given, where it did not parse (`bad_json`)."""


@dataclass
class Tally:
    asked: int = 0
    cached: int = 0
    skipped_short: int = 0
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


def tokens(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def longest_common_run(question: Sequence[str], passage: Sequence[str]) -> int:
    """The longest run of consecutive question tokens that occurs in the passage (dynamic programming)."""
    best = 0
    previous = [0] * (len(passage) + 1)
    for q in question:
        current = [0] * (len(passage) + 1)
        for j, p in enumerate(passage, start=1):
            if q == p:
                current[j] = previous[j - 1] + 1
                best = max(best, current[j])
        previous = current
    return best


def copies(question: str, passage: str) -> bool:
    """Whether `question` copies `passage` (`COPY_RUN` consecutive tokens, or `COPY_SHARE` of a question of at
    least `COPY_SHARE_MIN_TOKENS` tokens)."""
    q = tokens(question)
    run = longest_common_run(q, tokens(passage))
    return run >= COPY_RUN or (len(q) >= COPY_SHARE_MIN_TOKENS and run >= COPY_SHARE * len(q))


def parse_reply(text: str) -> tuple[str, str] | None:
    """(question, answer) of a reply holding a JSON object with both (code fences and text around it allowed), else
    None."""
    start = text.find("{")
    while start != -1:
        try:
            value, _ = json.JSONDecoder().raw_decode(text[start:])
        except ValueError:
            start = text.find("{", start + 1)
            continue
        if isinstance(value, dict):
            question, answer = value.get("question"), value.get("answer")
            if isinstance(answer, int | float) and not isinstance(answer, bool):
                answer = str(answer)
            if isinstance(question, str) and isinstance(answer, str) and question.strip() and answer.strip():
                return " ".join(question.split()), " ".join(answer.split())
        return None
    return None


def judge(question: str, answer: str, passage: str) -> str | None:
    """The refusal reason of a parsed question about `passage` (the checks before the round trip), None: keep."""
    if is_yes_no([answer]):
        return "yes_no"
    if not span_match(passage, [answer]):
        return "answer_not_in_passage"
    if span_match(question, [answer]):
        return "answer_in_question"
    if copies(question, passage):
        return "copied"
    return None


def _shown(title: str, passage: str) -> str:
    text = passage if len(passage) <= PROMPT_PASSAGE_CHARS else passage[:PROMPT_PASSAGE_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"Passage{f' (from: {title})' if title else ''}:\n{text}"


def messages(title: str, passage: str, examples: Sequence[Example]) -> list[ChatMessage]:
    """The instruction, each example as a turn of the conversation, then the passage to ask about."""
    out = [ChatMessage(role="system", content=INSTRUCTION)]
    for ex in examples:
        out.append(ChatMessage(role="user", content=_shown(ex.title, ex.passage)))
        out.append(ChatMessage(role="assistant", content=json.dumps({"question": ex.question, "answer": ex.answer},
                                                                    ensure_ascii=False)))
    out.append(ChatMessage(role="user", content=_shown(title, passage)))
    return out


def generic_examples() -> list[Example]:
    return [Example(*ex) for ex in GENERIC_EXAMPLES]


async def labelled_examples(items: Sequence[QAItem], retriever: IndexRetriever, *, seed: int = 0,
                            n: int = FEW_SHOT) -> list[Example]:
    """Up to `n` of the user's labelled training questions, each with a passage that answers it (one of its
    `passage_ids`, else the first of BM25's top 10 that holds a gold answer), drawn by `seed`; answers that are
    a span of that passage only."""
    pool = [q for q in items if not is_yes_no(q.golden_answers)]
    random.Random(seed).shuffle(pool)
    out: list[Example] = []
    for start in range(0, len(pool), 16):
        chunk = pool[start:start + 16]
        found = await retriever.retrieve([q.question for q in chunk], 10, "bm25")
        for q, docs in zip(chunk, found, strict=True):
            doc = next((d for d in docs if d.id in q.passage_ids), None) or \
                next((d for d in docs if q.golden_answers and span_match(d.text, q.golden_answers)), None)
            answer = next((a for a in q.golden_answers if doc is not None and span_match(doc.text, [a])), None)
            if doc is None or answer is None:
                continue
            out.append(Example(doc.title, doc.text, q.question, answer))
            if len(out) >= n:
                return out
    return out


class ReplyCache:
    """Replies already given (`CACHE_FILE`): the key is the model and the whole request; a rerun reads them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        rows, _ = read_jsonl(path, json.loads)
        self.replies: dict[str, str] = {str(r["key"]): str(r["reply"]) for r in rows
                                        if isinstance(r, dict) and "key" in r and "reply" in r}

    @staticmethod
    def key(body: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    def get(self, key: str) -> str | None:
        return self.replies.get(key)

    def put(self, key: str, reply: str) -> None:
        self.replies[key] = reply
        append_durable(self.path, json.dumps({"key": key, "reply": reply}, ensure_ascii=False) + "\n")


async def ask(llm: LLMBackend, config: LLMQuestions, msgs: list[ChatMessage], cache: ReplyCache
              ) -> tuple[str | None, bool]:
    """(the reply, whether it came from the cache); (None, False) when the LLM failed after its retries."""
    extra = {"response_format": {"type": "json_object"}} if config.json_mode == "object" else None
    body = {"model": config.model, "messages": [m.model_dump() for m in msgs], "temperature": config.temperature,
            "max_tokens": config.max_tokens, "extra": extra}
    key = cache.key(body)
    cached = cache.get(key)
    if cached is not None:
        return cached, True
    for attempt in range(config.retries + 1):
        try:
            result = await llm.chat(msgs, temperature=config.temperature, max_tokens=config.max_tokens, extra=extra)
        except UpstreamTimeout:
            if attempt == config.retries:
                logger.warning("the question LLM timed out %d time(s) on a passage; counted as failed (a rerun asks "
                               "again)", attempt + 1)
                return None, False
            await asyncio.sleep(min(30.0, 0.5 * 2 ** attempt))
        except ServiceError as exc:
            logger.warning("the question LLM failed on a passage: %s (a rerun asks again)", exc.message)
            return None, False
        else:
            cache.put(key, result.text)
            return result.text, False
    return None, False


async def write(llm: LLMBackend, config: LLMQuestions, passages: Sequence[tuple[str, str, str]],
                retriever: IndexRetriever, examples: Sequence[Example], cache: ReplyCache, *,
                progress: bool = True) -> tuple[list[Written], Tally]:
    """Ask about each passage (at most `config.concurrency` at once), check each reply, then the round trip."""
    from tqdm import tqdm

    tally = Tally()
    usable = [p for p in passages if len(p[2].split()) >= MIN_PASSAGE_WORDS]
    tally.skipped_short = len(passages) - len(usable)
    slots = asyncio.Semaphore(config.concurrency)
    with tqdm(total=len(usable), desc="questions from your LLM", unit="passage", disable=not progress) as bar:

        async def one(passage: tuple[str, str, str]) -> Written:
            pid, title, text = passage
            async with slots:
                reply, cached = await ask(llm, config, messages(title, text, examples), cache)
            bar.update(1)
            if reply is None:
                return Written(pid, reason="failed")
            parsed = parse_reply(reply)
            if parsed is None:
                return Written(pid, reason="bad_json", cached=cached, reply=reply[:300])
            question, answer = parsed
            return Written(pid, question, answer, judge(question, answer, text), cached)

        written = list(await asyncio.gather(*(one(p) for p in usable)))
    tally.asked = sum(not w.cached for w in written if w.reason != "failed")
    tally.cached = sum(w.cached for w in written)
    seen: set[str] = set()
    for w in written:
        if w.reason is None:
            if w.question.lower() in seen:
                w.reason = "duplicate"
            seen.add(w.question.lower())
    candidates = [w for w in written if w.reason is None]
    found = await retriever.retrieve([w.question for w in candidates], config.roundtrip_k, "bm25") \
        if candidates else []
    for w, docs in zip(candidates, found, strict=True):
        if w.passage_id not in {d.id for d in docs}:
            w.reason = "not_found_again"
    for w in written:
        if w.reason is not None:
            tally.refused[w.reason] += 1
    return written, tally


def question_file(out: Path, retriever: IndexRetriever, config: LLMQuestions, *,
                  labelled: Sequence[QAItem] = (), resume: bool = True, progress: bool = True,
                  llm: LLMBackend | None = None) -> tuple[Path, dict[str, Any]]:
    """`<out>/llm_questions.jsonl`: the kept questions (made once for a setting and few-shot source: a rerun reuses
    it, and asks the LLM only for what its cache lacks), and what was asked and kept (`<out>/llm_questions.json`).
    `labelled`: the user's labelled training questions, the few-shot examples' source. Raises `QAFileError` when
    no passage gave a kept question."""
    path, meta = out / QUESTIONS_FILE, out / INFO_FILE
    source = "labelled" if labelled else "generic"
    identity = {**config.identity(), "few_shot": source}
    if resume and path.is_file() and meta.is_file():
        info = json.loads(meta.read_text())
        if info.get("setting") == identity:
            logger.info("reusing the %d questions your LLM wrote in %s", info.get("kept", 0), path)
            return path, info
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    info, rows = asyncio.run(_run(out, retriever, config, labelled, progress=progress, llm=llm))
    info.update(setting=identity, seconds=round(time.perf_counter() - t0, 1))
    if not rows:
        atomic_write_text(meta, json.dumps(info, indent=1) + "\n")
        raise QAFileError(f"your LLM ({config.model} at {config.url}) gave no usable question for the "
                          f"{info['passages']} passages asked about (refused: {_refusals(info)}): see {meta}")
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    atomic_write_text(meta, json.dumps(info, indent=1, ensure_ascii=False) + "\n")  # after: it says they are whole
    logger.info("questions from your LLM (%s): %d of %d passages gave a kept question; refused: %s", config.model,
                info["kept"], info["passages"], _refusals(info))
    return path, info


def _refusals(info: dict[str, Any]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in info["refused"].items() if n) or "none"


async def _run(out: Path, retriever: IndexRetriever, config: LLMQuestions, labelled: Sequence[QAItem], *,
               progress: bool, llm: LLMBackend | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    examples = await labelled_examples(labelled, retriever, seed=config.seed) if labelled else []
    source = "labelled" if examples else "generic"
    if not examples:
        examples = generic_examples()
    store = retriever.service.corpus
    passages = store.documents(sample_positions(len(store), config.passages, seed=config.seed))
    client = llm if llm is not None else config.client()
    try:
        written, tally = await write(client, config, passages, retriever, examples, ReplyCache(out / CACHE_FILE),
                                     progress=progress)
    finally:
        if llm is None:
            await client.aclose()
    kept = [w for w in written if w.reason is None]
    rows = [{"id": f"llm-{i:06d}", "question": w.question, "golden_answers": [w.answer],
             "passage_ids": [w.passage_id], "dataset": DATASET} for i, w in enumerate(kept)]
    info = {"model": config.model, "passages": len(passages), "skipped_short": tally.skipped_short,
            "asked": tally.asked, "cached": tally.cached, "kept": len(kept), "refused": tally.refused,
            "few_shot": source, "few_shot_examples": [asdict(e) | {"passage": e.passage[:200]} for e in examples],
            "rules": {"copy_run": COPY_RUN, "copy_share": COPY_SHARE, "copy_share_min_tokens": COPY_SHARE_MIN_TOKENS,
                      "roundtrip_k": config.roundtrip_k},
            "examples": [{"question": w.question, "answer": w.answer, "passage_id": w.passage_id}
                         for w in kept[:EXAMPLES_SHOWN]],
            "refused_examples": {reason: next(({"question": w.question, "answer": w.answer, "passage_id": w.passage_id,
                                                **({"reply": w.reply} if w.reply else {})}
                                               for w in written if w.reason == reason), None)
                                 for reason in REASONS if tally.refused[reason]}}
    return info, rows

