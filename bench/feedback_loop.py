"""Marks from use, end to end, with a simulated user: search, mark what helped, export, train, serve, evaluate.

On a development set of `<data>/domain/` (default tatqa), split as the trainer splits a user's questions
(`plugsearch.common.qa.split_items`, seed `--split-seed`, yes/no questions left out; the evaluation part is
never searched, marked or trained on here):

1. the stack serves the set's corpus (`plugsearch-stack --corpus`, its own `--var-dir` under `--out`, so the marks of
   this run are alone in its feedback file); the searcher's rate limit is off for the simulated user;
2. the simulated user asks every question of the TRAINING part through the API (`SearchClient.search`, the service's
   default search), and marks (`SearchClient.feedback`) as helpful the returned documents whose text holds a gold
   answer (GenAcc's span check), the others as not helpful;
3. `plugsearch-feedback export --url` with the run's key writes its labelled questions (`--min-helpful 1`);
4. `plugsearch-train compact --feedback FILE --corpus CORPUS` trains a policy on them (skipped, and said, where the
   trainer has no `--feedback` yet, or with `--until export`); with `--eval-qa`, the set's evaluation part (its
   rows, written to `<out>/eval_part.jsonl`) is the trainer's `--eval-qa`: every mark trains, and the trainer's
   own verdict is on those held-back labelled questions instead of on held-back marks;
5. the stack serves the trained policy (`--policy`), and answer recall at 3 documents of the served search on the
   EVALUATION part is compared with naive BM25 top-3 (`mode: naive`, `method: bm25`, k 3) through the same API,
   with a paired 95% bootstrap interval; the packaged policy is measured the same way before training.

    python bench/feedback_loop.py [--set tatqa] [--out var/runs/feedback-loop] [--until export|train|eval]
        [--limit N] [--eval-qa] [--train-args "--steps 40"]

Final line: {"set", "split", "marking": {...}, "export": {...}, "before": {...}, "train": {...}, "after": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import DATA, REPO, log  # noqa: E402
from plugsearch.common.answers import is_yes_no, span_match  # noqa: E402
from plugsearch.common.qa import QAItem, read_qa_file, split_items, split_sizes  # noqa: E402
from plugsearch.common.stats import bootstrap_interval  # noqa: E402

BUDGET = 3


def split_of(name: str, seed: int) -> tuple[Path, Any]:
    """The set's corpus and its split (train / dev / eval), as `plugsearch-train compact --qa` splits it."""
    corpus = DATA / "domain" / f"{name}_corpus.jsonl"
    items = [q for q in read_qa_file(DATA / "domain" / f"{name}_qa.jsonl") if not is_yes_no(q.golden_answers)]
    n_eval, n_dev = split_sizes(len(items))
    return corpus, split_items(items, seed=seed, n_eval=n_eval, n_dev=n_dev)


