"""The retriever's documents API as a user meets it: a costly PDF refused at its CPU budget or stopped with its
request while other writes go on, a 2 MB text cut while searches are answered, the served documents listed with
their content hashes, a delete that counts what it removed, one rule for every text field, and no answer from
before an acknowledged change (the searcher's cache, and a second worker)."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path

import httpx
import pytest

from plugsearch.common.cache import MemoryCache, ResultCache
from plugsearch.common.clients import RetrieverClient
from plugsearch.common.http import ClientSettings
from plugsearch.common.schemas.searcher import SearchRequest
from plugsearch.retriever.api import create_app
from plugsearch.retriever.ingest.passages import numbered, passages_hash
from plugsearch.retriever.ingest.pool import ParseLimits
from plugsearch.searcher.index_identity import IndexIdentity
from plugsearch.searcher.policy import ChatPolicy
from plugsearch.searcher.retrieval import ServiceRetriever
from plugsearch.searcher.serving import SearchService
from plugsearch.searcher.settings import SearcherSettings
from tests.asgi import app_client
from tests.support.chat_policy import NoPolicy
from tests.support.pdfs import shared_stream_pdf
from tests.support.retriever import tiny_bm25s, tiny_settings
from tests.unit.test_live_changes import wait_ready

TOKEN = "internal-token-123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("documents"))


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def pool_workers() -> set[int]:
    """The parse pool's worker processes that are children of this process."""
    import os

    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            status = (proc / "status").read_text()
        except OSError:
            continue
        if b"plugsearch.retriever.ingest.pool" in cmdline and f"PPid:\t{os.getpid()}\n" in status \
                and "State:\tZ" not in status:
            found.add(int(proc.name))
    return found


