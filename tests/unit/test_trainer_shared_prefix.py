"""Reading each distinct prompt once gives TRL's own per-token log-probabilities and their gradients."""

from __future__ import annotations

from typing import Any

import pytest

from plugsearch.trainer.llm.shared_prefix import shared_prefix_logps


@pytest.fixture()
def tiny() -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(config)


def batch() -> tuple[Any, Any, int]:
    """Two prompts (one left-padded) with three and two completions of different lengths (right-padded)."""
    import torch

    pad = 0
    prompts = [[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    completions = [[20, 21, 22, 23], [24, 25, 0, 0], [26, 27, 28, 0], [30, 31, 32, 33], [34, 0, 0, 0]]
    owner = [0, 0, 0, 1, 1]
    ids = torch.tensor([prompts[o] + c for o, c in zip(owner, completions, strict=True)])
    mask = (ids != pad).long()
    return ids, mask, 4


def reference(model: Any, ids: Any, mask: Any, keep: int, temperature: float) -> Any:
    """TRL's own pass: its fused LM head on prompt + completion for every row."""
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, temperature=temperature)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :-keep] = -100
    return model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs[:, -keep:]


def test_same_log_probs_and_gradients_as_trls_pass(tiny: Any) -> None:
    import torch

    ids, mask, keep = batch()
    weight = torch.rand(ids.size(0), keep) * mask[:, -keep:]  # a loss over the real completion tokens
    ours, entropy = shared_prefix_logps(tiny, ids, mask, keep, temperature=0.7, compute_entropy=True)
    (ours * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in tiny.named_parameters() if p.grad is not None}
    tiny.zero_grad()
    theirs = reference(tiny, ids, mask, keep, 0.7)
    (theirs * weight).sum().backward()
    real = mask[:, -keep:].bool()
    assert torch.allclose(ours[real], theirs[real], atol=1e-5)
    for name, param in tiny.named_parameters():
        assert torch.allclose(grads[name], param.grad, atol=1e-5), name
    assert entropy is not None and entropy.shape == ours.shape and bool((entropy[real] > 0).all())


def test_each_distinct_prompt_is_read_once(tiny: Any) -> None:
    ids, mask, keep = batch()
    seen: list[tuple[int, int]] = []
    hook = tiny.model.embed_tokens.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape[:2])))
    try:
        shared_prefix_logps(tiny, ids, mask, keep)
    finally:
        hook.remove()
    assert seen == [(2, 6), (5, 4)]  # 2 prompts of 6 tokens, then 5 completions of 4
