"""Marks from use, on the real searcher app in-process (scripted policy LLM, fake retriever app:
`tests.api.test_searcher_api.Stack`), each test with its own SQLite file:

- every answer has its own `search_id` (JSON, the stream's `result` event, a cache hit, each batch item), and the
  store keeps what a mark needs (question, returned ids and titles, mode, policy model, who searched: never the
  key itself);
- `POST /feedback`: a key marks its own searches (403 for another key's; an admin key and the internal token mark
  any), a second mark replaces the first, ids the search did not return are 422 and named, an unknown or expired id
  is 404, too much is 422, a spent budget 429, all in the one error envelope; a 200 is on disk;
- `GET /feedback`: a key reads its own marks, an admin key every key's, paged and filtered by time;
- off (409) and a store that cannot open (503, searches go on without ids);
- the public client's `feedback` / `marks`.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import plugsearch
from plugsearch import AsyncSearchClient
from plugsearch.common.schemas.feedback import SEARCH_ID_PATTERN
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client, served_in_thread

KEY_A = "feedback-key-aaaa-0001"
KEY_B = "feedback-key-bbbb-0002"
ADMIN = "feedback-admin-cccc-0003"
INTERNAL = "feedback-internal-dddd-0004"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture()
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    s = Stack(api_keys=f"{KEY_A},{KEY_B}", admin_keys=ADMIN, internal_token=INTERNAL,
              feedback_db=tmp_path / "feedback.sqlite3")
    yield s
    await s.aclose()


async def search(client: httpx.AsyncClient, key: str, question: str = Q, **body: Any) -> dict[str, Any]:
    response = await client.post("/search", json={"question": question, "mode": "naive", **body}, headers=auth(key))
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["request_id"] == response.headers["x-request-id"]
    return error


async def test_every_answer_has_its_own_id_and_the_store_keeps_what_a_mark_needs(stack: Stack, tmp_path: Path
                                                                                ) -> None:
    async with app_client(stack.app) as client:
        first = await search(client, KEY_A)
        again = await search(client, KEY_A)  # the same search: a cache hit, a fresh id
        s3 = await search(client, KEY_A, mode="s3", max_turns=1)
        batch = (await client.post("/search/batch", headers=auth(KEY_B), json={"items": [
            {"question": "first question", "mode": "naive"}, {"question": "second question", "mode": "naive"}]}
        )).json()["results"]
        events = (await client.post("/search", headers=auth(KEY_A),
                                    json={"question": "streamed", "mode": "s3", "stream": True})).text
        await asyncio.to_thread(stack.app.state.service.feedback.store.writer.flush)
    assert again["cached"] and again["documents"] == first["documents"]
    result = [block for block in events.split("\n\n") if block.startswith("event: result")]
    assert len(result) == 1
    streamed = plugsearch.SearchResponse.model_validate_json(result[0].split("data: ", 1)[1])
    ids = [first["search_id"], again["search_id"], s3["search_id"], *(r["search_id"] for r in batch),
           streamed.search_id]
    assert all(isinstance(i, str) and re.fullmatch(SEARCH_ID_PATTERN, i) for i in ids), ids
    assert len(set(ids)) == len(ids)
    with sqlite3.connect(tmp_path / "feedback.sqlite3") as db:
        rows = {r[0]: r[1:] for r in db.execute("SELECT search_id, owner, question, mode, policy_model, documents "
                                                "FROM searches")}
        raw = b"".join(p.read_bytes() for p in sorted(tmp_path.glob("feedback.sqlite3*")))  # noqa: ASYNC240
    assert set(rows) == set(ids)
    owner, question, mode, model, documents = rows[s3["search_id"]]
    assert (question, mode, model) == (Q, "s3", "fake-policy") and owner.startswith("key:")
    assert json.loads(documents) == [[d["id"], d["title"]] for d in s3["documents"]]  # ids and titles, no text
    assert rows[batch[1]["search_id"]][0] != owner  # the other key's
    assert all(key.encode() not in raw for key in (KEY_A, KEY_B, ADMIN, INTERNAL))  # key ids, never keys


async def test_a_key_marks_its_own_searches_and_a_second_mark_replaces_the_first(stack: Stack,
                                                                                tmp_path: Path) -> None:
    async with app_client(stack.app) as client:
        found = await search(client, KEY_A)
        sid, docs = found["search_id"], [d["id"] for d in found["documents"]]
        marked = await client.post("/feedback", headers=auth(KEY_A), json={
            "search_id": sid, "helpful": [docs[0], docs[0]], "not_helpful": [docs[3]], "answer": "Jack London"})
        assert marked.status_code == 200, marked.text
        assert marked.json()["helpful"] == [docs[0]] and not marked.json()["replaced"]
        # what a 200 says is on disk already: another connection reads it
        with sqlite3.connect(tmp_path / "feedback.sqlite3") as db:
            assert db.execute("SELECT helpful FROM marks WHERE search_id = ?", (sid,)).fetchone() == (f'["{docs[0]}"]',)
        again = (await client.post("/feedback", headers=auth(KEY_A), json={
            "search_id": sid, "helpful": [docs[1]], "comment": "the second one"})).json()
        assert again["replaced"] and again["helpful"] == [docs[1]] and again["not_helpful"] == []
        other = error_of(await client.post("/feedback", headers=auth(KEY_B), json={
            "search_id": sid, "helpful": [docs[2]]}), 403)
        assert other["type"] == "forbidden" and "own searches" in other["message"]
        for key in (ADMIN, INTERNAL):  # an admin key and the internal token may mark any search
            response = await client.post("/feedback", headers=auth(key), json={"search_id": sid, "helpful": [docs[2]]})
            assert response.status_code == 200 and response.json()["replaced"], response.text
        page = (await client.get("/feedback", headers=auth(KEY_A))).json()
    assert len(page["marks"]) == 1 and page["next_after"] is None
    record = page["marks"][0]
    assert record["search_id"] == sid and record["helpful"] == [docs[2]] and record["question"] == Q
    assert record["answer"] is None and record["comment"] is None  # replaced whole, by the internal token's mark
    assert [d["id"] for d in record["documents"]] == docs and record["mode"] == "naive"


async def test_bad_marks_are_refused_in_the_error_envelope(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        found = await search(client, KEY_A)
        sid, docs = found["search_id"], [d["id"] for d in found["documents"]]

        async def mark(body: dict[str, Any], status: int) -> dict[str, Any]:
            return error_of(await client.post("/feedback", headers=auth(KEY_A), json=body), status)

        unknown = await mark({"search_id": sid, "helpful": [docs[0], "made-up-1"], "not_helpful": ["made-up-2"]}, 422)
        assert unknown["param"] == "helpful" and "made-up-1" in unknown["message"] and docs[0] not in unknown["message"]
        nothing = await mark({"search_id": sid}, 422)
        assert "mark at least one document" in nothing["message"]
        both = await mark({"search_id": sid, "helpful": [docs[0]], "not_helpful": [docs[0]]}, 422)
        assert "both helpful and not helpful" in both["message"]
        assert (await mark({"search_id": sid, "helpful": [docs[0]], "comment": "x" * 2001}, 422))["param"] == "comment"
        assert (await mark({"search_id": sid, "helpful": ["d"] * 257}, 422))["param"] == "helpful"
        assert (await mark({"search_id": sid, "helpful": [docs[0]], "rating": 5}, 422))["param"] == "rating"
        assert (await mark({"search_id": "not an id!", "helpful": [docs[0]]}, 422))["param"] == "search_id"
        t0 = time.monotonic()
        missing = await mark({"search_id": "A" * 22, "helpful": [docs[0]]}, 404)
        assert missing["type"] == "not_found" and "unknown search_id" in missing["message"]
        assert time.monotonic() - t0 < 10
        assert (await client.post("/feedback", headers={"Content-Type": "application/json"},
                                  content=b"{")).status_code == 401  # no key: the guard first
        bad_json = error_of(await client.post("/feedback", headers={**auth(KEY_A), "Content-Type": "application/json"},
                                              content=b"{"), 400)
        assert bad_json["type"] == "invalid_json"
        for query in ("limit=0", "limit=501", "after=-1", "since=abc", "colour=red"):
            assert error_of(await client.get(f"/feedback?{query}", headers=auth(KEY_A)), 422)["type"] == \
                "validation_error"


async def test_a_search_past_its_marking_window_is_404(tmp_path: Path) -> None:
    s = Stack(feedback_db=tmp_path / "f.sqlite3", feedback_search_ttl_s=0.2)
    try:
        async with app_client(s.app) as client:
            found = (await client.post("/search", json={"question": Q, "mode": "naive"})).json()
            await asyncio.sleep(0.4)
            expired = error_of(await client.post("/feedback", json={
                "search_id": found["search_id"], "helpful": [found["documents"][0]["id"]]}), 404)
    finally:
        await s.aclose()
    assert "marking window" in expired["message"]


async def test_marks_are_read_by_their_key_every_keys_by_an_admin_paged_and_by_time(stack: Stack) -> None:
    async with app_client(stack.app) as client:
        mine, theirs = [], []
        for i in range(3):
            for key, kept in ((KEY_A, mine), (KEY_B, theirs)):
                found = await search(client, key, f"question {i} of {key[-4:]}")
                response = await client.post("/feedback", headers=auth(key), json={
                    "search_id": found["search_id"], "helpful": [found["documents"][i]["id"]]})
                assert response.status_code == 200, response.text
                kept.append(found["search_id"])
        between = time.time()
        late = await search(client, KEY_A, "a late question")
        await client.post("/feedback", headers=auth(KEY_A), json={"search_id": late["search_id"],
                                                                 "not_helpful": [late["documents"][0]["id"]]})
        own = (await client.get("/feedback", headers=auth(KEY_A))).json()["marks"]
        other = (await client.get("/feedback", headers=auth(KEY_B))).json()["marks"]
        pages, after = [], 0
        while True:
            page = (await client.get(f"/feedback?limit=2&after={after}", headers=auth(ADMIN))).json()
            pages.append([m["search_id"] for m in page["marks"]])
            if page["next_after"] is None:
                break
            after = page["next_after"]
        recent = (await client.get(f"/feedback?since={between}", headers=auth(INTERNAL))).json()["marks"]
    assert [m["search_id"] for m in own] == [*mine, late["search_id"]]
    assert [m["search_id"] for m in other] == theirs
    assert {m["owner"] for m in own} != {m["owner"] for m in other}
    everything = [sid for page in pages for sid in page]
    assert sorted(everything) == sorted([*mine, *theirs, late["search_id"]]) and len(pages) == 4
    assert [m["search_id"] for m in recent] == [late["search_id"]]


async def test_marking_spends_the_keys_budget(tmp_path: Path) -> None:
    s = Stack(api_keys=KEY_A, feedback_db=tmp_path / "f.sqlite3", rate_limit_per_s=0.01, rate_limit_burst=4,
              max_request_cost=4)
    try:
        async with app_client(s.app) as client:
            found = await search(client, KEY_A)  # one unit
            statuses = []
            for _ in range(4):
                response = await client.post("/feedback", headers=auth(KEY_A), json={
                    "search_id": found["search_id"], "helpful": [found["documents"][0]["id"]]})
                statuses.append(response.status_code)
            assert statuses[:3] == [200, 200, 200] and statuses[3] == 429
            assert error_of(response, 429)["type"] == "rate_limited" and int(response.headers["retry-after"]) >= 1
    finally:
        await s.aclose()


async def test_off_and_unusable_stores_are_said_and_searches_go_on(tmp_path: Path) -> None:
    off = Stack(feedback="off", feedback_db=tmp_path / "never.sqlite3")
    folder = tmp_path / "a-folder.sqlite3"
    folder.mkdir()  # a folder where the file should be: it cannot be opened
    broken = Stack(feedback_db=folder)
    try:
        async with app_client(off.app) as client:
            found = (await client.post("/search", json={"question": Q, "mode": "naive"})).json()
            assert found["search_id"] is None
            error = error_of(await client.post("/feedback", json={"search_id": "A" * 22, "helpful": ["x"]}), 409)
            assert "SEARCHER_FEEDBACK=off" in error["message"]
            assert error_of(await client.get("/feedback"), 409)["type"] == "conflict"
            assert (await client.get("/version")).json()["details"]["feedback"]["state"] == "off"
        assert not (tmp_path / "never.sqlite3").exists()
        async with app_client(broken.app) as client:
            found = (await client.post("/search", json={"question": Q, "mode": "naive"})).json()
            assert found["search_id"] is None and found["documents"]
            response = await client.post("/feedback", json={"search_id": "A" * 22, "helpful": ["x"]})
            assert error_of(response, 503)["type"] == "not_ready" and response.headers["retry-after"]
            assert "could not be opened" in response.json()["error"]["message"]
            assert str(folder) not in response.text  # where the file is stays in the log
            assert (await client.get("/version")).json()["details"]["feedback"]["state"] == "unavailable"
    finally:
        await off.aclose()
        await broken.aclose()


async def test_the_public_client_marks_and_reads_marks(stack: Stack) -> None:
    transport = httpx.ASGITransport(app=stack.app)
    async with app_client(stack.app):
        async with AsyncSearchClient("http://searcher", api_key=KEY_A, transport=transport) as client:
            found = await client.search(Q, mode="naive", retrieve_k=3)
            assert found.search_id is not None
            marked = await client.feedback(found.search_id, helpful=[found.documents[1].id],
                                           not_helpful=[found.documents[0].id], answer="an answer")
            assert isinstance(marked, plugsearch.FeedbackResponse) and marked.helpful == [found.documents[1].id]
            with pytest.raises(plugsearch.ValidationFailed, match="not among the documents"):
                await client.feedback(found.search_id, helpful=["made-up"])
            with pytest.raises(plugsearch.BadRequest, match="mark at least one"):  # refused before the network
                await client.feedback(found.search_id)
            with pytest.raises(plugsearch.NotFound):
                await client.feedback("B" * 22, helpful=["x"])
            records = [r async for r in client.marks(page=1)]
            assert [(r.search_id, r.helpful, r.answer) for r in records] == [
                (found.search_id, [found.documents[1].id], "an answer")]
        async with AsyncSearchClient("http://searcher", api_key=KEY_B, transport=transport) as other:
            with pytest.raises(plugsearch.Forbidden):
                await other.feedback(found.search_id, helpful=[found.documents[0].id])
            assert [r async for r in other.marks()] == []


def test_export_from_a_running_searcher_reads_what_the_key_may(stack: Stack, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`plugsearch-feedback export --url`: every key's marks with an admin key, a plain key's own with it; the
    blocking client marks over a real socket."""
    from plugsearch import SearchClient
    from plugsearch.searcher.feedback.cli import main

    with served_in_thread(stack.app) as url:
        marked = {}
        for key in (KEY_A, KEY_B):
            with SearchClient(url, api_key=key, timeout=30) as client:
                found = client.search(f"a question of {key}", mode="naive", retrieve_k=4)
                assert found.search_id is not None
                client.feedback(found.search_id, helpful=[found.documents[2].id], not_helpful=[found.documents[0].id])
                marked[key] = found
        everyone, own = tmp_path / "everyone.jsonl", tmp_path / "own.jsonl"
        assert main(["export", "--url", url, "--api-key", ADMIN, "--out", str(everyone)]) == 0
        assert main(["export", "--url", url, "--api-key", KEY_B, "--out", str(own)]) == 0
        assert main(["stats", "--url", url, "--api-key", INTERNAL]) == 0
        stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert main(["export", "--url", url, "--api-key", "not-a-key-0000", "--out", str(own)]) == 2
        assert "missing or invalid API key" in capsys.readouterr().err
    rows = [json.loads(line) for line in everyone.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"feedback-{marked[k].search_id}" for k in (KEY_A, KEY_B)]
    assert rows[0] == {"id": f"feedback-{marked[KEY_A].search_id}", "question": f"a question of {KEY_A}",
                       "passage_ids": [marked[KEY_A].documents[2].id],
                       "negative_ids": [marked[KEY_A].documents[0].id], "source": "feedback"}
    assert [json.loads(line)["id"] for line in own.read_text().splitlines()] == [
        f"feedback-{marked[KEY_B].search_id}"]  # unchanged by the refused export: written whole or not at all
    assert stats["marks"] == 2 and stats["owners"] == 2 and stats["searches"] is None
