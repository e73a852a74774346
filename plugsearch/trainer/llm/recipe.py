"""The local LLM searcher recipe: the search setting, prompts and adapter shape the shipped LoRA searcher
(`plugsearch/searcher/trained/smollm2-s3`) is trained with (`plugsearch-train warmstart` / `train` defaults on the
CPU) and served with (`plugsearch-stack --policy trained`; the stack's default searcher is the compact policy,
`plugsearch.trainer.compact`).

Sized for two CPU cores: SmolLM2-135M reads ~190 tokens/s and trains on ~85 tokens/s here, so every
token of the prompt costs. s3 with one extra search (T=1), 5 documents per block cut to 200 characters
for the policy (the returned documents are whole), at most 3 marked per block, and a short system prompt
(88 tokens against the packaged s3 prompt's 391) keep an episode near 300-550 tokens.
"""

from __future__ import annotations

from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.trained import LORA_DIR

PROMPTS_DIR = LORA_DIR / "prompts"

SEARCH = SearchParams(mode="s3", max_turns=1, retrieve_k=5, select_k=3, doc_chars=200, max_new_tokens=64)

TRAIN_DATASETS = ("nq", "hotpotqa", "2wikimultihopqa", "popqa")
"""Training questions: each set after its first 100 (the evaluation questions), yes/no ones dropped."""

LORA_RANK = 16
LORA_ALPHA = 32
LORA_TOP_LAYERS = 12
"""The adapter covers the last 12 of SmolLM2's 30 layers: backpropagation stops there."""
