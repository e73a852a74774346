"""Parsing what a policy emits, and formatting what the environment shows it (s3 and QAgent tags).

The rules follow s3's own code (pat-jj/s3, `generation_s3.py` and `rag_2.py`):
- an output is cut right after its first `</query>`; a `<query>` whose closing tag was eaten by a
  stop sequence gets it back;
- `<search_complete>` content `true|yes|1|y` (case-insensitive) ends the search and wins over a query;
- a query is the `"query"` field of the JSON inside `<query>` (first element when it is a list); JSON
  that is not JSON falls back to the `"query": "..."` pattern, then to the raw text (as s3 does);
- `<important_info>`: every integer in it, kept only when it is a document id of the current block,
  duplicates dropped, order kept (s3), and at most `select_k` of them (the prompt's limit).
Nothing here raises on model output: every problem is reported in the parsed action.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from plugsearch.common.schemas.base import Document

MAX_QUERY_CHARS = 512
"""Queries longer than this are cut (a runaway generation must not become a 2 kB retrieval query)."""

_QUERY = re.compile(r"<query>(.*?)</query>", re.DOTALL)
_COMPLETE = re.compile(r"<search_complete>(.*?)</search_complete>", re.DOTALL)
_IMPORTANT = re.compile(r"<important_info>(.*?)</important_info>", re.DOTALL)
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_PLAN = re.compile(r"<plan>(.*?)</plan>", re.DOTALL)
_REFLECTION = re.compile(r"<reflection>(.*?)</reflection>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_QUERY_FIELD = re.compile(r'"query"\s*:\s*"((?:[^"\\]|\\.)*)"?', re.DOTALL)
_INT = re.compile(r"\d+")
_TRUE = frozenset({"true", "yes", "1", "y"})


def postprocess(raw: str, tag: str, *, stopped: bool) -> str:
    """The transcript text of an output (`tag`: s3's `query`, QAgent's `search`): `</tag>` re-appended when
    a stop sequence ate it (`<tag>` opened last, never closed), then cut after the first `</tag>`."""
    closing = f"</{tag}>"
    open_at = raw.rfind(f"<{tag}>")
    text = raw.rstrip() + closing if stopped and open_at >= 0 and raw.find(closing, open_at) < 0 else raw
    at = text.find(closing)
    return text if at < 0 else text[:at + len(closing)]


def normalize_query(query: str) -> str:
    """Key used to detect repeated queries."""
    return " ".join(query.lower().split())


def _clean_query(text: str) -> str:
    return " ".join(text.split())[:MAX_QUERY_CHARS]


def parse_query_payload(raw: str) -> tuple[str, bool]:
    """The query inside `<query>...</query>` and whether it was well-formed JSON with a `query` field."""
    body = raw.strip()
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and "query" in data:
        value = data["query"]
        if isinstance(value, list):
            value = value[0] if value else ""
        if isinstance(value, str):
            return _clean_query(value), True
        return _clean_query(str(value)), False
    if isinstance(data, str):
        return _clean_query(data), False
    match = _QUERY_FIELD.search(body)
    if match:
        try:
            value = json.loads(f'"{match.group(1)}"')
        except ValueError:
            value = match.group(1)
        return _clean_query(str(value)), False
    return _clean_query(body.strip("{}[] \n")), False


@dataclass
class Selection:
    """A parsed `<important_info>` tag."""

    ids: list[int]
    """Valid 1-based ids within the current block, deduplicated, at most `select_k`."""
    raw_ids: list[int]
    """Every integer written in the tag."""

    @property
    def explicit_empty(self) -> bool:
        """`[]`: the policy says nothing in the block is important."""
        return not self.raw_ids

    @property
    def out_of_range(self) -> list[int]:
        return [i for i in self.raw_ids if i not in self.ids]


def parse_selection(raw: str, n_docs: int, select_k: int) -> Selection:
    raw_ids = [int(n) for n in _INT.findall(raw) if len(n) <= 6]
    ids = list(dict.fromkeys(i for i in raw_ids if 1 <= i <= n_docs))  # deduplicated, order kept
    return Selection(ids=ids[:select_k], raw_ids=raw_ids)


@dataclass
class S3Action:
    """What one s3 policy output asks for."""

    text: str
    """The output as kept in the transcript (cut after the first `</query>`)."""
    complete: bool = False
    query: str | None = None
    query_json_ok: bool = False
    selection: Selection | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "complete" if self.complete else "search" if self.query else "invalid"


def parse_s3(text: str, *, n_docs: int, select_k: int) -> S3Action:
    """Parse one (post-processed) s3 output against the current information block of `n_docs` docs."""
    action = S3Action(text=text)
    important = _IMPORTANT.search(text)
    if important is not None:
        action.selection = parse_selection(important.group(1), n_docs, select_k)
        if action.selection.out_of_range:
            action.problems.append(f"ids out of range: {action.selection.out_of_range}")
    complete = _COMPLETE.search(text)
    if complete is not None and complete.group(1).strip().lower() in _TRUE:
        action.complete = True
        return action
    query = _QUERY.search(text)
    if query is None:
        action.problems.append("no <query> and no <search_complete>True</search_complete>")
        return action
    action.query, action.query_json_ok = parse_query_payload(query.group(1))
    if not action.query:
        action.problems.append("empty query")
        action.query = None
    elif not action.query_json_ok:
        action.problems.append("query is not JSON with a 'query' field")
    return action


@dataclass
class QAgentAction:
    text: str
    plan: str | None = None
    queries: list[str] = field(default_factory=list)
    reflection: str | None = None
    answer: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "search" if self.queries else "complete" if self.answer is not None else "invalid"


def parse_qagent(text: str, *, max_queries: int) -> QAgentAction:
    """Parse one QAgent output: `<reflection>`? then `<plan>` + `<search>` with `<query>`s, or `<answer>`.

    A search wins over an answer in the same output (the search is the action that changes state).
    Queries may be plain text or s3-style JSON; repeated ones are dropped; at most `max_queries`.
    """
    action = QAgentAction(text=text)
    for pattern, attr in ((_PLAN, "plan"), (_REFLECTION, "reflection"), (_ANSWER, "answer")):
        match = pattern.search(text)
        if match is not None:
            setattr(action, attr, match.group(1).strip())
    search = _SEARCH.search(text)
    scope = search.group(1) if search is not None else None
    if scope is None and action.answer is None:
        scope = text  # lenient: bare <query> tags without <search>
        if _QUERY.search(text):
            action.problems.append("queries outside <search>")
    seen: set[str] = set()
    for raw in _QUERY.findall(scope or ""):
        query, _ = parse_query_payload(raw)
        key = normalize_query(query)
        if query and key not in seen:
            seen.add(key)
            action.queries.append(query)
    if len(action.queries) > max_queries:
        action.problems.append(f"{len(action.queries)} queries, kept {max_queries}")
        action.queries = action.queries[:max_queries]
    if not action.queries and action.answer is None:
        action.problems.append("no <search> with a <query> and no <answer>")
    return action


def format_documents(docs: Sequence[Document], *, max_chars: int | None = None) -> str:
    """s3's information block: `Doc i(Title: t) text` per line, 1-based within the block."""
    lines = []
    for i, doc in enumerate(docs, start=1):
        text = " ".join(doc.text.split())
        if max_chars is not None and len(text) > max_chars:
            text = text[:max_chars].rstrip() + " ..."
        lines.append(f"Doc {i}(Title: {doc.title}) {text}\n")
    return "".join(lines)


def format_query_blocks(blocks: Sequence[tuple[str, Sequence[Document]]], *, max_chars: int | None = None) -> str:
    """QAgent's information: the results of every query of a round, numbered per query."""
    return "".join(f"Query: {query}\n{format_documents(docs, max_chars=max_chars)}" for query, docs in blocks)