async def until(condition: object, timeout_s: float = 30.0) -> None:
    """Wait until `condition()` holds (a test's polling, bounded)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


async def top_ids(client: httpx.AsyncClient, query: str, k: int = 3) -> list[str]:
    found = await client.post("/retrieve", json={"queries": [query], "k": k}, headers=AUTH)
    assert found.status_code == 200, found.text
    return [d["id"] for d in found.json()["results"][0]]


async def test_a_costly_pdf_is_refused_at_its_budget_while_other_writes_go_on(tiny: tuple[Path, Path],
                                                                              tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             parse=ParseLimits(workers=2, cpu_s=4.0, cpu_s_per_mb=0.0))
    bomb = shared_stream_pdf(300)  # 60 KB, a minute of CPU to read whole
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        upload = asyncio.create_task(client.post("/documents/files", headers=AUTH, json={"files": [
            {"name": "manual.pdf", "content_base64": b64(bomb)}]}))
        pool = client._transport.app.state.parse_pool  # type: ignore[attr-defined]
        await until(lambda: pool.busy)
        # meanwhile: a document put as text (cut by the pool's other worker), one put ready-cut, one deleted
        put = await client.put("/documents", headers=AUTH, json={"documents": [
            {"id": "memo", "title": "Memo", "text": "The quorvex audit starts on Monday."},
            {"id": "note", "passages": [{"title": "Note", "text": "Bring the zantrel ledgers."}]}]})
        assert put.status_code == 200, put.text
        deleted = await client.post("/documents/delete", headers=AUTH, json={"ids": ["note"]})
        assert deleted.status_code == 200 and deleted.json()["passages"] == 1
        assert not upload.done()  # the PDF is still being read: the other writes did not wait for it
        assert await top_ids(client, "quorvex audit", 1) == ["memo#0"]
        answer = await upload
        assert answer.status_code == 422, answer.text
        assert "manual.pdf: over its CPU budget of 4 s" in answer.json()["error"]["message"]


async def test_a_request_that_times_out_stops_its_pdf_worker(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             request_timeout_s=2.0, parse=ParseLimits(workers=1, cpu_s=600.0, max_cpu_s=600.0))
    bomb = shared_stream_pdf(300)
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        upload = asyncio.create_task(client.post("/documents/files", headers=AUTH, json={"files": [
            {"name": "manual.pdf", "content_base64": b64(bomb)}]}))
        pool = client._transport.app.state.parse_pool  # type: ignore[attr-defined]
        await until(lambda: pool.busy)
        await asyncio.sleep(0.5)
        reading = pool_workers()
        assert len(reading) == 1
        answer = await upload
        assert answer.status_code == 504 and answer.json()["error"]["type"] == "deadline_exceeded"
        for _ in range(100):  # its worker is killed with the request, not left burning CPU for minutes
            if not reading & pool_workers():
                break
            await asyncio.sleep(0.05)
        assert not reading & pool_workers() and pool.busy == 0
        again = await client.post("/documents/files", headers=AUTH, json={"files": [
            {"name": "note.txt", "content_base64": b64("The trellick note is short.")}]})
        assert again.status_code == 200 and again.json()["files"][0]["status"] == "put"  # a new worker reads


async def test_past_the_pool_queue_a_request_is_a_429_and_its_other_files_stop(tiny: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             parse=ParseLimits(workers=1, queue=0, cpu_s=600.0, max_cpu_s=600.0))
    bomb = b64(shared_stream_pdf(300))
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        answer = await client.post("/documents/files", headers=AUTH, json={"files": [
            {"name": f"manual-{n}.pdf", "content_base64": bomb} for n in range(3)]})
        assert answer.status_code == 429 and answer.headers["retry-after"]
        pool = client._transport.app.state.parse_pool  # type: ignore[attr-defined]
        await until(lambda: not pool.busy and not pool_workers(), 20)  # the file that was being read: stopped
        assert (await client.get("/version")).json()["details"]["changes"]["seq"] == 0


async def test_a_2_mb_text_is_cut_in_the_pool_while_searches_are_answered(tiny: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             max_body_bytes=4 << 20)
    text = " ".join(f"Sentence {n} tells of the vembrook valley and its {n % 97} mills." for n in range(32_000))
    assert len(text) > 1_950_000  # ~2 MB: about the most one document's text may hold (MAX_DOCUMENT_CHARS)
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        pool = client._transport.app.state.parse_pool  # type: ignore[attr-defined]
        put = asyncio.create_task(client.put("/documents", headers=AUTH, json={"documents": [
            {"id": "valley", "title": "Vembrook", "text": text}]}))
        await until(lambda: pool.busy)
        searched = 0
        while pool.busy and searched < 5:  # the cut runs in a worker process: searches are answered meanwhile
            assert await top_ids(client, "who wrote the novel", 3)
            searched += 0 if put.done() else 1  # answered while the put was still waiting on the cut
        assert searched >= 1
        answer = await put
        assert answer.status_code == 200 and answer.json()["passages"] > 2_000
        assert pool.stats.jobs == 1


async def test_the_listing_holds_each_served_document_with_its_content_hash_and_a_delete_counts(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             api_keys="search-key-123456")
    long = " ".join(f"Part {n} of the kelvar report covers {n} sites." for n in range(60))
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        base = (await client.get("/documents", params={"limit": 5}, headers=AUTH)).json()
        assert len(base["documents"]) == 5 and base["next"] == base["documents"][-1]["id"]
        refused = await client.get("/documents", headers={"Authorization": "Bearer search-key-123456"})
        assert refused.status_code == 403
        files = [{"name": "docs/kelvar report.txt", "content_base64": b64(long)},
                 {"name": "docs/été/notes.md", "content_base64": b64("# Notes\n\nThe \ufb01rst note.")}]
        put = (await client.post("/documents/files", headers=AUTH, json={"files": files, "words": 30})).json()
        hashes = {f["id"]: f["sha256"] for f in put["files"]}
        listed = (await client.get("/documents", params={"prefix": "docs/"}, headers=AUTH)).json()
        assert [(d["id"], d["sha256"]) for d in listed["documents"]] == sorted(hashes.items())
        assert listed["next"] is None and listed["index_id"].endswith("-c1")
        kelvar = next(d for d in listed["documents"] if d["id"] == "docs/kelvar report.txt")
        assert kelvar["passages"] > 5
        first = (await client.post("/retrieve", json={"queries": ["first note"], "k": 1}, headers=AUTH)).json()
        assert first["results"][0][0]["text"] == "The first note."  # the ligature read as letters
        put_text = await client.put("/documents", headers=AUTH, json={"documents": [
            {"id": "memo", "title": "Memo", "passages": [{"text": "One."}, {"text": "Two."}]}]})
        assert put_text.status_code == 200
        memo = (await client.get("/documents", params={"prefix": "memo"}, headers=AUTH)).json()["documents"]
        assert memo == [{"id": "memo", "passages": 2,
                         "sha256": passages_hash(numbered("memo", [("Memo", "One."), ("Memo", "Two.")]))}]
        gone = await client.post("/documents/delete", headers=AUTH,
                                 json={"ids": ["docs/kelvar report.txt", "memo", "never-served", base["documents"][0]["id"]]})
        assert gone.status_code == 200
        assert gone.json()["passages"] == kelvar["passages"] + 2 + base["documents"][0]["passages"]
        after = (await client.get("/documents", params={"prefix": "docs/"}, headers=AUTH)).json()["documents"]
        assert [d["id"] for d in after] == ["docs/été/notes.md"]
        first_page = (await client.get("/documents", params={"limit": 5}, headers=AUTH)).json()["documents"]
        assert base["documents"][0]["id"] not in [d["id"] for d in first_page]


async def test_a_lone_surrogate_is_a_422_in_every_text_field(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN)
    bad = "a\ud800b"
    bodies = [
        ("PUT", "/documents", {"documents": [{"id": "x", "text": bad}]}),
        ("PUT", "/documents", {"documents": [{"id": "x", "title": bad, "text": "ok"}]}),
        ("PUT", "/documents", {"documents": [{"id": bad, "text": "ok"}]}),
        ("PUT", "/documents", {"documents": [{"id": "x", "passages": [{"text": bad}]}]}),
        ("POST", "/documents/files", {"files": [{"name": "a.txt", "content_base64": b64("ok"), "title": bad}]}),
        ("POST", "/documents/files", {"files": [{"name": bad + ".txt", "content_base64": b64("ok")}]}),
        ("POST", "/documents/delete", {"ids": [bad]}),
        ("POST", "/retrieve", {"queries": [bad]}),
        ("POST", "/searchr1/retrieve", {"queries": [bad]}),
    ]
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        for method, path, body in bodies:
            import json

            raw = json.dumps(body).encode()  # the JSON escape \ud800, as a client that sends it writes it
            answer = await client.request(method, path, content=raw, headers={**AUTH, "Content-Type": "application/json"})
            assert answer.status_code == 422, (path, body, answer.text)
            assert answer.json()["error"]["type"] == "validation_error"
        assert (await client.get("/version")).json()["details"]["changes"]["seq"] == 0


async def test_no_cached_search_holds_a_document_deleted_by_an_acknowledged_change(tiny: tuple[Path, Path],
                                                                                    tmp_path: Path) -> None:
    """The real searcher service (cache on, identity read as the searcher reads it) over the real retriever."""
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN)
    app = create_app(settings)
    async with app_client(app) as retriever:
        await wait_ready(retriever, TOKEN)
        assert (await retriever.put("/documents", headers=AUTH, json={"documents": [
            {"id": "orbital", "title": "Orbital", "text": "The plinthor orbital station has nine docks."}]})
                ).status_code == 200
        client = RetrieverClient(ClientSettings(url="http://retriever", max_retries=0, token=TOKEN),
                                 transport=httpx.ASGITransport(app=app))
        service = SearchService(SearcherSettings(index_id_ttl_s=3600), policy=ChatPolicy(NoPolicy()),  # type: ignore[arg-type]
                                retriever=ServiceRetriever(client), cache=ResultCache(MemoryCache(), name="search"),
                                index_identity=IndexIdentity(client, ttl_s=3600))
        request = SearchRequest(question="plinthor orbital station docks", mode="naive", retrieve_k=3)
        try:
            first = await service.search(await service.prepare(request))
            again = await service.search(await service.prepare(request))
            assert first.documents[0].id == "orbital#0" and again.cached
            deleted = await retriever.post("/documents/delete", headers=AUTH, json={"ids": ["orbital"]})
            assert deleted.status_code == 200  # acknowledged: from now on no answer holds it
            after = await service.search(await service.prepare(request))
            assert not after.cached and "orbital#0" not in [d.id for d in after.documents]
            assert (await service.search(await service.prepare(request))).cached  # cached again, for the new index
        finally:
            await client.aclose()


async def test_a_second_worker_answers_from_every_acknowledged_change(tiny: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """Two workers on one change log (two apps here), neither reading it on its own for a minute: a change
    acknowledged by one is in the other's `/index` and searches at once."""
    one, two = (create_app(tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                                         workers=2, changes_poll_s=60)) for _ in range(2))
    async with app_client(one) as first, app_client(two) as second:
        await wait_ready(first, TOKEN)
        await wait_ready(second, TOKEN)
        assert (await second.get("/index", headers=AUTH)).json() == (await first.get("/index", headers=AUTH)).json()
        put = await first.put("/documents", headers=AUTH, json={"documents": [
            {"id": "glacier", "text": "The quenmark glacier retreats each summer."}]})
        assert put.status_code == 200
        assert (await second.get("/index", headers=AUTH)).json() == {"index_id": put.json()["index_id"], "seq": 1}
        assert await top_ids(second, "quenmark glacier", 1) == ["glacier#0"]
        assert (await first.post("/documents/delete", headers=AUTH, json={"ids": ["glacier"]})).status_code == 200
        assert "glacier#0" not in await top_ids(second, "quenmark glacier", 3)
