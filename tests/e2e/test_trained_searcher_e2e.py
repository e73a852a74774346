"""The shipped trained searcher served the way plugsearch-stack serves it: a llama.cpp server with the
LoRA adapter (checked against its manifest and base model) as the policy of a real searcher process with the
settings the adapter was trained with, over the real retriever."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from plugsearch.common.llama_server import LlamaServer, smollm2_gguf_path
from plugsearch.searcher.trained import TrainedSearcher
from tests.support.services import ensure_bm25_index, load_questions, retriever_process, searcher_process

pytestmark = [pytest.mark.e2e]


def test_the_trained_searcher_answers_with_its_own_setting(data_dir: Path, var_dir: Path) -> None:
    trained = TrainedSearcher.load()
    trained.check_base(smollm2_gguf_path())
    corpus = data_dir / "corpus" / "combined.jsonl"
    index_dir = ensure_bm25_index(corpus, var_dir)
    logs = var_dir / "logs" / "trained_e2e"
    with LlamaServer(n_threads=1, model_alias=trained.model_alias, log_path=logs / "policy.log",
                     extra_args=["--lora_path", str(trained.adapter)]) as policy, \
            retriever_process(corpus, index_dir, logs / "retriever.log") as retriever_url, \
            searcher_process(retriever_url, policy.base_url, logs / "searcher.log", policy_model=trained.model_alias,
                             extra=trained.searcher_env()) as url, httpx.Client(base_url=url, timeout=300) as client:
        assert "lora" in (logs / "policy.log").read_text(errors="replace").lower()  # llama.cpp loaded the adapter
        version = client.get("/version").json()
        assert version["details"]["prompt_version"].startswith("smollm2-s3-")  # the prompts it was trained with
        for row in load_questions(data_dir / "qa" / "hotpotqa.jsonl", 3):
            body = client.post("/search", json={"question": row["question"], "mode": "s3",
                                                "return_trace": True}).json()
            assert body["policy_model"] == trained.model_alias and not body["degraded"], body
            assert body["documents"] and body["invalid_actions"] == 0 and body["valid_actions"] >= 1
            blocks = body["trace"]["blocks"]
            assert len(blocks[0]["document_ids"]) == trained.search.retrieve_k
            assert blocks[0]["selected"] is not None  # the trained policy marks its documents
            assert body["trace"]["messages"][0]["content"].startswith("You find documents for another model")
