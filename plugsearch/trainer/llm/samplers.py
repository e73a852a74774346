"""Token samplers for `plugsearch.trainer.llm.episode.run_episode`: the policy being trained, continuing exact id sequences.

Concurrent `sample` calls are batched per sampling setting and run in a worker thread, so the event loop
keeps serving the episodes' retrievals. `HFSampler`: a KV-cached loop over a Hugging Face causal LM that
reads identical prompts (a GRPO group) once. `VLLMSampler`: TRL's own vLLM (colocate or server).
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any

from plugsearch.searcher.env import PolicyCall
from plugsearch.trainer.llm.episode import Sampled
from plugsearch.trainer.llm.kv_cache import cache_keyword, output_cache


@dataclass
class _Pending:
    ids: list[int]
    future: asyncio.Future[Sampled]


@dataclass
class _Group:
    call: PolicyCall
    items: list[_Pending] = field(default_factory=list)


class BatchingSampler:
    """Gathers concurrent `sample` calls with the same settings into batches of `max_batch`."""

    def __init__(self, *, max_batch: int = 32, gather_s: float = 0.02) -> None:
        self.max_batch = max_batch
        self.gather_s = gather_s
        self.batches = 0
        self._queue: dict[tuple[Any, ...], _Group] = {}
        self._worker: asyncio.Task[None] | None = None

    async def sample(self, ids: list[int], call: PolicyCall) -> Sampled:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Sampled] = loop.create_future()
        key = (call.temperature, call.max_tokens, tuple(call.stop))
        self._queue.setdefault(key, _Group(call)).items.append(_Pending(list(ids), future))
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            await asyncio.sleep(self.gather_s)  # let the other episodes reach their next policy call
            key = next(iter(self._queue))
            group = self._queue[key]
            batch, group.items = group.items[:self.max_batch], group.items[self.max_batch:]
            if not group.items:
                del self._queue[key]
            try:
                results = await asyncio.to_thread(self.sample_batch, [p.ids for p in batch], group.call)
            except Exception as exc:  # every waiting episode gets the failure; the worker goes on
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            self.batches += 1
            for p, r in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(r)

    def sample_batch(self, rows: list[list[int]], call: PolicyCall) -> list[Sampled]:
        raise NotImplementedError

    async def aclose(self) -> None:
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()


def _stop_at(text: str, stop: tuple[str, ...]) -> int:
    """Index just past the first stop string in `text`, or -1."""
    return min((at + len(s) for s in stop if (at := text.find(s)) >= 0), default=-1)


class HFSampler(BatchingSampler):
    """Samples from a causal LM with a KV cache; `temperature` 0 is greedy."""

    def __init__(self, model: Any, tokenizer: Any, *, top_p: float = 1.0, max_batch: int = 32,
                 gather_s: float = 0.02) -> None:
        super().__init__(max_batch=max_batch, gather_s=gather_s)
        self.model = model
        self.tokenizer = tokenizer
        self.top_p = top_p
        self.eos_id: int | None = tokenizer.eos_token_id
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_id or 0)
        self.prompt_tokens_read = 0

    def sample_batch(self, rows: list[list[int]], call: PolicyCall) -> list[Sampled]:
        import torch

        model = self.model
        device = next(model.parameters()).device
        unique: dict[tuple[int, ...], int] = {}
        order = [unique.setdefault(tuple(r), len(unique)) for r in rows]
        prompts = list(unique)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row continues at the last column
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        self.prompt_tokens_read += sum(len(p) for p in prompts)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                out = model(input_ids=ids.to(device), attention_mask=attention.to(device),
                            position_ids=positions.to(device), use_cache=True, logits_to_keep=1)
                cache = output_cache(out)
                index = torch.tensor(order, dtype=torch.long, device=device)
                if len(prompts) != len(rows):
                    cache.batch_select_indices(index)
                logits = out.logits[:, -1, :].float()[index]
                attention = attention.to(device)[index]
                position = positions.to(device)[index, -1]
                return self._decode_loop(model, cache, logits, attention, position, call, len(rows))
        finally:
            if was_training:
                model.train()

    def _decode_loop(self, model: Any, cache: Any, logits: Any, attention: Any, position: Any,
                     call: PolicyCall, n: int) -> list[Sampled]:
        import torch

        stop = tuple(call.stop)
        cache_kw = cache_keyword(model)
        new: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        done = [False] * n
        stopped = [False] * n
        texts = [""] * n
        for _ in range(call.max_tokens):
            logp = torch.log_softmax(logits / call.temperature if call.temperature > 0 else logits, dim=-1)
            if call.temperature > 0:
                probs = logp.exp()
                if self.top_p < 1.0:
                    probs = _top_p(probs, self.top_p)
                token = torch.multinomial(probs, 1).squeeze(-1)
            else:
                token = logp.argmax(-1)
            chosen = logp.gather(-1, token[:, None]).squeeze(-1)
            for row in range(n):
                if done[row]:
                    continue
                t = int(token[row])
                new[row].append(t)
                logps[row].append(float(chosen[row]))
                if t == self.eos_id:
                    done[row] = stopped[row] = True
                    continue
                if stop:
                    texts[row] = self.tokenizer.decode(new[row], skip_special_tokens=True)
                    if _stop_at(texts[row], stop) >= 0:
                        done[row] = stopped[row] = True
            if all(done):
                break
            token = torch.where(torch.tensor(done, device=token.device), torch.full_like(token, self.pad_id), token)
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
            position = position + 1
            with torch.no_grad():
                out = model(input_ids=token[:, None], attention_mask=attention, position_ids=position[:, None],
                            use_cache=True, **{cache_kw: cache})
            cache = output_cache(out)
            logits = out.logits[:, -1, :].float()
        return [Sampled(ids=new[row], text=self.tokenizer.decode(new[row], skip_special_tokens=True),
                        stopped=stopped[row], logprobs=logps[row]) for row in range(n)]


def _top_p(probs: Any, top_p: float) -> Any:
    import torch

    sorted_probs, order = probs.sort(dim=-1, descending=True)
    keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
    sorted_probs = sorted_probs * keep
    out = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return out / out.sum(-1, keepdim=True)


class VLLMSampler(BatchingSampler):
    """Samples through TRL's vLLM: `llm` (colocate mode, a `vllm.LLM`) or `client` (server mode, TRL's
    `VLLMClient`). Constrained decoding (the environment's grammar) goes through vLLM's structured outputs."""

    def __init__(self, tokenizer: Any, *, llm: Any = None, client: Any = None, max_batch: int = 256,
                 gather_s: float = 0.02) -> None:
        if (llm is None) == (client is None):
            raise ValueError("VLLMSampler needs exactly one of llm (colocate) or client (server)")
        super().__init__(max_batch=max_batch, gather_s=gather_s)
        self.tokenizer = tokenizer
        self.llm = llm
        self.client = client
        self.eos_id: int | None = tokenizer.eos_token_id

    def sample_batch(self, rows: list[list[int]], call: PolicyCall) -> list[Sampled]:
        kwargs: dict[str, Any] = {"n": 1, "temperature": call.temperature, "max_tokens": call.max_tokens,
                                  "stop": list(call.stop), "include_stop_str_in_output": True, "logprobs": 0}
        if call.grammar is not None:
            kwargs["structured_outputs"] = {"grammar": call.grammar}
        if self.llm is not None:
            from vllm import SamplingParams  # GPU images only
            from vllm.sampling_params import StructuredOutputsParams

            if "structured_outputs" in kwargs:
                kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
            outputs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sampling_params=SamplingParams(
                **kwargs), use_tqdm=False)
            results = []
            for output in outputs:
                first = output.outputs[0]
                ids = [int(t) for t in first.token_ids]
                logps = None
                if first.logprobs is not None:
                    logps = [float(step[t].logprob) for step, t in zip(first.logprobs, ids, strict=True)]
                results.append(engine_output(self.tokenizer, ids, logps, stop=call.stop,
                                             finish_reason=first.finish_reason))
            return results
        engine_keys = ("stop", "include_stop_str_in_output", "structured_outputs")
        generation_kwargs = {k: kwargs.pop(k) for k in engine_keys if k in kwargs}
        out = self.client.generate(prompts=rows, **kwargs, generation_kwargs=generation_kwargs)
        results = []
        for i, ids in enumerate(out["completion_ids"]):
            logps = None
            if out.get("logprobs") is not None:
                logps = [float(step[0]) if isinstance(step, list) else float(step) for step in out["logprobs"][i]]
            results.append(engine_output(self.tokenizer, [int(t) for t in ids], logps, stop=call.stop))
        return results


def engine_output(tokenizer: Any, ids: list[int], logprobs: list[float] | None, *, stop: list[str],
                  finish_reason: str | None = None) -> Sampled:
    """An inference engine's output ids (vLLM: the stop string kept, `include_stop_str_in_output`) as the
    environment reads them: the decoded text, whether it ended at end of turn or a stop string, and the
    logprobs (dropped when the engine gave NaNs). Shared by TRL's vLLM and veRL's rollout servers."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    ended = bool(ids) and ids[-1] == tokenizer.eos_token_id
    stopped = ended or finish_reason == "stop" or _stop_at(text, tuple(stop)) >= 0
    if logprobs is not None and any(math.isnan(x) for x in logprobs):
        logprobs = None
    return Sampled(ids=ids, text=text, stopped=stopped, logprobs=logprobs)
