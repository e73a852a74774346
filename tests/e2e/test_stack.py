"""The README's first command for real: `plugsearch-stack` on free ports (real Redis, llama.cpp with
SmolLM2, retriever with its BM25 index, generator, judge, searcher), `POST /search` returns documents (the
README's own first-search `curl` too, read from README.md),
SIGINT stops every process it started. Started with `--chat`, the answering proxy's set-up from
docs/integrations.md: the `openai` client gets a 200 answer from the stack's own llama.cpp."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.trained import COMPACT_DIR
from tests.docs.test_docs_commands import readme_first_search
from tests.support.procs import process_table

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 600.0


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every live process under `root` (start time guards against pid reuse)."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, str] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found[pid] = table[pid][1]
        todo.extend(children.get(pid, []))
    return found


def alive(processes: dict[int, str]) -> dict[int, str]:
    table = process_table()
    return {pid: start for pid, start in processes.items() if pid in table and table[pid][1] == start}


def wait_ready(proc: subprocess.Popen[bytes], ready_file: Path, log: Path, timeout_s: float) -> None:
    """Until the stack writes its ready file; fails with the log's tail if it exits or takes longer."""
    deadline = time.monotonic() + timeout_s
    while not ready_file.exists():
        assert proc.poll() is None, f"stack exited with {proc.returncode}:\n{log_tail(log)}"
        assert time.monotonic() < deadline, f"stack not ready:\n{log_tail(log)}"
        time.sleep(0.5)


