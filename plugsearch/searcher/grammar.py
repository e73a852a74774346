"""Constrained decoding: grammars that force a valid action, in the backend's structured-output field.

llama.cpp's server takes a GBNF string in a top-level `grammar` field; vLLM takes a grammar through its
structured-output parameters (`structured_outputs={"grammar": ...}`, older releases `guided_grammar`).
The grammars are built per call because the valid ids depend on the current block and `select_k`.
"""

from __future__ import annotations

from typing import Any

from plugsearch.common.schemas.searcher import ConstraintStyle

QUERY_MAX_CHARS = 100
TEXT_MAX_CHARS = 100


def _alternatives(values: list[str]) -> str:
    return " | ".join(f'"{v}"' for v in values)


def _optional_chain(item: str, sep: str, max_items: int) -> str:
    """`item (sep item (sep item)?)?` : one to `max_items` items (no `{m,n}`, for older parsers)."""
    if max_items <= 1:
        return item
    return f"{item} ({sep} {_optional_chain(item, sep, max_items - 1)})?"


_QCHAR = r'[^"\\<>\n]'
_TCHAR = r"[^<\n]"


def s3_grammar(*, n_docs: int, select_k: int, allow_search: bool) -> str:
    """GBNF for one s3 step: optional `<important_info>`, then stop, or continue with one JSON query."""
    ids = _alternatives([str(i) for i in range(1, max(1, n_docs) + 1)])
    lines = [
        "root ::= sel? " + ("(done | more)" if allow_search else "done"),
        f'sel ::= "<important_info>[" ({_optional_chain("id", chr(34) + ", " + chr(34), select_k)})? "]</important_info>\\n"',
        f"id ::= {ids}",
        'done ::= "<search_complete>True</search_complete>"',
    ]
    if allow_search:
        lines += [
            'more ::= "<search_complete>False</search_complete>\\n<query>{\\"query\\": \\"" qtext "\\"}</query>"',
            f"qtext ::= [a-zA-Z0-9] {_QCHAR}{{0,{QUERY_MAX_CHARS}}}",
        ]
    return "\n".join(lines) + "\n"


def qagent_grammar(*, max_queries: int, first_round: bool) -> str:
    """GBNF for one QAgent step: (`<reflection>` after the first round) then plan + search, or an answer."""
    root = 'root ::= plan search' if first_round else 'root ::= refl (plan search | answer)'
    lines = [
        root,
        'refl ::= "<reflection>" text "</reflection>\\n"',
        'plan ::= "<plan>" text "</plan>\\n"',
        f'search ::= "<search>" {_optional_chain("query", "", max_queries)} "</search>"',
        f'query ::= "<query>" [a-zA-Z0-9] {_QCHAR}{{0,{QUERY_MAX_CHARS}}} "</query>"',
        'answer ::= "<answer>" text "</answer>"',
        f"text ::= {_TCHAR}{{1,{TEXT_MAX_CHARS}}}",
    ]
    return "\n".join(lines) + "\n"


def grammar_request(grammar: str, style: ConstraintStyle) -> dict[str, Any]:
    """The extra request fields that carry `grammar` to the backend."""
    fields: dict[str, dict[str, Any]] = {
        "llama": {"grammar": grammar}, "vllm": {"structured_outputs": {"grammar": grammar}},
        "vllm_legacy": {"guided_grammar": grammar}}
    return fields[style]
