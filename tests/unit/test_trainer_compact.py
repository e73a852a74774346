"""`plugsearch-train compact` end to end on the shared corpus (the retriever's own bm25s and MiniLM FAISS
backends, in-process, over the stack's index folder): a tiny warm start and RL run with the dense pool, its
resumption, the rows it may train on, and `compact-export`'s verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugsearch.searcher.compact import CompactPolicy
from plugsearch.stack.corpus import index_dir_for
from plugsearch.trainer.cli import main
from plugsearch.trainer.common.evaluation import beats_naive
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.data import load_items


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


def user_files(data_dir: Path, folder: Path, rows: range = range(200, 280), distractors: int = 40,
               by_ids: bool = False) -> tuple[Path, Path]:
    """A user's corpus and questions, as plain files: 2WikiMultihopQA rows 200+ (never the evaluation rows) and
    their supporting passages plus a few others; `by_ids`: every other question labelled by the ids of its
    supporting passages (BEIR / TREC qrels style) instead of its answers."""
    folder.mkdir(parents=True, exist_ok=True)
    with (data_dir / "qa" / "2wikimultihopqa.jsonl").open() as fh:
        questions = [json.loads(line) for i, line in enumerate(fh) if i in rows]
    titles = {t for q in questions for t in q["supporting_titles"]}
    passages, other = [], 0
    with (data_dir / "corpus" / "2wikimultihopqa.jsonl").open() as fh:
        for line in fh:
            title = json.loads(line)["title"]
            if title in titles or other < distractors:
                passages.append(line)
                other += title not in titles
    corpus, qa = folder / "my-corpus.jsonl", folder / "my-questions.jsonl"
    corpus.write_text("".join(passages))
    ids: dict[str, list[str]] = {}
    for line in passages:
        row = json.loads(line)
        ids.setdefault(row["title"], []).append(row["id"])
    rows_out = []
    for i, q in enumerate(questions):
        row = {k: q[k] for k in ("id", "question", "golden_answers", "supporting_titles")}
        if by_ids and i % 2:
            row.pop("golden_answers")
            row["passage_ids"] = [pid for t in q["supporting_titles"] for pid in ids.get(t, [])]
        rows_out.append(row)
    qa.write_text("".join(json.dumps(row) + "\n" for row in rows_out))
    return corpus, qa


def test_a_tiny_run_on_a_users_files_resumes_exports_and_is_served_on_its_corpus_only(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plugsearch.stack import StackError
    from plugsearch.stack.policy import check_policy_corpus

    corpus, qa = user_files(data_dir, tmp_path / "mine", by_ids=True)  # half labelled by answers, half by ids
    out, var = tmp_path / "run", tmp_path / "var"
    # the first round's learner (from the shipped policy) with a given pull (no choice on dev folds, and RL runs,
    # pulled toward the warm start)
    argv = ["compact", "--corpus", str(corpus), "--qa", str(qa), "--warm-epochs", "1", "--steps", "2",
            "--questions-per-step", "2", "--group", "2", "--start", "shipped", "--pull", "0.1", "--out", str(out),
            "--var-dir", str(var), "--quiet"]
    main(argv)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["learner"]["pull"] == "0.1" and result["learner"]["how"] == "given"
    split = json.loads((out / "split.json").read_text())
    assert set(split["eval"]).isdisjoint(split["train"] + split["dev"]) and split["seed"] == 0
    assert result["questions"] == split["sizes"] and split["sizes"]["eval"] >= 20
    assert result["left_out"]["yes_no"] == split["left_out"]["yes_no"]["count"]
    by_ids = {json.loads(line)["id"] for line in qa.read_text().splitlines() if "passage_ids" in json.loads(line)}
    used = set(split["train"] + split["dev"] + split["eval"])
    assert len(by_ids & used) >= 35 and by_ids & set(split["eval"])  # labelled by passage ids: used like the rest
    # the policy folder: weights, manifest with its setting, corpus identity and verdict, the report beside it
    policy = CompactPolicy.load(Path(result["policy"]))
    manifest = policy.manifest
    assert manifest["search"] == {"mode": "s3", "retrieve_k": 30, "select_k": 3, "max_turns": 2, "method": "bm25",
                                  "pool_methods": ["bm25", "dense"]}
    assert manifest["corpus"]["bound"] and manifest["corpus"]["file"] == "my-corpus.jsonl"
    assert manifest["corpus"]["encoder"] == policy.dense_encoder == "all-MiniLM-L6-v2"
    assert manifest["evaluation"]["beats_naive"] == result["beats_naive"]
    evaluated = manifest["evaluation"]["bench"]["all"]["budget3"]["answer_recall"]
    assert {"naive_bm25", "naive_dense", "naive_hybrid", "compact_warm", "compact_rl"} <= set(evaluated)
    assert manifest["evaluation"]["bench"]["all"]["n"] == split["sizes"]["eval"]
    report = (out / "report" / "report.md").read_text()
    assert "naive BM25 top-3" in report and f"beats_naive: {str(result['beats_naive']).lower()}" in report
    assert (out / "policy" / "report.png").stat().st_size > 10_000
    # resumed with more steps: the warm start and the split are reused, only the new RL step runs
    warm = CompactPolicy.load(out / "warmstart").digest
    more = list(argv)
    more[more.index("--steps") + 1] = "3"
    main(more)
    capsys.readouterr()
    assert CompactPolicy.load(out / "warmstart").digest == warm
    assert json.loads((out / "split.json").read_text())["eval"] == split["eval"]
    assert [json.loads(line)["step"] for line in (out / "rl" / "rewards.jsonl").read_text().splitlines()] == [0, 1, 2]
    # served on its own corpus only
    served = CompactPolicy.load(out / "policy")
    check_policy_corpus(served, corpus, True, environ={})
    with pytest.raises(StackError, match="trained on my-corpus.jsonl"):
        check_policy_corpus(served, data_dir / "corpus" / "2wikimultihopqa.jsonl", True, environ={})


def test_bad_user_data_is_refused_before_any_work(data_dir: Path, tmp_path: Path) -> None:
    corpus, qa = user_files(data_dir, tmp_path / "mine", rows=range(200, 230), distractors=0)
    var = tmp_path / "var"
    base = ["compact", "--corpus", str(corpus), "--out", str(tmp_path / "run"), "--var-dir", str(var), "--quiet"]
    with pytest.raises(SystemExit, match="too few questions to split"):
        main([*base, "--qa", str(qa)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "Who?", "golden_answers": []}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl: 1 bad row\(s\): line 1: `golden_answers` must be a non-empty"):
        main([*base, "--qa", str(bad)])
    with pytest.raises(SystemExit, match="--datasets choose rows of the shipped sets"):
        main([*base, "--qa", str(qa), "--datasets", "nq"])
    # the shipped evaluation rows cannot come in through a user's file
    held = tmp_path / "held.jsonl"
    with (data_dir / "qa" / "nq.jsonl").open() as fh:
        held.write_text("".join(line for _, line in zip(range(60), fh, strict=False)))
    with pytest.raises(SystemExit, match="held-out rows of the shipped sets"):
        main(["compact", "--qa", str(held), "--out", str(tmp_path / "held"), "--var-dir", str(var), "--quiet"])
    assert not (var / "indexes").exists()  # refused before any index was built


def wiki_corpus(data_dir: Path, out: Path, n: int = 600) -> Path:
    """The first `n` passages of 2WikiMultihopQA's corpus file (titles that other passages mention)."""
    with (data_dir / "corpus" / "2wikimultihopqa.jsonl").open() as fh:
        out.write_text("".join(line for _, line in zip(range(n), fh, strict=False)))
    return out


