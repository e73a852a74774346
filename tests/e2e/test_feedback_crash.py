"""An acknowledged mark is never lost: the real searcher (two workers sharing one feedback file, the compact policy,
over the real retriever on a tiny corpus) answers searches and takes marks from a client in a loop (some marks
replace earlier ones, and a mark may reach the other worker than the one that answered its search); its whole
process group is killed with SIGKILL in the middle, twice. After each restart every mark that got a 200 is there
as it was acknowledged, the one in flight is there whole or not at all, and a search from before the cut can still
be marked."""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.retriever import tiny_bm25s
from tests.support.services import power_cut, retriever_process, start_killable

pytestmark = pytest.mark.e2e

KEY = "feedback-crash-key-0001"
TOKEN = "feedback-crash-internal-0002"


def start(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The searcher, in its own session (so its workers die with it), ready when it answers."""
    return start_killable("plugsearch.searcher", env, log, timeout_s=120)


Mark = tuple[list[str], list[str]]


class Marker(threading.Thread):
    """Searches and marks, one request at a time, keeping what the searcher acknowledged (search id -> the
    last acknowledged mark) and the mark in flight when the searcher died."""

    def __init__(self, url: str, questions: list[str], acked: dict[str, Mark], searches: dict[str, list[str]],
                 seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.questions, self.acked, self.searches = url, questions, acked, searches
        self.rng = random.Random(seed)
        self.in_flight: tuple[str, Mark] | None = None
        self.failure: str | None = None
        self.stopped_by: str | None = None

    def run(self) -> None:
        # a connection per request: the kernel spreads them over the two workers, so a mark often reaches the
        # worker that did not answer its search
        headers = {"Authorization": f"Bearer {KEY}", "Connection": "close"}
        with httpx.Client(base_url=self.url, timeout=30, headers=headers) as client:
            try:
                while True:
                    if self.acked and self.rng.random() < 0.3:  # mark an earlier search again: replaces its mark
                        search_id = self.rng.choice(sorted(self.acked))
                    else:
                        response = client.post("/search", json={"question": self.rng.choice(self.questions),
                                                                "mode": "naive", "retrieve_k": 4})
                        if response.status_code != 200:
                            self.failure = f"search: {response.status_code} {response.text}"
                            return
                        body = response.json()
                        if len(body["documents"]) < 2:
                            continue  # a title BM25 matches only once: nothing to mark against
                        search_id = body["search_id"]
                        self.searches[search_id] = [d["id"] for d in body["documents"]]
                    found = self.searches[search_id]
                    docs = self.rng.sample(found, min(3, len(found)))
                    mark: Mark = ([docs[0]], docs[1:])
                    self.in_flight = (search_id, mark)
                    response = client.post("/feedback", json={"search_id": search_id, "helpful": mark[0],
                                                              "not_helpful": mark[1]})
                    if response.status_code != 200:
                        self.failure = f"mark: {response.status_code} {response.text}"
                        return
                    self.acked[search_id] = mark
                    self.in_flight = None
            except httpx.HTTPError as exc:
                self.stopped_by = repr(exc)  # the power cut
                return


def stored_marks(url: str) -> dict[str, Mark]:
    out: dict[str, Mark] = {}
    after = 0
    with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        while True:
            page = client.get("/feedback", params={"after": after, "limit": 50}).json()
            for m in page["marks"]:
                assert m["search_id"] not in out  # one mark per search
                out[m["search_id"]] = (m["helpful"], m["not_helpful"])
            if page["next_after"] is None:
                return out
            after = page["next_after"]


def test_acknowledged_marks_survive_a_power_cut(data_dir: Path, var_dir: Path, tmp_path: Path) -> None:
    corpus, index_dir = tiny_bm25s(data_dir, var_dir, tmp_path)
    questions = [json.loads(line)["title"] for line in corpus.read_text().splitlines()[:200]]
    db = tmp_path / "feedback.sqlite3"
    acked: dict[str, Mark] = {}
    searches: dict[str, list[str]] = {}
    rng = random.Random(11)
    with retriever_process(corpus, index_dir, tmp_path / "retriever.log") as retriever:
        env = {"SEARCHER_RETRIEVER__URL": retriever, "SEARCHER_POLICY_KIND": "compact", "SEARCHER_CORPUS_CHECK": "off",
               "SEARCHER_WORKERS": "2", "SEARCHER_FEEDBACK_DB": str(db), "SEARCHER_API_KEYS": KEY,
               "SEARCHER_INTERNAL_TOKEN": TOKEN, "SEARCHER_LOG_LEVEL": "info"}
        for round_ in range(2):
            proc, url = start(env, tmp_path / "searcher.log")
            before = len(acked)
            try:
                marker = Marker(url, questions, acked, searches, seed=round_)
                marker.start()
                deadline = time.monotonic() + 60
                while len(acked) < before + 25 and marker.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 0.5))
            finally:
                power_cut(proc)
            marker.join(timeout=60)
            assert marker.failure is None, marker.failure
            assert len(acked) >= before + 25, f"round {round_}: too few marks before the cut ({marker.stopped_by})"
            proc, url = start(env, tmp_path / "searcher.log")
            try:
                stored = stored_marks(url)
                in_flight = marker.in_flight
                for search_id, mark in acked.items():
                    if in_flight is not None and in_flight[0] == search_id:
                        assert stored.get(search_id) in (mark, in_flight[1]), (search_id, stored.get(search_id))
                    else:
                        assert stored.get(search_id) == mark, (search_id, stored.get(search_id), mark)
                if in_flight is not None:
                    search_id, mark = in_flight
                    assert stored.get(search_id) in (acked.get(search_id), mark)  # whole or not at all
                    if stored.get(search_id) is not None:
                        acked[search_id] = stored[search_id]
                assert set(stored) == set(acked)
                print(f"round {round_}: {len(stored)} marks acknowledged and found after the cut, "
                      f"{len(searches)} searches, in flight: {in_flight is not None}")
                # a search answered before the cut can still be marked after it
                old = sorted(acked)[0]
                again = httpx.post(f"{url}/feedback", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                                   json={"search_id": old, "helpful": searches[old][:2]})
                assert again.status_code == 200 and again.json()["replaced"], again.text
                acked[old] = (searches[old][:2], [])
            finally:
                power_cut(proc)
    log = (tmp_path / "searcher.log").read_text()
    assert "Traceback" not in log, log[-3000:]
