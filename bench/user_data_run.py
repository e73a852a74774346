"""The one-command flow on a user's data, timed: writes a corpus and question files that are not the shipped
defaults (the passages of the chosen sets' own corpus files, concatenated; their questions from row 200 on,
never the evaluation rows, as plain files under `--data-dir`), then runs `plugsearch-train compact --corpus ...
--qa ...` as a user would (a fresh corpus: its indexes are built by the run) and reports its time per stage,
the split and the evaluation.

    python bench/user_data_run.py                          # ~2,400 questions: rows 200-799 of nq, hotpotqa and
                                                           # popqa, 200-884 of 2wikimultihopqa
    python bench/user_data_run.py --rows 200:260 -- --warm-epochs 2 --steps 5   # a smoke run

Final line: the run's JSON result plus {"questions_in", "corpus_passages", "wall_seconds"}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, log  # noqa: E402
from plugsearch.common.qa import default_data_dir  # noqa: E402

CORPUS_OF = {"nq": "nq_gold", "hotpotqa": "hotpotqa", "2wikimultihopqa": "2wikimultihopqa", "popqa": "popqa"}


def write_files(data: Path, out: Path, sets: list[str], first: int, last: int) -> tuple[Path, list[Path], int, int]:
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / f"user-corpus-{'-'.join(sets)}.jsonl"
    passages = 0
    with corpus.open("w", encoding="utf-8") as sink:
        for name in dict.fromkeys(CORPUS_OF[s] for s in sets):
            for line in (data / "corpus" / f"{name}.jsonl").open(encoding="utf-8"):
                sink.write(line)
                passages += 1
    files, questions = [], 0
    for name in sets:
        rows = (data / "qa" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)[first:last]
        path = out / f"user-questions-{name}-{first}-{first + len(rows) - 1}.jsonl"
        path.write_text("".join(rows), encoding="utf-8")
        files.append(path)
        questions += len(rows)
    return corpus, files, passages, questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sets", nargs="+", default=list(CORPUS_OF), choices=list(CORPUS_OF))
    parser.add_argument("--rows", default="200:800", help="rows FIRST:LAST of every question file (from 200 on)")
    parser.add_argument("--data-dir", default=str(REPO / "var" / "user-data"), help="where the files are written")
    parser.add_argument("--out", default=str(REPO / "var" / "runs" / "user-data"))
    parser.add_argument("train_args", nargs="*", help="more plugsearch-train compact flags (after --)")
    args = parser.parse_args()
    first, last = (int(x) for x in args.rows.split(":"))
    if first < 200:
        raise SystemExit("--rows starts at 200 or later (rows 0-99 evaluate, 100-199 are reserved)")
    corpus, files, passages, questions = write_files(default_data_dir(), Path(args.data_dir), args.sets, first, last)
    log(f"{questions} questions in {len(files)} files, {passages} passages: {corpus}")
    argv = [sys.executable, "-m", "plugsearch.trainer.cli", "compact", "--corpus", str(corpus),
            *(a for f in files for a in ("--qa", str(f))), "--out", args.out, "--quiet", *args.train_args]
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"plugsearch-train compact failed (exit {done.returncode})")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps({**result, "questions_in": questions, "corpus_passages": passages,
                      "wall_seconds": round(wall, 1)}))


if __name__ == "__main__":
    main()