def log_tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="process-tree check reads /proc")
def test_stack_serves_search_and_stops_cleanly_on_sigint(tmp_path: Path, data_dir: Path, var_dir: Path) -> None:
    ready_file = tmp_path / "ready.json"
    log = tmp_path / "stack.log"
    # Settings pass through the stack's environment to the services: short documents and answers keep
    # llama.cpp's prompt small, so one s3 turn stays quick on a busy 2-core CI machine.
    env = {**os.environ, "PLUGSEARCH_DATA": str(data_dir), "PYTHONUNBUFFERED": "1",
           "SEARCHER_DOC_CHARS": "300", "SEARCHER_MAX_NEW_TOKENS": "64"}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.stack", "--free-ports", "--no-color", "--chat",
                                 "--ready-file", str(ready_file), "--var-dir", str(var_dir),
                                 "--ready-timeout", str(READY_TIMEOUT_S)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    started: dict[int, str] = {}
    try:
        wait_ready(proc, ready_file, log, READY_TIMEOUT_S + 120)
        info = json.loads(ready_file.read_text())
        assert info["pid"] == proc.pid
        assert info["corpus"] == str((data_dir / "corpus" / "combined.jsonl").resolve())
        output = log.read_text(errors="replace")
        assert f"curl -s -X POST {info['searcher']}/search" in output  # the banner with a ready-to-copy curl
        for name in ("llm", "retriever", "generator", "judge", "searcher"):
            assert re.search(rf"^\d\d:\d\d:\d\d {name} +\| ", output, re.M), name  # logs prefixed by service
            assert f"stack     | {name} ready" in output, name

        started = descendants(proc.pid)
        names = {Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                 for pid in started if Path(f"/proc/{pid}/cmdline").exists()}
        expected = ["plugsearch.common.llama_server", *(f"plugsearch.{svc}" for svc in ("retriever", "generator", "judge",
                                                                        "searcher"))]
        if shutil.which("redis-server"):
            expected.append("redis-server")
        for what in expected:
            assert any(what in n for n in names), (what, names)

        with httpx.Client(timeout=300.0) as client:
            response = client.post(f"{info['searcher']}/search",
                                   json={"question": "who wrote the novel the call of the wild", "mode": "s3",
                                         "max_turns": 1, "retrieve_k": 3, "select_k": 3})
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["documents"], body
            assert all(doc["id"] and doc["text"] for doc in body["documents"])
            assert body["context"]
            assert body["mode"] == "s3" and body["timings"]["retrieval_calls"] >= 1
            # the default policy is the shipped compact one, acting in the searcher's process once its corpus
            # check (ready waited for it) found it not worse than naive BM25 on this corpus and pool: it decided,
            # and returned the 3 documents it selects; where the check found it worse, naive BM25's 3 and why
            shipped = CompactPolicy.load(COMPACT_DIR)
            assert f"policy: the compact searcher {shipped.model}" in output
            check = client.get(f"{info['searcher']}/version").json()["details"]["corpus_check"]
            assert check["last"] is not None and check["last"]["questions"] >= 30, check
            assert len(body["documents"]) == 3 and not body["degraded"], body
            if body["fallback"] is None:
                assert body["policy_model"] == shipped.model, body
                assert body["timings"]["policy_calls"] >= 1 and body["stop_reason"] == "complete", body
            else:
                assert body["policy_model"] is None and body["stop_reason"] == "naive", body
                assert "pseudo-questions of this corpus" in body["fallback"], body
            # the retriever behind the stack really indexed the shared corpus: naive top-k (deterministic
            # BM25, unlike the documents the policy selects) finds the novel's page
            naive = client.post(f"{info['searcher']}/search",
                                json={"question": "who wrote the novel the call of the wild", "mode": "naive",
                                      "retrieve_k": 3})
            assert naive.status_code == 200, naive.text
            titles = [doc["title"] for doc in naive.json()["documents"]]
            assert any("call of the wild" in title.lower() for title in titles), titles
            assert client.get(f"{info['urls']['retriever']}/health/ready").status_code == 200
        # the README's first search as a reader copies it (tests/docs checks it is the curl printed above)
        if shutil.which("curl"):
            copied = readme_first_search().text.replace("http://127.0.0.1:8000", info["searcher"])
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", copied], capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, done.stderr
            answered = json.loads(done.stdout)
            assert answered["mode"] == "s3" and len(answered["documents"]) == 3 and answered["context"], answered
        with httpx.Client(timeout=300.0) as client:
            # issue 31: the documented chat set-up answers (the proxy has the LLM's per-run key)
            import openai

            chat = openai.OpenAI(base_url=f"{info['searcher']}/v1", api_key="any", timeout=300, max_retries=0)
            answer = chat.chat.completions.create(
                model="plugsearch", messages=[{"role": "user", "content": "who wrote the call of the wild"}],
                max_tokens=8, temperature=0, extra_body={"search": {"mode": "naive", "retrieve_k": 2}})
            assert answer.choices[0].message.content is not None
            assert (answer.model_extra or {})["search"]["mode"] == "naive"
            chat.close()
            # issue 21: any other local process is refused by the LLM and by Redis (per-run key and password)
            assert client.get(f"{info['urls']['llm']}/v1/models").status_code == 401
            assert client.post(f"{info['urls']['llm']}/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status_code == 401
        if shutil.which("redis-server"):
            with socket.create_connection(("127.0.0.1", info["ports"]["redis"]), timeout=5) as sock:
                sock.sendall(b"KEYS *\r\n")
                assert sock.recv(64).startswith(b"-NOAUTH")
    finally:
        if proc.poll() is None:
            if not started:
                started = descendants(proc.pid)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
                for pid in alive(started):
                    os.kill(pid, signal.SIGKILL)
                pytest.fail(f"stack did not stop within 60 s of SIGINT:\n{log_tail(log)}")
    assert proc.returncode in (0, 130), log_tail(log)
    assert started, "no child processes were seen"
    time.sleep(0.5)
    left = alive(started)
    assert not left, f"processes left after SIGINT: {left}\n{log_tail(log)}"
    assert not ready_file.exists()
    for port in info["ports"].values():
        if port is not None:
            with httpx.Client(timeout=2.0) as client, pytest.raises(httpx.TransportError):
                client.get(f"http://127.0.0.1:{port}/")  # nothing listens any more
