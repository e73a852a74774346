"""`plugsearch-stack` when things go wrong, with real processes: a service that never gets ready, and
a service that dies at start. Either way the stack exits non-zero, says why, and leaves no process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plugsearch.common.workers import free_port
from tests.e2e.test_stack import alive, descendants, log_tail

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def run_stack(tmp_path: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None,
              timeout_s: float = 240.0) -> tuple[int, str, dict[int, str]]:
    """Run the stack on a small real corpus (first 500 passages of the shared one) until it exits."""
    corpus = tmp_path / "small.jsonl"
    with (data_dir / "corpus" / "combined.jsonl").open() as src:
        corpus.write_text("".join(next(src) for _ in range(500)))
    log = tmp_path / "stack.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "plugsearch.stack", "--free-ports", "--no-color", "--no-redis",
                                 "--corpus", str(corpus), "--var-dir", str(tmp_path / "var"), *args],
                                cwd=REPO, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        seen.update(descendants(proc.pid))
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(timeout=30)
            pytest.fail(f"stack still running after {timeout_s:g} s:\n{log_tail(log)}")
        time.sleep(0.2)
    time.sleep(0.5)
    return proc.returncode, log.read_text(errors="replace"), seen


def test_a_service_that_never_gets_ready_stops_the_stack(tmp_path: Path, data_dir: Path) -> None:
    # An LLM endpoint where nothing listens: generator and judge stay not ready (the searcher is ready:
    # without its policy it degrades to naive top-k).
    code, output, seen = run_stack(tmp_path, data_dir, "--llm-url", f"http://127.0.0.1:{free_port()}/v1",
                                   "--ready-timeout", "15")
    assert code == 1, output[-4000:]
    (line,) = [ln for ln in output.splitlines() if "error: not ready within 15 s" in ln]
    not_ready = set(line.split(": ", 2)[2].split(" (")[0].split(", "))
    assert {"generator", "judge"} <= not_ready  # (the retriever may still be loading on a busy machine)
    assert not_ready <= {"generator", "judge", "retriever", "searcher"}
    assert seen and not alive(seen), output[-4000:]


def test_a_service_that_dies_at_start_stops_the_others(tmp_path: Path, data_dir: Path) -> None:
    # An impossible generator setting: its settings validation fails at start and the process exits.
    code, output, seen = run_stack(tmp_path, data_dir, "--llm-url", f"http://127.0.0.1:{free_port()}/v1",
                                   env={"GENERATOR_MIN_DOCUMENT_TOKENS": "5000"})
    assert code not in (0, 130), output[-4000:]
    assert "generator stopped (rc=2)" in output  # a bad setting: one line, exit 2 (plugsearch.common.process.entrypoint)
    assert "generator: invalid configuration: " in output
    assert "plugsearch is ready" not in output
    assert seen and not alive(seen), output[-4000:]
