"""Supervised warm start before RL: behaviour cloning of an answer-aware demonstrator, through the same
search environment and token path as RL (`plugsearch.trainer.llm.episode.episode_in`).

A 135M instruct model neither follows the s3 action format nor knows a useful selection, so GRPO from it
sees almost no reward variance. The demonstrator (training questions only):
- select: the current block's documents that contain a gold answer (GenAcc's span check), in rank order,
  at most `select_k`; none in the first block -> its top document (a search never returns nothing),
  none in a later one -> `[]`;
- stop once a selected document holds the answer, or when no further search would find it;
- search: among strings the policy can see (document titles and capitalised phrases so far, phrases of
  the question), the one whose results rank an answer document highest: hindsight, but copyable.

The loss is the negative log-likelihood of the mask-1 tokens of the episodes, kept exactly as RL sees
them. Resumable: a checkpoint every `save_steps` steps holds the adapter, optimizer state and data position.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, count, islice
from pathlib import Path
from typing import Any

from pydantic import Field

from plugsearch.common.answers import span_match
from plugsearch.common.qa import QAItem, append_durable, read_jsonl
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher import parsing
from plugsearch.searcher.env import InfoBlock, PolicyCall, RetrieverBackend, SearchEnv
from plugsearch.searcher.prompts import PromptSet
from plugsearch.trainer.llm.episode import ChatTokens, Episode, Sampled, episode_in
from plugsearch.trainer.llm.grpo import TORCH_DTYPES, RunConfig, resolve_device, resolve_precision

logger = logging.getLogger(__name__)

_PHRASE = re.compile(r"\b[A-Z][\w'\u2019.-]*(?:\s+(?:(?:of|the|and|de|la|von|van|der|du)\s+)*"
                     r"[A-Z0-9][\w'\u2019.-]*){0,5}")
_NOT_NAMES = frozenset({"who", "what", "when", "where", "which", "why", "how", "the", "a", "an", "in", "it", "he",
                        "she", "they", "this", "that", "his", "her", "its", "on", "at", "as", "for", "of", "and"})
MAX_CANDIDATES = 48


def answer_ids(block: InfoBlock, answers: Sequence[str], select_k: int) -> list[int]:
    """1-based ids of the block's documents that contain a gold answer, in rank order, at most `select_k`."""
    return [i for i, d in enumerate(block.documents, start=1) if span_match(d.text, answers)][:select_k]


def candidate_queries(question: str, blocks: Sequence[InfoBlock], seen: set[str]) -> list[str]:
    """Strings the policy could copy from what it has seen: document titles, then capitalised phrases of
    the documents and of the question; minus queries already issued. In that order, without repeats."""
    out: list[str] = []
    keys = set(seen)

    def add(text: str) -> None:
        text = " ".join(text.strip(" .,;:'\"").split())
        if text.count("(") != text.count(")"):
            text = text.strip("()")
        key = parsing.normalize_query(text)
        if key in _NOT_NAMES:
            return
        if len(text) >= 3 and key not in keys and len(text) <= 80:
            keys.add(key)
            out.append(text)

    docs = [doc for block in blocks for doc in block.documents]
    for text in [doc.title for doc in docs] + [m.group(0) for source in [*(d.text for d in docs), question]
                                               for m in _PHRASE.finditer(source)]:
        add(text)
    return out[:MAX_CANDIDATES]


def action_text(selected: Sequence[int], *, complete: bool, query: str | None = None) -> str:
    """An s3 action, exactly as the grammar and the prompt spell it."""
    text = f"<important_info>[{', '.join(str(i) for i in selected)}]</important_info>\n"
    if complete or query is None:
        return text + "<search_complete>True</search_complete>"
    return text + "<search_complete>False</search_complete>\n" + f'<query>{json.dumps({"query": query})}</query>'


class Demonstrator:
    """The answer-aware s3 policy, as a `TokenSampler` bound to one environment."""

    def __init__(self, env: SearchEnv, item: QAItem, retriever: RetrieverBackend, tokenizer: Any) -> None:
        self.env = env
        self.item = item
        self.retriever = retriever
        self.tokenizer = tokenizer
        self.found = False

    async def best_query(self) -> str | None:
        env = self.env
        candidates = candidate_queries(env.question, env.blocks, env.seen_queries)
        if not candidates:
            return None
        results = await self.retriever.retrieve(candidates, env.params.retrieve_k, env.params.method)
        seen_text = {" ".join(d.text.split()) for b in env.blocks for d in b.documents}
        answers = self.item.golden_answers
        # (rank of a new document holding an answer, query): the best-ranked, then the first query
        best = min(((rank, index) for index, hits in enumerate(results) for rank, doc in enumerate(hits)
                    if " ".join(doc.text.split()) not in seen_text and span_match(doc.text, answers)),
                   default=None)
        return candidates[best[1]] if best is not None else None

    async def sample(self, ids: list[int], call: PolicyCall) -> Sampled:
        env = self.env
        p = env.params
        block = env.blocks[-1]
        selected = answer_ids(block, self.item.golden_answers, p.select_k)
        if not selected and len(env.blocks) == 1:
            selected = [1]  # the naive choice: a search never returns nothing
        self.found = self.found or any(span_match(block.documents[i - 1].text, self.item.golden_answers)
                                       for i in selected)
        query = None
        if env.can_search and not self.found:
            query = await self.best_query()
        text = action_text(selected, complete=query is None, query=query)
        out = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if query is None:  # a finished action ends the turn; a query ends at its stop string `</query>`
            out.append(int(self.tokenizer.eos_token_id))
        return Sampled(ids=out, text=text, stopped=True)


