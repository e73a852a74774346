"""Versioned prompt files of the LLM judge (s3's `check_if_response_is_correct_llm` wording):
`judge_<version>.user.txt` and `.retry.txt` (the one follow-up to a reply with neither yes nor no), both
`string.Template`s with $response and $golden_answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from string import Template

from plugsearch.common.prompts import load_prompt_files

PARTS = ("user", "retry")


@dataclass(frozen=True)
class JudgePrompt:
    version: str
    user: Template
    retry: Template


@cache
def load_prompt(version: str = "v1") -> JudgePrompt:
    """The prompt set `judge_<version>.*.txt`; ValueError when a part is missing."""
    return JudgePrompt(**load_prompt_files(__name__, "judge", version, PARTS))
