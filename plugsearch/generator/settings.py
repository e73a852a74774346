"""Generator settings, env prefix `GENERATOR_`; the LLM is any OpenAI-compatible chat endpoint
(`GENERATOR_LLM__*`). Local (llama.cpp + SmolLM2) and GPU (vLLM) configurations and how the token-budget
tokenizer is chosen: plugsearch/generator/README.md.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from plugsearch.common.llm import LLMServiceSettings


class GeneratorSettings(LLMServiceSettings):
    model_config = SettingsConfigDict(env_prefix="GENERATOR_", env_nested_delimiter="__", extra="ignore")

    port: int = Field(8002, ge=1, le=65535)
    prompt_version: str = Field("v1", pattern=r"^[A-Za-z0-9_.-]+$",
                                description="selects plugsearch/generator/prompts/answer_<version>.*.txt")
    context_token_budget: int = Field(3000, ge=64, le=1_000_000,
                                      description="tokens of formatted documents at most; later documents "
                                      "are dropped, the one that crosses the budget is cut")
    min_document_tokens: int = Field(16, ge=1, description="a cut document shorter than this is dropped")
    max_answer_tokens: int = Field(64, ge=1, le=1024, description="default max_tokens of an answer")
    tokenizer_from_gguf: bool = Field(True, description="with no LLM tokenizer set and the packaged SmolLM2 "
                                      "as model, read its tokenizer from the GGUF file")
    tokenizer_cache_dir: str | None = Field("var/tokenizers", description="where a tokenizer read from a GGUF "
                                            "is saved once (HF format): reading the GGUF takes 20-50 s on 2 "
                                            "cores, the saved copy about 1 s; None = never saved")

    @model_validator(mode="after")
    def _budget_fits(self) -> GeneratorSettings:
        if self.min_document_tokens > self.context_token_budget:
            raise ValueError("min_document_tokens must not exceed context_token_budget")
        return self
