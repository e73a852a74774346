"""The search loops driven by a scripted policy and a fake retriever, through every branch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from plugsearch.common.errors import UpstreamError, UpstreamTimeout
from plugsearch.common.http import UpstreamUnavailable
from plugsearch.common.llm import ChatMessage, ChatResult
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import select_documents
from plugsearch.searcher.prompts import PROMPT_VERSION
from tests.support import fake_policy
from tests.support.chat_policy import run_search

Q = "Who directed the film that won Best Picture in 1998?"


class ScriptedPolicy:
    """Answers from a script (strings or exceptions), records every call exactly as made."""

    model = "scripted"

    def __init__(self, script: Sequence[str | Exception] | Callable[[list[ChatMessage]], str],
                 delay_s: float = 0.0) -> None:
        self.script = script
        self.delay_s = delay_s
        self.calls: list[dict[str, Any]] = []

    async def chat(self, messages: list[ChatMessage], *, temperature: float = 0.0, max_tokens: int = 256,
                   stop: list[str] | None = None, extra: dict[str, Any] | None = None) -> ChatResult:
        self.calls.append({"messages": [m.model_copy() for m in messages], "temperature": temperature,
                           "max_tokens": max_tokens, "stop": stop, "extra": extra})
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if callable(self.script):
            return ChatResult(text=self.script(messages), finish_reason="stop")
        item = self.script[len(self.calls) - 1]
        if isinstance(item, Exception):
            raise item
        # like an OpenAI server: output ends before the first stop string, which is not returned
        text = item
        for s in stop or []:
            text = text.split(s)[0]
        return ChatResult(text=text, finish_reason="stop")

    async def check_health(self) -> str:
        return "ok"

    async def aclose(self) -> None:
        return None


class FakeRetriever:
    """Docs `<query>#i` with text unique per (query, i) unless `shared` makes some texts repeat."""

    def __init__(self, shared: int = 0, fail_after: int | None = None) -> None:
        self.calls: list[tuple[list[str], int, str | None]] = []
        self.shared = shared
        self.fail_after = fail_after

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise UpstreamUnavailable("retriever unreachable", retry_after=2)
        self.calls.append((list(queries), k, method))
        out = []
        for q in queries:
            docs = []
            for i in range(1, k + 1):
                text = f"shared passage {i}" if i <= self.shared else f"passage {i} about {q}"
                docs.append(Document(id=f"{q}#{i}", title=f"T{i}", text=text, score=1.0 / i))
            out.append(docs)
        return out


def s3(query: str | None = None, ids: str | None = None, complete: bool = False) -> str:
    parts = []
    if ids is not None:
        parts.append(f"<important_info>{ids}</important_info>")
    parts.append(f"<search_complete>{complete}</search_complete>")
    if query is not None:
        parts.append(f'<query>{{"query": "{query}"}}</query>')
    return "\n".join(parts)


def assert_transcript_is_the_calls(policy: ScriptedPolicy, messages: list[ChatMessage]) -> None:
    """The contract with the trainer: call i saw exactly the transcript before the i-th assistant message."""
    assistant_at = [i for i, m in enumerate(messages) if m.role == "assistant"]
    assert len(assistant_at) == len(policy.calls)
    for call, at in zip(policy.calls, assistant_at, strict=True):
        assert call["messages"] == messages[:at]
    assert all(m.role in {"system", "user", "assistant"} for m in messages)
    assert messages[0].role == "system" and messages[1].role == "user"


async def test_s3_normal_stop_selects_marked_documents() -> None:
    policy = ScriptedPolicy([
        s3("first hop"),                             # step on the initial block: no tag -> all of it
        s3("second hop", ids="[2, 5]"),
        s3(ids="[1]", complete=True),
    ])
    retriever = FakeRetriever()
    out = await run_search(Q, SearchParams(), policy=policy, retriever=retriever)
    assert out.stop_reason == "complete" and not out.degraded
    assert out.queries == ["first hop", "second hop"]
    assert [c[0] for c in retriever.calls] == [[Q], ["first hop"], ["second hop"]]
    assert all(c[1] == 8 for c in retriever.calls)
    ids = [d.id for d in out.documents]
    # tagged blocks first, in tag order, then every document of untagged blocks (s3's rule)
    assert ids == ["first hop#2", "first hop#5", "second hop#1"] + [f"{Q}#{i}" for i in range(1, 9)]
    assert {(d.turn, d.query) for d in out.documents[:2]} == {(1, "first hop")}
    assert out.documents[-1].turn == 0 and out.documents[-1].query == Q
    assert out.turns == 3 and out.valid_actions == 3 and out.invalid_actions == 0
    assert out.prompt_version == PROMPT_VERSION and out.policy_model == "scripted"
    assert_transcript_is_the_calls(policy, out.messages)
    # the stop sequence ate </query>; the transcript has it back, and the information follows it
    assert out.messages[2].content.endswith('{"query": "first hop"}</query>')
    assert "<information>" in out.messages[3].content and "passage 1 about first hop" in out.messages[3].content
    assert policy.calls[0]["stop"] == ["</query>"] and policy.calls[0]["extra"] is None


async def test_s3_turn_limit_then_final_selection_step() -> None:
    policy = ScriptedPolicy([s3("a"), s3("b", ids="[1]"), s3("c", ids="[2]"), s3(ids="[3]")])
    out = await run_search(Q, SearchParams(max_turns=3), policy=policy, retriever=FakeRetriever())
    assert out.stop_reason == "max_turns"
    assert out.queries == ["a", "b", "c"] and out.turns == 4
    assert "This was the last search" in out.messages[-2].content
    assert [d.id for d in out.documents][:3] == ["a#1", "b#2", "c#3"]
    assert len(out.documents) == 3 + 8  # + the untagged initial block
    assert_transcript_is_the_calls(policy, out.messages)


async def test_s3_zero_turns_is_a_selection_over_the_naive_block() -> None:
    policy = ScriptedPolicy([s3(ids="[4, 1]", complete=True)])
    out = await run_search(Q, SearchParams(max_turns=0), policy=policy, retriever=FakeRetriever())
    assert [d.id for d in out.documents] == [f"{Q}#4", f"{Q}#1"]
    assert out.stop_reason == "complete"


async def test_s3_malformed_output_is_reprompted_then_falls_back() -> None:
    policy = ScriptedPolicy(["I think the answer is Titanic.", "<query> </query>", "still nothing"])
    out = await run_search(Q, SearchParams(max_invalid=2, max_turns=5), policy=policy, retriever=FakeRetriever())
    assert out.stop_reason == "invalid_actions"
    assert out.invalid_actions == 3 and out.valid_actions == 0 and out.queries == []
    assert [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 9)]  # naive top-k
    reprompts = [m for m in out.messages if m.role == "user" and "invalid" in m.content]
    assert len(reprompts) == 2
    assert_transcript_is_the_calls(policy, out.messages)


async def test_s3_recovers_after_one_invalid_action() -> None:
    policy = ScriptedPolicy(["garbage", s3("real query"), s3(ids="[1]", complete=True)])
    out = await run_search(Q, SearchParams(), policy=policy, retriever=FakeRetriever())
    assert out.stop_reason == "complete" and out.queries == ["real query"]
    assert out.invalid_actions == 1 and out.valid_actions == 2
    assert out.documents[0].id == "real query#1"


async def test_s3_broken_json_query_is_still_used() -> None:
    policy = ScriptedPolicy(['<query>{"query": "broken json', "<query>plain words</query>",
                             s3(complete=True)])
    out = await run_search(Q, SearchParams(), policy=policy, retriever=FakeRetriever())
    assert out.queries == ["broken json", "plain words"]


async def test_s3_out_of_range_ids_are_dropped_and_capped_at_select_k() -> None:
    policy = ScriptedPolicy([s3("q1"), s3("q2", ids="[0, 9, 3, 3, 12]"), s3(ids="[1, 2, 3, 4, 5]", complete=True)])
    out = await run_search(Q, SearchParams(select_k=3), policy=policy, retriever=FakeRetriever())
    assert out.blocks[1].selected == [3]
    assert out.blocks[2].selected == [1, 2, 3]
    assert [d.id for d in out.documents][:4] == ["q1#3", "q2#1", "q2#2", "q2#3"]


async def test_s3_tag_with_only_invalid_ids_counts_as_no_tag_but_empty_list_selects_nothing() -> None:
    policy = ScriptedPolicy([s3("q1", ids="[42]"), s3("q2", ids="[]"), s3(ids="[]", complete=True)])
    out = await run_search(Q, SearchParams(), policy=policy, retriever=FakeRetriever())
    assert out.blocks[0].selected is None  # [42]: nothing usable -> whole initial block
    assert out.blocks[1].selected == [] and out.blocks[2].selected == []
    assert [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 9)]


async def test_s3_duplicate_documents_are_kept_once() -> None:
    policy = ScriptedPolicy([s3("q1"), s3("q2", ids="[1, 2, 3]"), s3(ids="[1, 4]", complete=True)])
    out = await run_search(Q, SearchParams(), policy=policy, retriever=FakeRetriever(shared=2))
    texts = [d.text for d in out.documents]
    assert len(texts) == len(set(texts))
    assert texts[:3] == ["shared passage 1", "shared passage 2", "passage 3 about q1"]
    assert out.documents[0].turn == 1  # first occurrence wins: found by q1's block (tagged first)


async def test_s3_repeated_query_is_not_searched_again() -> None:
    policy = ScriptedPolicy([s3("same"), s3("SAME ", ids="[1]"), s3(Q.lower()), s3(ids="[1]", complete=True)])
    retriever = FakeRetriever()
    out = await run_search(Q, SearchParams(max_turns=5), policy=policy, retriever=retriever)
    assert out.queries == ["same"]
    assert len(retriever.calls) == 2 and out.invalid_actions == 2
    assert sum("already searched" in m.content for m in out.messages if m.role == "user") == 2


@pytest.mark.parametrize("error, reason", [(UpstreamError("llm down"), "policy_error"),
                                           (UpstreamTimeout("llm slow"), "policy_timeout")])
async def test_s3_policy_error_mid_loop_degrades_to_what_it_marked_else_naive_top_k(error: Exception,
                                                                                    reason: str) -> None:
    """One rule for every policy (`SearchEnv.degrade`): the documents it marked, else naive top-select_k."""
    policy = ScriptedPolicy([s3("q1"), error])
    out = await run_search(Q, SearchParams(), policy=policy, retriever=FakeRetriever())
    assert out.degraded and out.stop_reason == reason and "llm" in (out.degraded_reason or "")
    assert [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 4)]  # nothing marked: naive top-3
    marked = ScriptedPolicy([s3("q1", ids="[2, 5]"), error])
    out = await run_search(Q, SearchParams(), policy=marked, retriever=FakeRetriever())
    assert out.degraded and [d.id for d in out.documents] == [f"{Q}#2", f"{Q}#5"]  # q1's block was not marked


async def test_s3_policy_error_first_call_returns_naive_top_k() -> None:
    out = await run_search(Q, SearchParams(), policy=ScriptedPolicy([UpstreamError("down")]),
                           retriever=FakeRetriever())
    assert out.degraded and [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 4)]
    assert out.messages[-1].role == "user"  # no assistant message for the failed call


class HangingAfterFirst(ScriptedPolicy):
    """Answers the first call at once, then never answers (until cancelled)."""

    async def chat(self, messages: list[ChatMessage], **kwargs: Any) -> ChatResult:
        if self.calls:
            self.calls.append({"messages": list(messages)})
            await asyncio.Event().wait()
        return await super().chat(messages, **kwargs)


async def test_s3_deadline_degrades() -> None:
    policy = HangingAfterFirst([s3("q1"), s3("q2")])
    out = await run_search(Q, SearchParams(timeout_s=1.0), policy=policy, retriever=FakeRetriever())
    assert out.degraded and out.stop_reason == "deadline"
    assert out.queries == ["q1"] and [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 4)]


async def test_retriever_down_at_start_raises_and_mid_loop_degrades() -> None:
    with pytest.raises(UpstreamUnavailable):
        await run_search(Q, SearchParams(), policy=ScriptedPolicy([]), retriever=FakeRetriever(fail_after=0))
    out = await run_search(Q, SearchParams(), policy=ScriptedPolicy([s3("q1")]),
                           retriever=FakeRetriever(fail_after=1))
    assert out.degraded and out.stop_reason == "retriever_error" and len(out.documents) == 3


async def test_constrained_decoding_sends_a_grammar_matching_the_block() -> None:
    policy = ScriptedPolicy([s3("q1"), s3(ids="[1]", complete=True)])
    params = SearchParams(constrained=True, retrieve_k=4, select_k=2)
    await run_search(Q, params, policy=policy, retriever=FakeRetriever())
    grammar = policy.calls[0]["extra"]["grammar"]
    assert 'id ::= "1" | "2" | "3" | "4"' in grammar and "more ::=" in grammar
    vllm = ScriptedPolicy([s3(ids="[1]", complete=True)])
    await run_search(Q, params.model_copy(update={"constraint_style": "vllm", "max_turns": 0}), policy=vllm,
                     retriever=FakeRetriever())
    final = vllm.calls[0]["extra"]["structured_outputs"]["grammar"]
    assert "more ::=" not in final  # no search allowed in the final step


async def test_params_are_forwarded() -> None:
    policy = ScriptedPolicy([s3(complete=True)])
    retriever = FakeRetriever()
    params = SearchParams(retrieve_k=5, select_k=2, method="bm25", temperature=0.7, max_new_tokens=64)
    await run_search(Q, params, policy=policy, retriever=retriever)
    assert retriever.calls == [([Q], 5, "bm25")]
    assert policy.calls[0]["temperature"] == 0.7 and policy.calls[0]["max_tokens"] == 64
    assert "at most 2 documents" in policy.calls[0]["messages"][0].content


def test_params_refuse_impossible_combinations() -> None:
    with pytest.raises(ValueError):
        SearchParams(retrieve_k=2, select_k=3)


async def test_naive_mode_is_plain_top_k_without_the_policy() -> None:
    policy = ScriptedPolicy([])
    out = await run_search(Q, SearchParams(mode="naive", retrieve_k=5), policy=policy, retriever=FakeRetriever())
    assert [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 6)]
    assert out.stop_reason == "naive" and not policy.calls and out.messages == []


def qa(*, plan: bool = True, queries: Sequence[str] = (), reflection: str | None = None,
       answer: str | None = None) -> str:
    parts = []
    if reflection is not None:
        parts.append(f"<reflection>{reflection}</reflection>")
    if answer is not None:
        parts.append(f"<answer>{answer}</answer>")
        return "\n".join(parts)
    if plan:
        parts.append("<plan>find it</plan>")
    parts.append("<search>" + "".join(f"<query>{q}</query>" for q in queries) + "</search>")
    return "\n".join(parts)


async def test_qagent_union_of_rounds_then_answer() -> None:
    policy = ScriptedPolicy([qa(queries=["a", "b"]), qa(queries=["c", "a"], reflection="need c"),
                             qa(reflection="enough", answer="x")])
    retriever = FakeRetriever(shared=1)
    out = await run_search(Q, SearchParams(mode="qagent", retrieve_k=3), policy=policy, retriever=retriever)
    assert out.stop_reason == "complete" and out.queries == ["a", "b", "c"]
    assert [c[0] for c in retriever.calls] == [["a", "b"], ["c"]]  # one batch per round, repeats dropped
    assert [d.id for d in out.documents] == ["a#1", "a#2", "a#3", "b#2", "b#3", "c#2", "c#3"]
    assert out.documents[-1].turn == 2 and out.documents[-1].query == "c"
    assert_transcript_is_the_calls(policy, out.messages)
    assert "Query: a" in out.messages[3].content


async def test_qagent_may_search_the_question_itself_but_not_twice() -> None:
    policy = ScriptedPolicy([qa(queries=[Q]), qa(queries=[Q.upper()], reflection="again"), qa(answer="x")])
    out = await run_search(Q, SearchParams(mode="qagent", retrieve_k=2), policy=policy, retriever=FakeRetriever())
    assert out.queries == [Q] and out.valid_actions == 2 and out.invalid_actions == 1
    assert any("already issued" in m.content for m in out.messages if m.role == "user")


async def test_qagent_round_limit_and_query_cap() -> None:
    policy = ScriptedPolicy([qa(queries=["a", "b", "c", "d"]), qa(queries=["e"])])
    out = await run_search(Q, SearchParams(mode="qagent", max_turns=2, max_queries_per_round=3, retrieve_k=1),
                           policy=policy, retriever=FakeRetriever())
    assert out.stop_reason == "max_turns" and out.queries == ["a", "b", "c", "e"]


async def test_qagent_that_never_searches_falls_back_to_naive() -> None:
    policy = ScriptedPolicy(["no idea", "<search></search>", "nothing", "never"])
    out = await run_search(Q, SearchParams(mode="qagent", max_turns=5, max_invalid=2), policy=policy,
                           retriever=FakeRetriever())
    assert out.stop_reason == "invalid_actions" and out.invalid_actions == 3
    assert [d.id for d in out.documents] == [f"{Q}#{i}" for i in range(1, 9)]


async def test_qagent_policy_error_degrades_keeping_retrieved() -> None:
    policy = ScriptedPolicy([qa(queries=["a"]), UpstreamError("gone")])
    out = await run_search(Q, SearchParams(mode="qagent", retrieve_k=2), policy=policy, retriever=FakeRetriever())
    assert out.degraded and [d.id for d in out.documents] == ["a#1", "a#2"]


async def test_qagent_constrained_first_round_has_no_answer_branch() -> None:
    policy = ScriptedPolicy([qa(queries=["a"]), qa(reflection="ok", answer="y")])
    await run_search(Q, SearchParams(mode="qagent", constrained=True), policy=policy, retriever=FakeRetriever())
    first, second = (c["extra"]["grammar"] for c in policy.calls)
    assert first.startswith("root ::= plan search") and "answer" in second.splitlines()[0]


@pytest.mark.parametrize("mode", ["s3", "qagent"])
async def test_scripted_fake_policy_produces_valid_actions(mode: str) -> None:
    policy = ScriptedPolicy(lambda msgs: fake_policy.respond({"messages": [m.model_dump() for m in msgs]}))
    out = await run_search(Q, SearchParams(mode=mode), policy=policy,  # type: ignore[arg-type]
                           retriever=FakeRetriever())
    assert out.invalid_actions == 0 and out.stop_reason in {"complete", "max_turns"}
    assert len(out.queries) >= 2 and not out.degraded


def test_select_documents_without_blocks_is_empty() -> None:
    assert select_documents([]) == []
