"""`plugsearch-train compact` (the compact policy's run: `plugsearch.trainer.compact.run`) and `compact-export` (a trained
folder as the one the stack serves, with its evaluation and verdict). Every flag's default is
`CompactConfig`'s."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from plugsearch.common.qa import QAFileError
from plugsearch.trainer.cli.common import LLM_THREADS_DEFAULT, command_line, count, positive, settings_from
from plugsearch.trainer.common.rewards import BASELINES
from plugsearch.trainer.compact.config import CompactConfig, default

SHIPPED_ONLY = ("datasets", "per_dataset", "dev_per_dataset")
"""Flags that choose rows of the shipped sets: not with a user's `--qa` files."""
PSEUDO_DEFAULT = 2000
"""Questions made from the corpus when `--corpus` comes without `--qa` (and no LLM writes them)."""
LLM_QUESTIONS_DEFAULT = 1000
"""Passages the user's LLM is asked about (`--llm-url` with the recall reward)."""


def pull_value(text: str) -> float | str | None:
    """`--pull`: auto (None: the learner's default rule), cv (chosen by k-fold on the training questions), keep
    (infinite: the start as it is) or a strength."""
    import math

    if text == "auto":
        return None
    if text == "cv":
        return "cv"
    if text == "keep":
        return math.inf
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not auto, cv, keep or a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the pull is 0 or more")
    return value


def config_from(args: argparse.Namespace) -> CompactConfig:
    """`CompactConfig` with every flag given in its place (the others keep the dataclass's defaults)."""
    given = {"datasets": tuple(args.datasets) if args.datasets else None, "per_dataset": args.per_dataset,
             "dev_per_dataset": args.dev_per_dataset, "retrieve_k": args.retrieve_k, "select_k": args.select_k,
             "max_turns": args.max_turns, "warm_epochs": args.warm_epochs, "rl_steps": args.steps,
             "questions_per_step": args.questions_per_step, "group": args.group, "rl_lr": args.lr,
             "temperature": args.temperature, "seed": args.seed, "dense": False if args.no_dense else None,
             "reward": args.reward, "baseline": args.baseline}
    return CompactConfig(**{k: v for k, v in given.items() if v is not None})


def llm_questions_from(args: argparse.Namespace) -> Any:
    """The question writer's setting (`plugsearch.trainer.compact.llm_questions.LLMQuestions`), None when the run
    asks no LLM for questions: `--llm-url` with the recall reward (the default) asks it, for `--llm-questions`
    passages (default `LLM_QUESTIONS_DEFAULT`); with `--reward gbr` the endpoint serves the generator and judge,
    and writes questions only when `--llm-questions N` is given."""
    from plugsearch.trainer.compact.llm_questions import LLMQuestions

    wanted = args.llm_questions
    if wanted is None:
        wanted = LLM_QUESTIONS_DEFAULT if args.llm_url and args.reward in (None, "recall") else 0
    if not wanted:
        return None
    if not args.llm_url:
        raise SystemExit("error: --llm-questions asks your LLM: give its endpoint with --llm-url (and --llm-model)")
    if not args.corpus:
        raise SystemExit("error: your LLM writes questions about the passages of --corpus: give the corpus file")
    return LLMQuestions(url=args.llm_url, model=args.llm_model, passages=wanted, api_key_env=args.llm_key_env,
                        concurrency=args.llm_concurrency, timeout_s=args.llm_timeout, seed=args.split_seed,
                        json_mode=args.llm_json)


