"""A folder kept in step, with real processes: `plugsearch-index ingest` a folder, serve it (the real retriever, two
workers), then `plugsearch-index sync` after files are added, changed, renamed (odd names included) and removed,
while searches run, after a restart, after a rebuild from a re-ingested folder, and with the sync process and the
retriever each killed with SIGKILL in the middle: afterwards the documents served under the folder are exactly
the folder's files (ids and content hashes), and every change the retriever acknowledged is there."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugsearch.retriever.ingest.passages import passages_hash
from plugsearch.retriever.ingest.reading import read_data
from plugsearch.retriever.ingest.run import document_id
from tests.conftest import REPO, free_port
from tests.support.services import power_cut, start_killable
from tests.unit.test_ingest import PAGE_HTML, SETUP_MD, write_pdf

pytestmark = pytest.mark.e2e

TOKEN = "sync-test-internal-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WORDS = ["amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "heath", "indigo", "jasper", "kelp",
         "lichen", "marl", "nectar", "onyx", "peat", "quartz", "rowan", "slate", "tundra"]


def note(n: int, version: int = 0) -> str:
    word = WORDS[n % len(WORDS)]
    return (f"Field note {n} on the {word} ridge (version {version}). The {word} survey counted {n * 7 + version} "
            f"cairns.\n\nA second paragraph about {word} weather and the {n}th camp.\n")


def index(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "plugsearch.retriever.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})


def sync(root: Path, url: str, *extra: str) -> dict[str, Any]:
    done = index("sync", "docs", "--root", ".", "--url", url, "--token", TOKEN, "--quiet", "--cache",
                 str(root / "sync-cache.json"), *extra, cwd=root)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def expected(root: Path) -> dict[str, str]:
    """id -> content hash of every document the folder's files give (read here, as ingest reads them)."""
    out = {}
    for path in sorted((root / "docs").rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            doc_id = document_id(path, root)
            _, passages = read_data(doc_id, path.read_bytes(), doc_id=doc_id, words=100, max_bytes=1 << 30)
            out[doc_id] = passages_hash(passages)
    return out


def served(url: str) -> dict[str, str]:
    out: dict[str, str] = {}
    after = None
    while True:
        params: dict[str, Any] = {"prefix": "docs/", "limit": 7}
        if after is not None:
            params["after"] = after
        page = httpx.get(f"{url}/documents", params=params, headers=AUTH, timeout=60).json()
        out.update({d["id"]: d["sha256"] for d in page["documents"]})
        after = page["next"]
        if after is None:
            return out


def in_step(root: Path, url: str) -> None:
    assert served(url) == expected(root)


def start(env: dict[str, str], log: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """The retriever (`python -m plugsearch.retriever`), ready when every worker has loaded."""
    return start_killable("plugsearch.retriever", env, log, port=port,
                          loaded=(b"retriever ready in", int(env["RETRIEVER_WORKERS"])))


def start_refused(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The retriever started on a rebuilt corpus with changes acknowledged against the one before: alive, not
    ready, and saying how to carry or retire them."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.retriever"], cwd=REPO, start_new_session=True,
                                env={**os.environ, **env, "RETRIEVER_PORT": str(port)}, stdout=out,
                                stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            ready = httpx.get(f"{url}/health/ready", timeout=2)
            if ready.status_code == 503 and "changes carry" in ready.text:
                return proc, url
            assert ready.status_code != 200, "a rebuilt corpus was served as if no change had been acknowledged"
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"the retriever did not say why it refuses: {log.read_text()[-3000:]}")


def build(env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, "-m", "plugsearch.retriever.cli", "build", "--quiet"], cwd=REPO,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


class Searcher(threading.Thread):
    """Searches while the folder is synced: every answer a 200."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.stop, self.answers, self.failures = url, threading.Event(), 0, []  # type: ignore[var-annotated]

    def run(self) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=60) as client:
            while not self.stop.is_set():
                word = random.choice(WORDS)
                response = client.post("/retrieve", json={"queries": [f"{word} ridge survey"], "k": 5})
                if response.status_code == 200:
                    self.answers += 1
                else:
                    self.failures.append(response.text)


def test_a_synced_folder_is_what_the_retriever_serves_through_changes_restarts_rebuilds_and_kills(
        tmp_path: Path) -> None:
    root = tmp_path / "work"
    docs = root / "docs"
    (docs / "guide").mkdir(parents=True)
    for n in range(12):
        (docs / f"note-{n:02d}.txt").write_text(note(n))
    (docs / "guide" / "setup.md").write_text(SETUP_MD)
    (docs / "page.html").write_text(PAGE_HTML)
    write_pdf(docs / "report.pdf", ["The zentrofil report covers the first quarter.", "Its second page."])
    corpus = root / "corpus.jsonl"
    done = index("ingest", "docs", "--root", ".", "--out", str(corpus), "--quiet", cwd=root)
    assert done.returncode == 0, done.stderr
    env = {"RETRIEVER_CORPUS": str(corpus), "RETRIEVER_INDEX_DIR": str(tmp_path / "indexes"),
           "RETRIEVER_BM25": "true", "RETRIEVER_DENSE": "false", "RETRIEVER_DEFAULT_METHOD": "bm25",
           "RETRIEVER_INTERNAL_TOKEN": TOKEN, "RETRIEVER_WORKERS": "2", "RETRIEVER_LOG_LEVEL": "info",
           "RETRIEVER_CHANGES_POLL_S": "5"}
    build(env)
    log = tmp_path / "retriever.log"
    proc, url = start(env, log)
    try:
        # ingested, then synced: nothing to do (the hashes are computed here, as the retriever computed them)
        first = sync(root, url)
        assert (first["unchanged"], first["added"], first["replaced"], first["deleted"]) == (15, 0, 0, 0), first
        in_step(root, url)

        # add, change, rename to odd names, remove; sync while searches run
        (docs / "note-00.txt").write_text(note(0, version=1))
        (docs / "note-01.txt").unlink()
        (docs / "note-02.txt").rename(docs / "Notes on été 2024 (draft) #2.txt")
        (docs / "guide" / "new one.md").write_text("# New\n\nThe new glimmerwick page.\n")
        odd = docs / os.fsdecode(b"caf\xe9 latin-1.txt")  # a name that is not UTF-8
        odd.write_text(note(40))
        searches = Searcher(url)
        searches.start()
        second = sync(root, url)
        searches.stop.set()
        searches.join(30)
        assert not searches.failures and searches.answers > 0
        assert (second["added"], second["replaced"], second["deleted"], second["unchanged"]) == (3, 1, 2, 12), second
        assert second["errors"] == 0 and not second.get("failed")
        in_step(root, url)
        assert "docs/caf%E9 latin-1.txt" in served(url)
        again = sync(root, url)  # from the cache of the last sync: nothing read, nothing sent
        assert (again["unchanged"], again["to_put"], again["to_delete"]) == (16, 0, 0), again

        # a restart replays the acknowledged changes
        power_cut(proc)
        proc, url = start(env, log)
        in_step(root, url)

        # kill -9 of the sync itself in the middle of a long one: running it again finishes the job
        for n in range(100, 300):
            (docs / f"bulk-{n}.txt").write_text(note(n))
        killed = subprocess.Popen([sys.executable, "-m", "plugsearch.retriever.cli", "sync", "docs", "--root", ".",
                                   "--url", url, "--token", TOKEN, "--quiet", "--batch", "1", "--cache",
                                   str(root / "sync-cache.json")], cwd=root, env={**os.environ, "PYTHONPATH": str(REPO)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for _ in range(1200):  # until part of it is acknowledged
            listed = httpx.get(f"{url}/documents", params={"prefix": "docs/bulk-", "limit": 10}, headers=AUTH).json()
            if len(listed["documents"]) >= 3:
                break
            time.sleep(0.02)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait(30)
        partial = served(url)
        assert 16 < len(partial) < 216  # killed in the middle
        finished = sync(root, url)
        assert finished["added"] == 216 - len(partial) and finished["errors"] == 0, finished
        in_step(root, url)

        # the retriever killed in the middle of a sync: the sync waits it out (--wait-s) and finishes
        for n in range(100, 160):
            (docs / f"bulk-{n}.txt").write_text(note(n, version=2))
        for n in range(160, 300):
            (docs / f"bulk-{n}.txt").unlink()
        wanted = expected(root)
        syncing = subprocess.Popen([sys.executable, "-m", "plugsearch.retriever.cli", "sync", "docs", "--root", ".",
                                    "--url", url, "--token", TOKEN, "--quiet", "--batch", "1", "--wait-s", "240",
                                    "--cache", str(root / "sync-cache.json")], cwd=root,
                                   env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        for _ in range(3000):  # until the first changed file is acknowledged
            listed = httpx.get(f"{url}/documents", params={"prefix": "docs/bulk-100.txt"}, headers=AUTH).json()
            if listed["documents"][0]["sha256"] == wanted["docs/bulk-100.txt"]:
                break
            time.sleep(0.02)
        power_cut(proc)  # the retriever's whole process group, SIGKILL
        proc, url = start(env, log, port=int(url.rsplit(":", 1)[1]))  # where the sync keeps calling
        out, err = syncing.communicate(timeout=600)
        assert syncing.returncode == 0, (out, err)
        assert "did not answer" in err and "trying again" in err, err  # it met the dead retriever, and waited
        in_step(root, url)

        # a rebuild from the folder re-ingested (one file added that was never synced): the retriever refuses to
        # serve the new build while the changes acknowledged against the old one are neither carried nor retired
        # (never dropped in silence); carried, the served corpus is the new build with them, and sync converges
        (docs / "after-rebuild.txt").write_text(note(77))
        (docs / "note-03.txt").write_text(note(3, version=9))
        done = index("ingest", "docs", "--root", ".", "--out", str(corpus), "--quiet", cwd=root)
        assert done.returncode == 0, done.stderr
        (docs / "note-04.txt").unlink()  # and one gone since
        power_cut(proc)
        build(env)
        proc, url = start_refused(env, log)
        power_cut(proc)
        carried = subprocess.run([sys.executable, "-m", "plugsearch.retriever.cli", "changes", "carry"], cwd=REPO,
                                 env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
        assert carried.returncode == 0, carried.stderr
        proc, url = start(env, log)
        sync(root, url)
        in_step(root, url)
        assert sync(root, url)["to_put"] == 0
    finally:
        power_cut(proc)
