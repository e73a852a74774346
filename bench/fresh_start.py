"""A fresh machine, measured: the README's first command from a clean clone with an empty pip cache and no var/.

    python bench/fresh_start.py                     # clone HEAD into a temporary folder, run the README's first
                                                    # command there, then the test command's install
    python bench/fresh_start.py --no-test-install   # the stack only
    python bench/fresh_start.py --source URL        # clone another repository (default: this one's HEAD)

1. `git clone` into a new temporary folder (no virtualenv, no `var/`: no index), `PIP_CACHE_DIR` a new empty
   folder (pip's own configuration, its index and find-links, stays the machine's);
2. `bash scripts/run-stack.sh --free-ports --ready-file ...` there (its install, the BM25 index, the services);
   from the start of the clone: `install_s` (the install's end), `ready_s` (the stack's ready file),
   `first_compact_search_s` (the first `POST /search` with nothing but a question answered 200 by the compact
   policy), `full_dense_pool_s` (the first one whose pool is BM25 + dense: the retriever built its dense index in
   the background and the searcher switched); then Ctrl-C (SIGINT) and the stack's exit;
3. the test command's install (`bash scripts/install.sh --all`: everything the tests use, llama-cpp-python
   compiled) into another new virtualenv of the same clone, with another empty pip cache: `test_install_s`.

The stack's log lines are passed to stderr as they come (the dense build's progress among them); the last line
on stdout is one JSON object. Measure alone on the machine: every step is CPU- and network-bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from plugsearch.common.paths import default_data_dir  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
QUESTION = "who wrote the novel the call of the wild"


def log(msg: str) -> None:
    print(f"[fresh-start] {msg}", file=sys.stderr, flush=True)


def clean_env(pip_cache: Path, venv: Path) -> dict[str, str]:
    """This process's environment without what would reuse this machine's state (a virtualenv on PATH, pip's
    cache); the data folder is this repository's (the clone lies elsewhere)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PIP_CACHE_DIR", "PLUGSEARCH_VENV")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and not (Path(p).parent / "pyvenv.cfg").is_file()]
    env.update({"PATH": os.pathsep.join(path), "PIP_CACHE_DIR": str(pip_cache), "PLUGSEARCH_VENV": str(venv),
                "PLUGSEARCH_DATA": str(default_data_dir().resolve()), "PYTHONUNBUFFERED": "1"})
    return env


class Stack:
    """`bash scripts/run-stack.sh` in the clone; its output to a log and stderr, the moments that matter."""

    def __init__(self, clone: Path, env: dict[str, str], folder: Path) -> None:
        self.ready_file = folder / "ready.json"
        self.log_path = folder / "stack.log"
        self.installed_at: float | None = None
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(["bash", "scripts/run-stack.sh", "--free-ports", "--no-color",
                                      "--ready-file", str(self.ready_file), "--ready-timeout", "1800"],
                                     cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip()
            if self.installed_at is None and not line.startswith("[install]") and not line.startswith("[run-stack]"):
                self.installed_at = time.monotonic()  # the first line of plugsearch-stack itself
            self._log.write(line + "\n")
            self._log.flush()
            print(f"  | {line}", file=sys.stderr, flush=True)

    def ready(self) -> dict[str, Any] | None:
        if self.proc.poll() is not None:
            raise SystemExit(f"the stack exited with {self.proc.returncode}: see {self.log_path}")
        return json.loads(self.ready_file.read_text()) if self.ready_file.exists() else None

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=10)
        self._log.close()
        return self.proc.returncode


def compact_pool(client: httpx.Client, url: str, question: str) -> list[str] | None:
    """The first retrieval's methods of a default search answered by the compact policy (None: not that yet)."""
    try:
        response = client.post(f"{url}/search", json={"question": question, "return_trace": True})
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    body = response.json()
    if not str(body.get("policy_model") or "").startswith("compact") or body.get("degraded"):
        return None
    return [b.get("method") or "default" for b in body["trace"]["blocks"] if b["turn"] == 0]


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="fresh-start-", dir=args.tmp))
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                              "folder": str(work)}
    try:
        t0 = time.monotonic()
        clone = work / "clone"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", args.source, str(clone)], check=True)
        result["clone_s"] = round(time.monotonic() - t0, 1)
        assert not (clone / "var").exists() and not (clone / ".venv").exists()
        env = clean_env(work / "pip-cache", clone / ".venv")
        log(f"clone in {result['clone_s']} s; bash scripts/run-stack.sh (pip cache {work / 'pip-cache'}, empty)")
        stack = Stack(clone, env, work)
        try:
            info = None
            while info is None:
                if time.monotonic() - t0 > args.timeout:
                    raise SystemExit("the stack was not ready in time")
                info = stack.ready()
                time.sleep(0.5)
            result["install_s"] = round((stack.installed_at or time.monotonic()) - t0, 1)
            result["ready_s"] = round(time.monotonic() - t0, 1)
            url = info["searcher"]
            with httpx.Client(timeout=120) as client:
                pool = None
                i = 0
                while pool is None:
                    pool = compact_pool(client, url, QUESTION)
                    i += 1
                    if pool is None:
                        time.sleep(0.5)
                result["first_compact_search_s"] = round(time.monotonic() - t0, 1)
                result["first_pool"] = "+".join(pool)
                log(f"first compact search at {result['first_compact_search_s']} s (pool {result['first_pool']})")
                while pool != ["bm25", "dense"]:
                    if time.monotonic() - t0 > args.timeout:
                        raise SystemExit("the dense pool was not served in time")
                    time.sleep(5)
                    i += 1
                    pool = compact_pool(client, url, f"{QUESTION} ({i})") or pool
                result["full_dense_pool_s"] = round(time.monotonic() - t0, 1)
                log(f"full dense pool at {result['full_dense_pool_s']} s")
        finally:
            result["stack_exit"] = stack.stop()
        if args.test_install:
            log("the test command's install: bash scripts/install.sh --all (new virtualenv, empty pip cache)")
            t1 = time.monotonic()
            done = subprocess.run(["bash", "scripts/install.sh", "--all"], cwd=clone,
                                  env=clean_env(work / "pip-cache-test", work / "test-venv"),
                                  stdout=sys.stderr, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            result["test_install_s"] = round(time.monotonic() - t1, 1)
            result["test_install_rc"] = done.returncode
        return result
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--source", default=str(REPO), help="the repository to clone (default: this one, HEAD)")
    parser.add_argument("--tmp", default=None, help="where the temporary folder goes (default: the system's)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the stack and its dense pool")
    parser.add_argument("--no-test-install", dest="test_install", action="store_false",
                        help="skip the test command's install")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (clone, logs, virtualenvs)")
    args = parser.parse_args()
    print(json.dumps(run(args)), flush=True)


if __name__ == "__main__":
    main()
