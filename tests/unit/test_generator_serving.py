"""Generator logic against a scripted LLM: prompt shape, token budget, cache, concurrent batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.errors import UpstreamError
from plugsearch.common.llm import ChatMessage, ChatResult
from plugsearch.common.metrics import ServiceMetrics
from plugsearch.common.schemas.generator import GenDocument, GenerateRequest
from plugsearch.generator.prompts import load_prompt
from plugsearch.generator.serving import Generator, document_key
from plugsearch.generator.tokens import EstimatedTokens, HFTokens
from tests.gate import ScriptedBase


class ScriptedLLM(ScriptedBase):
    """Answers with the first word of the first document (or "none"); records every call."""

    model = "scripted"

    def __init__(self, delay_s: float = 0.0, fail: bool = False, gate: int = 0) -> None:
        super().__init__(delay_s, gate)
        self.calls: list[list[ChatMessage]] = []
        self.fail = fail

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult:
        self.calls.append(messages)
        async with self.in_flight():
            if self.fail:
                raise UpstreamError("scripted failure")
            system = messages[0].content
            marker = "(Title: "
            if marker in system:
                first = system.split(")\n", 1)[1].split()[0]
                return ChatResult(text=f"  {first}\n", prompt_tokens=10, completion_tokens=1)
            return ChatResult(text="none", prompt_tokens=5, completion_tokens=1)


def make(llm: ScriptedLLM, **kw: Any) -> Generator:
    return Generator(llm, ResultCache(MemoryCache(), name="generator"), kw.pop("tokens", EstimatedTokens()),
                     load_prompt("v1"), metrics=ServiceMetrics("generator"), **kw)


DOCS = [GenDocument(id="d1", title="Paris", text="Paris is the capital of France."),
        GenDocument(id="d2", title="Lyon", text="Lyon is a city in France.")]


async def test_prompt_follows_s3_format() -> None:
    llm = ScriptedLLM()
    response = await make(llm).generate(GenerateRequest(question="capital of France?", documents=DOCS))
    assert response.answer == "Paris" and response.documents_used == 2 and not response.cached
    system, user = llm.calls[0]
    assert system.role == "system" and user.role == "user" and user.content == "capital of France?"
    assert system.content.startswith("Use the following contexts (some might be irrelevant) on demand:")
    assert "Doc 1 (Title: Paris)\nParis is the capital of France.\n\nDoc 2 (Title: Lyon)\nLyon" in system.content
    assert system.content.endswith("You MUST directly answer the question without any other text and thinking.")
    assert response.prompt_version.startswith("v1-")


async def test_no_documents_uses_the_zero_shot_prompt() -> None:
    llm = ScriptedLLM()
    response = await make(llm).generate(GenerateRequest(question="capital of France?"))
    assert response.answer == "none" and response.documents_used == 0
    assert "Contexts" not in llm.calls[0][0].content


def test_budget_drops_and_cuts_documents() -> None:
    gen = make(ScriptedLLM(), context_token_budget=40, min_document_tokens=5)
    long = GenDocument(id="x", title="T", text="word " * 200)
    ctx = gen.build_context([DOCS[0], long, DOCS[1]])
    assert ctx.truncated and ctx.documents_used == 2  # d1 whole, the long one cut, d2 dropped
    assert EstimatedTokens().count(ctx.text) <= 40
    assert "Doc 2 (Title: T)\nword word" in ctx.text and "Lyon" not in ctx.text
    tight = make(ScriptedLLM(), context_token_budget=20, min_document_tokens=16)
    assert tight.build_context([DOCS[0], long]).documents_used == 1  # too little room left for a cut doc


def test_budget_with_a_real_tokenizer_interface() -> None:
    class CharTokenizer:  # one token per character, fast-tokenizer style offsets
        is_fast = True

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(c) for c in text]

        def __call__(self, text: str, add_special_tokens: bool = False,
                     return_offsets_mapping: bool = False) -> dict[str, Any]:
            return {"offset_mapping": [(i, i + 1) for i in range(len(text))]}

    tokens = HFTokens(CharTokenizer(), "chars")
    assert tokens.count("abc") == 3 and tokens.truncate("abcdef", 4) == "abcd" and tokens.truncate("ab", 4) == "ab"
    gen = make(ScriptedLLM(), tokens=tokens, context_token_budget=60, min_document_tokens=5)
    ctx = gen.build_context([GenDocument(title="T", text="x" * 500)])
    assert ctx.truncated and len(ctx.text) <= 60


async def test_cache_by_model_prompt_question_and_document_ids() -> None:
    llm = ScriptedLLM()
    gen = make(llm)
    first = await gen.generate(GenerateRequest(question="q", documents=DOCS))
    again = await gen.generate(GenerateRequest(question="q", documents=DOCS))
    assert again.cached and again.answer == first.answer and len(llm.calls) == 1
    await gen.generate(GenerateRequest(question="q", documents=DOCS[::-1]))  # order matters
    await gen.generate(GenerateRequest(question="q2", documents=DOCS))
    assert len(llm.calls) == 3
    assert document_key(GenDocument(title="a", text="b")) == document_key(GenDocument(title="a", text="b"))
    assert document_key(GenDocument(title="a", text="b")) != document_key(GenDocument(title="a", text="c"))


async def test_batch_is_concurrent_ordered_and_deduplicated() -> None:
    llm = ScriptedLLM(gate=10)
    gen = make(llm)
    items = [GenerateRequest(question=f"q{i % 10}", documents=[DOCS[i % 2]]) for i in range(20)]
    results = await gen.generate_batch(items)
    assert [r.answer for r in results] == ["Paris" if i % 2 == 0 else "Lyon" for i in range(20)]
    assert len(llm.calls) == 10  # q0..q9, each with one document: duplicates computed once
    assert llm.peak == 10  # all at once, nothing serialised


async def test_batch_failure_raises_the_upstream_error() -> None:
    gen = make(ScriptedLLM(fail=True))
    with pytest.raises(UpstreamError):
        await gen.generate_batch([GenerateRequest(question=f"q{i}") for i in range(3)])


def test_token_counter_choice(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS, GGUF_ENV
    from plugsearch.generator.tokens import load_token_counter

    monkeypatch.setenv(GGUF_ENV, str(tmp_path / "missing.gguf"))  # SmolLM2 not available: estimate
    assert load_token_counter(None, model=DEFAULT_MODEL_ALIAS).kind == "estimate"
    assert load_token_counter(None, model="Qwen/Qwen2.5-14B-Instruct").kind == "estimate"
    assert load_token_counter(None, model=DEFAULT_MODEL_ALIAS, from_gguf=False).kind == "estimate"
    with pytest.raises(RuntimeError, match="nope.gguf"):  # configured but unloadable: refuse to start
        load_token_counter(str(tmp_path / "nope.gguf"), model="x")


async def test_malformed_cache_entries_are_recomputed() -> None:
    llm = ScriptedLLM()
    gen = make(llm)
    request = GenerateRequest(question="q", documents=DOCS)
    await gen.cache.set_json(gen.key(request), {"answer": 3})
    response = await gen.generate(request)
    assert response.answer == "Paris" and not response.cached and len(llm.calls) == 1
