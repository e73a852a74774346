"""What the benches share: the data paths, progress lines on stderr, the question sets, the fake LLM."""

from __future__ import annotations

import sys
from pathlib import Path

from plugsearch.common.procgroup import ProcessSpec
from plugsearch.common.qa import QAItem, default_data_dir, load_qa

REPO = Path(__file__).resolve().parent.parent
DATA = default_data_dir()
CORPUS = DATA / "corpus" / "combined.jsonl"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_questions(name: str, limit: int | None = None) -> list[QAItem]:
    """The first `limit` rows (default all) of ../shared/data/qa/<name>.jsonl (the trainer's reader)."""
    return load_qa(DATA / "qa" / f"{name}.jsonl", limit)


def fake_llm_spec(port: int, latency_ms: float, responder: str = "tests.support.fake_policy:respond",
                  model: str = "fake-policy", slots: int = 0) -> ProcessSpec:
    """`tests.support.fake_llm` on `port` (process "llm"), answering with `responder` after `latency_ms`
    (`slots` > 0: that many completions at once, as llama.cpp's one)."""
    return ProcessSpec("llm", [sys.executable, "-m", "tests.support.fake_llm", "--port", str(port),
                               "--latency-ms", str(latency_ms), "--model", model, "--responder", responder,
                               "--slots", str(slots)],
                       ready_url=f"http://127.0.0.1:{port}/v1/models", port=port)
