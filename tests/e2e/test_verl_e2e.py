"""veRL's rollout and reward on real local services (Redis, the BM25 retriever service, the generator and
judge services on the real llama.cpp SmolLM2 server): the agent loop retrieves through the retriever
service and returns the documents `POST /search`'s loop returns for the same policy outputs, and the
reward scores them through the generator and judge. The policy is scripted at veRL's server-manager
interface (no GPU, no veRL needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from plugsearch.common.clients import RetrieverClient
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.trainer.common.localstack import LocalServices
from plugsearch.trainer.verl import reward
from plugsearch.trainer.verl.agent_loop import OUTCOME_FIELD
from tests.e2e.test_trainer_e2e import stack  # noqa: F401 - fixture: the local services
from tests.support.chat_policy import run_search
from tests.unit.test_searcher_loop import ScriptedPolicy, s3
from tests.unit.test_trainer_verl import (
    SEARCH,
    FakeServerManager,
    agent_loop,
    row,
    run,
    tokenizer,  # noqa: F401 - fixture: SmolLM2's tokenizer
)

pytestmark = [pytest.mark.e2e]

QUESTION = "who got the first nobel prize in physics"
GOLD = ["Wilhelm Conrad Röntgen"]
SCRIPT = [s3("Wilhelm Röntgen Nobel Prize", ids="[2]"), s3(ids="[1]", complete=True)]


async def test_verl_episode_and_reward_through_the_services(stack: LocalServices, tokenizer: Any,  # noqa: F811
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = stack.settings()
    for key, value in {"TRAINER_RETRIEVER__URL": settings.retriever.url,
                       "TRAINER_GENERATOR__URL": settings.generator.url, "TRAINER_JUDGE__URL": settings.judge.url,
                       "TRAINER_REDIS_URL": settings.redis_url or "", "TRAINER_VAR_DIR": str(tmp_path),
                       "TRAINER_REWARD": "genacc"}.items():
        monkeypatch.setenv(key, value)

    params = {**SEARCH, "retrieve_k": 3}
    output = await run(agent_loop(tokenizer, FakeServerManager(tokenizer, SCRIPT), search=params,
                                  retriever="service"), question=QUESTION)
    documents = output.extra_fields[OUTCOME_FIELD]["documents"]
    assert len(documents) == 2 and output.extra_fields[OUTCOME_FIELD]["stop_reason"] == "complete"

    from plugsearch.common.schemas.searcher import SearchParams

    retriever = ServiceRetriever(RetrieverClient(settings.retriever))
    try:
        service = await run_search(QUESTION, SearchParams(**params), policy=ScriptedPolicy(SCRIPT), retriever=retriever)
    finally:
        await retriever.client.aclose()
    assert [d.id for d in service.documents] == [d["id"] for d in documents]

    fields = row(QUESTION)
    scored = await reward.compute_score("nq", "", GOLD, {**fields["extra_info"], **output.extra_fields})
    assert scored["documents"] == 2.0 and scored["score"] in (0.0, 1.0) and scored["genacc"] == scored["score"]
