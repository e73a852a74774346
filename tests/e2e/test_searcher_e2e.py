"""The real local stack answers POST /search: retriever process (bm25s over the shared corpus), llama.cpp
with SmolLM2 as the policy, real Redis, the searcher as its own process.

20 HotpotQA questions, each searched with free and with constrained decoding: no request fails, every
answer carries documents; the shares of searches whose actions were all valid are reported (printed and
written to var/reports/searcher_e2e.json). Small settings (1 turn, k=3, short documents) keep the 80-odd
SmolLM2 calls within a few minutes on two cores.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS
from tests.support.services import ensure_bm25_index, load_questions, retriever_process, searcher_process

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_QUESTIONS = int(os.environ.get("PLUGSEARCH_SEARCHER_E2E_QUESTIONS", "20"))
SETTINGS = {"max_turns": 1, "retrieve_k": 3, "select_k": 2, "doc_chars": 200, "max_new_tokens": 64,
            "search_timeout_s": 300, "request_timeout_s": 400, "policy__timeout_s": 240, "policy__max_retries": 0}


@pytest.fixture(scope="module")
def retriever_url(data_dir: Path, var_dir: Path) -> Iterator[str]:
    corpus = data_dir / "corpus" / "combined.jsonl"
    index_dir = ensure_bm25_index(corpus, var_dir)
    with retriever_process(corpus, index_dir, var_dir / "logs" / "searcher_e2e_retriever.log") as url:
        yield url


def test_search_on_the_real_stack(retriever_url: str, llama_url: str, redis_url: str, data_dir: Path,
                                  var_dir: Path) -> None:
    questions = load_questions(data_dir / "qa" / "hotpotqa.jsonl", N_QUESTIONS)
    extra = {**SETTINGS, "redis_url": redis_url}
    with searcher_process(retriever_url, llama_url, var_dir / "logs" / "searcher_e2e.log",
                          policy_model=DEFAULT_MODEL_ALIAS, extra=extra) as url, \
            httpx.Client(base_url=url, timeout=600) as client:
        results: dict[str, list[dict[str, object]]] = {"free": [], "constrained": []}
        for row in questions:
            for decoding in ("free", "constrained"):
                response = client.post("/search", json={"question": row["question"], "mode": "s3",
                                                        "constrained": decoding == "constrained"})
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["documents"] and body["context"].startswith("Doc 1(Title: ")
                assert body["timings"]["policy_calls"] >= 1
                results[decoding].append(body)
        # the same request again is a Redis cache hit (unless the first one was degraded: never cached)
        first = results["constrained"][0]
        again = client.post("/search", json={"question": questions[0]["question"], "mode": "s3",
                                             "constrained": True}).json()
        assert again["cached"] is (not first["degraded"])
        assert again["documents"] == first["documents"]
        metrics = client.get("/metrics").text
        assert "searcher_stop_total" in metrics

    def share(bodies: list[dict[str, object]]) -> float:
        ok = [b for b in bodies if b["invalid_actions"] == 0 and int(b["valid_actions"]) > 0]  # type: ignore[call-overload]
        return round(len(ok) / len(bodies), 3)

    report = {
        "questions": len(questions),
        "searches_with_all_actions_valid": {k: share(v) for k, v in results.items()},
        "degraded": {k: sum(bool(b["degraded"]) for b in v) for k, v in results.items()},
        "stop_reasons": {k: sorted({str(b["stop_reason"]) for b in v}) for k, v in results.items()},
        "settings": SETTINGS,
    }
    (var_dir / "reports").mkdir(exist_ok=True)
    (var_dir / "reports" / "searcher_e2e.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    # The grammar forces the action format, so constrained searches must end with valid actions
    # (a repeated query is the one invalid action a grammar cannot exclude).
    assert report["searches_with_all_actions_valid"]["constrained"] >= 0.8  # type: ignore[index]
