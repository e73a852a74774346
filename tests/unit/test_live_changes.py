"""Documents put and deleted while serving (`plugsearch.retriever.live.changelog`, `plugsearch.retriever.live.overlay`): the durable
log and its torn tail, the overlay over a real bm25s index and document store (a put passage found, a replaced
document's old passages and a deleted one's never), every worker's view through the log, and the API's rules
(who may change, what a search key gets)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from plugsearch.retriever.ingest.passages import Passage
from plugsearch.retriever.live.changelog import ChangeLog, ChangeNotWritten
from plugsearch.retriever.serving import RetrieverService, check_indexes
from tests.asgi import app_client
from tests.support.retriever import ensure_tiny_indexes, tiny_bm25s, tiny_settings


def passage(doc: str, n: int, text: str, title: str = "") -> Passage:
    return Passage(id=f"{doc}#{n}", doc_id=doc, title=title, text=text)


def test_the_log_keeps_acknowledged_changes_in_order_and_never_reuses_a_number(tmp_path: Path) -> None:
    log = ChangeLog(tmp_path)
    first = log.append([passage("a", 0, "alpha text")], [])
    second = log.append([], ["b"])
    assert (first.seq, second.seq) == (1, 2)
    again = ChangeLog(tmp_path)  # another worker, or a restart
    changes = again.read_after(0)
    assert [c.seq for c in changes] == [1, 2] and changes[0].put[0].text == "alpha text"
    assert changes[1].delete == ("b",) and again.read_after(1) == changes[1:] and again.epoch == log.epoch
    assert again.append([passage("c", 0, "gamma")], []).seq == 3
    assert [c.seq for c in log.read_after(0)] == [1, 2, 3]


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("live"))


def service(tiny: tuple[Path, Path], changes: Path) -> RetrieverService:
    settings = tiny_settings(*tiny, dense=False, changes_dir=changes)
    return RetrieverService.load(settings, check_indexes(settings))


def first_ids(svc: RetrieverService, query: str, k: int = 3) -> list[str]:
    hits = svc.batchers["bm25"].fn([query], k)
    return [doc for doc, _, _ in svc.corpus.documents([int(d) for d in hits.ids[0] if d >= 0])]


def test_put_replace_and_delete_are_searched_by_every_worker_whole(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    one, two = service(tiny, tmp_path), service(tiny, tmp_path)  # two workers, one log
    corpus_ids = [json.loads(line)["id"] for line in tiny[0].read_text().splitlines()]
    base_id = one.index_id
    victim = first_ids(one, "Big Stone Gap", 1)[0]
    assert victim in corpus_ids
    change = one.live.write([passage("zx-doc", 0, "Quorvexian turbines hum at dawn", "Quorvex"),  # type: ignore[union-attr]
                             passage("zx-doc", 1, "A second passage about quorvexian rotors")], [victim])
    epoch = one.live.epoch[:8]  # type: ignore[union-attr]
    assert change.seq == 1 and one.index_id == f"{base_id}-{epoch}-c1"
    assert first_ids(one, "quorvexian turbines", 2) == ["zx-doc#0", "zx-doc#1"]
    assert victim not in first_ids(one, "Big Stone Gap", 50)
    assert first_ids(two, "quorvexian turbines", 2) == []  # not yet read by the other worker
    assert two.live is not None and two.live.poll() == 1
    assert first_ids(two, "quorvexian turbines", 2) == ["zx-doc#0", "zx-doc#1"] and two.index_id == one.index_id
    # a document put again replaces all its passages
    one.live.write([passage("zx-doc", 0, "Now only about velzarine pumps")], [])  # type: ignore[union-attr]
    assert first_ids(one, "quorvexian", 5) == [] and first_ids(one, "velzarine", 5) == ["zx-doc#0"]
    one.live.write([], ["zx-doc"])  # type: ignore[union-attr]
    assert first_ids(one, "velzarine", 5) == []
    described = one.describe()
    assert {k: described["changes"][k] for k in ("seq", "added", "replaced", "deleted", "passages", "generation")} == \
        {"seq": 3, "added": 1, "replaced": 1, "deleted": 2, "passages": 5, "generation": 0}
    assert described["documents"] == len(corpus_ids) - 1
    # a restart replays the log: the same state
    again = service(tiny, tmp_path)
    assert again.index_id == one.index_id and first_ids(again, "velzarine", 5) == []
    assert victim not in first_ids(again, "Big Stone Gap", 50)
    sampled = json.loads(again.sample(len(corpus_ids) + 10, seed=1))
    assert sampled["total"] == len(corpus_ids) - 1 and victim not in {p["id"] for p in sampled["passages"]}


async def test_only_the_internal_token_or_an_admin_key_changes_documents(tiny: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    from plugsearch.retriever.api import create_app

    search_key, admin_key, token = "search-key-123456", "admin-key-1234567", "internal-token-123"
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path, api_keys=search_key, admin_keys=admin_key,
                             internal_token=token)
    doc = {"documents": [{"id": "memo-7", "title": "Memo", "text": "The plinthorax audit starts Monday. "
                          "It covers every plinthorax ledger."}]}
    client_app = create_app(settings)
    async with app_client(client_app) as client:
        await wait_ready(client, token)
        refused = await client.put("/documents", json=doc, headers={"Authorization": f"Bearer {search_key}"})
        assert refused.status_code == 403 and "search key" in refused.json()["error"]["message"]
        anonymous = await client.put("/documents", json=doc)
        assert anonymous.status_code == 401
        put = await client.put("/documents", json=doc, headers={"Authorization": f"Bearer {admin_key}"})
        assert put.status_code == 200, put.text
        assert put.json()["seq"] == 1 and put.json()["passages"] == 1
        found = await client.post("/retrieve", json={"queries": ["plinthorax audit"], "k": 1},
                                  headers={"Authorization": f"Bearer {search_key}"})
        assert [d["id"] for d in found.json()["results"][0]] == ["memo-7#0"]
        bad = await client.put("/documents", json={"documents": [{"id": "x", "text": "a", "passages": [{"text": "b"}]}]},
                               headers={"Authorization": f"Bearer {token}"})
        assert bad.status_code == 422
        binary = await client.put("/documents", json={"documents": [{"id": "x", "text": "a\u0000b"}]},
                                  headers={"Authorization": f"Bearer {token}"})
        assert binary.status_code == 422 and binary.json()["error"]["type"] == "validation_error"
        def disk_full(*_: object) -> None:
            raise ChangeNotWritten("database or disk is full")

        live = client_app.state.retriever.live
        real, live.log.append = live.log.append, disk_full
        full = await client.post("/documents/delete", json={"ids": ["memo-7"]},
                                 headers={"Authorization": f"Bearer {token}"})
        live.log.append = real
        assert full.status_code == 503 and "disk is full" in full.json()["error"]["message"]
        assert int(full.headers["Retry-After"]) > 0  # a client knows when to try again
        gone = await client.post("/documents/delete", json={"ids": ["memo-7"]},
                                 headers={"Authorization": f"Bearer {token}"})
        assert gone.status_code == 200 and gone.json()["seq"] == 2
        found = await client.post("/retrieve", json={"queries": ["plinthorax audit"], "k": 1},
                                  headers={"Authorization": f"Bearer {search_key}"})
        assert found.json()["results"][0] == [] or found.json()["results"][0][0]["id"] != "memo-7#0"
        version = (await client.get("/version")).json()
        assert version["details"]["changes"]["seq"] == 2
    off = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "off", changes="off", internal_token=token)
    async with app_client(create_app(off)) as client:
        await wait_ready(client, token)
        refused = await client.put("/documents", json=doc, headers={"Authorization": f"Bearer {token}"})
        assert refused.status_code == 409 and "RETRIEVER_CHANGES=off" in refused.json()["error"]["message"]


async def wait_ready(client: httpx.AsyncClient, token: str) -> None:
    import asyncio

    for _ in range(600):
        if (await client.get("/health/ready")).status_code == 200:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the retriever did not get ready")


def test_a_put_passage_is_found_by_dense_and_hybrid_search_too(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    """The writer encodes the passages put (as the base's were) and logs their vectors: every worker searches
    them by inner product beside the FAISS index, and hybrid fuses both."""
    import asyncio

    settings = tiny_settings(*tiny, changes_dir=tmp_path)
    ensure_tiny_indexes(settings, bm25=["bm25s"], dense=True)
    one = RetrieverService.load(settings, check_indexes(settings))
    one.live.write([passage("orchid-note", 0, "Orchids bloom in humid greenhouses every spring",  # type: ignore[union-attr]
                            "Greenhouse orchids")], [])
    ChangeLog(one.live.log.folder).append(  # type: ignore[union-attr]
        [passage("cactus-note", 0, "Cacti store water in thick stems through the dry desert summer")], [])
    two = RetrieverService.load(settings, check_indexes(settings))  # another worker: the vectors from the log,
    # and the change logged without vectors (by a worker whose dense index was pending) encoded by its catch-up
    wait_for_vectors(two)

    async def top(svc: RetrieverService, method: str) -> str:
        _, hits = await svc.search(["when do greenhouse orchids flower"], 3, method)
        return svc.corpus.documents([int(hits.ids[0][0])])[0][0]

    async def run() -> list[str]:
        try:
            return [await top(svc, m) for svc in (one, two) for m in ("dense", "hybrid")]
        finally:
            await one.aclose()
            await two.aclose()

    assert asyncio.run(run()) == ["orchid-note#0"] * 4
    three = RetrieverService.load(settings, check_indexes(settings))
    wait_for_vectors(three)

    async def cactus() -> str:
        try:
            _, hits = await three.search(["how do desert cacti keep water"], 1, "dense")
            return three.corpus.documents([int(hits.ids[0][0])])[0][0]
        finally:
            await three.aclose()

    assert asyncio.run(cactus()) == "cactus-note#0"


def test_the_command_line_puts_an_ingested_corpus_and_deletes_through_the_api(
        tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plugsearch-index ingest` then `plugsearch-index put` into a running retriever (a real server in a thread,
    the project's HTTP client), then `delete`; a wrong token is one line and exit 1."""
    import time

    from plugsearch.retriever.api import create_app
    from plugsearch.retriever.cli import main
    from tests.asgi import served_in_thread

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "memo.md").write_text("# Brintel memo\n\nThe brintel rollout starts in March. It needs two teams.\n")
    (folder / "note.txt").write_text("Kaporite samples were shipped to the lab on Friday.\n")
    with pytest.raises(SystemExit) as done:
        main(["ingest", str(folder), "--out", str(tmp_path / "docs.jsonl"), "--quiet", "--root", str(folder)])
    assert done.value.code == 0
    token = "internal-token-12345"
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=token)
    with served_in_thread(create_app(settings)) as url:
        for _ in range(600):
            if httpx.get(f"{url}/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        with pytest.raises(SystemExit) as done:
            main(["put", str(tmp_path / "docs.jsonl"), "--url", url, "--token", token, "--quiet"])
        assert done.value.code == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"documents": 2, "passages": 2,
                                                                              "seq": 1}
        headers = {"Authorization": f"Bearer {token}"}
        found = httpx.post(f"{url}/retrieve", json={"queries": ["kaporite samples"], "k": 1}, headers=headers).json()
        assert found["results"][0][0]["id"] == "note.txt#0"
        with pytest.raises(SystemExit) as done:
            main(["delete", "note.txt", "--url", url, "--token", token])
        assert done.value.code == 0
        found = httpx.post(f"{url}/retrieve", json={"queries": ["kaporite samples"], "k": 1}, headers=headers).json()
        assert not found["results"][0] or found["results"][0][0]["id"] != "note.txt#0"
        with pytest.raises(SystemExit) as done:
            main(["delete", "memo.md", "--url", url, "--token", "wrong-token-123"])
        assert done.value.code == 1 and "answered 401" in capsys.readouterr().err


def wait_for_vectors(svc: RetrieverService) -> None:
    """Until the catch-up has encoded every passage put without vectors (in a thread, in batches)."""
    import time

    assert svc.live is not None
    for _ in range(1200):
        if svc.live.pending_vectors() == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the catch-up did not encode the passages put without vectors")


def test_a_change_the_disk_cannot_take_is_not_acknowledged_and_never_read(tmp_path: Path) -> None:
    """A full disk (SQLite's page limit stands in for it): the append fails whole, nothing of it is read back, and
    the next change gets the next number."""
    log = ChangeLog(tmp_path)
    log.append([passage("a", 0, "kept")], [])
    pages = log._conn.execute("PRAGMA page_count").fetchone()[0]
    log._conn.execute(f"PRAGMA max_page_count = {pages}")
    with pytest.raises(ChangeNotWritten, match="full"):
        log.append([passage("b", 0, "not acknowledged " * 2000)], [])
    log._conn.execute("PRAGMA max_page_count = 1073741823")
    assert [c.seq for c in ChangeLog(tmp_path).read_after(0)] == [1]
    assert log.append([], ["a"]).seq == 2
