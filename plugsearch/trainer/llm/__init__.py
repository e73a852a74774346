"""The chat LLM policy's trainer on TRL: token-level episodes of the search environment (`episode`), samplers
(HF, vLLM), the GRPO rollout and trainer (`rollout`, `grpo`), the supervised warm start (`warmstart`), the
LoRA export to llama.cpp (`export`), the local CPU recipe (`recipe`) and the multi-GPU configs
(`accelerate/`)."""
