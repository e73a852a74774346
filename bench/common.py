"""What the benches share: the data paths, progress lines on stderr, the question sets, the fake LLM."""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

from services.common.procgroup import ProcessSpec

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("PLUGSEARCH_DATA", REPO.parent / "shared" / "data"))
CORPUS = DATA / "corpus" / "combined.jsonl"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_questions(name: str, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` rows (default all) of ../shared/data/qa/<name>.jsonl."""
    with (DATA / "qa" / f"{name}.jsonl").open(encoding="utf-8") as fh:
        return [json.loads(line) for line in itertools.islice(fh, limit)]


def fake_llm_spec(port: int, latency_ms: float, responder: str = "tests.support.fake_policy:respond",
                  model: str = "fake-policy") -> ProcessSpec:
    """`tests.support.fake_llm` on `port` (process "llm"), answering with `responder` after `latency_ms`."""
    return ProcessSpec("llm", [sys.executable, "-m", "tests.support.fake_llm", "--port", str(port),
                               "--latency-ms", str(latency_ms), "--model", model, "--responder", responder],
                       ready_url=f"http://127.0.0.1:{port}/v1/models", port=port)
