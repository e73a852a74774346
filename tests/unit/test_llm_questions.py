"""Questions written by the user's LLM (`plugsearch.trainer.compact.llm_questions`): the rules a question must pass
(JSON, the answer in its passage and not in the question, no copy of the passage, its passage found again by naive
BM25), against a scripted OpenAI-compatible endpoint (the project's client over a mock transport): one passage's
question is kept, one copies its passage, one is not found again, one reply is not JSON, one call times out and is
asked again; the replies are cached so a rerun asks nothing; few-shot from the user's labelled questions; the key
comes from the environment and is written nowhere. And the training run: with labelled questions the LLM's join
the training split only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugsearch.common.llm import LLMSettings, OpenAIChatClient
from plugsearch.common.qa import QAFileError, QAItem
from plugsearch.trainer.common.retrieval import IndexRetriever
from plugsearch.trainer.compact.llm_questions import (
    CACHE_FILE,
    GENERIC_EXAMPLES,
    INFO_FILE,
    QUESTIONS_FILE,
    LLMQuestions,
    copies,
    judge,
    parse_reply,
    question_file,
)

PASSAGES = {
    "keep": ("Quorvex turbine", "The Quorvex turbine was designed by Ilsa Varnhold in 1987 at the Tarbeck works, and "
             "it powered the northern mills of the valley for four decades before it was retired."),
    "copy": ("Belmar canal", "The Belmar canal runs for forty kilometres between the harbour of Ostrand and the "
             "inland lakes of the Velde region, and it was dug by hand over eleven years."),
    "lost": ("Town notes", "At its spring meeting the committee agreed to build a new footbridge over the river, "
             "after residents asked for a safer crossing near the old school and the market."),
    "garbled": ("Pellam lighthouse", "The Pellam lighthouse stands on a basalt ledge at the mouth of the bay and "
                "its lamp was first lit in 1852 by the keeper Jonas Hale and his daughter."),
    "slow": ("Orrin glacier", "The Orrin glacier retreated by nearly two kilometres during the twentieth century, "
             "according to surveys made by the alpine club of Hestvik between 1910 and 1990."),
    "short": ("Heading", "Contents of this chapter."),
}
DISTRACTORS = [(f"d{i}", "Council minutes", "The committee met at the spring meeting and the committee approved "
                "the spring meeting agenda; every spring meeting of the committee approves what the committee "
                f"agreed at the previous spring meeting, item {i}.") for i in range(3)]
SCRIPT: dict[str, str | list[str]] = {
    "keep": json.dumps({"question": "Who designed the Quorvex turbine?", "answer": "Ilsa Varnhold"}),
    "copy": json.dumps({"question": "The Belmar canal runs for how far between the harbour of Ostrand and the inland "
                                    "lakes of the Velde region?", "answer": "forty kilometres"}),
    "lost": json.dumps({"question": "What did the committee approve at the spring meeting?",
                        "answer": "a new footbridge"}),
    "garbled": "Sure! Here is a question about the lighthouse: when was it first lit",
    "slow": ["TIMEOUT", "```json\n" + json.dumps({"question": "How far did the Orrin glacier retreat last century?",
                                                  "answer": "nearly two kilometres"}) + "\n```"],
}


def write_corpus(path: Path) -> Path:
    rows = [{"id": pid, "title": title, "text": text} for pid, (title, text) in PASSAGES.items()]
    rows += [{"id": pid, "title": title, "text": text} for pid, title, text in DISTRACTORS]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class ScriptedLLM:
    """An OpenAI-compatible endpoint answering each passage as `SCRIPT` says ("TIMEOUT": the call times out);
    unscripted passages get an empty object. Records every request."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.calls: dict[str, int] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        self.headers.append(request.headers)
        passage = body["messages"][-1]["content"]
        name = next((n for n, (_, text) in PASSAGES.items() if text[:60] in passage), "other")
        n = self.calls[name] = self.calls.get(name, 0) + 1
        reply = SCRIPT.get(name, "{}")
        if isinstance(reply, list):
            reply = reply[min(n, len(reply)) - 1]
        if reply == "TIMEOUT":
            raise httpx.ReadTimeout("timed out", request=request)
        return httpx.Response(200, json={"choices": [{"message": {"content": reply}, "finish_reason": "stop"}],
                                         "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "model": "m"})


def client(script: Any, config: LLMQuestions) -> OpenAIChatClient:
    return OpenAIChatClient(LLMSettings(base_url=config.url, model=config.model, api_key=config.api_key(),
                                        max_retries=0, breaker_failures=100), transport=httpx.MockTransport(script))


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> IndexRetriever:
    folder = tmp_path_factory.mktemp("llmq")
    return IndexRetriever(write_corpus(folder / "corpus.jsonl"), folder / "index", dense=False, progress=False)


def test_the_rules_a_question_must_pass() -> None:
    assert parse_reply('{"question": "Who?", "answer": "Ann"}') == ("Who?", "Ann")
    assert parse_reply('Here: {"question": "How many?", "answer": 12} done') == ("How many?", "12")
    assert parse_reply('{"question": "", "answer": "x"}') is None and parse_reply("no json here") is None
    assert parse_reply('{"q": "x"}') is None and parse_reply('["question", "answer"]') is None
    text = PASSAGES["keep"][1]
    assert judge("Who designed the Quorvex turbine?", "Ilsa Varnhold", text) is None
    assert judge("Was it designed in 1987?", "yes", text) == "yes_no"
    assert judge("Who designed it?", "Tomas Grell", text) == "answer_not_in_passage"
    assert judge("Did Ilsa Varnhold design the Quorvex turbine?", "Ilsa Varnhold", text) == "answer_in_question"
    assert copies("Who powered the northern mills of the valley for four decades?", text)  # a run of 9 tokens
    assert not copies("The Quorvex turbine was designed by whom in 1987 at the Tarbeck works?", text)  # runs of 6
    assert copies("Quorvex turbine was designed by whom?", text)  # 5 of 6 tokens in one run: over 75%
    assert not copies("Who designed the Quorvex turbine?", text)  # a name and a verb, as real questions share


def test_kept_copied_not_found_again_bad_json_and_a_timeout_asked_again(
        retriever: IndexRetriever, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TEST_LLM_KEY", "sk-test-secret-123")
    config = LLMQuestions(url="http://llm/v1", model="m", passages=50, api_key_env="TEST_LLM_KEY", roundtrip_k=1,
                          retries=2)
    script = ScriptedLLM()
    path, info = question_file(tmp_path, retriever, config, progress=False, llm=client(script, config))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert path == tmp_path / QUESTIONS_FILE
    assert [(r["question"], r["golden_answers"], r["passage_ids"], r["dataset"]) for r in rows] == [
        ("Who designed the Quorvex turbine?", ["Ilsa Varnhold"], ["keep"], "llm"),
        ("How far did the Orrin glacier retreat last century?", ["nearly two kilometres"], ["slow"], "llm")]
    assert info["kept"] == 2 and info["passages"] == len(PASSAGES) + len(DISTRACTORS)
    assert info["skipped_short"] == 1 and info["few_shot"] == "generic"
    refused = info["refused"]
    assert refused["copied"] == 1 and refused["not_found_again"] == 1 and refused["failed"] == 0
    assert refused["bad_json"] == 1 + len(DISTRACTORS)  # the garbled reply and the empty objects
    assert info["kept"] + sum(refused.values()) + info["skipped_short"] == info["passages"]
    assert script.calls["slow"] == 2  # timed out once, asked again
    assert info["refused_examples"]["copied"]["passage_id"] == "copy"
    first = script.requests[0]
    assert first["response_format"] == {"type": "json_object"} and first["messages"][0]["role"] == "system"
    assert first["messages"][1]["content"].endswith(GENERIC_EXAMPLES[0][1])  # the generic examples as turns
    assert all(h["authorization"] == "Bearer sk-test-secret-123" for h in script.headers)
    for written in (tmp_path / INFO_FILE, tmp_path / CACHE_FILE, path):
        assert "sk-test-secret" not in written.read_text()

    def unreachable(request: httpx.Request) -> httpx.Response:
        raise AssertionError("a rerun asks nothing its cache holds")

    again, info2 = question_file(tmp_path, retriever, config, progress=False, resume=False,
                                 llm=client(unreachable, config))
    assert [json.loads(line) for line in again.read_text().splitlines()] == rows
    assert info2["cached"] == info["passages"] - info["skipped_short"] and info2["asked"] == 0
    reused, _ = question_file(tmp_path, retriever, config, progress=False, llm=client(unreachable, config))
    assert reused == path  # the same setting: the file is reused as it is


def test_a_call_that_keeps_timing_out_is_counted_and_nothing_usable_is_refused(
        retriever: IndexRetriever, tmp_path: Path) -> None:
    config = LLMQuestions(url="http://llm/v1", model="m", passages=50, retries=1, api_key_env="")

    def always_late(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=request)

    with pytest.raises(QAFileError, match="gave no usable question"):
        question_file(tmp_path, retriever, config, progress=False, llm=client(always_late, config))
    info = json.loads((tmp_path / INFO_FILE).read_text())
    assert info["refused"]["failed"] == info["passages"] - info["skipped_short"] and info["kept"] == 0
    assert not (tmp_path / CACHE_FILE).exists()  # nothing answered: nothing cached, a rerun asks again


def test_few_shot_examples_come_from_the_users_labelled_questions(retriever: IndexRetriever, tmp_path: Path) -> None:
    config = LLMQuestions(url="http://llm/v1", model="m", passages=50, roundtrip_k=1, api_key_env="")
    script = ScriptedLLM()
    labelled = [QAItem(id="q1", question="When was the Pellam lamp first lit?", golden_answers=["1852"]),
                QAItem(id="q2", question="Who dug the canal near Ostrand?", passage_ids=["copy"],
                       golden_answers=["by hand"])]
    _, info = question_file(tmp_path, retriever, config, labelled=labelled, progress=False,
                            llm=client(script, config))
    assert info["few_shot"] == "labelled"
    turns = script.requests[0]["messages"]
    shown = [json.loads(m["content"]) for m in turns if m["role"] == "assistant"]
    assert {s["question"] for s in shown} == {q.question for q in labelled}
    assert {"1852", "by hand"} == {s["answer"] for s in shown}
    assert not any(s["question"] in {q for q, *_ in GENERIC_EXAMPLES} for s in shown)


def year_questions(request: httpx.Request) -> httpx.Response:
    """A stand-in LLM for a training run: for a passage naming a year, "when ... <title>?" answered by that year."""
    import re

    passage = json.loads(request.content)["messages"][-1]["content"]
    title = re.search(r"\(from: (.*?)\)", passage)
    year = re.search(r"\b(1[5-9]\d\d|20\d\d)\b", passage.split("\n", 1)[-1])
    reply = json.dumps({"question": f"In which year is {title.group(1)} dated?", "answer": year.group(1)}) \
        if title and year else "no year here"
    return httpx.Response(200, json={"choices": [{"message": {"content": reply}, "finish_reason": "stop"}]})


def test_with_labelled_questions_the_llms_questions_join_training_only_and_never_the_evaluation(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.trainer.cli import main
    from tests.unit.test_trainer_compact import user_files

    def scripted(self: LLMQuestions) -> OpenAIChatClient:
        return OpenAIChatClient(LLMSettings(base_url=self.url, model=self.model, max_retries=0),
                                transport=httpx.MockTransport(year_questions))

    monkeypatch.setattr(LLMQuestions, "client", scripted)
    corpus, qa = user_files(data_dir, tmp_path / "mine", distractors=200)
    out = tmp_path / "run"
    main(["compact", "--corpus", str(corpus), "--qa", str(qa), "--llm-url", "http://my-llm/v1", "--llm-model", "mine",
          "--llm-questions", "150", "--no-dense", "--warm-epochs", "1", "--steps", "2", "--questions-per-step", "2",
          "--group", "2", "--out", str(out), "--var-dir", str(tmp_path / "var"), "--quiet"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    written = [json.loads(line) for line in (out / QUESTIONS_FILE).read_text().splitlines()]
    info = json.loads((out / INFO_FILE).read_text())
    assert written and len(written) == info["kept"] and info["few_shot"] == "labelled"
    split = json.loads((out / "split.json").read_text())
    every = set(split["train"] + split["dev"] + split["eval"])
    assert every.isdisjoint(r["id"] for r in written)  # never split: not in RL-dev, not evaluated on
    manifest = CompactPolicy.load(Path(result["policy"])).manifest
    assert manifest["trained_on"]["llm"] == len(written) and manifest["trained_on"]["labelled"] == len(split["train"])
    assert manifest["llm_questions"]["evaluated_on"] == "never" and manifest["llm_questions"]["model"] == "mine"
    assert manifest["evaluation"]["questions"] == "labelled"
    assert manifest["evaluation"]["bench"]["all"]["n"] == split["sizes"]["eval"]
    assert manifest["llm_questions"]["refused"] == info["refused"]
    assert f"{len(written)} questions written by your LLM (mine; training only)" in manifest["rows"]


def test_without_labelled_questions_the_run_says_it_has_no_real_evaluation_and_is_not_served(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.searcher.corpus_check import evaluated_here
    from plugsearch.trainer.cli import main
    from tests.unit.test_trainer_compact import wiki_corpus

    def scripted(self: LLMQuestions) -> OpenAIChatClient:
        return OpenAIChatClient(LLMSettings(base_url=self.url, model=self.model, max_retries=0),
                                transport=httpx.MockTransport(year_questions))

    monkeypatch.setattr(LLMQuestions, "client", scripted)
    corpus = wiki_corpus(data_dir, tmp_path / "docs.jsonl", n=1500)
    out = tmp_path / "run"
    main(["compact", "--corpus", str(corpus), "--llm-url", "http://my-llm/v1", "--llm-questions", "400",
          "--no-dense", "--warm-epochs", "1", "--steps", "2", "--questions-per-step", "2", "--group", "2",
          "--out", str(out), "--var-dir", str(tmp_path / "var"), "--quiet"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not (out / "pseudo_questions.jsonl").exists()  # the LLM's questions replace the made-up cloze ones
    assert result["serve"].startswith("not known: no real evaluation")
    manifest = CompactPolicy.load(Path(result["policy"])).manifest
    assert manifest["evaluation"]["questions"] == "llm"
    assert "no real evaluation" in manifest["llm_questions"]["evaluated_on"]
    assert manifest["trained_on"]["llm"] == len(json.loads((out / "split.json").read_text())["train"])
    assert evaluated_here(manifest, manifest["corpus"]["sha256"]) is False  # the searcher does not serve it as is
    assert "**Which to serve**: not known: no real evaluation" in (out / "report" / "report.md").read_text()
