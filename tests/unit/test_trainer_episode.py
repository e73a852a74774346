"""The search environment at the token level (what TRL and veRL train on): the ids trained on are the ids
sampled, the environment's tokens carry mask 0, and the documents come from the environment's state, the
same on the service path and the training path."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.llm import ChatMessage
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import PolicyCall
from plugsearch.trainer.llm.episode import ChatTokens, Sampled, run_episode
from tests.support.chat_policy import run_search
from tests.unit.test_searcher_loop import ScriptedPolicy, s3


@pytest.fixture(scope="module")
def tokenizer(var_dir: Path) -> Any:
    from plugsearch.trainer.llm.model import default_policy_path, load_tokenizer

    return load_tokenizer(default_policy_path(var_dir))


class ScriptedSampler:
    """Answers each call with the next scripted text, tokenised; `eos=True` also samples end-of-turn."""

    def __init__(self, tokenizer: Any, script: Sequence[str], *, eos: bool = False) -> None:
        self.tokenizer = tokenizer
        self.script = list(script)
        self.eos = eos
        self.seen: list[list[int]] = []
        self.calls: list[PolicyCall] = []

    async def sample(self, ids: list[int], call: PolicyCall) -> Sampled:
        self.seen.append(list(ids))
        self.calls.append(call)
        text = self.script[len(self.seen) - 1]
        out = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        if self.eos:
            out.append(int(self.tokenizer.eos_token_id))
        return Sampled(ids=out, text=text, stopped=True, logprobs=[-0.5] * len(out))


class Blocks:
    """Query `q` -> documents `<q>-1`, `<q>-2` (the two-block case of the issue: A then B)."""

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        return [[Document(id=f"{q}-{i}", title=f"{q} {i}", text=f"text {i} of {q}") for i in range(1, k + 1)]
                for q in queries]


TWO_BLOCKS = [s3("B", ids="[2]"), s3(ids="[1]", complete=True)]
PARAMS = SearchParams(retrieve_k=2, select_k=2, max_turns=2)


@pytest.mark.parametrize("eos", [False, True])
async def test_trained_ids_are_the_sampled_ids_and_inserted_tokens_are_masked(tokenizer: Any, eos: bool) -> None:
    sampler = ScriptedSampler(tokenizer, TWO_BLOCKS, eos=eos)
    chat = ChatTokens(tokenizer)
    episode = await run_episode("A", PARAMS, sampler=sampler, chat=chat, retriever=Blocks())
    assert episode.masked_ids() == [t for turn in episode.sampled for t in turn]
    assert len(episode.completion_ids) == len(episode.env_mask) == len(episode.logprobs or [])
    # every call continued the exact ids so far
    assert sampler.seen[0] == episode.prompt_ids
    assert sampler.seen[1] == episode.prompt_ids + episode.completion_ids[:len(sampler.seen[1]) - len(
        episode.prompt_ids)]
    # the whole sequence is the chat template's rendering of the environment's transcript
    rendered = tokenizer.apply_chat_template([m.model_dump() for m in episode.outcome.messages], tokenize=False)
    decoded = tokenizer.decode(episode.prompt_ids + episode.completion_ids)
    assert rendered.startswith(decoded) and rendered[len(decoded):].strip() in {"", "<|im_end|>"}
    # the information block the environment inserted is in the mask-0 part
    inserted = tokenizer.decode([t for t, m in zip(episode.completion_ids, episode.env_mask, strict=True) if not m])
    assert "text 1 of B" in inserted and "<information>" in inserted
    assert episode.outcome.stop_reason == "complete"


async def test_two_blocks_give_the_same_documents_on_the_service_and_training_paths(tokenizer: Any) -> None:
    """Blocks [A1, A2] and [B1, B2] marked [2] then [1]: every path returns [A2, B1]."""
    service = await run_search("A", PARAMS, policy=ScriptedPolicy(TWO_BLOCKS), retriever=Blocks())
    episode = await run_episode("A", PARAMS, sampler=ScriptedSampler(tokenizer, TWO_BLOCKS),
                                chat=ChatTokens(tokenizer), retriever=Blocks())
    assert [d.id for d in service.documents] == ["A-2", "B-1"]
    assert [d.id for d in episode.outcome.documents] == ["A-2", "B-1"]
    assert [m.model_dump() for m in service.messages] == [m.model_dump() for m in episode.outcome.messages]


async def test_truncation_cuts_the_completion_not_the_search(tokenizer: Any) -> None:
    episode = await run_episode("A", PARAMS, sampler=ScriptedSampler(tokenizer, TWO_BLOCKS),
                                chat=ChatTokens(tokenizer), retriever=Blocks(), max_completion_tokens=10)
    assert episode.truncated and len(episode.completion_ids) == 10
    assert [d.id for d in episode.outcome.documents] == ["A-2", "B-1"]


def test_after_turn_renders_only_what_the_template_adds(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    history = [ChatMessage(role="system", content="sys"), ChatMessage(role="user", content="q")]
    added = [ChatMessage(role="user", content="<information>x</information>")]
    ids = chat.after_turn(history, added, sampled_eos=False)
    assert ids[0] == tokenizer.eos_token_id  # the end of turn the policy did not sample
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    assert chat.after_turn(history, added, sampled_eos=True) == ids[1:]
