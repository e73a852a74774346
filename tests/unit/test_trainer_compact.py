"""`plugsearch-train compact` end to end on the shared corpus (the retriever's own bm25s and MiniLM FAISS
backends, in-process, over the stack's index folder): a tiny warm start and RL run with the dense pool, its
resumption, the rows it may train on, and `compact-export`'s verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.searcher.compact import CompactPolicy
from services.stack import index_dir_for
from trainer.cli import main
from trainer.common.evaluation import beats_naive
from trainer.compact.config import CompactConfig
from trainer.compact.data import load_items


def test_training_rows_start_at_200_and_never_use_the_evaluation_only_sets(data_dir: Path) -> None:
    train, dev = load_items(data_dir, CompactConfig(datasets=("nq",), per_dataset=5,
                                                                    dev_per_dataset=2))
    assert [i.item.id for i in train] == [f"nq-lim-{n:04d}" for n in range(200, 205)]
    assert [i.item.id for i in dev] == ["nq-lim-0205", "nq-lim-0206"]
    with pytest.raises(ValueError, match="never trained on"):
        load_items(data_dir, CompactConfig(datasets=("musique",)))
    with pytest.raises(ValueError, match="reserved"):
        load_items(data_dir, CompactConfig(offset=100))


def test_compact_training_run_resumes_and_exports(data_dir: Path, var_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PLUGSEARCH_DATA", str(data_dir))
    out = tmp_path / "run"
    # the stack's index folder for this corpus: its dense index is built once for this test and the stack's
    index_dir = index_dir_for(data_dir / "corpus" / "combined.jsonl", var_dir)
    argv = ["compact", "--per-dataset", "3", "--dev-per-dataset", "1", "--warm-epochs", "1", "--steps", "2",
            "--questions-per-step", "2", "--group", "2", "--index-dir", str(index_dir), "--out", str(out), "--quiet"]
    main(argv)
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = CompactPolicy.load(out / "final")
    assert final.manifest["config"]["offset"] == 200 and final.manifest["search"]["retrieve_k"] == 30
    assert final.manifest["rl"]["steps"] == 2 and (out / "rl" / "reward_curve.png").is_file()
    # both scorers, the dense one for the encoder it was trained with, and the pool it asks for
    assert final.has_dense and final.dense_encoder == "all-MiniLM-L6-v2"
    assert final.manifest["search"]["pool_methods"] == ["bm25", "dense"]
    assert final.pool_methods(["bm25", "dense", "hybrid"], "all-MiniLM-L6-v2") == ["bm25", "dense"]
    assert set(first["rl_dev"]) >= {"nq", "hotpotqa", "2wikimultihopqa", "popqa"}
    rewards = [json.loads(line) for line in (out / "rl" / "rewards.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rewards] == [0, 1]
    # a rerun with more steps keeps the warm start and the saved RL state, and adds only the new steps
    warm_digest = CompactPolicy.load(out / "warmstart").digest
    more = list(argv)
    more[more.index("--steps") + 1] = "3"
    main(more)
    assert CompactPolicy.load(out / "warmstart").digest == warm_digest
    rewards = [json.loads(line) for line in (out / "rl" / "rewards.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rewards] == [0, 1, 2]

    evaluation = {"datasets": {name: {"budget3": {"answer_recall": {"compact_rl_minus_naive": gain}}}
                               for name, gain in (("hotpotqa", 0.05), ("nq", -0.01))},
                  "all": {"budget3": {"answer_recall": {"compact_rl_minus_naive_ci95": [0.01, 0.09]}}}}
    (tmp_path / "eval.json").write_text("log line\n" + json.dumps(evaluation) + "\n")
    main(["compact-export", str(out / "final"), str(tmp_path / "shipped"), "--evaluation", str(tmp_path / "eval.json")])
    shipped = CompactPolicy.load(tmp_path / "shipped")
    assert shipped.digest == final.digest and shipped.manifest["evaluation"]["beats_naive"] is True


def test_the_verdict_needs_a_positive_interval_and_no_set_losing() -> None:
    def evaluation(low: float, gains: dict[str, float]) -> dict[str, object]:
        return {"datasets": {n: {"budget3": {"answer_recall": {"compact_rl_minus_naive": g}}} for n, g in gains.items()},
                "all": {"budget3": {"answer_recall": {"compact_rl_minus_naive_ci95": [low, 0.1]}}}}

    assert beats_naive(evaluation(0.01, {"a": 0.1, "b": -0.02}))
    assert not beats_naive(evaluation(0.0, {"a": 0.1}))
    assert not beats_naive(evaluation(0.02, {"a": 0.1, "b": -0.03}))
    assert not beats_naive(evaluation(0.02, {}))
