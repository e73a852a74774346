"""The change log as an operator meets it, with the real retriever process (bm25s over a tiny corpus):

- restarted while the log's file system is read-only (what `errors=remount-ro` does after an I/O error; a tmpfs
  remounted read-only stands in, since root ignores file permissions): not ready, with the reason, by default; with
  RETRIEVER_CHANGES_ON_ERROR=read-only it serves every acknowledged change and refuses new ones with 503 and
  Retry-After; never the built corpus as if nothing had been acknowledged;
- 1,000 changes, then a restart: every one is there, replayed without re-reading the base for each (the time is
  printed; docs/benchmarks.md has the figures);
- two workers and RETRIEVER_COMPACT_AFTER: the retriever compacts in a child process, both workers move to the new
  generation, and searches go on finding what was put and not what was deleted.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port
from tests.support.retriever import tiny_bm25s

pytestmark = pytest.mark.e2e

TOKEN = "durability-internal-token"
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


class Served:
    """`python -m plugsearch.retriever` with `env`, its output in `log`."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.since = log, log.stat().st_size if log.exists() else 0
        self.workers = int(env.get("RETRIEVER_WORKERS", "1"))
        with log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "plugsearch.retriever"], cwd=REPO,
                                         start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env, "RETRIEVER_PORT": str(self.port)})
        self.started = time.monotonic()

    def text(self) -> str:
        return self.log.read_bytes()[self.since:].decode(errors="replace")

    def wait(self, *, ready: bool, timeout_s: float = 240) -> dict[str, object]:
        """Until every worker is ready (`ready`), or has failed loading; the readiness answer."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the retriever exited ({self.proc.returncode}): {self.text()[-3000:]}")
            try:
                answer = httpx.get(f"{self.url}/health/ready", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            body: dict[str, object] = answer.json()
            loaded = self.text().count("retriever ready in") >= self.workers
            if ready and answer.status_code == 200 and loaded:
                return body
            if not ready and "loading failed" in json.dumps(body):
                return body
            time.sleep(0.2)
        raise AssertionError(f"the retriever did not get {'ready' if ready else 'to a failure'}: {self.text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


@pytest.fixture()
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    where = tmp_path / "logs-volume"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({mounted.stderr.strip() or mounted.returncode}): the "
                    "read-only file system case needs `mount -o remount,ro` (root, or a container with SYS_ADMIN)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def remount(where: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(where)], check=True, capture_output=True)


def env_for(corpus: Path, index_dir: Path, changes: Path, **extra: str) -> dict[str, str]:
    return {"RETRIEVER_CORPUS": str(corpus), "RETRIEVER_INDEX_DIR": str(index_dir), "RETRIEVER_BM25": "true",
            "RETRIEVER_DENSE": "false", "RETRIEVER_CHANGES_DIR": str(changes), "RETRIEVER_INTERNAL_TOKEN": TOKEN,
            "RETRIEVER_WORKERS": "1", "RETRIEVER_LOG_LEVEL": "info", "RETRIEVER_CHANGES_POLL_S": "0.2", **extra}


def ids(url: str, query: str, k: int = 5) -> list[str]:
    body = httpx.post(f"{url}/retrieve", json={"queries": [query], "k": k}, headers=HEADERS, timeout=30).json()
    return [d["id"] for d in body["results"][0]]


def put(url: str, doc: str, text: str) -> httpx.Response:
    return httpx.put(f"{url}/documents", json={"documents": [{"id": doc, "passages": [{"text": text}]}]},
                     headers=HEADERS, timeout=30)


def test_a_read_only_file_system_at_start_up_is_refused_or_served_read_only_never_silently(
        data_dir: Path, var_dir: Path, tmp_path: Path, tmpfs: Path) -> None:
    corpus, index_dir = tiny_bm25s(data_dir, var_dir, tmp_path)
    log = tmp_path / "retriever.log"
    env = env_for(corpus, index_dir, tmpfs / "changes")
    first = Served(env, log)
    try:
        first.wait(ready=True)
        base_id = httpx.get(f"{first.url}/version", timeout=10).json()["details"]["index_id"]
        for n in range(3):
            assert put(first.url, f"ledger-{n}", f"The grimvault ledger {n} of the zephyrine audit").status_code == 200
        victim = ids(first.url, "Big Stone Gap", 1)[0]
        gone = httpx.post(f"{first.url}/documents/delete", json={"ids": [victim]}, headers=HEADERS, timeout=30)
        assert gone.status_code == 200 and gone.json()["documents"] == 1
        acknowledged = httpx.get(f"{first.url}/version", timeout=10).json()["details"]
    finally:
        first.stop()
    assert acknowledged["index_id"] != base_id and acknowledged["changes"]["seq"] == 4
    remount(tmpfs, "ro")
    try:
        refused = Served(env, log)
        try:
            body = refused.wait(ready=False)
            reason = json.dumps(body)
            assert "cannot be written" in reason and "read-only" in reason.lower(), reason
            search = httpx.post(f"{refused.url}/retrieve", json={"queries": ["zephyrine"], "k": 3}, headers=HEADERS,
                                timeout=10)
            assert search.status_code == 503  # not the built corpus as if nothing had been acknowledged
        finally:
            refused.stop()
        served = Served({**env, "RETRIEVER_CHANGES_ON_ERROR": "read-only"}, log)
        try:
            served.wait(ready=True)
            details = httpx.get(f"{served.url}/version", timeout=10).json()["details"]
            assert details["index_id"] == acknowledged["index_id"]  # every acknowledged change is served
            assert details["changes"]["writable"] is False and "cannot be written" in details["changes_error"]
            assert sorted(ids(served.url, "zephyrine grimvault ledger", 3)) == [f"ledger-{n}#0" for n in range(3)]
            assert victim not in ids(served.url, "Big Stone Gap", 50)
            refused_put = put(served.url, "ledger-9", "refused while the disk is read-only")
            assert refused_put.status_code == 503 and int(refused_put.headers["Retry-After"]) > 0
            assert "nothing was changed" in refused_put.json()["error"]["message"]
        finally:
            served.stop()
    finally:
        remount(tmpfs, "rw")


def test_a_thousand_changes_are_all_there_after_a_restart(data_dir: Path, var_dir: Path, tmp_path: Path) -> None:
    corpus, index_dir = tiny_bm25s(data_dir, var_dir, tmp_path)
    log = tmp_path / "retriever.log"
    env = env_for(corpus, index_dir, tmp_path / "changes", RETRIEVER_COMPACT_AFTER="0")
    with (data_dir / "domain" / "realtimeqa_corpus.jsonl").open() as fh:
        rows = [json.loads(line) for _, line in zip(range(1000), fh, strict=False)]
    first = Served(env, log)
    try:
        first.wait(ready=True)
        with httpx.Client(base_url=first.url, headers=HEADERS, timeout=60) as client:
            for n, row in enumerate(rows):
                body = {"documents": [{"id": f"news-{n}", "title": row["title"],
                                       "passages": [{"text": f"{row['text']} tag{n:04d}x"}]}]}
                assert client.put("/documents", json=body).status_code == 200
    finally:
        first.stop()
    again = Served(env, log)
    try:
        again.wait(ready=True)
        seconds = time.monotonic() - again.started
        details = httpx.get(f"{again.url}/version", timeout=10).json()["details"]
        assert details["changes"]["seq"] == 1000 and details["changes"]["added"] == 1000
        for n in (0, 499, 999):
            assert ids(again.url, f"tag{n:04d}x", 1) == [f"news-{n}#0"]
        replayed = [line for line in again.text().splitlines() if "changes replayed up to 1000" in line]
        assert replayed, again.text()[-2000:]
        print(f"\n1,000 changes: the retriever was ready {seconds:.1f} s after its start; {replayed[0].split(': ')[-1]}")
    finally:
        again.stop()


def test_two_workers_compact_in_the_background_and_both_move_to_the_new_generation(
        data_dir: Path, var_dir: Path, tmp_path: Path) -> None:
    corpus, index_dir = tiny_bm25s(data_dir, var_dir, tmp_path)
    log = tmp_path / "retriever.log"
    env = env_for(corpus, index_dir, tmp_path / "changes", RETRIEVER_WORKERS="2", RETRIEVER_COMPACT_AFTER="40")
    served = Served(env, log)
    try:
        served.wait(ready=True)
        victim = ids(served.url, "Big Stone Gap", 1)[0]
        assert httpx.post(f"{served.url}/documents/delete", json={"ids": [victim]}, headers=HEADERS,
                          timeout=30).status_code == 200
        documents = [{"id": f"memo-{n}", "passages": [{"text": f"Memo {n} on the vorkelline pump, code q{n:03d}z"}]}
                     for n in range(60)]
        answer = httpx.put(f"{served.url}/documents", json={"documents": documents}, headers=HEADERS, timeout=60)
        assert answer.status_code == 200
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and served.text().count("serving generation 1") < 2:
            time.sleep(0.3)
        assert "compacting in the background" in served.text() and "generation 1 ready" in served.text()
        assert served.text().count("serving generation 1") == 2, served.text()[-3000:]  # both workers moved
        for _ in range(20):  # whichever worker answers
            assert ids(served.url, "q042z vorkelline", 1) == ["memo-42#0"]
            assert victim not in ids(served.url, "Big Stone Gap", 50)
        details = httpx.get(f"{served.url}/version", timeout=10).json()["details"]
        assert details["changes"]["overlay_passages"] == 0 and details["changes"]["added"] == 60
        assert details["documents"] == 300 - 1 + 60
    finally:
        served.stop()
