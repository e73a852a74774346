"""Documents put while the dense index is still building (RETRIEVER_DENSE_MISSING=build, the real retriever over a
tiny corpus whose dense index is not there yet): BM25 finds them at once; when the build lands, the retriever keeps
answering `/health/live` and searches while the catch-up encodes them in batches; once it is done dense search finds
them; a restart reads their vectors from the log instead of encoding them again. (The 20,000-passage run and its
1 s criterion for `/health/live`: `bench/live_catchup.py`, figures in docs/benchmarks.md.)"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_live_durability import HEADERS, Served, env_for, ids
from tests.support.retriever import tiny_bm25s

pytestmark = pytest.mark.e2e


class LiveProbe(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.answers: list[tuple[int, float]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.halt.is_set():
                t0 = time.perf_counter()
                try:
                    status = client.get(f"{self.url}/health/live").status_code
                except httpx.HTTPError:
                    status = 0
                self.answers.append((status, time.perf_counter() - t0))
                self.halt.wait(0.1)


def test_passages_put_during_the_dense_build_are_encoded_while_the_retriever_answers_and_never_again(
        data_dir: Path, var_dir: Path, tmp_path: Path) -> None:
    corpus, cached = tiny_bm25s(data_dir, var_dir, tmp_path)
    index_dir = tmp_path / "indexes"  # bm25s and the document store, no dense index: it is built while serving
    for part in ("bm25s", "docstore"):
        shutil.copytree(cached / part, index_dir / part)
    env = env_for(corpus, index_dir, tmp_path / "changes", RETRIEVER_DENSE="true", RETRIEVER_DENSE_MISSING="build",
                  RETRIEVER_DENSE_POLL_S="1", RETRIEVER_COMPACT_AFTER="0")
    with (data_dir / "domain" / "realtimeqa_corpus.jsonl").open() as fh:
        rows = [json.loads(line) for _, line in zip(range(1000), fh, strict=False)]
    log = tmp_path / "retriever.log"
    served = Served(env, log)
    probe = LiveProbe(served.url)
    try:
        served.wait(ready=True)
        probe.start()
        with httpx.Client(base_url=served.url, headers=HEADERS, timeout=120) as client:
            for start in range(0, len(rows), 250):
                documents = [{"id": f"late-{n}", "title": rows[n]["title"],
                              "passages": [{"text": f"{rows[n]['text']} tag{n:04d}q"}]}
                             for n in range(start, start + 250)]
                assert client.put("/documents", json={"documents": documents}).status_code == 200
            details = client.get("/version").json()["details"]
            assert "dense" not in details["methods"], "the dense index landed before the puts: nothing to catch up"
            assert ids(served.url, "tag0777q", 1) == ["late-777#0"]  # BM25 finds them at once
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                details = client.get("/version").json()["details"]
                if "dense" in details["methods"] and details["changes"]["pending_vectors"] == 0:
                    break
                if "dense" in details["methods"]:  # the catch-up is running: searches are answered meanwhile
                    found = client.post("/retrieve", json={"queries": ["tag0123q"], "k": 1, "method": "bm25"})
                    assert found.status_code == 200 and found.json()["results"][0][0]["id"] == "late-123#0"
                time.sleep(0.5)
            assert details["changes"]["pending_vectors"] == 0, served.text()[-3000:]
            own = rows[42]["text"][:300]  # a passage's own words find it by meaning (its article's others share a title)
            dense = client.post("/retrieve", json={"queries": [own], "k": 3, "method": "dense"}).json()
            assert "late-42#0" in [d["id"] for d in dense["results"][0]]
        probe.halt.set()
        probe.join(timeout=30)
        assert probe.answers and all(status == 200 for status, _ in probe.answers), probe.answers[-5:]
        print(f"\n/health/live: {len(probe.answers)} probes, slowest {max(s for _, s in probe.answers) * 1000:.0f} ms")
        assert "dense catch-up: 1,000 passages" in served.text()
    finally:
        probe.halt.set()
        served.stop()
    again = Served({**env, "RETRIEVER_DENSE_MISSING": "refuse"}, log)
    try:
        again.wait(ready=True)
        details = httpx.get(f"{again.url}/version", timeout=10).json()["details"]
        assert details["changes"]["pending_vectors"] == 0 and "dense catch-up" not in again.text()
        dense = httpx.post(f"{again.url}/retrieve", json={"queries": [rows[42]["text"][:300]], "k": 3, "method": "dense"},
                           headers=HEADERS, timeout=30).json()
        assert "late-42#0" in [d["id"] for d in dense["results"][0]]
    finally:
        again.stop()