def test_a_corpus_alone_trains_its_searcher_without_matplotlib(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The default install has no matplotlib: the run completes without its charts. With --corpus and no --qa the
    questions are made from the passages; the final line names the folder to serve first, and the report compares
    the trained policy with the shipped one and says which to serve."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on `bash scripts/install.sh`: not importable
    corpus = wiki_corpus(data_dir, tmp_path / "docs.jsonl", n=1500)
    out = tmp_path / "run"
    argv = ["compact", "--corpus", str(corpus), "--pseudo", "150", "--no-dense", "--warm-epochs", "1", "--steps",
            "2", "--questions-per-step", "2", "--group", "2", "--out", str(out), "--var-dir", str(tmp_path / "var"),
            "--quiet"]
    main(argv)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last)
    assert list(result)[:2] == ["policy", "serve"] and result["policy"] == str(out / "policy")
    assert f"plugsearch-stack --corpus {corpus}" in result["serve"] and result["png"] is None
    rows = [json.loads(line) for line in (out / "pseudo_questions.jsonl").read_text().splitlines()]
    assert 100 <= len(rows) <= 150 and all(r["golden_answers"][0] and r["dataset"] == "pseudo" for r in rows)
    texts = {json.loads(line)["id"]: json.loads(line)["text"] for line in corpus.read_text().splitlines()}
    assert all(r["golden_answers"][0] in texts[r["passage_id"]] for r in rows)  # the answer is in its passage
    assert all(r["golden_answers"][0] not in r["question"] for r in rows)
    manifest = CompactPolicy.load(out / "policy").manifest
    assert manifest["trained_on"]["pseudo"] == len(json.loads((out / "split.json").read_text())["train"])
    assert {k: v for k, v in manifest["trained_on"].items() if k != "pseudo"} == dict.fromkeys(
        ("labelled", "feedback", "shipped", "llm"), 0)
    made = manifest["pseudo_questions"]
    assert made["kept"] == len(rows) and made["naive_bm25_top3_misses"] >= made["kept"] // 2
    versus = manifest["evaluation"]["versus_shipped"]
    assert versus["n"] == manifest["evaluation"]["bench"]["all"]["n"] and len(versus["ci95"]) == 2
    assert manifest["evaluation"]["questions"] == "pseudo" and result["serve"].startswith("not known")
    report = (out / "report" / "report.md").read_text()
    assert "shipped compact policy" in report and "**Which to serve**: not known" in report
    assert not (out / "report" / "report.png").exists() and not (out / "policy" / "report.png").exists()
    # a rerun reuses the questions it made
    main(argv)
    assert [json.loads(line) for line in (out / "pseudo_questions.jsonl").read_text().splitlines()] == rows