async def demonstrate(item: QAItem, params: SearchParams, *, retriever: RetrieverBackend, chat: ChatTokens,
                      prompts: PromptSet | None = None) -> Episode:
    env = SearchEnv(item.question, params, retriever, prompts=prompts)
    return await episode_in(env, Demonstrator(env, item, retriever, chat.tokenizer), chat)


def collect_examples(items: Sequence[QAItem], params: SearchParams, settings: Any, model_path: Path, path: Path, *,
                     prompts_dir: Path | None = None, concurrency: int = 8,
                     progress: bool = True) -> tuple[list[Example], dict[str, Any]]:
    """Demonstrated episodes of `items` through the retriever service of `settings` (a `TrainerSettings`),
    appended to `path` one JSON line each, so a rerun only demonstrates the questions not done yet."""
    import asyncio

    from tqdm import tqdm

    from plugsearch.common.clients import RetrieverClient
    from plugsearch.searcher.retrieval import ServiceRetriever
    from plugsearch.trainer.llm.model import load_tokenizer

    done: dict[str, dict[str, Any]] = {row["id"]: row for row in read_jsonl(path, json.loads)[0]}
    todo = [it for it in items if it.id not in done]
    chat = ChatTokens(load_tokenizer(model_path))
    prompts = PromptSet.load(prompts_dir)

    async def run() -> None:
        client = RetrieverClient(settings.retriever)
        retriever = ServiceRetriever(client)
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(items), initial=len(items) - len(todo), desc="demonstrations", disable=not progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            async def one(item: QAItem) -> None:
                async with sem:
                    episode = await demonstrate(item, params, retriever=retriever, chat=chat, prompts=prompts)
                docs = episode.outcome.documents
                row = {"id": item.id, "dataset": item.dataset, "prompt_ids": episode.prompt_ids,
                       "completion_ids": episode.completion_ids, "env_mask": episode.env_mask,
                       "queries": episode.outcome.queries, "documents": len(docs),
                       "hit": any(span_match(d.text, item.golden_answers) for d in docs)}
                append_durable(path, json.dumps(row) + "\n")
                done[item.id] = row
                bar.update(1)

            await asyncio.gather(*(one(item) for item in todo))
        finally:
            bar.close()
            await client.aclose()

    if todo:
        asyncio.run(run())
    rows = [done[it.id] for it in items if it.id in done]
    examples = [Example(r["prompt_ids"] + r["completion_ids"], [0] * len(r["prompt_ids"]) + r["env_mask"])
                for r in rows]
    n = max(1, len(rows))
    stats = {"demonstrations": len(rows), "demo_hit": round(sum(r["hit"] for r in rows) / n, 3),
             "demo_searched": round(sum(bool(r["queries"]) for r in rows) / n, 3),
             "demo_documents": round(sum(r["documents"] for r in rows) / n, 2),
             "demo_tokens": round(sum(len(e.input_ids) for e in examples) / n, 1)}
    return examples, stats


class WarmStartConfig(RunConfig):
    """`precision` auto: bf16 autocast on GPUs (fp16 with loss scaling where bf16 is missing), fp32 on the
    CPU; the trained weights stay fp32 either way."""

    epochs: float = Field(1.0, gt=0)
    learning_rate: float = Field(2e-4, gt=0)
    batch_tokens: int = Field(4096, ge=256, description="tokens per optimizer step (examples packed by length)")
    save_steps: int = Field(20, ge=1)


@dataclass
class Example:
    input_ids: list[int]
    labels_mask: list[int]
    """1 on the tokens the loss is taken on (the demonstrator's output tokens)."""


