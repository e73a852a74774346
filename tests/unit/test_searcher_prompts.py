"""Prompt sets: the packaged one, a user folder (SEARCHER_PROMPTS_DIR) checked at start-up, in the transcript
and in the cache key."""

from __future__ import annotations

from pathlib import Path

import pytest

from plugsearch.common.schemas.searcher import SearchParams, SearchRequest
from plugsearch.searcher.prompts import PROMPT_VERSION, VARIABLES, PromptError, PromptSet
from plugsearch.searcher.serving import SearchService
from plugsearch.searcher.settings import SearcherSettings
from tests.support.chat_policy import chat as chat_policy
from tests.support.chat_policy import run_search
from tests.unit.test_searcher_loop import FakeRetriever, ScriptedPolicy, s3


def test_packaged_set_has_every_template_and_a_stable_version() -> None:
    packaged = PromptSet.packaged()
    assert set(packaged.texts) == set(VARIABLES)
    assert packaged.version == PROMPT_VERSION == PromptSet.load(None).version
    assert "at most 3 documents" in packaged.render("s3", "system", select_k=3)


async def test_a_folder_overrides_templates_and_the_loop_uses_them(tmp_path: Path) -> None:
    (tmp_path / "s3.system.txt").write_text("Select up to $select_k ids. Costs $$5.")
    (tmp_path / "VERSION").write_text("trained-v3\n")
    prompts = PromptSet.load(tmp_path)
    assert prompts.version.startswith("trained-v3-") and prompts.version != PROMPT_VERSION
    assert prompts.texts["s3.initial"] == PromptSet.packaged().texts["s3.initial"]  # the rest: packaged
    policy = ScriptedPolicy([s3(ids="[1]", complete=True)])
    out = await run_search("q", SearchParams(select_k=2), policy=policy, retriever=FakeRetriever(), prompts=prompts)
    assert policy.calls[0]["messages"][0].content == "Select up to 2 ids. Costs $5."
    assert out.prompt_version == prompts.version


@pytest.mark.parametrize("name, text, needle", [
    ("s3.system.txt", "Mark $select_k of $question", "$question"),
    ("s3.invalid.txt", "bad $", "literal"),
    ("s3.nonsense.txt", "x", "unknown template"),
])
def test_bad_folders_are_refused_at_start_up(tmp_path: Path, name: str, text: str, needle: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(PromptError, match=needle.replace("$", r"\$")):
        PromptSet.load(tmp_path)
    with pytest.raises(ValueError, match=needle.replace("$", r"\$")):
        SearcherSettings(prompts_dir=tmp_path)


def test_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        SearcherSettings(prompts_dir=tmp_path / "nope")


def test_prompt_folder_is_part_of_the_cache_key(tmp_path: Path) -> None:
    (tmp_path / "s3.system.txt").write_text("Other prompt, $select_k.")
    policy, retriever = chat_policy(ScriptedPolicy([])), FakeRetriever()
    default = SearchService(SearcherSettings(), policy=policy, retriever=retriever)
    custom = SearchService(SearcherSettings(prompts_dir=tmp_path), policy=policy, retriever=retriever)
    params = default.params_for(SearchRequest(question="q"))
    assert default.key("q", params) != custom.key("q", params)
