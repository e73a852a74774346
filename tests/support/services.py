"""Real service processes on free ports for the e2e tests and benches, each a one-member `ProcessGroup`
(ready when it answers; stopped with SIGTERM, then SIGKILL of its process group).

The BM25 index of the shared corpus is built once (bm25s, a few seconds) under
`var/indexes/<corpus>-<digest>` (the same folder the local stack uses) and reused afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from plugsearch.common.procgroup import ProcessGroup, ProcessGroupError, ProcessSpec
from plugsearch.common.workers import free_port

REPO = Path(__file__).resolve().parents[2]


def start_killable(module: str, env: Mapping[str, str], log: Path, *, port: int | None = None,
                   loaded: tuple[bytes, int] | None = None,
                   timeout_s: float = 240.0) -> tuple[subprocess.Popen[bytes], str]:
    """`python -m <module>` (`plugsearch.retriever`, `plugsearch.searcher`: its port setting `<NAME>_PORT`) in a
    session of its own, so that `power_cut` kills it with its workers; ready when `/health/ready` answers 200 and,
    with `loaded` = (line, n), the log holds that line n times since the start (each worker's `retriever ready in`:
    a worker still loading answers 503)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    prefix = module.rsplit(".", 1)[-1].upper()
    since = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:  # the child keeps its own copy of the file
        proc = subprocess.Popen([sys.executable, "-m", module], cwd=REPO, start_new_session=True,
                                env={**os.environ, **env, f"{prefix}_PORT": str(port)}, stdout=out,
                                stderr=subprocess.STDOUT)
    line, wanted = loaded or (b"", 0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (not wanted or log.read_bytes()[since:].count(line) >= wanted) and httpx.get(f"{url}/health/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise AssertionError(f"{module} exited ({proc.returncode}): {log.read_text()[-3000:]}")
        time.sleep(0.2)
    power_cut(proc)
    raise AssertionError(f"{module} did not get ready: {log.read_text()[-3000:]}")


def power_cut(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL of the process's whole group (its workers with it), as a power cut would; a group already gone is
    cut already."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def ensure_bm25_index(corpus: Path, var_dir: Path) -> Path:
    """The bm25s index of `corpus` (built when missing or stale); returns the index folder."""
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings
    from plugsearch.stack.corpus import index_dir_for

    index_dir = index_dir_for(corpus, var_dir)
    settings = RetrieverSettings(corpus=corpus, index_dir=index_dir, bm25=True, dense=False,
                                 default_method="bm25")
    build(settings, bm25=["bm25s"], dense=False, force=False, show_progress=False)
    return index_dir


@contextmanager
def python_process(args: list[str], ready_url: str, log: Path, *, env: Mapping[str, str] | None = None,
                   timeout_s: float = 180.0) -> Iterator[ProcessGroup]:
    """`python <args>` from the repository with `env` added, ready when `ready_url` answers 200 (output to
    `log`); stopped on exit."""
    name = log.stem
    spec = ProcessSpec(name, [sys.executable, *args], env=dict(env or {}), ready_url=ready_url, log=log)
    try:
        group = ProcessGroup(cwd=REPO).up(spec, timeout_s=timeout_s)
    except ProcessGroupError as exc:
        raise RuntimeError(f"{ready_url}: {exc}") from exc
    with group:
        yield group


@contextmanager
def service_process(module: str, env: Mapping[str, str], port: int, log: Path,
                    timeout_s: float = 180.0) -> Iterator[str]:
    """`python -m <module>` with `env`, ready on `port` (GET /health/ready); yields its URL."""
    url = f"http://127.0.0.1:{port}"
    with python_process(["-m", module], f"{url}/health/ready", log, env=env, timeout_s=timeout_s):
        yield url


@contextmanager
def retriever_process(corpus: Path, index_dir: Path, log: Path) -> Iterator[str]:
    """The real retriever service (bm25s only) over `corpus`; yields its base URL."""
    port = free_port()
    env = {"RETRIEVER_PORT": str(port), "RETRIEVER_CORPUS": str(corpus), "RETRIEVER_INDEX_DIR": str(index_dir),
           "RETRIEVER_DENSE": "false", "RETRIEVER_BM25": "true", "RETRIEVER_BM25_BACKEND": "bm25s",
           "RETRIEVER_DEFAULT_METHOD": "bm25", "RETRIEVER_LOG_LEVEL": "warning"}
    with service_process("plugsearch.retriever", env, port, log) as url:
        yield url


@contextmanager
def scripted_policy_process(log: Path, model: str = "scripted-policy") -> Iterator[str]:
    """`tests.support.fake_llm` answering as the scripted policy (`tests.support.fake_policy`: valid
    s3 / QAgent actions, instantly, deterministic); yields its OpenAI base URL (`.../v1`)."""
    port = free_port()
    args = ["-m", "tests.support.fake_llm", "--port", str(port), "--model", model,
            "--responder", "tests.support.fake_policy:respond"]
    with python_process(args, f"http://127.0.0.1:{port}/v1/models", log):
        yield f"http://127.0.0.1:{port}/v1"


@contextmanager
def searcher_process(retriever_url: str, policy_base_url: str, log: Path, *, policy_model: str | None = None,
                     extra: Mapping[str, Any] | None = None) -> Iterator[str]:
    """The searcher service against a retriever and an OpenAI-compatible policy; yields its base URL."""
    port = free_port()
    env = {"SEARCHER_PORT": str(port), "SEARCHER_RETRIEVER__URL": retriever_url,
           "SEARCHER_POLICY__BASE_URL": policy_base_url, "SEARCHER_LOG_LEVEL": "info"}
    if policy_model:
        env["SEARCHER_POLICY__MODEL"] = policy_model
    for key, value in (extra or {}).items():
        env[f"SEARCHER_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    with service_process("plugsearch.searcher", env, port, log) as url:
        yield url


def load_questions(path: Path, n: int, *, skip_yes_no: bool = True) -> list[dict[str, Any]]:
    """The first `n` questions of a QA file (yes/no questions skipped: answer recall cannot judge them)."""
    from plugsearch.common.answers import is_yes_no

    out = []
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            if skip_yes_no and is_yes_no(row["golden_answers"]):
                continue
            out.append(row)
            if len(out) >= n:
                break
    return out
