"""Trainer settings: one pydantic-settings class, env prefix `TRAINER_` (nested with `__`,
e.g. `TRAINER_GENERATOR__URL`). CLI flags override individual fields."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from plugsearch.common.http import ClientSettings
from plugsearch.common.paths import REPOSITORY
from plugsearch.common.qa import default_data_dir
from plugsearch.common.schemas.retriever import Method

RewardKind = Literal["gbr", "genacc", "em", "qagent", "gbr_genacc", "recall"]
RewardSetting = Literal["auto", "gbr", "genacc", "em", "qagent", "gbr_genacc", "recall"]
"""The kinds are described in `plugsearch.trainer.common.rewards`; `auto` is resolved by `TrainerSettings.reward_kind`."""


def _client(url: str, timeout_s: float) -> ClientSettings:
    return ClientSettings.model_validate({"url": url, "timeout_s": timeout_s})


class TrainerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINER_", env_nested_delimiter="__", extra="ignore")

    retriever: ClientSettings = Field(default_factory=lambda: _client("http://127.0.0.1:8001", 30.0))
    # generation queues behind one local LLM: long timeouts, the trainer's batches are large
    generator: ClientSettings = Field(default_factory=lambda: _client("http://127.0.0.1:8002", 600.0))
    judge: ClientSettings = Field(default_factory=lambda: _client("http://127.0.0.1:8003", 600.0))
    searcher: ClientSettings = Field(default_factory=lambda: _client("http://127.0.0.1:8000", 600.0))
    redis_url: str | None = Field(None, description="baselines are mirrored here as well as in the JSONL file")

    data_dir: Path = Field(default_factory=default_data_dir)
    var_dir: Path = Field(default_factory=lambda: REPOSITORY / "var")

    method: Method | None = Field(None, description="retrieval method; None = the retriever's default")
    baseline_k: int = Field(3, ge=1, le=64, description="naive-RAG top-k of the GBR baseline (s3: 3)")
    reward: RewardSetting = Field("auto", description="auto: gbr on GPUs, recall (no LLM) on the CPU")
    format_lambda: float = Field(0.0, ge=0.0, le=10.0, description="weight of the format reward (0 = off)")
    concurrency: int = Field(4, ge=1, le=256, description="batch requests in flight per service")
    chunk: int = Field(4, ge=1, le=256, description="items per generate/judge batch request (at most the "
                       "generator's batch limit)")
    batch_timeout_s: float = Field(900.0, gt=0, description="timeout of one generate/judge batch request "
                                   "(one local LLM serves requests one at a time: batches queue)")
    log_level: str = "INFO"

    def reward_kind(self, device: str) -> RewardKind:
        """The reward to train with on `device`: `auto` is GBR through the generator and judge on GPUs and
        the LLM-free `recall` GBR on the CPU."""
        if self.reward == "auto":
            return "gbr" if device == "cuda" else "recall"
        return self.reward
