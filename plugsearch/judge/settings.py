"""Judge settings, env prefix `JUDGE_`; the LLM (`JUDGE_LLM__*`, as for the generator) is asked only when the
span check fails (mode `genacc`) or always (mode `llm`). SmolLM2-135M (the local default) is a weak judge: it
exercises the pipeline, it does not report GenAcc. `JUDGE_LLM_REQUIRED=false` (a span/EM/F1-only deployment):
ready without an LLM, and `genacc` items the span check cannot decide come back `undecided`.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from plugsearch.common.llm import LLMServiceSettings


class JudgeSettings(LLMServiceSettings):
    model_config = SettingsConfigDict(env_prefix="JUDGE_", env_nested_delimiter="__", extra="ignore")

    port: int = Field(8003, ge=1, le=65535)
    llm_required: bool = Field(True, description="readiness includes the judge LLM being reachable")
    prompt_version: str = Field("v1", pattern=r"^[A-Za-z0-9_.-]+$",
                                description="selects plugsearch/judge/prompts/judge_<version>.*.txt")
    verdict_max_tokens: int = Field(10, ge=1, le=256, description="max_tokens of a yes/no verdict (s3: 10)")
