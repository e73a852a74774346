"""Generalization, measured: leave-one-dataset-out training of the compact policy and its evaluation on the
held-out set's evaluation rows (rows 0-99), plus a policy on sets never trained on (musique, bamboogle), each
cell against naive BM25, dense and hybrid top-3 at the same 3 documents with 95% intervals.

For each of nq, hotpotqa, 2wikimultihopqa and popqa: `plugsearch-train compact --datasets <the other three>
--out <out>/loo-<held>` (rows 200+ only; resumable), then `bench/search_quality.py --compact` on the held-out
set's rows 0-99; and `bench/search_quality.py --compact <--unseen-policy>` on musique and bamboogle rows 0-99.
Every step is skipped when its output is there (a rerun resumes).

    python bench/leave_one_out.py                       # ~4 x (training + evaluation), hours on 2 cores
    python bench/leave_one_out.py --held nq -- --steps 2 --warm-epochs 1 --per-dataset 20   # a smoke run

Final line: {"cells": [{"trained_on", "evaluated_on", "n", "naive_bm25", "naive_dense", "naive_hybrid", "policy",
"*_ci95", "gain", "gain_ci95"}], "table": markdown}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, log  # noqa: E402

SETS = ("nq", "hotpotqa", "2wikimultihopqa", "popqa")
UNSEEN = ("musique", "bamboogle")


def run(argv: list[str], log_file: Path) -> None:
    log(" ".join(argv))
    with log_file.open("w") as sink:
        done = subprocess.run(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"failed (exit {done.returncode}), see {log_file}")


def evaluate(policy: Path, sets: list[str], out: Path, n: int) -> dict[str, Any]:
    """`bench/search_quality.py --compact` (its last line), run once per output file."""
    if not out.is_file() or not out.read_text().strip():
        run([sys.executable, "bench/search_quality.py", "--compact", str(policy), "--datasets", *sets, "--n", str(n),
             "--no-minilm", "--quiet"], out)
    return dict(json.loads(out.read_text().strip().splitlines()[-1]))


def cells(result: dict[str, Any], trained_on: str) -> list[dict[str, Any]]:
    out = []
    for name, block in result["datasets"].items():
        recall = block["budget3"]["answer_recall"]
        cell: dict[str, Any] = {"trained_on": trained_on, "evaluated_on": name, "n": block["n"]}
        for system, key in (("naive_bm25", "naive_bm25"), ("naive_dense", "naive_dense"),
                            ("naive_hybrid", "naive_hybrid"), ("policy", "compact_rl")):
            cell[system], cell[f"{system}_ci95"] = recall.get(key), recall.get(f"{key}_ci95")
        cell["gain"], cell["gain_ci95"] = recall.get("compact_rl_minus_naive"), recall.get("compact_rl_minus_naive_ci95")
        out.append(cell)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    def fmt(value: float | None, ci: list[float] | None) -> str:
        return "-" if value is None else f"{value:.3f} [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{value:.3f}"

    lines = ["| trained on | evaluated on (n) | naive BM25 top-3 | naive dense top-3 | naive hybrid top-3 | compact "
             "policy | policy - naive BM25 [95% CI] |", "|---|---|---:|---:|---:|---:|---:|"]
    for c in rows:
        gain = "-" if c["gain"] is None else f"{c['gain']:+.3f} [{c['gain_ci95'][0]:+.3f}, {c['gain_ci95'][1]:+.3f}]"
        lines.append(f"| {c['trained_on']} | {c['evaluated_on']} ({c['n']}) | {fmt(c['naive_bm25'], c['naive_bm25_ci95'])} | "
                     f"{fmt(c['naive_dense'], c['naive_dense_ci95'])} | {fmt(c['naive_hybrid'], c['naive_hybrid_ci95'])} | "
                     f"**{fmt(c['policy'], c['policy_ci95'])}** | {gain} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--held", nargs="+", default=list(SETS), choices=list(SETS), help="sets to hold out, in turn")
    parser.add_argument("--unseen-policy", default=str(REPO / "plugsearch" / "searcher" / "trained" / "compact"),
                        help="the policy evaluated on musique and bamboogle (default: the shipped one)")
    parser.add_argument("--no-unseen", action="store_true", help="skip musique and bamboogle")
    parser.add_argument("--n", type=int, default=100, help="evaluation rows of each set (rows 0..n-1)")
    parser.add_argument("--out", default=str(REPO / "var" / "runs" / "leave-one-out"))
    parser.add_argument("train_args", nargs="*", help="more plugsearch-train compact flags (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for held in args.held:
        train = [s for s in SETS if s != held]
        run_dir = out / f"loo-{held}"
        if not (run_dir / "final" / "manifest.json").is_file():
            run([sys.executable, "-m", "plugsearch.trainer.cli", "compact", "--datasets", *train, "--out", str(run_dir), "--quiet",
                 *args.train_args], out / f"loo-{held}.train.log")
        rows += cells(evaluate(run_dir / "final", [held], out / f"loo-{held}.eval.log", args.n), " + ".join(train))
    if not args.no_unseen:
        rows += cells(evaluate(Path(args.unseen_policy), list(UNSEEN), out / "unseen.eval.log", args.n),
                      "nq + hotpotqa + 2wikimultihopqa + popqa (the shipped run)")
    md = table(rows)
    (out / "table.md").write_text(md + "\n")
    log(md)
    print(json.dumps({"cells": rows, "table": md}))


if __name__ == "__main__":
    main()
