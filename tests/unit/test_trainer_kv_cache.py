"""plugsearch.trainer.llm.kv_cache: the KV cache's keyword read from the model's own forward, through wrappers."""

from __future__ import annotations

from typing import Any

from plugsearch.trainer.llm.kv_cache import cache_keyword, output_cache


class New:
    def forward(self, input_ids: Any = None, cache: Any = None, use_cache: bool = False) -> None: ...


class Old:
    def forward(self, input_ids: Any = None, past_key_values: Any = None, use_cache: bool = False) -> None: ...


class Ddp:  # torch DDP / accelerate: `.module`
    def __init__(self, inner: Any) -> None:
        self.module = inner

    def forward(self, *args: Any, **kwargs: Any) -> None: ...


class Peft:  # PEFT: get_base_model()
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def get_base_model(self) -> Any:
        return self.inner

    def forward(self, input_ids: Any = None, **kwargs: Any) -> None: ...


def test_the_keyword_follows_the_innermost_forward() -> None:
    assert cache_keyword(New()) == "cache"
    assert cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Ddp(Peft(New()))) == "cache"
    assert cache_keyword(Peft(Old())) == "past_key_values"
    assert cache_keyword(object()) == "past_key_values"  # nothing to read: the long-standing name


def test_the_returned_cache_under_either_name() -> None:
    assert output_cache({"logits": 1, "cache": "kv"}) == "kv"
    assert output_cache({"logits": 1, "past_key_values": "kv"}) == "kv"
