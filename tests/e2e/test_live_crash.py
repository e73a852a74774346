"""Nothing acknowledged is lost: the real retriever (two workers, bm25s + MiniLM over a tiny corpus) takes a
stream of documents put and deleted; its whole process group is killed with SIGKILL in the middle (a power cut
as the process sees it), twice; after each restart every acknowledged change is there, the one in flight is
there whole or not at all, nothing is duplicated, and BM25, dense and hybrid search agree with the documents
served."""

from __future__ import annotations

import random
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.retriever import cached_index_dir, ensure_tiny_indexes, tiny_settings, write_tiny_corpus
from tests.support.services import power_cut, start_killable

pytestmark = pytest.mark.e2e

TOKEN = "crash-test-internal-token"


def start(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The retriever, ready when every worker has loaded (a worker still loading answers 503)."""
    return start_killable("plugsearch.retriever", env, log, loaded=(b"retriever ready in", int(env["RETRIEVER_WORKERS"])))


def words(n: int) -> str:
    """A made-up word per document, so a search for it finds that document alone."""
    return f"zq{n:04d}vex"


class Writer(threading.Thread):
    """Puts two-passage documents and deletes some of them, one request at a time, recording what the service
    acknowledged (and the one request in flight when the service died)."""

    def __init__(self, url: str, start_at: int, live: dict[str, bool]) -> None:
        super().__init__(daemon=True)
        self.url, self.n, self.live = url, start_at, live
        self.in_flight: tuple[str, str] | None = None
        self.rng = random.Random(start_at)

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=self.url, timeout=30, headers=headers) as client:
            while True:
                alive = [d for d, on in self.live.items() if on]
                if alive and self.rng.random() < 0.3:
                    doc = self.rng.choice(alive)
                    self.in_flight = ("delete", doc)
                    try:
                        response = client.post("/documents/delete", json={"ids": [doc]})
                    except httpx.HTTPError:
                        return
                    assert response.status_code == 200, response.text
                    self.live[doc] = False
                else:
                    doc = f"crash-{self.n}"
                    self.n += 1
                    self.in_flight = ("put", doc)
                    body = {"documents": [{"id": doc, "title": f"Note {doc}", "passages": [
                        {"text": f"The {words(self.n)} ledger was filed on time."},
                        {"text": f"A second page about the {words(self.n)} ledger and its audit."}]}]}
                    try:
                        response = client.put("/documents", json=body)
                    except httpx.HTTPError:
                        return
                    assert response.status_code == 200, response.text
                    self.live[doc] = True
                self.in_flight = None


def check(url: str, live: dict[str, bool], in_flight: tuple[str, str] | None, word_of: dict[str, str]) -> None:
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        for doc, on in live.items():
            if in_flight is not None and in_flight[1] == doc:
                continue
            found = {}
            for method in ("bm25", "dense", "hybrid"):
                body = client.post("/retrieve", json={"queries": [f"{word_of[doc]} ledger"], "k": 10,
                                                      "method": method}).json()
                ids = [d["id"] for d in body["results"][0]]
                assert len(ids) == len(set(ids)), (method, ids)  # nothing twice
                found[method] = {i for i in ids if i.startswith(f"{doc}#")}
            expected = {f"{doc}#0", f"{doc}#1"} if on else set()
            assert found["bm25"] == expected, (doc, on, found)
            # dense ranks by meaning (the made-up word need not win among a hundred look-alike notes), but it
            # never returns a passage that is not served
            assert found["dense"] <= expected and found["hybrid"] <= expected, (doc, on, found)
            if on:
                assert found["hybrid"], (doc, found)
        if in_flight is not None:
            kind, doc = in_flight
            body = client.post("/retrieve", json={"queries": [f"{word_of[doc]} ledger"], "k": 10}).json()
            flying = {d["id"] for d in body["results"][0] if d["id"].startswith(f"{doc}#")}
            assert flying in (set(), {f"{doc}#0", f"{doc}#1"}), (kind, doc, flying)  # whole or not at all
        sample = client.post("/passages/sample", json={"n": 4000, "seed": 3}).json()
        ids = [p["id"] for p in sample["passages"]]
        assert len(ids) == len(set(ids)) == sample["total"]  # the documents served, each once
        for doc, on in live.items():
            if in_flight is None or in_flight[1] != doc:
                assert (f"{doc}#0" in ids) == on


def test_acknowledged_changes_survive_a_power_cut_and_nothing_is_half_applied(
        data_dir: Path, var_dir: Path, tmp_path: Path) -> None:
    corpus = write_tiny_corpus(data_dir, tmp_path / "tiny.jsonl")
    settings = tiny_settings(corpus, cached_index_dir(var_dir, corpus))
    ensure_tiny_indexes(settings, bm25=["bm25s"], dense=True)
    env = {"RETRIEVER_CORPUS": str(corpus), "RETRIEVER_INDEX_DIR": str(settings.index_dir),
           "RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "true", "RETRIEVER_DEFAULT_METHOD": "bm25",
           "RETRIEVER_CHANGES_DIR": str(tmp_path / "changes"), "RETRIEVER_INTERNAL_TOKEN": TOKEN,
           "RETRIEVER_WORKERS": "2", "RETRIEVER_LOG_LEVEL": "info", "RETRIEVER_CHANGES_POLL_S": "0.2"}
    live: dict[str, bool] = {}
    word_of: dict[str, str] = {}
    start_at = 0
    rng = random.Random(7)
    for round_ in range(2):
        proc, url = start(env, tmp_path / "retriever.log")
        try:
            writer = Writer(url, start_at, live)
            writer.start()
            time.sleep(rng.uniform(1.5, 4.0))
        finally:
            power_cut(proc)
        writer.join(timeout=60)
        assert not writer.is_alive()
        acked = sum(1 for _ in live)
        assert acked > 3, f"round {round_}: too few changes before the cut to test anything"
        word_of.update({f"crash-{n}": words(n + 1) for n in range(start_at, writer.n)})
        start_at = writer.n
        proc, url = start(env, tmp_path / "retriever.log")
        try:
            in_flight = writer.in_flight
            if in_flight is not None and in_flight[0] == "delete":
                live.pop(in_flight[1], None)  # a delete in flight: the document is there or not, both fine
            check(url, live, in_flight, word_of)
            if in_flight is not None and in_flight[0] == "put":
                body = httpx.post(f"{url}/retrieve", json={"queries": [f"{word_of[in_flight[1]]} ledger"], "k": 10},
                                  timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}).json()
                live[in_flight[1]] = any(d["id"] == f"{in_flight[1]}#0" for d in body["results"][0])
        finally:
            power_cut(proc)
