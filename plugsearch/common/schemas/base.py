from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, field_validator

_SURROGATE = re.compile("[\ud800-\udfff]")


def no_nul(value: str) -> str:
    """The one rule for text a request brings, in any field of any service: no NUL character, and no lone
    surrogate (U+D800..U+DFFF, half of a UTF-16 pair, is no character: it cannot be stored or sent on as UTF-8).
    Both are a 422 wherever they are (`StrictModel` applies it to every string of a request)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if _SURROGATE.search(value):
        raise ValueError("must not contain a lone surrogate (U+D800..U+DFFF is half of a UTF-16 pair, not a "
                         "character): send the text as UTF-8")
    return value


def _check_text(value: Any) -> None:
    if isinstance(value, str):
        no_nul(value)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _check_text(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must not be blank")
    return no_nul(value)


def bounded_text(max_chars: int) -> type[str]:
    """A non-blank string of at most `max_chars` characters."""
    return Annotated[str, StringConstraints(min_length=1, max_length=max_chars),  # type: ignore[return-value]
                     AfterValidator(_not_blank)]


class StrictModel(BaseModel):
    """Requests refuse unknown fields, so a typo is a 422 rather than a silently ignored option, and take
    JSON's types as they are: `"5"` or `true` for an integer, `"yes"` for a boolean are 422 (no lax
    coercion); an integer stands for a float. Every string in them follows one rule (`no_nul`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _text_rule(cls, value: Any) -> Any:
        """Every string a request brings, however deep in lists and objects, follows `no_nul` (a 422 with the
        field named, never a 500 further on)."""
        _check_text(value)
        return value


class Document(BaseModel):
    """A passage as every service exchanges it."""

    id: str
    title: str = ""
    text: str
    score: float | None = None