@contextmanager
def stack(corpus: Path, var_dir: Path, key: str, policy: str, log_path: Path) -> Iterator[dict[str, Any]]:
    """`plugsearch-stack` on free ports (its ready file's URLs), stopped on exit."""
    ready = var_dir / f"ready-{os.getpid()}.json"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SEARCHER_RATE_LIMIT_PER_S": "0"}
    argv = [sys.executable, "-m", "plugsearch.stack", "--corpus", str(corpus), "--var-dir", str(var_dir),
            "--free-ports", "--no-color", "--ready-file", str(ready), "--api-key", key, "--policy", policy,
            "--wait-dense"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 1800
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the stack did not start:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        info: dict[str, Any] = json.loads(ready.read_text())  # ready: the corpus check has its verdict
        yield info
    finally:
        if proc.poll() is None:
            proc.terminate()  # the stack stops its services
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the stack and what it started
                proc.wait()


def version(url: str) -> dict[str, Any]:
    import httpx

    details: dict[str, Any] = httpx.get(f"{url}/version", timeout=10).json().get("details", {})
    return {"policy_model": details.get("policy_model"),
            "corpus_check": (details.get("corpus_check") or {}).get("last", details.get("corpus_check")),
            "defaults": (details.get("defaults") or {}).get("s3")}


def mark_training_part(url: str, key: str, items: Sequence[QAItem]) -> dict[str, Any]:
    """The simulated user: each question searched as the service searches by default, each returned document
    marked helpful when its text holds a gold answer, not helpful otherwise."""
    from plugsearch.client import SearchClient

    counts = {"questions": len(items), "marked": 0, "with_helpful": 0, "helpful_ids": 0, "not_helpful_ids": 0,
              "documents_per_search": 0.0, "fallback": 0}
    t0 = time.monotonic()
    with SearchClient(url, api_key=key, timeout=120) as client:
        for i, item in enumerate(items, start=1):
            found = client.search(item.question)
            if found.search_id is None:
                raise SystemExit("the searcher returned no search_id: it keeps no marks (SEARCHER_FEEDBACK=off?)")
            helpful = [d.id for d in found.documents if span_match(d.text, item.golden_answers)]
            not_helpful = [d.id for d in found.documents if d.id not in set(helpful)]
            if helpful or not_helpful:
                client.feedback(found.search_id, helpful=helpful, not_helpful=not_helpful)
                counts["marked"] += 1
            counts["with_helpful"] += bool(helpful)
            counts["helpful_ids"] += len(helpful)
            counts["not_helpful_ids"] += len(not_helpful)
            counts["documents_per_search"] += len(found.documents)
            counts["fallback"] += found.fallback is not None
            if i % 100 == 0:
                log(f"marked {i}/{len(items)} ({time.monotonic() - t0:.0f} s)")
    counts["documents_per_search"] = round(counts["documents_per_search"] / max(1, len(items)), 2)
    counts["seconds"] = round(time.monotonic() - t0, 1)
    return counts


def export(url: str, key: str, out: Path) -> dict[str, Any]:
    """`plugsearch-feedback export --url` with the run's key (its own marks: this run's alone), as a user runs it."""
    done = subprocess.run([sys.executable, "-m", "plugsearch.searcher.feedback.cli", "export", "--url", url,
                           "--api-key", key, "--out", str(out), "--min-helpful", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"export failed: {done.stderr[-2000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return summary


def train(feedback: Path, corpus: Path, out: Path, var_dir: Path, extra: Sequence[str], log_path: Path
          ) -> tuple[Path | None, dict[str, Any]]:
    """`plugsearch-train compact --feedback` on the exported rows; (the policy folder, what happened)."""
    base = [sys.executable, "-m", "plugsearch.trainer.cli", "compact"]
    helped = subprocess.run([*base, "--help"], cwd=REPO, capture_output=True, text=True, timeout=300)
    if "--feedback" not in helped.stdout:
        return None, {"state": "skipped", "reason": "plugsearch-train compact has no --feedback option here yet"}
    argv = [*base, "--feedback", str(feedback), "--corpus", str(corpus), "--out", str(out), "--var-dir",
            str(var_dir), *extra]
    log(f"training: {shlex.join(argv[2:])} (log: {log_path})")
    t0 = time.monotonic()
    with log_path.open("ab") as fh:
        done = subprocess.run(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"command": "plugsearch-train " + shlex.join(argv[3:]),
                              "seconds": round(time.monotonic() - t0, 1), "exit": done.returncode}
    if done.returncode != 0:
        result.update(state="failed", log_tail=log_path.read_text(errors="replace")[-1500:])
        return None, result
    policy = next((p for p in (out / "policy", out / "final") if (p / "manifest.json").is_file()), None)
    result["state"] = "done" if policy is not None else "no policy folder found"
    result["policy"] = str(policy) if policy is not None else None
    return policy, result


def evaluate(url: str, key: str, items: Sequence[QAItem]) -> dict[str, Any]:
    """Answer recall at `BUDGET` documents of the served search against naive BM25 top-`BUDGET`, paired."""
    from plugsearch.client import SearchClient

    served, naive, fallback = [], [], 0
    with SearchClient(url, api_key=key, timeout=120) as client:
        for item in items:
            found = client.search(item.question)
            plain = client.search(item.question, mode="naive", retrieve_k=BUDGET, method="bm25")
            served.append(float(any(span_match(d.text, item.golden_answers) for d in found.documents[:BUDGET])))
            naive.append(float(any(span_match(d.text, item.golden_answers) for d in plain.documents[:BUDGET])))
            fallback += found.fallback is not None
    diff = [a - b for a, b in zip(served, naive, strict=True)]
    n = max(1, len(items))
    return {"n": len(items), "served": round(sum(served) / n, 3), "served_ci95": bootstrap_interval(served),
            "naive_bm25": round(sum(naive) / n, 3), "served_minus_naive": round(sum(diff) / n, 3),
            "served_minus_naive_ci95": bootstrap_interval(diff), "fallback_to_naive": fallback}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="tatqa", choices=["tatqa", "policyqa", "realtimeqa"])
    parser.add_argument("--out", type=Path, default=REPO / "var" / "runs" / "feedback-loop")
    parser.add_argument("--split-seed", type=int, default=0)
    parser.add_argument("--until", choices=["export", "train", "eval"], default="eval")
    parser.add_argument("--limit", type=int, default=0, help="at most this many questions of each part (0: all)")
    parser.add_argument("--skip-before", action="store_true", help="do not measure the packaged policy first")
    parser.add_argument("--train-args", default="", help="more options for plugsearch-train compact")
    parser.add_argument("--eval-qa", action="store_true", help="give the trainer the set's evaluation part as --eval-qa "
                        "(every mark trains; its verdict is on held-back labelled questions, not on held-back marks)")
    args = parser.parse_args()
    out: Path = args.out.resolve()
    var_dir = out / "var"
    var_dir.mkdir(parents=True, exist_ok=True)
    corpus, split = split_of(args.set, args.split_seed)
    train_part, eval_part = split.train, split.eval
    if args.limit:
        train_part, eval_part = train_part[:args.limit], eval_part[:args.limit]
    result: dict[str, Any] = {"set": args.set, "split": {"seed": args.split_seed, "train": len(split.train),
                                                         "dev": len(split.dev), "eval": len(split.eval),
                                                         "marked_from": "train", "evaluated_on": "eval"},
                              "budget": BUDGET}
    key = f"feedback-loop-{secrets.token_hex(8)}"
    feedback_file = out / "feedback.jsonl"
    with stack(corpus, var_dir, key, "auto", out / "stack-before.log") as info:
        url = info["searcher"]
        result["served_before"] = version(url)
        log(f"stack ready at {url}: {json.dumps(result['served_before'])}")
        if not args.skip_before and args.until == "eval":
            result["before"] = evaluate(url, key, eval_part)
            log(f"before: {json.dumps(result['before'])}")
        result["marking"] = mark_training_part(url, key, train_part)
        log(f"marking: {json.dumps(result['marking'])}")
        result["export"] = export(url, key, feedback_file)
        log(f"export: {json.dumps(result['export'])}")
    if args.until != "export":
        extra = shlex.split(args.train_args)
        if args.eval_qa:  # the evaluation part's own rows, as a user's held-back file
            wanted = {q.id for q in eval_part}
            rows = [line for line in (DATA / "domain" / f"{args.set}_qa.jsonl").read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["id"] in wanted]
            (out / "eval_part.jsonl").write_text("".join(line + "\n" for line in rows), encoding="utf-8")
            extra += ["--eval-qa", str(out / "eval_part.jsonl")]
        policy, result["train"] = train(feedback_file, corpus, out / "train", var_dir, extra, out / "train.log")
        log(f"train: {json.dumps(result['train'])}")
        if policy is not None and args.until == "eval":
            with stack(corpus, var_dir, key, str(policy), out / "stack-after.log") as info:
                result["served_after"] = version(info["searcher"])
                result["after"] = evaluate(info["searcher"], key, eval_part)
                log(f"after: {json.dumps(result['after'])}")
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
