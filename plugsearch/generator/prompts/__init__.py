"""Versioned prompt files of the generator: `answer_<version>.<part>.txt`, `string.Template`s: `system`
($context) when documents are given, `no_context` when none are, `document` ($index, $title, $text).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from string import Template

from plugsearch.common.prompts import load_prompt_files

PARTS = ("system", "no_context", "document")


@dataclass(frozen=True)
class AnswerPrompt:
    version: str
    """`v1-1a2b3c4d`: the configured version plus a digest of its files (goes into cache keys)."""
    system: Template
    no_context: Template
    document: Template

    def render_document(self, index: int, title: str, text: str) -> str:
        return self.document.substitute(index=index, title=title, text=text)


@cache
def load_prompt(version: str = "v1") -> AnswerPrompt:
    """The prompt set `answer_<version>.*.txt`; ValueError when a part is missing."""
    return AnswerPrompt(**load_prompt_files(__name__, "answer", version, PARTS))
