"""Checks on a live GRPO step (`bench/train_gpu_check.py`, the trainer's e2e test): the gradient that
reaches the final hidden states on masked completion positions (inserted environment tokens, padding:
exactly 0 when the mask works) and on the policy's own tokens (> 0), and whether the ids trained on are
the ids the policy sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from plugsearch.trainer.llm.episode import Episode


def final_norm(model: Any) -> Any:
    """The last normalisation layer of a (possibly PEFT-wrapped) causal LM."""
    inner = model
    for attr in ("base_model", "model"):
        while hasattr(inner, attr) and not hasattr(inner, "norm"):
            inner = getattr(inner, attr)
    if not hasattr(inner, "norm"):
        raise TypeError(f"no final norm found in {type(model).__name__}")
    return inner.norm


class GradientProbe:
    """Keeps a step's loss inputs and the gradient of the final hidden states (position t predicts token t+1;
    over prompt + completion, or the completions alone after the shared-prefix pass)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.inputs: dict[str, Any] = {}
        self.hidden: Any = None
        self._original = trainer._compute_loss
        trainer._compute_loss = self._spy
        self._hook = final_norm(trainer.model).register_forward_hook(self._keep)

    def _spy(self, model: Any, inputs: dict[str, Any]) -> Any:
        self.inputs = inputs
        return self._original(model, inputs)

    def _keep(self, module: Any, args: Any, output: Any) -> None:
        if output.requires_grad:
            output.retain_grad()
            self.hidden = output

    def callback(self, episodes: Callable[[], Sequence[Episode]]) -> Any:
        """A `TrainerCallback` that reads the probe after every step (`episodes()`: that step's rollouts) and
        keeps the worst figures of the run: `.masked`, `.unmasked`, `.match`."""
        from transformers import TrainerCallback

        probe = self

        class Check(TrainerCallback):  # type: ignore[misc]
            masked = 0.0
            unmasked = 0.0
            match = True

            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                self.masked = max(self.masked, probe.masked_grad_max())
                self.unmasked = max(self.unmasked, probe.unmasked_grad_max())
                self.match = self.match and probe.trained_vs_sampled(episodes())

        return Check()

    def close(self) -> None:
        self._hook.remove()
        self.trainer._compute_loss = self._original

    def _position_grads(self) -> tuple[Any, Any]:
        """(|grad| per completion position, loss mask), from the last step."""
        if self.hidden is None or self.hidden.grad is None:
            raise RuntimeError("no gradient kept: run a training step first")
        inputs = self.inputs
        loss_mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            loss_mask = loss_mask * inputs["tool_mask"]
        prompt_len = inputs["prompt_ids"].size(1)
        completion_len = inputs["completion_ids"].size(1)
        grad = self.hidden.grad.float().abs().amax(-1)
        if grad.size(1) == prompt_len + completion_len:  # one pass over prompt + completion
            return grad[:, prompt_len - 1: prompt_len - 1 + completion_len], loss_mask.bool()
        # the shared-prefix pass read the completions on their own (the prompts once, before): position t of
        # that pass predicts completion token t + 1; the first completion token (always one the policy
        # sampled, from the shared prompt's last position) is left out of both figures
        return grad[:, :completion_len - 1], loss_mask[:, 1:].bool()

    def masked_grad_max(self) -> float:
        grads, mask = self._position_grads()
        return float(grads[~mask].max()) if (~mask).any() else 0.0

    def unmasked_grad_max(self) -> float:
        grads, mask = self._position_grads()
        return float(grads[mask].max()) if mask.any() else 0.0

    def trained_vs_sampled(self, episodes: Sequence[Episode]) -> bool:
        """The rows' completion ids at mask 1 are, one for one, the episodes' sampled ids (as cut when an
        episode was truncated). Rows are matched as a multiset: the trainer may reorder its batch."""
        inputs = self.inputs
        tool_mask = inputs.get("tool_mask")
        if tool_mask is None or inputs["completion_ids"].size(0) != len(episodes):
            return False
        mask = (inputs["completion_mask"] * tool_mask).tolist()
        trained = sorted([int(t) for t, m in zip(row, row_mask, strict=True) if m]
                         for row, row_mask in zip(inputs["completion_ids"].tolist(), mask, strict=True))
        sampled = sorted(e.masked_ids() for e in episodes)
        return trained == sampled and all(_is_sampled(e) for e in episodes)


def _is_sampled(episode: Episode) -> bool:
    """The episode's mask-1 ids are its sampled ids (a prefix of them when the episode was truncated)."""
    kept = episode.masked_ids()
    sampled = [t for turn in episode.sampled for t in turn]
    return kept == (sampled[:len(kept)] if episode.truncated else sampled)
