"""Versioned prompt files of the LLM judge (s3's `check_if_response_is_correct_llm` wording).

`judge_<version>.user.txt` asks whether any gold answer is contained in the response;
`judge_<version>.retry.txt` is the one follow-up when the first reply is neither yes nor no. Both are
`string.Template`s with $response and $golden_answers. The effective version is
`<version>-<digest of the files>`, so editing a file changes every cached verdict's key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from string import Template

from services.common.prompts import load_prompt_files

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