def test_a_corpus_too_small_to_make_questions_from_is_refused(data_dir: Path, tmp_path: Path) -> None:
    corpus = wiki_corpus(data_dir, tmp_path / "small.jsonl", n=20)
    with pytest.raises(SystemExit, match="too small or too uniform"):
        main(["compact", "--corpus", str(corpus), "--no-dense", "--out", str(tmp_path / "run"), "--var-dir",
              str(tmp_path / "var"), "--quiet"])


def test_a_duplicate_passage_id_is_one_line_before_anything_is_written(data_dir: Path, tmp_path: Path) -> None:
    corpus, qa = user_files(data_dir, tmp_path / "mine", rows=range(200, 260), distractors=5)
    lines = corpus.read_text().splitlines(keepends=True)
    first = json.loads(lines[0])["id"]
    corpus.write_text("".join(lines[:3] + [json.dumps({"id": first, "title": "x", "text": "again"}) + "\n"]
                              + lines[3:]))
    out, var = tmp_path / "run", tmp_path / "var"
    with pytest.raises(SystemExit) as stopped:
        main(["compact", "--corpus", str(corpus), "--qa", str(qa), "--out", str(out), "--var-dir", str(var), "--quiet"])
    message = str(stopped.value)
    assert message == f"error: {corpus}:4: passage id {first!r} is used again (first at line 1); every passage " \
                      "needs its own id"
    assert not out.exists() and not var.exists()


