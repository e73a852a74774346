"""The KV-cached batch sampler of the policy being trained, on a tiny random model (fast) with SmolLM2's
tokenizer: greedy equals `generate`, shared prompts are read once, stop strings and end of turn stop a row,
logprobs are those of the sampled tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from plugsearch.searcher.env import PolicyCall
from plugsearch.trainer.llm.samplers import HFSampler, VLLMSampler


@pytest.fixture(scope="module")
def tokenizer(var_dir: Path) -> Any:
    from plugsearch.trainer.llm.model import default_policy_path, load_tokenizer

    return load_tokenizer(default_policy_path(var_dir))


@pytest.fixture(scope="module")
def tiny(tokenizer: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return LlamaForCausalLM(config).eval()


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def test_greedy_rows_equal_generate_whatever_their_padding(tiny: Any, tokenizer: Any) -> None:
    import torch

    sampler = HFSampler(tiny, tokenizer)
    long, short = _ids(tokenizer, "The capital of France is a city where"), _ids(tokenizer, "Hello")
    results = sampler.sample_batch([long, short], PolicyCall(stop=[], max_tokens=12, temperature=0.0))
    for row, result in zip((long, short), results, strict=True):
        expected = tiny.generate(input_ids=torch.tensor([row]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)[0, len(row):].tolist()
        assert result.ids == expected[:len(result.ids)]
        assert len(result.ids) == 12 or result.ids[-1] == tokenizer.eos_token_id


def test_identical_prompts_are_read_once_and_sampled_independently(tiny: Any, tokenizer: Any) -> None:
    import torch

    torch.manual_seed(1)
    sampler = HFSampler(tiny, tokenizer)
    prompt = _ids(tokenizer, "Write a word:")
    results = sampler.sample_batch([prompt] * 6, PolicyCall(stop=[], max_tokens=8, temperature=1.0))
    assert sampler.prompt_tokens_read == len(prompt)
    assert len({tuple(r.ids) for r in results}) > 1  # independent samples from one shared cache
    for r in results:  # logprobs are the sampled tokens' log-probabilities under the temperature
        assert r.logprobs is not None and len(r.logprobs) == len(r.ids) and all(lp <= 0 for lp in r.logprobs)


def test_a_stop_string_ends_the_row_and_is_kept_in_the_ids(tiny: Any, tokenizer: Any) -> None:
    sampler = HFSampler(tiny, tokenizer)
    prompt = _ids(tokenizer, "x")
    free = sampler.sample_batch([prompt], PolicyCall(stop=[], max_tokens=10, temperature=0.0))[0]
    word = tokenizer.decode(free.ids[2:4])
    assert word.strip()
    cut = sampler.sample_batch([prompt], PolicyCall(stop=[word], max_tokens=10, temperature=0.0))[0]
    assert cut.stopped and word in cut.text and len(cut.ids) <= 4
    assert free.ids[:len(cut.ids)] == cut.ids


async def test_concurrent_calls_are_gathered_into_one_batch(tiny: Any, tokenizer: Any) -> None:
    sampler = HFSampler(tiny, tokenizer)
    call = PolicyCall(stop=[], max_tokens=4, temperature=0.0)
    prompts = [_ids(tokenizer, f"prompt {i}") for i in range(5)]
    results = await asyncio.gather(*(sampler.sample(p, call) for p in prompts))
    assert sampler.batches == 1 and len(results) == 5
    await sampler.aclose()


class FakeVLLMClient:
    """TRL's `VLLMClient.generate` shape (server mode)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kwargs: dict[str, Any] = {}

    def generate(self, prompts: list[list[int]], **kwargs: Any) -> dict[str, Any]:
        self.kwargs = kwargs
        ids = _ids(self.tokenizer, '<query>{"query": "x"}</query>')
        return {"completion_ids": [ids for _ in prompts], "logprobs": [[[-0.1]] * len(ids) for _ in prompts]}


def test_vllm_server_mode_sends_stop_strings_and_the_grammar(tokenizer: Any) -> None:
    client = FakeVLLMClient(tokenizer)
    sampler = VLLMSampler(tokenizer, client=client)
    call = PolicyCall(stop=["</query>"], max_tokens=32, temperature=1.0, grammar='root ::= "x"')
    out = sampler.sample_batch([[1, 2, 3]], call)[0]
    assert out.stopped and out.text.endswith("</query>") and out.logprobs == [-0.1] * len(out.ids)
    assert client.kwargs["generation_kwargs"] == {"stop": ["</query>"], "include_stop_str_in_output": True,
                                                  "structured_outputs": {"grammar": 'root ::= "x"'}}
    with pytest.raises(ValueError):
        VLLMSampler(tokenizer)
