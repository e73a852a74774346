"""End to end: real llama.cpp server (SmolLM2-135M-Instruct), real Redis, generator and judge as real
processes. The generator answers, the judge scores (span and LLM paths), repeats are cache hits, and
the cached entries are in Redis.

SmolLM2 is a weak judge; this checks the plumbing, not the verdicts. LLM calls are kept to about four.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS
from tests.conftest import VAR, free_port
from tests.support.services import service_process

pytestmark = pytest.mark.e2e

QUESTION = "What is the capital of France?"
DOCS = [{"id": "wiki-paris", "title": "Paris",
         "text": "Paris is the capital and most populous city of France."},
        {"id": "wiki-lyon", "title": "Lyon", "text": "Lyon is the third-largest city of France."}]


@contextmanager
def service(module: str, prefix: str, llama_url: str, redis_url: str) -> Iterator[str]:
    port = free_port()
    env = {f"{prefix}_PORT": str(port), f"{prefix}_REDIS_URL": redis_url,
           f"{prefix}_LLM__BASE_URL": llama_url, f"{prefix}_LLM__MODEL": DEFAULT_MODEL_ALIAS,
           f"{prefix}_LLM__TIMEOUT_S": "120", f"{prefix}_LOG_LEVEL": "WARNING"}
    if prefix == "GENERATOR":
        env["GENERATOR_TOKENIZER_CACHE_DIR"] = str(VAR / "tokenizers")
    # up to 300 s: reading SmolLM2's tokenizer from the GGUF the first time
    with service_process(f"plugsearch.{module}", env, port, VAR / "logs" / f"e2e_{module}.log", timeout_s=300) as url:
        yield url


def test_generator_and_judge_with_llama_cpp_and_redis(llama_url: str, redis_url: str) -> None:
    gen_request = {"question": QUESTION, "documents": DOCS, "max_tokens": 24}
    verdict_request = {"prediction": "The capital is Lutetia.", "golden_answers": ["Paris"], "mode": "llm"}
    with service("generator", "GENERATOR", llama_url, redis_url) as gen, \
            service("judge", "JUDGE", llama_url, redis_url) as judge:
        version = httpx.get(f"{gen}/version").json()["details"]
        assert version["tokenizer"].startswith("hf:SmolLM2") and version["cache"] == "redis"

        first = httpx.post(f"{gen}/generate", json=gen_request, timeout=180)
        assert first.status_code == 200, first.text
        answer = first.json()
        assert answer["answer"].strip() and not answer["cached"] and answer["documents_used"] == 2
        assert answer["model"] == DEFAULT_MODEL_ALIAS and answer["completion_tokens"] > 0

        scored = httpx.post(f"{judge}/judge", json={"prediction": answer["answer"], "golden_answers": ["Paris"],
                                                    "question": QUESTION}, timeout=180)
        assert scored.status_code == 200, scored.text
        result = scored.json()
        assert result["decided_by"] in ("span", "llm") and result["score"] in (0.0, 1.0)

        llm_verdict = httpx.post(f"{judge}/judge", json=verdict_request, timeout=300)
        assert llm_verdict.status_code == 200, llm_verdict.text
        assert llm_verdict.json()["decided_by"] == "llm" and not llm_verdict.json()["cached"]

        again = httpx.post(f"{gen}/generate", json=gen_request, timeout=30).json()
        assert again["cached"] and again["answer"] == answer["answer"]
        repeat = httpx.post(f"{judge}/judge", json=verdict_request, timeout=30).json()
        assert repeat["cached"] and repeat["score"] == llm_verdict.json()["score"]
        assert 'generator_answers_total{source="cache"} 1.0' in httpx.get(f"{gen}/metrics").text
        assert httpx.get(f"{judge}/version").json()["details"]["model"] == DEFAULT_MODEL_ALIAS

    # The hits came from Redis (the services keep no in-process layer when a Redis URL is set).
    client = redis.Redis.from_url(redis_url)
    try:
        assert len(client.keys("plugsearch:generator:*")) == 1
        assert len(client.keys("plugsearch:judge:*")) >= 1  # + one if the span check failed above
    finally:
        client.close()


def test_saved_smollm2_tokenizer_counts_like_transformers(var_dir: Path) -> None:
    """The fast path (tokenizers on the saved copy) counts and cuts exactly as transformers does."""
    from transformers import AutoTokenizer

    from plugsearch.generator.tokens import FastTokens, load_token_counter

    cache = var_dir / "tokenizers"
    fast = load_token_counter(None, model=DEFAULT_MODEL_ALIAS, cache_dir=str(cache))
    fast = load_token_counter(None, model=DEFAULT_MODEL_ALIAS, cache_dir=str(cache))  # second: from the copy
    assert type(fast) is FastTokens  # HFTokens is a FastTokens too
    saved = next(p for p in cache.iterdir() if p.name.startswith("SmolLM2"))
    hf = AutoTokenizer.from_pretrained(str(saved), local_files_only=True)
    for text in ["Paris is the capital of France.", "Wilhelm Conrad Röntgen, 150,782 SEK — 1901", "x" * 300]:
        ids = hf.encode(text, add_special_tokens=False)
        assert fast.count(text) == len(ids)
        cut = fast.truncate(text, 5)
        assert len(hf.encode(cut, add_special_tokens=False)) <= 5 and text.startswith(cut)