def test_ctrl_c_stops_with_one_line_and_the_command_to_resume(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import plugsearch.trainer.compact.run as compact_run

    def interrupted(job: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(compact_run, "run", interrupted)
    with pytest.raises(SystemExit) as stopped:
        main(["compact", "--out", str(tmp_path / "run"), "--steps", "5"])
    assert stopped.value.code == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"interrupted: what is finished is kept (split, indexes, warm start, RL state); resume with: "
                   f"plugsearch-train compact --out {tmp_path / 'run'} --steps 5"]


def test_which_policy_to_serve_follows_the_paired_intervals() -> None:
    from plugsearch.trainer.compact.run import recommendation, versus_shipped

    rows = [{"scores": {"3": {"compact_rl": {"hit": float(i % 2)}, "compact_shipped": {"hit": 0.0}}}}
            for i in range(40)]
    versus = versus_shipped(rows)
    assert versus["trained"] == 0.5 and versus["shipped"] == 0.0 and versus["ci95"][0] > 0
    assert recommendation(True, versus, "TRAINED", "SHIPPED").startswith("serve the trained policy: it beats")
    assert recommendation(False, versus, "TRAINED", "SHIPPED").endswith("SHIPPED")
    worse = {"difference": -0.2, "ci95": [-0.3, -0.1]}
    assert recommendation(True, worse, "TRAINED", "SHIPPED").startswith("the shipped policy finds more")
    tie = {"difference": 0.0, "ci95": [-0.1, 0.1]}
    assert "not measurable" in recommendation(True, tie, "TRAINED", "SHIPPED")


def test_questions_labelled_by_passage_ids_are_read_checked_and_scored(tmp_path: Path) -> None:
    """BEIR / TREC-style labels: the ids of the passages that answer a question, instead of its answers."""
    from plugsearch.common.qa import QAFileError, QAItem, answerable, found, read_qa_file
    from plugsearch.common.schemas.base import Document

    qa = tmp_path / "qrels.jsonl"
    qa.write_text("\n".join(json.dumps(r) for r in (
        {"id": "q1", "question": "what does the policy say about cookies?", "passage_ids": ["p2", "p9"]},
        {"id": "q2", "question": "who founded it?", "relevant_ids": ["p1"], "golden_answers": ["Ada"]},
        {"id": "q3", "question": "unknown?", "gold_passage_ids": ["p404"]})) + "\n")
    q1, q2, q3 = read_qa_file(qa)
    assert q1.passage_ids == ["p2", "p9"] and q1.golden_answers == [] and q2.passage_ids == ["p1"]
    docs = [Document(id="p1", title="", text="nothing here"), Document(id="p2", title="", text="cookies policy")]
    assert found(docs, q1) and found(docs[:1], q2) and not found(docs[:1], q1)
    assert found([Document(id="p7", title="", text="Ada founded it")], q2)  # or by its answer
    assert answerable([q1, q2, q3], [("p1", "x"), ("p2", "y")]) == {"q1", "q2"}
    bad = tmp_path / "bad.jsonl"
    for row, message in (({"question": "x?"}, "no `golden_answers`"), ({"question": "x?", "passage_ids": []},
                                                                        "`passage_ids` must be a non-empty list")):
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(QAFileError, match=message):
            read_qa_file(bad)
    with pytest.raises(ValueError, match="golden_answers or passage_ids"):
        QAItem(id="x", question="x?")


def test_shipped_questions_are_mixed_in_evenly_each_with_the_shared_corpus_s_retriever(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--shipped N`: N training rows (200+, never the RL-dev rows) of the shipped sets, drawn evenly across
    them, each searched over the shared corpus (its own retriever), not the user's."""
    from plugsearch.trainer.compact import run as compact_run

    made: list[Path] = []

    class Retriever:
        def __init__(self, corpus: Path, index_dir: Path, **_: object) -> None:
            made.append(corpus)

    monkeypatch.setattr(compact_run, "IndexRetriever", Retriever)
    job = compact_run.CompactRun(config=CompactConfig(per_dataset=30, dev_per_dataset=5), out=tmp_path / "run",
                                 command="", shipped=40, var_dir=tmp_path / "var")
    items = compact_run.shipped_items(data_dir, job)
    assert len(items) == 40 and made == [(data_dir / "corpus" / "combined.jsonl").resolve()]
    assert all(isinstance(i.retriever, Retriever) for i in items) and len({id(i.retriever) for i in items}) == 1
    sets = [i.item.dataset for i in items]
    assert {s: sets.count(s) for s in set(sets)} == {"nq": 10, "hotpotqa": 10, "2wikimultihopqa": 10, "popqa": 10}
    train, dev = load_items(data_dir, job.config)
    ids = {i.item.id for i in items}
    assert ids <= {i.item.id for i in train} and not ids & {i.item.id for i in dev}  # rows 200+, never RL-dev
    assert [i.item.id for i in compact_run.shipped_items(data_dir, job)] == [i.item.id for i in items]  # seeded


def test_shipped_needs_questions_of_the_user_s_own_and_the_recall_reward(data_dir: Path, tmp_path: Path) -> None:
    base = ["compact", "--out", str(tmp_path / "run"), "--var-dir", str(tmp_path / "var"), "--quiet"]
    with pytest.raises(SystemExit, match="--shipped adds the shipped Wikipedia questions to your own"):
        main([*base, "--shipped", "10"])
    corpus = wiki_corpus(data_dir, tmp_path / "docs.jsonl", n=50)
    with pytest.raises(SystemExit, match="--shipped works with the recall reward"):
        main([*base, "--corpus", str(corpus), "--shipped", "10", "--reward", "gbr"])
    with pytest.raises(SystemExit):
        main([*base, "--corpus", str(corpus), "--shipped", "-1"])
    assert not (tmp_path / "var").exists()


def test_a_few_questions_and_users_marks_train_and_are_judged_on_the_held_back_file(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """25 labelled questions and 10 marked searches train (no split needs 45); the --eval-qa file alone judges
    the policy; the manifest says what it learnt from and what it was judged on."""
    corpus, qa = user_files(data_dir, tmp_path / "mine", rows=range(200, 265), distractors=40)
    rows = [json.loads(line) for line in qa.read_text().splitlines()]
    ids: dict[str, list[str]] = {}
    for line in corpus.read_text().splitlines():
        passage = json.loads(line)
        ids.setdefault(passage["title"], []).append(passage["id"])
    train, marked, held = tmp_path / "train.jsonl", tmp_path / "marks.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:25]))
    # a user marked the first supporting passage as helpful and the other one's as not
    marked.write_text("".join(json.dumps({"id": f"search-{i}", "question": r["question"], "source": "feedback",
                                          "passage_ids": ids[r["supporting_titles"][0]][:1],
                                          "negative_ids": ids[r["supporting_titles"][-1]], "answer": None}) + "\n"
                              for i, r in enumerate(rows[25:35]) if len(set(r["supporting_titles"])) > 1))
    held.write_text("".join(json.dumps(r) + "\n" for r in rows[35:]))
    out = tmp_path / "run"
    main(["compact", "--corpus", str(corpus), "--qa", str(train), "--feedback", str(marked), "--eval-qa", str(held),
          "--no-dense", "--warm-epochs", "2", "--steps", "2", "--questions-per-step", "2", "--group", "2",
          "--negative-weight", "2", "--start", "shipped", "--out", str(out), "--var-dir", str(tmp_path / "var"),
          "--quiet"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    split = json.loads((out / "split.json").read_text())
    n_marked = len(marked.read_text().splitlines())
    assert split["sources"]["train"]["feedback"] == n_marked >= 5 and 20 <= split["sources"]["train"]["labelled"] <= 25
    assert set(split["eval"]) <= {r["id"] for r in rows[35:]} and len(split["eval"]) >= 20 and split["dev"] == []
    manifest = CompactPolicy.load(Path(result["policy"])).manifest
    assert manifest["trained_on"] == split["sources"]["train"] == result["trained_on"]
    evaluation = manifest["evaluation"]
    assert evaluation["n"] == len(split["eval"]) == evaluation["bench"]["all"]["n"]
    assert evaluation["evaluated_on"] == {"labelled": len(split["eval"]), "feedback": 0, "shipped": 0, "pseudo": 0,
                                          "llm": 0}
    assert evaluation["questions"] == "labelled" and evaluation["part"] == "the --eval-qa file(s)"
    # the learner started from the shipped policy and chose its pull on the training questions (5 folds)
    learner = manifest["warm_start"]["learner"]
    assert learner["start"].startswith("compact-gbr@") and learner["how"] == f"5-fold over {len(split['train'])} " \
        "training questions"
    assert set(learner["dev_recall"]) == {"0", "0.001", "0.01", "0.1", "keep"} and learner["pull"] in learner["dev_recall"]
    assert manifest["warm_start"]["negative_weight"] == 2.0 and manifest["warm_start"]["marked_negatives"]["lexical"] > 0
    report = (out / "report" / "report.md").read_text()
    assert f"judged on {len(split['eval'])} held-back labelled questions only (the --eval-qa file)" in report
    assert "trained on: " in report and "**Which to serve**" in report and "marks from use" not in report


def test_by_default_a_few_questions_correct_naive_bm25s_order_and_serve_it_without_rl(
        data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The default learner with questions of yours (`--start naive`): naive BM25's order plus a correction with
    the default penalty (5 / n), one search, no RL; the policy folder serves exactly the fitted weights."""
    corpus, qa = user_files(data_dir, tmp_path / "mine", rows=range(200, 260), distractors=40)
    rows = [json.loads(line) for line in qa.read_text().splitlines()]
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows[:30]))
    held.write_text("".join(json.dumps(r) + "\n" for r in rows[30:]))
    out = tmp_path / "run"
    main(["compact", "--corpus", str(corpus), "--qa", str(train), "--eval-qa", str(held), "--no-dense",
          "--out", str(out), "--var-dir", str(tmp_path / "var"), "--quiet"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    split = json.loads((out / "split.json").read_text())
    learner = result["learner"]
    assert learner["start"] == "naive" and learner["rl"] is False
    n = len(split["train"])
    assert learner["how"] == f"5 / {n} training questions" and learner["pull"] == f"{5 / n:g}"
    final = CompactPolicy.load(out / "final")
    assert final.manifest["rl"]["steps"] == 0 and not (out / "rl" / "rewards.jsonl").exists()
    served = CompactPolicy.load(Path(result["policy"]))
    assert served.digest == CompactPolicy.load(out / "warmstart").digest == final.digest
    assert served.weights["w1"].shape == (len(served.weights["mean"]), 2)  # the linear score, carried exactly
    report = (out / "report" / "report.md").read_text()
    assert "naive BM25's order" in report and "**Which to serve**" in report
