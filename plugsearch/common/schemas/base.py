from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints


def no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


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
    coercion); an integer stands for a float."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Document(BaseModel):
    """A passage as every service exchanges it."""

    id: str
    title: str = ""
    text: str
    score: float | None = None