def batches(examples: Sequence[Example], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices of each optimizer step: shuffled per epoch, grouped so a batch holds ~`batch_tokens`."""
    order = list(range(len(examples)))
    random.Random(seed * 1000 + epoch).shuffle(order)
    out: list[list[int]] = []
    current: list[int] = []
    width = 0
    for i in order:
        n = len(examples[i].input_ids)
        if current and max(width, n) * (len(current) + 1) > batch_tokens:
            out.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, n)
    if current:
        out.append(current)
    return out


def masked_nll(model: Any, examples: Sequence[Example], pad_id: int) -> Any:
    """Mean negative log-likelihood of the mask-1 tokens of a right-padded batch."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    device = next(model.parameters()).device
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(examples):
        ids[row, :len(e.input_ids)] = torch.tensor(e.input_ids)
        attention[row, :len(e.input_ids)] = 1
        mask[row, :len(e.labels_mask)] = torch.tensor(e.labels_mask)
    first = int(mask.argmax(-1).min())  # logits are needed only from the first trained position on
    logits = model(input_ids=ids.to(device), attention_mask=attention.to(device),
                   logits_to_keep=width - first + 1).logits.float()
    # logits[:, j] predicts token first + j (the last position predicts nothing we keep)
    target = ids[:, first:].to(device)
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, target[..., None]).squeeze(-1)
    weight = mask[:, first:].to(device).float()
    return -(logp * weight).sum() / weight.sum().clamp(min=1.0)


STATE = "warmstart_state.json"
LOSS_LOG = "loss.jsonl"


def train_warm_start(config: WarmStartConfig, examples: Sequence[Example], lora: Any, *,
                     resume: bool = True, progress: bool = True) -> dict[str, Any]:
    """LoRA fine-tuning on the examples' mask-1 tokens; `lora` is a `plugsearch.trainer.llm.grpo.LoraSettings`. Writes
    `<output_dir>/adapter` (the latest weights), checkpoints under `<output_dir>/checkpoint` every
    `save_steps` steps, and `loss.jsonl` (one line per step); a rerun resumes from the checkpoint."""
    import torch
    from peft import PeftModel
    from tqdm import tqdm

    from plugsearch.trainer.llm.model import load_policy

    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    precision = resolve_precision(config.precision, device)
    autocast_dtype = None if precision == "fp32" else getattr(torch, TORCH_DTYPES[precision])
    scaler = torch.amp.GradScaler(device, enabled=precision == "fp16")
    out = config.output_dir
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / "checkpoint"
    model, tokenizer = load_policy(config.model_path, threads=config.threads)
    state: dict[str, Any] = {"step": 0}
    if resume and (checkpoint / STATE).is_file():
        state = json.loads((checkpoint / STATE).read_text())
        model = PeftModel.from_pretrained(model, str(checkpoint), is_trainable=True)
        logger.info("resuming the warm start at step %s", state["step"])
    else:
        model = lora.wrap(model)
        (out / LOSS_LOG).unlink(missing_ok=True)
    model.to(device)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.learning_rate)
    if resume and (checkpoint / "optimizer.pt").is_file():
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", map_location=device))
    total = max(1, round(len(batches(examples, config.batch_tokens, config.seed, 0)) * config.epochs))
    # whole epochs, each shuffled anew, cut at `epochs`
    plan = list(islice(chain.from_iterable(batches(examples, config.batch_tokens, config.seed, epoch)
                                           for epoch in count()), total))
    pad_id = int(tokenizer.pad_token_id)
    model.train()
    bar = tqdm(total=len(plan), initial=state["step"], desc="warm start", disable=not progress)
    t0 = time.perf_counter()
    try:
        for step in range(state["step"], len(plan)):
            with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = masked_nll(model, [examples[i] for i in plan[step]], pad_id)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            value = float(loss.detach())
            state["step"] = step + 1
            line = {"step": step + 1, "loss": value, "examples": len(plan[step])}
            append_durable(out / LOSS_LOG, json.dumps(line) + "\n")
            bar.update(1)
            bar.set_postfix(loss=f"{value:.3f}")
            if state["step"] % config.save_steps == 0 or state["step"] == len(plan):
                _save(model, optimizer, state, checkpoint)
    finally:
        bar.close()
    model.save_pretrained(str(out / "adapter"))
    tokenizer.save_pretrained(str(out / "adapter"))
    return {"steps": state["step"], "examples": len(examples), "seconds": round(time.perf_counter() - t0, 1),
            "adapter": str(out / "adapter")}


def _save(model: Any, optimizer: Any, state: dict[str, Any], checkpoint: Path) -> None:
    """Adapter, optimizer and position, written to a temporary folder and swapped in (a kill mid-save
    leaves the previous checkpoint whole)."""
    import torch

    from plugsearch.common.files import atomic_folder

    with atomic_folder(checkpoint, clean_stale=True) as tmp:  # one trainer writes its checkpoint
        model.save_pretrained(str(tmp))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        (tmp / STATE).write_text(json.dumps(state))
