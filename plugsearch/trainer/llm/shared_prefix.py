"""Per-token log-probabilities of completions that share prompts, reading each distinct prompt once.

A GRPO batch holds `num_generations` identical (equally padded) rows of every prompt. Each distinct prompt
goes through the model once and its key/value cache is indexed out to its rows (an indexing op, so every
row's gradient flows back into it); only the completions are read per row, at the positions TRL's own
forward gives them. Same values and gradients as TRL's (`tests/unit/test_trainer_shared_prefix.py`);
~2.8x fewer tokens read with 4 rollouts per question and ~340-token prompts.
"""

from __future__ import annotations

from typing import Any

from plugsearch.trainer.llm.kv_cache import cache_keyword, output_cache


def shared_prefix_logps(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *,
                        temperature: float = 1.0, compute_entropy: bool = False) -> tuple[Any, Any | None]:
    """(log p(completion token), entropy or None), each `(batch, logits_to_keep)`, for rows whose first
    `P = input_ids.size(1) - logits_to_keep` columns are the (left-padded) prompt."""
    import torch

    prompt_len = input_ids.size(1) - logits_to_keep
    prompts = input_ids[:, :prompt_len]
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    # one row of each distinct prompt (identical prompt rows carry identical padding, so any one will do)
    first = torch.zeros(unique.size(0), dtype=torch.long, device=input_ids.device)
    first.scatter_(0, inverse, torch.arange(input_ids.size(0), device=input_ids.device))
    out = model(input_ids=unique, attention_mask=attention_mask[first, :prompt_len], use_cache=True,
                logits_to_keep=1)
    cache = output_cache(out)
    cache.batch_select_indices(inverse)
    rest = model(input_ids=input_ids[:, prompt_len:], attention_mask=attention_mask, use_cache=False,
                 **{cache_keyword(model): cache})
    logits = torch.cat([out.logits[inverse, -1:, :], rest.logits[:, :-1, :]], dim=1).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, input_ids[:, prompt_len:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if compute_entropy else None
    return token_logp, entropy


def supports_shared_prefix(model: Any) -> bool:
    """Plain causal LMs whose head is a bare projection (no logit scaling or soft-capping)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return not any(getattr(config, name, None) for name in
                   ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling"))


def trainer_class() -> Any:
    """`GRPOTrainer` whose log-probability pass reads each distinct prompt once (TRL's own pass otherwise:
    multimodal inputs, MoE auxiliary losses, heads with scaling, or no shared prompt in the batch)."""
    import torch
    from trl import GRPOTrainer

    class SharedPrefixGRPOTrainer(GRPOTrainer):  # type: ignore[misc]
        def _get_per_token_logps_and_entropies(self, model: Any, input_ids: Any, attention_mask: Any,
                                               logits_to_keep: int, batch_size: int | None = None,
                                               compute_entropy: bool = False, compute_aux_loss: bool = False,
                                               **multimodal: Any) -> Any:
            prompt_len = input_ids.size(1) - logits_to_keep
            plain = not compute_aux_loss and not any(v is not None for v in multimodal.values())
            if plain and supports_shared_prefix(self.accelerator.unwrap_model(model)) and prompt_len > 0 and \
                    torch.unique(input_ids[:, :prompt_len], dim=0).size(0) < input_ids.size(0):
                with self.accelerator.autocast():
                    logps, entropies = shared_prefix_logps(model, input_ids, attention_mask, logits_to_keep,
                                                           temperature=self.temperature,
                                                           compute_entropy=compute_entropy)
                return logps, entropies, None
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)

    return SharedPrefixGRPOTrainer
