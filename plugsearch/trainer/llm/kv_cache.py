"""The key/value cache's name in a Hugging Face causal LM's call, whichever transformers is installed.

transformers renamed it: `forward(past_key_values=...)` / `output.past_key_values` became `forward(cache=...)`
/ `output.cache` (5.24 warns with a FutureWarning on the old keyword and logs on the old attribute, both
until 5.40). The name is read from the model's own `forward` signature (through PEFT and DDP wrappers,
whose `forward` takes `**kwargs`), so the same code runs without a warning on the locked and the newest
releases.
"""

from __future__ import annotations

import inspect
from typing import Any

_NAMES = ("cache", "past_key_values")


def cache_keyword(model: Any) -> str:
    """`cache` or `past_key_values`: the keyword the innermost model's `forward` takes its KV cache by."""
    seen: set[int] = set()
    while model is not None and id(model) not in seen:
        seen.add(id(model))
        try:
            params = set(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError, AttributeError):
            params = set()
        for name in _NAMES:
            if name in params:
                return name
        # PEFT's PeftModel (get_base_model), accelerate / torch DDP (module)
        inner = getattr(model, "module", None)
        if inner is None and callable(getattr(model, "get_base_model", None)):
            inner = model.get_base_model()
        model = inner
    return "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a forward returned (`output.cache`, or `output.past_key_values` before the rename)."""
    if "cache" in output:
        return output["cache"]
    return output["past_key_values"]
