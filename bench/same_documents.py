"""The same 3 documents however the searcher is started: `plugsearch-stack`, docker compose, or the bare service
(`python -m plugsearch.searcher` with only its retriever's URL and token set) asked the same evaluation questions
with nothing but the question (every setting the service's own: the compact policy's manifest).

    python bench/same_documents.py                           # starts plugsearch-stack, and a bare searcher on its
                                                             # retriever; compose if --compose-url is given
    python bench/same_documents.py --compose-url http://127.0.0.1:8000 --compose-key KEY
    python bench/same_documents.py --stack-url URL --bare-url URL   # searchers already running

Questions: rows 0-99 of the evaluation sets (nq, hotpotqa, 2wikimultihopqa, popqa; yes/no left out), the
first `--questions` (default 50) taken round-robin. Before asking, each searcher must serve the pool the
policy was trained on (bm25 + dense: `--wait-dense` seconds, default 1800, for a retriever still building its
dense index). Prints progress on stderr and one JSON line last: per searcher its policy and pool, and how many
questions got the same documents (ids, in order) from all of them, with the first differences.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, load_questions, log  # noqa: E402
from plugsearch.common.answers import is_yes_no  # noqa: E402
from plugsearch.common.workers import free_port  # noqa: E402

SETS = ("nq", "hotpotqa", "2wikimultihopqa", "popqa")


def questions(n: int) -> list[str]:
    """The first `n` evaluation questions (rows 0-99), round-robin over the sets, yes/no left out."""
    per_set = [[q.question for q in load_questions(name, 100) if not is_yes_no(q.golden_answers)] for name in SETS]
    out: list[str] = []
    for i in range(100):
        for rows in per_set:
            if i < len(rows) and len(out) < n:
                out.append(rows[i])
    return out


def search(client: httpx.Client, url: str, question: str, key: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for attempt in range(5):
        response = client.post(f"{url}/search", json={"question": question, "return_trace": True}, headers=headers)
        if response.status_code in (429, 503) and attempt < 4:
            time.sleep(float(response.headers.get("Retry-After", "1")))
            continue
        response.raise_for_status()
        body: dict[str, Any] = response.json()
        return body
    raise RuntimeError("unreachable")


def pool_of(body: dict[str, Any]) -> list[str]:
    return [b.get("method") or "default" for b in (body.get("trace") or {}).get("blocks", []) if b["turn"] == 0]


def wait_for_dense(client: httpx.Client, name: str, url: str, key: str | None, seconds: float) -> list[str]:
    """Ask until the searcher's pool is the trained one (bm25 + dense); returns the pool it settled on."""
    deadline = time.monotonic() + seconds
    i = 0
    while True:
        body = search(client, url, f"who wrote the novel the call of the wild ({name} {i})", key)
        pool = pool_of(body)
        if pool == ["bm25", "dense"] or time.monotonic() > deadline:
            return pool
        if i % 12 == 0:
            log(f"{name}: pool {'+'.join(pool)}, waiting for the dense index")
        i += 1
        time.sleep(5)


class Started:
    """Processes this bench starts: `plugsearch-stack` and a bare searcher on its retriever."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[bytes]] = []

    def stack(self, timeout_s: float) -> dict[str, Any]:
        ready = self.folder / "ready.json"
        log_file = (self.folder / "stack.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.stack", "--free-ports", "--no-color",
                                 "--ready-file", str(ready)], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"plugsearch-stack did not start: see {self.folder / 'stack.log'}")
            time.sleep(0.5)
        info: dict[str, Any] = json.loads(ready.read_text())
        return info

    def bare(self, retriever_url: str, token: str, timeout_s: float = 120.0) -> str:
        """`python -m plugsearch.searcher` with only its retriever's URL (and the token that retriever requires)."""
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SEARCHER_")}
        env.update({"SEARCHER_PORT": str(port), "SEARCHER_RETRIEVER__URL": retriever_url,
                    "SEARCHER_RETRIEVER__TOKEN": token})
        log_file = (self.folder / "bare.log").open("wb")
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.searcher"], cwd=REPO, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.5)
        raise SystemExit(f"the bare searcher did not start: see {self.folder / 'bare.log'}")

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT if proc is self.procs[0] else signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--stack-url", help="a running plugsearch-stack's searcher (default: start one)")
    parser.add_argument("--bare-url", help="a running bare searcher (default: start one on the stack's retriever)")
    parser.add_argument("--compose-url", help="the compose stack's searcher (skipped when not given)")
    parser.add_argument("--compose-key", default=os.environ.get("PLUGSEARCH_API_KEYS", "").split(",")[0] or None,
                        help="its API key (default: the first of PLUGSEARCH_API_KEYS)")
    parser.add_argument("--wait-dense", type=float, default=1800.0,
                        help="seconds each searcher may take to serve the bm25 + dense pool before the questions")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    args = parser.parse_args()

    asked = questions(args.questions)
    folder = Path(tempfile.mkdtemp(prefix="same-documents-"))
    started = Started(folder)
    try:
        urls: dict[str, tuple[str, str | None]] = {}
        if args.stack_url:
            urls["plugsearch-stack"] = (args.stack_url, None)
        if args.bare_url:
            urls["bare service"] = (args.bare_url, None)
        if not args.stack_url or not args.bare_url:
            log("starting plugsearch-stack (free ports)")
            info = started.stack(args.start_timeout)
            urls.setdefault("plugsearch-stack", (info["searcher"], None))
            if not args.bare_url:
                log("starting the bare searcher: python -m plugsearch.searcher with its retriever's URL only")
                urls["bare service"] = (started.bare(info["urls"]["retriever"], info["internal_token"]), None)
        if args.compose_url:
            urls["docker compose"] = (args.compose_url, args.compose_key)
        with httpx.Client(timeout=120) as client:
            described: dict[str, dict[str, Any]] = {}
            for name, (url, key) in urls.items():
                pool = wait_for_dense(client, name, url, key, args.wait_dense)
                version = client.get(f"{url}/version", headers={"Authorization": f"Bearer {key}"} if key else {})
                details = version.json().get("details", {}) if version.status_code == 200 else {}
                described[name] = {"url": url, "pool": "+".join(pool), "policy_model": details.get("policy_model"),
                                   "s3_defaults": (details.get("defaults") or {}).get("s3")}
                log(f"{name}: {described[name]}")
            answers: dict[str, list[list[str]]] = {name: [] for name in urls}
            for i, question in enumerate(asked):
                for name, (url, key) in urls.items():
                    body = search(client, url, question, key)
                    answers[name].append([d["id"] for d in body["documents"]])
                    described[name]["policy_model"] = described[name]["policy_model"] or body.get("policy_model")
                if (i + 1) % 10 == 0:
                    log(f"{i + 1} / {len(asked)} questions asked")
        names = list(urls)
        same = [i for i in range(len(asked)) if all(answers[n][i] == answers[names[0]][i] for n in names)]
        differing = [{"question": asked[i], **{n: answers[n][i] for n in names}}
                     for i in range(len(asked)) if i not in set(same)][:5]
        print(json.dumps({"questions": len(asked), "searchers": described, "same_documents": len(same),
                          "all_same": len(same) == len(asked) and len(names) > 1, "differing": differing}))
    finally:
        started.close()


if __name__ == "__main__":
    main()
