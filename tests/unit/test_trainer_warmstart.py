"""The warm start's demonstrator (answer-aware s3 actions through the real environment) and its loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.qa import QAItem
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchedDocument, SearchParams
from plugsearch.searcher import parsing
from plugsearch.searcher.env import InfoBlock
from plugsearch.trainer.llm.episode import ChatTokens
from plugsearch.trainer.llm.warmstart import (
    Example,
    action_text,
    batches,
    candidate_queries,
    demonstrate,
    masked_nll,
)


@pytest.fixture(scope="module")
def tokenizer(var_dir: Path) -> Any:
    from plugsearch.trainer.llm.model import default_policy_path, load_tokenizer

    return load_tokenizer(default_policy_path(var_dir))


class Wiki:
    """The question finds a film page naming its director; only the director's page holds the answer."""

    pages = {
        "Big Stone Gap": [("Big Stone Gap (film)", "Big Stone Gap is a 2014 film directed by Adriana Trigiani."),
                          ("Virginia", "Virginia is a state.")],
        "Adriana Trigiani": [("Adriana Trigiani", "Adriana Trigiani is a writer based in Greenwich Village.")],
    }

    def __init__(self) -> None:
        self.queries: list[list[str]] = []

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        self.queries.append(list(queries))
        out = []
        for q in queries:
            key = next((name for name in self.pages if name.lower() in q.lower()), None)
            hits = self.pages.get(key, []) if key else []
            out.append([Document(id=f"{t}", title=t, text=x) for t, x in hits][:k])
        return out


def test_actions_parse_back_as_the_environment_reads_them() -> None:
    stop = parsing.parse_s3(action_text([2, 1], complete=True), n_docs=5, select_k=3)
    assert stop.kind == "complete" and stop.selection is not None and stop.selection.ids == [2, 1]
    search = parsing.parse_s3(action_text([], complete=False, query='a "b"'), n_docs=5, select_k=3)
    assert search.kind == "search" and search.query == 'a "b"' and search.query_json_ok
    assert search.selection is not None and search.selection.explicit_empty


def test_candidates_are_titles_then_phrases_the_policy_has_seen() -> None:
    docs = [SearchedDocument(id="1", title="Big Stone Gap (film)", text="It was directed by Adriana Trigiani in "
                             "New York.", turn=0, query="q")]
    block = InfoBlock(turn=0, queries=["q"], documents=docs)
    found = candidate_queries("Who directed Big Stone Gap?", [block], {"new york"})
    assert found[0] == "Big Stone Gap (film)" and "Adriana Trigiani" in found
    assert "New York" not in found  # already searched


async def test_demonstrator_searches_the_bridge_entity_and_marks_the_answer(tokenizer: Any) -> None:
    wiki = Wiki()
    item = QAItem(id="x", question="The director of Big Stone Gap is based in what New York city?",
                  golden_answers=["Greenwich Village"])
    params = SearchParams(mode="s3", max_turns=1, retrieve_k=3, select_k=2)
    episode = await demonstrate(item, params, retriever=wiki, chat=ChatTokens(tokenizer))
    out = episode.outcome
    assert out.queries == ["Adriana Trigiani"] and out.stop_reason == "complete"
    assert [d.id for d in out.documents] == ["Big Stone Gap (film)", "Adriana Trigiani"]
    assert out.invalid_actions == 0
    # the demonstration is an ordinary episode: its mask-1 ids are exactly the demonstrator's outputs
    assert episode.masked_ids() == [t for turn in episode.sampled for t in turn]
    assert episode.sampled[-1][-1] == tokenizer.eos_token_id  # a finished action ends its turn


async def test_demonstrator_stops_at_once_when_the_first_block_answers(tokenizer: Any) -> None:
    item = QAItem(id="y", question="Where is Adriana Trigiani based?", golden_answers=["Greenwich Village"])
    episode = await demonstrate(item, SearchParams(max_turns=2, retrieve_k=3), retriever=Wiki(),
                                chat=ChatTokens(tokenizer))
    assert episode.outcome.queries == [] and [d.id for d in episode.outcome.documents] == ["Adriana Trigiani"]


def test_loss_counts_only_the_masked_tokens(tiny_lm: Any) -> None:
    import torch

    model, _ = tiny_lm
    a = Example([5, 6, 7, 8, 9], [0, 0, 1, 1, 0])
    b = Example([5, 6, 7], [0, 0, 1])
    loss = masked_nll(model, [a, b], pad_id=0)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([a.input_ids])).logits[0], -1)
        logp_b = torch.log_softmax(model(input_ids=torch.tensor([b.input_ids])).logits[0], -1)
    expected = -(logp[1, 7] + logp[2, 8] + logp_b[1, 7]) / 3
    assert torch.allclose(loss, expected, atol=1e-5)


def test_batches_cover_every_example_once_per_epoch() -> None:
    examples = [Example([1] * n, [1] * n) for n in (10, 300, 20, 250, 40)]
    plan = batches(examples, 512, seed=0, epoch=0)
    assert sorted(i for b in plan for i in b) == list(range(5))
    assert all(max(len(examples[i].input_ids) for i in b) * len(b) <= 512 or len(b) == 1 for b in plan)
    assert plan != batches(examples, 512, seed=0, epoch=1) or len(plan) == 1


@pytest.fixture(scope="module")
def tiny_lm() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval(), None


def test_warm_start_trains_on_the_resolved_device_and_resumes(tmp_path: Path, var_dir: Path) -> None:
    """A tiny random model: the LoRA learns (the loss falls over repeated epochs), device/precision are settings
    (cuda without a GPU is refused, bf16 on the CPU too), and a second run resumes where the first ended."""
    import sys

    import torch

    from plugsearch.trainer.llm.grpo import LoraSettings
    from plugsearch.trainer.llm.model import default_policy_path
    from plugsearch.trainer.llm.warmstart import LOSS_LOG, WarmStartConfig, train_warm_start

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from train_gpu_check import tiny_model

    model_dir = tiny_model(default_policy_path(var_dir), tmp_path / "tiny", seed=0)
    examples = [Example(input_ids=[5, 6, 7, 8, 9, 10], labels_mask=[0, 0, 0, 1, 1, 1]),
                Example(input_ids=[11, 12, 13, 14], labels_mask=[0, 0, 1, 1])]
    lora = LoraSettings(rank=8, alpha=16, top_layers=None)
    out = tmp_path / "ws"
    config = WarmStartConfig(output_dir=out, model_path=model_dir, epochs=40, learning_rate=5e-2,
                             batch_tokens=256, save_steps=10, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no GPU"):
            train_warm_start(config.model_copy(update={"device": "cuda"}), examples, lora, progress=False)
    with pytest.raises(ValueError, match="bf16"):
        train_warm_start(config.model_copy(update={"precision": "bf16"}), examples, lora, progress=False)
    half = train_warm_start(config.model_copy(update={"epochs": 20}), examples, lora, progress=False)
    assert half["steps"] == 20 and (out / "adapter" / "adapter_config.json").is_file()
    done = train_warm_start(config, examples, lora, progress=False)  # resumes at step 20
    assert done["steps"] == 40
    import json

    losses = [json.loads(line)["loss"] for line in (out / LOSS_LOG).read_text().splitlines()]
    assert [json.loads(line)["step"] for line in (out / LOSS_LOG).read_text().splitlines()] == list(range(1, 41))
    assert losses[-1] < losses[0] - 0.3  # a random 64-wide model: logits stay small, but it learns