def cmd_compact(args: argparse.Namespace) -> dict[str, Any]:
    """The compact policy: warm start, RL, the final policy folder (resumable: a finished stage is reused);
    with `--qa`, a user's questions over their `--corpus`, evaluated and exported with a verdict."""
    from plugsearch.trainer.compact.run import CompactRun, run

    own = bool(args.qa or args.feedback)
    """Questions of the user's own to train on (labelled files or marks)."""
    if own or args.eval_qa:
        given = [f"--{name.replace('_', '-')}" for name in SHIPPED_ONLY if getattr(args, name) is not None]
        if given:
            raise SystemExit(f"error: {', '.join(given)} choose rows of the shipped sets; with --qa / --feedback your "
                             "files are split into training, RL-dev and evaluation questions (--split-seed), or "
                             "evaluated on --eval-qa")
    if args.eval_qa and not (own or args.corpus):
        raise SystemExit("error: --eval-qa is the evaluation part of your questions: give the ones to train on "
                         "(--qa, --feedback) or --corpus to train on questions made from it")
    start = args.start or ("naive" if own else "shipped")
    if start == "scratch" and args.pull is not None:
        raise SystemExit("error: --pull pulls the fit toward where it starts: it needs --start naive or shipped")
    if args.reward == "recall" and args.local:
        raise SystemExit("error: --local starts the generator and judge for --reward gbr; the recall reward needs no "
                         "LLM")
    llm = llm_questions_from(args)
    pseudo = args.pseudo if args.pseudo is not None else \
        (PSEUDO_DEFAULT if args.corpus and not own and llm is None else 0)
    if pseudo and not args.corpus:
        raise SystemExit("error: --pseudo makes questions from --corpus: give the corpus file")
    if pseudo or llm is not None:
        given = [f"--{name.replace('_', '-')}" for name in SHIPPED_ONLY if getattr(args, name) is not None]
        if given:
            raise SystemExit(f"error: {', '.join(given)} choose rows of the shipped sets; with --corpus alone the "
                             "questions are made from your passages")
    if args.shipped and not (own or pseudo or llm):
        raise SystemExit("error: --shipped adds the shipped Wikipedia questions to your own (--qa, or --corpus "
                         "alone); without them the run trains on the shipped sets already")
    if args.shipped and args.reward not in (None, "recall"):
        raise SystemExit("error: --shipped works with the recall reward (the gbr reward's naive baselines come from "
                         "one corpus)")
    config = config_from(args)
    job = CompactRun(config=config, out=Path(args.out), command=command_line(args),
                     corpus=Path(args.corpus) if args.corpus else None, qa=[Path(q) for q in args.qa or ()],
                     index_dir=Path(args.index_dir) if args.index_dir else None, var_dir=Path(args.var_dir),
                     resume=not args.no_resume, progress=not args.quiet, split_seed=args.split_seed,
                     local=args.local or bool(args.llm_url), llm_url=args.llm_url, llm_threads=args.llm_threads,
                     pseudo=pseudo, shipped=args.shipped, llm_questions=llm, settings=settings_from(args),
                     feedback=[Path(f) for f in args.feedback or ()], eval_qa=[Path(f) for f in args.eval_qa or ()],
                     start=start, pull=args.pull, negative_weight=args.negative_weight,
                     scale_steps=args.steps is None)
    try:
        return run(job)
    except QAFileError as exc:
        raise SystemExit(f"error: {exc}") from exc
    except KeyboardInterrupt:
        print(f"interrupted: what is finished is kept (split, indexes, warm start, RL state); resume with: "
              f"{job.command}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def cmd_compact_export(args: argparse.Namespace) -> dict[str, Any]:
    """A trained compact policy folder as the one the stack serves, with its held-out evaluation recorded."""
    from plugsearch.searcher.compact import CompactPolicy
    from plugsearch.trainer.common.evaluation import beats_naive

    policy = CompactPolicy.load(Path(args.policy))
    evaluation = json.loads(Path(args.evaluation).read_text().strip().splitlines()[-1])
    key = args.key
    verdict = beats_naive(evaluation, key)
    gains = {name: d["budget3"]["answer_recall"].get(f"{key}_minus_naive")
             for name, d in evaluation.get("datasets", {}).items()}
    summary = ", ".join(f"{name} {g:+.3f}" for name, g in gains.items() if g is not None)
    manifest = {**policy.manifest, "evaluation": {
        "summary": f"answer recall at 3 documents minus naive BM25 top-3 on rows 0-99: {summary}",
        "beats_naive": verdict, "gains_at_3": gains, "bench": evaluation}}
    policy.save(Path(args.out), manifest)
    return {"out": args.out, "beats_naive": verdict, "gains_at_3": gains, "digest": policy.digest}


def add_parsers(sub: Any) -> None:
    c = sub.add_parser("compact", help="the compact CPU searcher policy: supervised warm start, then RL with the "
                       "GBR reward, in the search environment (resumable); with --corpus/--qa on your own data, "
                       "evaluated and exported in the same command")
    data = c.add_argument_group("data", "the shipped sets (default) or your own corpus and questions")
    data.add_argument("--qa", action="append", metavar="QUESTIONS.jsonl",
                      help="your questions (JSONL: question, golden_answers or passage_ids, optional "
                      "supporting_titles and id); repeat for several files. They are checked, split into training / "
                      "RL-dev / evaluation by --split-seed (split.json in --out; with --eval-qa they all train), and "
                      "the run ends with the evaluation report and a policy folder (<out>/policy) that "
                      "plugsearch-stack --policy serves")
    data.add_argument("--feedback", action="append", metavar="MARKS.jsonl",
                      help="labelled questions exported from users' marks (plugsearch-feedback export; JSONL: question, "
                      "passage_ids = the passages marked as helpful, optional negative_ids = shown and marked as not "
                      "helpful, answer, id): trained on like --qa's rows, the marked passages being what counts as "
                      "found; repeat for several files")
    data.add_argument("--eval-qa", action="append", metavar="HELD_BACK.jsonl",
                      help="the evaluation part, as its own file (rows as --qa's): its questions are never trained or "
                      "tuned on, and every --qa / --feedback question trains, however few (without it, your questions "
                      "are split and at least 45 usable ones are needed)")
    data.add_argument("--corpus", help="JSONL corpus (id + title/text, or id + contents) the questions are answered "
                      "from (default: $PLUGSEARCH_DATA/corpus/combined.jsonl). Without --qa: a searcher trained "
                      "from the corpus alone, on questions made from its passages (--pseudo)")
    data.add_argument("--pseudo", type=count, default=None, metavar="N", help="make N questions from the corpus's "
                      f"passages and train on them (default {PSEUDO_DEFAULT} with --corpus and no --qa, else none; "
                      "with --qa they are added to your questions); written to <out>/pseudo_questions.jsonl")
    data.add_argument("--shipped", type=count, default=0, metavar="N", help="with your questions or --corpus alone: "
                      "add N of the shipped Wikipedia training questions (rows 200+ of the shipped sets, over the "
                      "shared corpus, drawn evenly by --split-seed) to the training split (default 0: none)")
    data.add_argument("--split-seed", type=int, default=0, help="with --qa: the seed of the split (recorded)")
    data.add_argument("--datasets", nargs="+", help=f"shipped sets to train on (default: {' '.join(default('datasets'))}; "
                      "musique, bamboogle and triviaqa are refused)")
    data.add_argument("--per-dataset", type=int, help=f"training rows per shipped set, from row 200 on (default "
                      f"{default('per_dataset')})")
    data.add_argument("--dev-per-dataset", type=int, help="rows after those, held out to watch RL (default "
                      f"{default('dev_per_dataset')})")
    c.add_argument("--index-dir", default=None, help="the corpus's index folder, built once when missing (default: "
                   "plugsearch-stack's, <var-dir>/indexes/<corpus>-<sha256>)")
    c.add_argument("--var-dir", default="var", help="where the indexes are kept (default: var)")
    c.add_argument("--no-dense", action="store_true", help="BM25 pools only: no dense block, no dense scorer")
    for flag, name, kind, what in (
            ("--retrieve-k", "retrieve_k", int, "documents per retrieval (the pool)"),
            ("--select-k", "select_k", int, "documents returned"),
            ("--max-turns", "max_turns", int, "follow-up searches at most"),
            ("--warm-epochs", "warm_epochs", int, "epochs of the warm start's fit"),
            ("--steps", "rl_steps", int, "RL steps (with your questions, when not given: about 8 searches per "
             "training question, at least 10 and at most the default)"),
            ("--questions-per-step", "questions_per_step", int, "questions per RL step"),
            ("--group", "group", int, "sampled searches per question (the group baseline)"),
            ("--lr", "rl_lr", float, "RL learning rate"),
            ("--temperature", "temperature", float, "softmax temperature of the sampled actions in RL (1.0 explored "
             "too little to learn follow-up searches)"),
            ("--seed", "seed", int, "training seed")):
        c.add_argument(flag, type=kind, help=f"{what} (default {default(name)})")
    c.add_argument("--start", choices=["naive", "shipped", "scratch"], default=None, help="with your questions: "
                   "where the learner starts: naive (the default with questions of yours, --qa or --feedback): naive BM25's order plus a linear correction of its "
                   "ranking, penalised back toward none, one search and no RL, so few questions move it only as far as "
                   "they show; shipped (the default with questions made from the corpus alone): the shipped policy, "
                   "fine-tuned with a pull back toward its weights, then RL; "
                   "scratch: random weights, then RL")
    c.add_argument("--pull", type=pull_value, default=None, metavar="auto|cv|keep|STRENGTH", help="with --start naive: "
                   "the L2 penalty on the correction of naive BM25's order (auto, the default: 5 / the number of "
                   "training questions), with --start shipped: the L2 pull toward the shipped weights (auto: as cv); "
                   "cv chooses it on your training questions (k-fold, or a dev part of them when there are 250 or "
                   "more), keep leaves the start as it is")
    c.add_argument("--negative-weight", type=float, default=1.0, metavar="W", help="how much a passage users marked "
                   "as not helpful (negative_ids of --feedback rows) weighs in the warm start's loss (default "
                   "%(default)s: as any other passage without the answer)")
    c.add_argument("--reward", choices=["recall", "gbr"], help="recall (default): GBR with GenAcc's span check on "
                   "the documents, no LLM; gbr: GenAcc of the frozen generator's answers, judged, against the naive "
                   "baseline (the generator and judge services: --local, --llm-url or TRAINER_* URLs)")
    c.add_argument("--baseline", choices=list(BASELINES), help="GBR's naive documents: same_n (default: naive "
                   "top-n at the n documents returned) or top_k (naive top-3, s3's)")
    c.add_argument("--local", action="store_true", help="with --reward gbr: start llama.cpp (SmolLM2), generator "
                   "and judge here")
    c.add_argument("--llm-url", help="your OpenAI-compatible endpoint (e.g. vLLM's or a hosted API's .../v1). With "
                   "the recall reward (default) it writes training questions about sampled passages of --corpus "
                   "(--llm-questions; kept only if naive BM25 finds the passage again for them); with --reward gbr it "
                   "serves the generator and judge instead of llama.cpp")
    c.add_argument("--llm-model", default="smollm2-135m-instruct", help="the model name the endpoint serves "
                   "(default %(default)s, the local llama.cpp server's)")
    c.add_argument("--llm-key-env", default="OPENAI_API_KEY", metavar="VAR", help="the environment variable that "
                   "holds the endpoint's API key (default %(default)s; unset: no key). Never give a key on the "
                   "command line")
    c.add_argument("--llm-questions", type=count, default=None, metavar="N", help="passages your LLM is asked "
                   f"about, one question each (default {LLM_QUESTIONS_DEFAULT} with --llm-url and the recall reward, "
                   "else 0); with --qa they join the training split only, without it they are the run's questions "
                   "(no real evaluation); written to <out>/llm_questions.jsonl, replies cached for a rerun")
    c.add_argument("--llm-concurrency", type=positive, default=4, help="questions asked of your LLM at once "
                   "(default %(default)s)")
    c.add_argument("--llm-timeout", type=float, default=120.0, metavar="S", help="seconds per question asked; a "
                   "timed-out one is asked twice more (default %(default)s)")
    c.add_argument("--llm-json", choices=["object", "off"], default="object", help="object (default): ask for "
                   "response_format json_object (OpenAI, vLLM, llama.cpp); off: for an endpoint that refuses it")
    c.add_argument("--llm-threads", type=positive, default=LLM_THREADS_DEFAULT,
                   help="with --local and no --llm-url: llama.cpp threads (default %(default)s, as plugsearch-stack)")
    c.add_argument("--out", default="var/runs/compact")
    c.add_argument("--no-resume", action="store_true", help="redo the warm start even when it is there")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compact)

    ce = sub.add_parser("compact-export", help="a trained compact policy as the one plugsearch-stack serves, "
                        "with its evaluation (bench/search_quality.py --compact) and the beats_naive verdict")
    ce.add_argument("policy", help="policy folder, e.g. var/runs/compact/final")
    ce.add_argument("out", help="e.g. plugsearch/searcher/trained/compact")
    ce.add_argument("--evaluation", required=True, help="a file whose last line is the bench's final JSON line")
    ce.add_argument("--key", default="compact_rl", help="the bench's name of this policy")
    ce.set_defaults(func=cmd_compact_export)
