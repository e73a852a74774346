"""`plugsearch-train compact`: the compact policy's whole run, resumable (a finished stage is reused).

- On the shipped data (no `--qa`): rows 200+ of the shipped sets over the shared corpus; warm start, RL, the
  final policy folder (`<out>/final`). Its held-out evaluation is `bench/search_quality.py --compact` on rows
  0-99, recorded by `plugsearch-train compact-export`.
- On a user's data (`--corpus CORPUS.jsonl --qa QUESTIONS.jsonl [--qa ...] [--feedback MARKS.jsonl]
  [--eval-qa HELD.jsonl]`): the questions are checked and split by a recorded seed (`<out>/split.json`; with
  `--eval-qa` that file is the evaluation part and every other question trains, however few), the corpus's
  indexes built (bm25s and the MiniLM flat index, as the stack's retriever does, into
  `var/indexes/<corpus>-<sha256>`), the warm start (with the user's own questions by default naive BM25's order
  plus a penalised linear correction, served without RL: `plugsearch.trainer.compact.rerank`; with `--start
  shipped` the shipped policy fine-tuned with a pull back toward it, `plugsearch.trainer.compact.finetune`, then RL
  on the training split, steps scaled to the number of questions), then the evaluation split (real questions only, never trained or tuned on) against naive BM25,
  dense and hybrid top-k at equal document budget with 95% intervals (`<out>/report/report.md`, `report.json`,
  `report.png`), and the policy folder `<out>/policy` with its verdict (`beats_naive`), what it was trained on
  (`trained_on`, counts per source), its setting and its corpus's identity:
  `plugsearch-stack --corpus CORPUS.jsonl --policy <out>/policy` serves it.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from plugsearch.common.qa import (
    MADE_UP,
    MIN_SPLIT,
    QAFileError,
    QAItem,
    default_data_dir,
    load_qa,
)
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.retriever.store.corpus import check_corpus_file
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.trainer.common.baseline import BaselineConfig, BaselineStore
from plugsearch.trainer.common.evaluation import (
    BudgetEval,
    PolicyRun,
    beats_naive,
    dev_check,
    metric_block,
    write_budget_report,
)
from plugsearch.trainer.common.localstack import services_for
from plugsearch.trainer.common.retrieval import IndexRetriever
from plugsearch.trainer.common.rewards import RewardComputer
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.compact.config import NEVER_TRAIN, TRAIN_SETS, CompactConfig, config_dict
from plugsearch.trainer.compact.data import (
    LabeledItem,
    QuestionFile,
    UserData,
    labeled,
    load_items,
    source_counts,
    user_split,
)
from plugsearch.trainer.compact.llm_questions import LLMQuestions

logger = logging.getLogger(__name__)

EVAL_BUDGETS = (3, 5)
VERDICT_KEY = "compact_rl"
SHIPPED_KEY = "compact_shipped"
"""The packaged policy, evaluated beside the trained one on the same questions."""
RL_PASSES = 8
"""On a user's questions, RL runs about this many searches' worth of steps per training question (at least
`MIN_RL_STEPS`, at most `--steps`' default): a short run for a few questions, as long as the shipped run's for many."""
MIN_RL_STEPS = 10


def rl_steps_for(n_train: int, config: CompactConfig) -> int:
    """RL steps for `n_train` training questions when `--steps` is not given (`RL_PASSES`)."""
    return min(config.rl_steps, max(MIN_RL_STEPS, math.ceil(RL_PASSES * n_train / config.questions_per_step)))


@dataclass
class CompactRun:
    """Everything `plugsearch-train compact` was given."""

    config: CompactConfig
    out: Path
    command: str
    corpus: Path | None = None
    qa: Sequence[Path] = ()
    index_dir: Path | None = None
    var_dir: Path = Path("var")
    resume: bool = True
    progress: bool = True
    split_seed: int = 0
    local: bool = False
    llm_url: str | None = None
    llm_threads: int = 1
    pseudo: int = 0
    """Questions to make from the corpus's passages (`plugsearch.trainer.compact.pseudo`), 0: none."""
    shipped: int = 0
    """With a user's corpus: this many of the shipped Wikipedia training questions (rows 200+ of the shipped
    sets, over the shared corpus) added to the training split (`shipped_items`), 0: none."""
    llm_questions: LLMQuestions | None = None
    """Questions written by the user's own LLM (`plugsearch.trainer.compact.llm_questions`): training questions
    beside the user's own (never evaluated on), or, without any, the run's questions (no real evaluation unless
    `--eval-qa` gives one)."""
    settings: TrainerSettings = field(default_factory=TrainerSettings)
    feedback: Sequence[Path] = ()
    """Labelled questions exported from users' marks (`read_feedback_file`): trained on like `qa`'s."""
    eval_qa: Sequence[Path] = ()
    """The evaluation part, given as its own files: never trained or tuned on; every other question trains."""
    start: str = "shipped"
    """On a user's questions, where the learner starts: `naive` (naive BM25's order plus a penalised linear
    correction, one search: `plugsearch.trainer.compact.rerank`; the command's default with questions of the
    user's own), `shipped` (the shipped policy, pulled back toward it: `plugsearch.trainer.compact.finetune`) or
    `scratch` (random weights)."""
    pull: float | str | None = None
    """With `start` naive or shipped: the penalty on the correction, or the pull toward the shipped weights (L2-SP);
    None: the learner's default (naive: 5 / n; shipped: chosen on the training questions), `cv`: chosen on the
    training questions by k-fold."""
    negative_weight: float = 1.0
    """How much a passage a user marked as not helpful weighs in the warm start's loss (1: as any other negative)."""
    scale_steps: bool = False
    """RL steps from the number of training questions (`rl_steps_for`): `--steps` not given on a user's data."""

    @property
    def user_data(self) -> bool:
        return bool(self.qa or self.feedback or self.eval_qa)

    def question_files(self, made_up: Sequence[QuestionFile] = ()) -> list[QuestionFile]:
        """The user's question files with their source and role (`made_up`: questions the run made from the
        corpus), in the order given."""
        return [*(QuestionFile(p) for p in self.qa), *(QuestionFile(p, "feedback") for p in self.feedback),
                *made_up, *(QuestionFile(p, evaluation=True) for p in self.eval_qa)]


def shipped_holdout(data_dir: Path) -> dict[str, str]:
    """Question id -> the shipped set it is held out in: rows 0-199 of every shipped set (0-99 evaluate,
    100-199 are reserved) and every row of the sets never trained on."""
    out: dict[str, str] = {}
    folder = data_dir / "qa"
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.jsonl")):
        for item in load_qa(path, limit=None if path.stem in NEVER_TRAIN else 200):
            out[item.id] = path.stem
    return out


def shipped_items(data_dir: Path, job: CompactRun) -> list[LabeledItem]:
    """`job.shipped` of the shipped sets' training questions (rows 200+, the dev rows left out, drawn evenly
    across the sets by the split seed), each with the retriever of the shared Wikipedia corpus they are asked over:
    a user's run learns from them beside its own questions (the features are the same on any corpus)."""
    import random

    from plugsearch.stack.corpus import index_dir_for

    corpus = (data_dir / "corpus" / "combined.jsonl").resolve()
    if not corpus.is_file():
        raise QAFileError(f"--shipped: the shared corpus {corpus} is not there (set PLUGSEARCH_DATA)")
    items, _ = load_items(data_dir, replace(job.config, datasets=TRAIN_SETS))
    by_set: dict[str, list[LabeledItem]] = {}
    for item in items:
        by_set.setdefault(item.item.dataset, []).append(item)
    rng = random.Random(job.split_seed)
    for rows in by_set.values():
        rng.shuffle(rows)
    mixed = [rows[i] for i in range(max(map(len, by_set.values()), default=0)) for rows in by_set.values()
             if i < len(rows)][:job.shipped]
    wiki = IndexRetriever(corpus, index_dir_for(corpus, job.var_dir), dense=job.config.dense, progress=job.progress)
    return [replace(item, item=item.item.model_copy(update={"source": "shipped"}), retriever=wiki) for item in mixed]


def check_user_questions(items: Sequence[QAItem], data_dir: Path) -> None:
    """A user's files must not smuggle in the shipped evaluation rows: refuse questions whose id is one of
    them (train on the shipped sets with `--datasets`, which starts at row 200)."""
    held = shipped_holdout(data_dir)
    clash = [(q.id, held[q.id]) for q in items if q.id in held]
    if clash:
        sets = sorted({s for _, s in clash})
        raise QAFileError(f"{len(clash)} question(s) are held-out rows of the shipped sets ({', '.join(sets)}; e.g. "
                          f"{clash[0][0]}): rows 0-99 evaluate, 100-199 are reserved and musique, bamboogle and "
                          "triviaqa are never trained on; give rows 200+ (or train on the shipped sets with "
                          "--datasets)")


def run(job: CompactRun) -> dict[str, Any]:
    """Warm start, RL, the final policy; with a user's data also the evaluation, the report and the policy
    folder with its verdict. Every bad input is refused before any index is built or any model trained."""
    t0 = time.perf_counter()
    data_dir = default_data_dir()
    out = job.out
    user: UserData | None = None
    from plugsearch.trainer.common import plotting

    if not plotting.available():
        logger.warning("%s", plotting.MISSING)
    retriever: IndexRetriever | None = None
    pseudo_info: dict[str, Any] | None = None
    made_up: list[QuestionFile] = []
    """Questions the run makes from the corpus (`--pseudo`): they only ever train (unless there is nothing else)."""
    if job.user_data:  # every row of the user's files checked before any index is built
        from plugsearch.common.qa import read_qa_files

        given = job.question_files()
        check_user_questions([q for rows in read_qa_files([f.path for f in given], [f.source for f in given])
                              for q in rows], data_dir)
    if job.pseudo:  # questions made from the corpus's own passages: a question file, then the labelled flow
        from plugsearch.stack.corpus import index_dir_for
        from plugsearch.trainer.compact.pseudo import pseudo_question_file

        if job.corpus is None or not job.corpus.is_file():
            raise QAFileError(f"--corpus {job.corpus} is not a file")
        corpus = job.corpus.resolve()
        check_corpus_file(corpus, progress=job.progress)
        out.mkdir(parents=True, exist_ok=True)
        retriever = IndexRetriever(corpus, job.index_dir or index_dir_for(corpus, job.var_dir),
                                   dense=job.config.dense, progress=job.progress)
        path, pseudo_info = pseudo_question_file(out, retriever, job.pseudo, seed=job.split_seed,
                                                 resume=job.resume)
        made_up.append(QuestionFile(path, "pseudo"))
    llm_info: dict[str, Any] | None = None
    own = bool(job.qa or job.feedback)
    """Whether the user gave questions of their own to train on (the LLM's then train beside them, written with
    the training split's few-shot examples)."""
    if job.llm_questions is not None and not own:  # no questions of the user's: the LLM's are the run's (made up)
        retriever, llm_info, path = _llm_question_file(job, retriever, ())
        made_up.append(QuestionFile(path, "llm"))
    config = job.config
    shipped: list[LabeledItem] = []
    """The shipped Wikipedia questions mixed into a user's run (`--shipped`)."""
    files = job.question_files(made_up)
    if files:  # a user's questions (or ones made from the corpus): the shipped sets' rows are not what it trains on
        config = replace(config, datasets=())
        corpus = (job.corpus or data_dir / "corpus" / "combined.jsonl").resolve()
        if not corpus.is_file():
            raise QAFileError(f"--corpus {corpus} is not a file")
        check_corpus_file(corpus, progress=job.progress)  # a bad row or a duplicate id: before anything is written
        out.mkdir(parents=True, exist_ok=True)
        user = user_split(files, corpus, seed=job.split_seed, out=out, progress=job.progress,
                          check=lambda rows: check_user_questions(rows, data_dir))
        logger.info("questions: %s", user.summary())
        unanswered = [q.id for q in (*user.split.train, *user.split.dev, *user.split.eval) if not q.golden_answers]
        if unanswered and job.config.reward != "recall":
            raise QAFileError(f"{len(unanswered)} question(s) are labelled by passage ids alone (e.g. {unanswered[0]}): "
                              "the generator and judge of --reward gbr need gold answers; use the recall reward")
        train, dev = labeled(user.split.train), labeled(user.split.dev)
        named = ", ".join(f.path.name for f in files if not f.evaluation)
        rows = (f"every question of {named} (the evaluation part is {', '.join(p.name for p in job.eval_qa)})"
                if job.eval_qa else f"the training split of {named} (see split.json: seed {job.split_seed})")
        if job.llm_questions is not None and own:  # the LLM's questions join the training split only
            from plugsearch.common.qa import read_qa_file

            retriever, llm_info, path = _llm_question_file(job, retriever, user.split.train)
            written = labeled(read_qa_file(path, "llm"))
            train = train + written
            rows += f" and {len(written)} questions written by your LLM ({job.llm_questions.model}; training only)"
        if job.shipped:
            shipped = shipped_items(data_dir, job)
            rows += (f" and {len(shipped)} shipped Wikipedia training questions (rows {job.config.offset}+ of "
                     f"{', '.join(TRAIN_SETS)}, over the shared corpus)")
            train = train + shipped
        if job.scale_steps:
            config = replace(config, rl_steps=rl_steps_for(len(train), config))
    else:
        corpus = job.corpus or data_dir / "corpus" / "combined.jsonl"
        train, dev = load_items(data_dir, config)
        rows = (f"{config.offset}..{config.offset + config.per_dataset + config.dev_per_dataset - 1} of "
                f"{', '.join(config.datasets)} (yes/no dropped); the last {config.dev_per_dataset} of each set held "
                "out as the RL stage's dev check")
    job = replace(job, config=config)
    out.mkdir(parents=True, exist_ok=True)
    from plugsearch.stack.corpus import index_dir_for

    index_dir = job.index_dir or index_dir_for(corpus, job.var_dir)
    stages = {"questions": round(time.perf_counter() - t0, 1)}
    t = time.perf_counter()
    if retriever is None:
        retriever = IndexRetriever(corpus, index_dir, dense=config.dense, progress=job.progress)
    stages["indexes"] = round(time.perf_counter() - t, 1)
    record: dict[str, Any] = {"command": job.command, "config": config_dict(config), "rows": rows,
                              "train_questions": len(train), "dev_questions": len(dev)}
    if pseudo_info is not None:
        record["pseudo_questions"] = {**pseudo_info, "what": (
            "questions made from the corpus's passages by the trainer (plugsearch/trainer/compact/pseudo.py): a cloze over a "
            "sentence, or a two-passage question through a title another document mentions; filtered so that "
            "naive BM25 top-3 misses half of them")}
    if llm_info is not None:  # a source of its own: how many, from which model, kept of how many passages
        record["llm_questions"] = {**{k: v for k, v in llm_info.items() if k != "few_shot_examples"},
                                   "evaluated_on": "never" if own or job.eval_qa else "held-out questions it wrote "
                                   "(no real evaluation)"}
    if user is not None:
        record["trained_on"] = source_counts(train)
    if user is not None:
        record["questions"] = {"files": user.files, "split_seed": job.split_seed,
                               "sizes": {k: len(v) for k, v in user.split.ids().items()},
                               "sources": user.sources(), "evaluation_file": user.eval_given,
                               "left_out": {k: len(v) for k, v in user.left_out.items()}}
    if retriever.encoder is not None:
        record["dense"] = {"encoder": retriever.encoder, "index": "flat (exact)"}
    identity = {"file": corpus.name, **retriever.identity(), "bound": user is not None}
    """The corpus's identity: a policy trained on a user's corpus (`bound`) is served on that corpus only."""
    search = config.search_setting()
    params = config.search_params()

    start = _start_policy(job, user)
    t = time.perf_counter()
    warm, warm_info = _warm_start(job, train, dev, retriever, record, search, identity, start)
    stages["warm_start"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    final, rl_info = _reinforce(job, warm, train, dev, retriever, corpus, start, warm_info.get("learner"))
    stages["rl"] = round(time.perf_counter() - t, 1)
    final.save(out / "final", {**record, "stage": "warm start + RL", "warm_start": warm_info, "rl": rl_info,
                               "search": search, "corpus": identity})
    result: dict[str, Any] = {"out": str(out / "final"), "warm_dev": warm_info.get("dev"), "rl_dev": rl_info["dev"],
                              "rl_reward_first_10": rl_info["first_10_mean_reward"],
                              "rl_reward_last_10": rl_info["last_10_mean_reward"], "rl_timing": rl_info.get("timing")}
    if user is not None:
        t = time.perf_counter()
        exported = _evaluate_and_export(job, user, warm, final, retriever, params, identity)
        stages["evaluation"] = round(time.perf_counter() - t, 1)
        # the line a user reads last: the folder to serve (and the command) first, `<out>/final` is the raw run
        result = {"policy": exported.pop("policy"), "serve": exported.pop("serve"), **exported,
                  **{("final" if k == "out" else k): v for k, v in result.items()}}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["stage_seconds"] = stages
    return result


def _llm_question_file(job: CompactRun, retriever: IndexRetriever | None, labelled: Sequence[QAItem]
                       ) -> tuple[IndexRetriever, dict[str, Any], Path]:
    """The questions the user's LLM writes for sampled passages of the corpus (`llm_questions.question_file`;
    `labelled`: the few-shot source), with the corpus's retriever (built here when the run has none yet)."""
    from plugsearch.stack.corpus import index_dir_for
    from plugsearch.trainer.compact.llm_questions import question_file

    assert job.llm_questions is not None
    if retriever is None:
        if job.corpus is None or not job.corpus.is_file():
            raise QAFileError(f"--corpus {job.corpus} is not a file: your LLM writes questions about its passages")
        corpus = job.corpus.resolve()
        check_corpus_file(corpus, progress=job.progress)
        retriever = IndexRetriever(corpus, job.index_dir or index_dir_for(corpus, job.var_dir),
                                   dense=job.config.dense, progress=job.progress)
    path, info = question_file(job.out, retriever, job.llm_questions, labelled=labelled, resume=job.resume,
                               progress=job.progress)
    return retriever, info, path


def _start_policy(job: CompactRun, user: UserData | None) -> CompactPolicy | None:
    """Where a user's warm start starts: the shipped policy (`--start shipped`) or nowhere (scratch, naive BM25's
    order (`--start naive`, its own learner), and always on the shipped sets)."""
    if user is None or job.start in ("scratch", "naive"):
        return None
    from plugsearch.searcher.trained import COMPACT_DIR

    return CompactPolicy.load(COMPACT_DIR)


def _warm_start(job: CompactRun, train: list[LabeledItem], dev: list[LabeledItem], retriever: IndexRetriever,
                record: dict[str, Any], search: dict[str, Any], identity: dict[str, Any],
                start: CompactPolicy | None) -> tuple[CompactPolicy, dict[str, Any]]:
    from plugsearch.trainer.compact.finetune import learn
    from plugsearch.trainer.compact.warmstart import warm_start

    warm_dir = job.out / "warmstart"
    if (warm_dir / "manifest.json").is_file() and job.resume:
        warm = CompactPolicy.load(warm_dir)
        logger.info("reusing the warm start in %s (--no-resume redoes it)", warm_dir)
        return warm, warm.manifest.get("warm_start", {})
    t = time.perf_counter()
    if record.get("trained_on") is not None and job.start == "naive":  # naive BM25's order, corrected
        from plugsearch.trainer.compact.rerank import learn_naive

        warm, info = learn_naive(train, retriever, job.config, penalty=job.pull, progress=job.progress)
    elif record.get("trained_on") is not None:  # a user's questions: the few-question learner
        pull = None if isinstance(job.pull, str) else job.pull  # cv: the shipped-start learner's own choice
        warm, info = learn(train, retriever, job.config, start=start, pull=pull,
                           negative_weight=job.negative_weight, progress=job.progress)
    else:
        warm, info = warm_start(train, retriever, job.config, progress=job.progress)
    info["seconds"] = round(time.perf_counter() - t, 1)
    info["dev"] = dev_check(warm, [d.item for d in dev], retriever, job.config.search_params()) if dev else {}
    warm.save(warm_dir, {**record, "stage": "warm start", "warm_start": info, "search": search, "corpus": identity})
    return warm, info


def _reinforce(job: CompactRun, warm: CompactPolicy, train: list[LabeledItem], dev: list[LabeledItem],
               retriever: IndexRetriever, corpus: Path, start: CompactPolicy | None = None,
               learner: dict[str, Any] | None = None) -> tuple[CompactPolicy, dict[str, Any]]:
    from plugsearch.trainer.common.plotting import plot_reward_curve
    from plugsearch.trainer.common.upstreams import ServiceStack
    from plugsearch.trainer.compact.rl import reinforce, timing

    config = job.config
    pull = (learner or {}).get("pull")
    if (learner or {}).get("rl") is False:  # the naive-start learner: served as fitted (its choice was judged so)
        return (CompactPolicy(dict(warm.weights), name=warm.name),
                {"steps": 0, "skipped": "the naive-start learner serves its fit as chosen on the training questions' "
                 "dev parts", "first_10_mean_reward": 0.0, "last_10_mean_reward": 0.0, "dev": {}})
    if start is not None and pull == "keep":  # the training questions showed no change that helps: none is made
        return (CompactPolicy(dict(warm.weights), name="compact-gbr"),
                {"steps": 0, "skipped": "the learner kept the shipped weights (no change helped on the training "
                 "questions' dev parts)", "first_10_mean_reward": 0.0, "last_10_mean_reward": 0.0, "dev": {}})
    anchor_pull = float(pull) if start is not None and pull is not None else 0.0
    rl_dir = job.out / "rl"
    rl_dir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    answering = config.reward != "recall"
    with services_for(job.settings, job.local and answering, corpus=corpus, answering=True, retriever=False,
                      llm_url=job.llm_url, llm_threads=job.llm_threads) as settings:
        def make_reward() -> RewardComputer:
            if not answering:
                return RewardComputer(None, kind="recall", baseline=config.baseline, method="bm25",
                                      retriever=retriever)
            store = BaselineStore(rl_dir / "baselines", BaselineConfig(k=3, method="bm25", tag="compact"),
                                  redis_url=settings.redis_url)
            return RewardComputer(ServiceStack(settings), kind=config.reward,  # type: ignore[arg-type]
                                  baseline=config.baseline, baselines=store, method="bm25", retriever=retriever)

        # pulled toward the warm start, the point the learner chose on the training questions (its pull toward the
        # shipped weights would outweigh RL's small loss and undo that choice)
        final, entries = reinforce(warm, train, retriever, config, rl_dir, make_reward, progress=job.progress,
                                   anchor=warm if start is not None else None, pull=anchor_pull)
    first, last = entries[:10], entries[-10:]
    info: dict[str, Any] = {
        "seconds_this_run": round(time.perf_counter() - t, 1), "steps": len(entries), "reward": config.reward,
        "baseline": config.baseline, "pull": anchor_pull if start is not None else None,
        "first_10_mean_reward": round(float(sum(e["mean_reward"] for e in first) / max(1, len(first))), 4),
        "last_10_mean_reward": round(float(sum(e["mean_reward"] for e in last) / max(1, len(last))), 4),
        "timing": timing(entries),
        "dev": dev_check(final, [d.item for d in dev], retriever, config.search_params()) if dev else {}}
    if entries:
        what = "recall: span check" if config.reward == "recall" else f"{config.reward}: generator + judge"
        png = plot_reward_curve(entries, rl_dir / "reward_curve.png",
                                title=f"compact policy: GBR ({what}) per RL step")
        info["reward_curve"] = str(png) if png else None
    return final, info


def versus_shipped(rows: Sequence[dict[str, Any]], key: str = VERDICT_KEY, shipped: str = SHIPPED_KEY,
                   budget: int = 3) -> dict[str, Any]:
    """The trained policy against the shipped one on the same evaluation questions at `budget` documents: both
    answer recalls and the paired difference with its 95% interval."""
    cells = [r["scores"][str(budget)] for r in rows]
    block = metric_block(cells, [key, shipped], "hit", reference=shipped)
    return {"trained": block[key], "shipped": block[shipped], "difference": block.get(f"{key}_minus_naive"),
            "ci95": block.get(f"{key}_minus_naive_ci95"), "n": len(cells)}


def recommendation(verdict: bool, versus: Mapping[str, Any], serve_trained: str, serve_shipped: str) -> str:
    """Which policy to serve, in one sentence with the command."""
    low, high = (versus.get("ci95") or [0.0, 0.0])[:2]
    diff = versus.get("difference") or 0.0
    if not verdict:
        return (f"do not serve the trained policy: it does not beat naive BM25 top-3 on the evaluation split; the "
                f"shipped policy measures itself on your corpus at start-up and falls back to naive top-k where it "
                f"does not beat it: {serve_shipped}")
    if high < 0:
        return (f"the shipped policy finds more answers on these questions ({diff:+.3f} [{low:+.3f}, {high:+.3f}] "
                f"for the trained one): serve the shipped one: {serve_shipped}")
    if low > 0:
        return f"serve the trained policy: it beats naive BM25 and the shipped policy ({diff:+.3f} [{low:+.3f}, " \
               f"{high:+.3f}]): {serve_trained}"
    return (f"serve the trained policy (it beats naive BM25); against the shipped policy the difference is "
            f"{diff:+.3f} [{low:+.3f}, {high:+.3f}], not measurable on these questions: {serve_trained}")


def _learner_note(learner: dict[str, Any]) -> str:
    """The report's line on how the warm start learnt."""
    if not learner:
        return "warm start: from random weights"
    if learner.get("start") == "scratch":
        return "warm start: from random weights (--start scratch)"
    pull = learner.get("pull")
    how = learner.get("how", "")
    recall = ", ".join(f"{p} {r:.3f}" for p, r in (learner.get("dev_recall") or {}).items())
    chosen = f"chosen on {how}; answer recall at 3 per pull: {recall}" if how != "given" else "given"
    if learner.get("start") == "naive":
        if how != "given" and not learner.get("dev_recall"):
            chosen = f"the default penalty, {how}"
        if pull == "keep":
            return (f"policy: naive BM25's order, unchanged (one search, no follow-up): no correction helped on the "
                    f"training questions ({chosen})")
        return (f"policy: naive BM25's order plus a linear correction with a penalty of {pull} (one search, no "
                f"follow-up, no RL; {chosen})")
    if pull == "keep":
        return (f"warm start: the shipped policy ({learner.get('start')}), kept unchanged: no change helped on the "
                f"training questions ({chosen})")
    return f"warm start: the shipped policy ({learner.get('start')}) fine-tuned with a pull of {pull} toward it ({chosen})"


def _evaluate_and_export(job: CompactRun, user: UserData, warm: CompactPolicy, final: CompactPolicy,
                         retriever: IndexRetriever, params: Any, identity: dict[str, Any]) -> dict[str, Any]:
    """The evaluation split against naive top-k at equal budgets and against the shipped policy, the report,
    and `<out>/policy`."""
    from plugsearch.searcher.trained import COMPACT_DIR

    served = list(retriever.methods)
    naive = [m for m in ("bm25", "dense", "hybrid") if m in served]
    policies = {name: PolicyRun(p, params.model_copy(update={"pool_methods": p.pool_methods(served, retriever.encoder)}))
                for name, p in (("compact_warm", warm), (VERDICT_KEY, final))}
    shipped = CompactPolicy.load(COMPACT_DIR)
    policies[SHIPPED_KEY] = PolicyRun(shipped, SearchParams(
        mode="s3", method="bm25", pool_methods=shipped.pool_methods(served, retriever.encoder),
        **{**shipped.search_setting(), "select_k": params.select_k}))
    evaluation = BudgetEval(retriever, naive=naive, policies=policies, budgets=EVAL_BUDGETS)
    by_set: dict[str, list[QAItem]] = {}
    for item in user.split.eval:
        by_set.setdefault(item.dataset, []).append(item)
    t = time.perf_counter()
    rows = evaluation.run_rows(by_set, progress=job.progress)
    result = evaluation.summary(rows, list(by_set))
    versus = versus_shipped(rows)
    result["settings"] = {"questions": "the evaluation split (split.json), yes/no and unanswerable left out",
                          "budgets": list(EVAL_BUDGETS), "pool_k": job.config.retrieve_k, "retriever": "bm25s",
                          "dense": retriever.encoder, "policies": {k: p.policy.model for k, p in policies.items()},
                          "seconds": round(time.perf_counter() - t, 1)}
    result["versus_shipped"] = versus
    systems = evaluation.systems
    verdict = beats_naive(result, VERDICT_KEY)
    gains = {name: d["budget3"]["answer_recall"].get(f"{VERDICT_KEY}_minus_naive")
             for name, d in result["datasets"].items()}
    corpus_arg = job.corpus or identity["file"]
    serve_trained = f"plugsearch-stack --corpus {corpus_arg} --policy {job.out / 'policy'}"
    serve_shipped = f"plugsearch-stack --corpus {corpus_arg}"
    advice = recommendation(verdict, versus, serve_trained, serve_shipped)
    learner = (warm.manifest.get("warm_start") or {}).get("learner") or {}
    if verdict and learner.get("pull") == "keep" and learner.get("start") != "naive":  # the same weights: what differs is the verdict it carries
        advice = (f"serve the trained policy: it is the shipped policy unchanged (your training questions showed no "
                  f"change that helps), and on your held-back questions it beats naive BM25; its folder carries that "
                  f"verdict for this corpus, so the searcher serves it without its start-up check: {serve_trained}")
    evaluated_on = source_counts(user.split.eval)
    pseudo_only = all(item.source in MADE_UP for item in user.split.eval)
    """Every evaluation question made from the corpus or written by the user's LLM: no real evaluation."""
    by_llm = any(item.source == "llm" for item in user.split.eval)
    if pseudo_only and by_llm:  # no real question was evaluated: no verdict on real questions to stand on
        advice = (f"not known: no real evaluation: the figures are on held-out questions your LLM wrote (trained "
                  f"{versus['trained']:.3f}, shipped {versus['shipped']:.3f}), not on questions people asked, so the "
                  "searcher serves naive BM25 with it unless labelled questions of yours show it "
                  "(SEARCHER_CORPUS_CHECK_QA=FILE) or SEARCHER_CORPUS_CHECK=off; label some questions (--qa FILE, "
                  "with --eval-qa FILE holding others to judge it on) and train again (your LLM's questions then join "
                  f"the training), or serve the shipped policy, which measures itself on your corpus: {serve_shipped}")
    elif pseudo_only:
        advice = (f"not known: no real evaluation: evaluated on questions made from the corpus only (trained "
                  f"{versus['trained']:.3f}, shipped {versus['shipped']:.3f}, naive BM25 lower by the table above), "
                  "which did not carry over to real questions on the development sets we measured, so the searcher "
                  "serves naive BM25 with it unless SEARCHER_CORPUS_CHECK=off; label some questions of yours and "
                  "train again (--qa FILE, with --eval-qa FILE holding others to judge it on), or serve the shipped "
                  f"policy, which measures itself on your corpus: {serve_shipped}")
    real_kinds = [s for s in ("labelled", "feedback") if evaluated_on.get(s)]
    kind = ("llm" if by_llm else "pseudo") if pseudo_only else " and ".join(real_kinds)
    trained_on = final.manifest.get("trained_on") or source_counts(user.split.train)
    notes = [user.summary(), f"corpus {identity['file']} (sha256 {identity['sha256'][:12]}, {identity['documents']} "
             f"passages); policy {final.model}; warm start = compact_warm, "
             + (f"served as fitted (no RL) = {VERDICT_KEY}" if learner.get("rl") is False else f"+ RL = {VERDICT_KEY}")
             + f", the shipped policy ({shipped.model}) = {SHIPPED_KEY}",
             "trained on: " + ", ".join(f"{n} {s}" for s, n in trained_on.items() if n) +
             (" questions; judged on " + ", ".join(f"{n} held-back {s}" for s, n in evaluated_on.items() if n) +
              " questions only (" + ("the --eval-qa file" if user.eval_given else f"split seed {job.split_seed}") +
              "), never on made-up ones" if not pseudo_only else
              " questions; judged on held-out questions made from the corpus (no real question to judge it on)"),
             _learner_note(learner),
             f"trained against shipped, answer recall at 3 on the same {versus['n']} questions: {versus['trained']:.3f} "
             f"against {versus['shipped']:.3f}, paired difference {versus['difference']:+.3f} "
             f"[{versus['ci95'][0]:+.3f}, {versus['ci95'][1]:+.3f}]"]
    if user.eval_in_training:
        notes.append(f"{len(user.eval_in_training)} of the evaluation questions are asked in the same words as a "
                     "training question: those are not new questions to the policy")
    if evaluated_on.get("feedback"):
        notes.append(f"{evaluated_on['feedback']} of the evaluation questions are marks from use: a returned passage "
                     "counts as found only where a user marked it helpful, and users marked only what a searcher "
                     "showed them, so the searcher that showed them (naive BM25 where the searcher fell back to it) "
                     "scores best by construction; judge the policy on held-back labelled questions (--eval-qa FILE)")
    if versus["n"] < MIN_SPLIT["eval"]:
        notes.append(f"only {versus['n']} evaluation questions: the intervals are wide, and a verdict needs the "
                     "interval above 0")
    notes.append(f"**Which to serve**: {advice}")
    report = write_budget_report(result, systems, job.out / "report", key=VERDICT_KEY,
                                 title=f"compact searcher on {identity['file']}", notes=notes)
    summary = ", ".join(f"{name} {g:+.3f}" for name, g in gains.items() if g is not None)
    folder = job.out / "policy"
    manifest = {**final.manifest, "trained_on": trained_on, "evaluation": {
        "summary": f"answer recall at 3 documents minus naive BM25 top-3 on the evaluation split: {summary}",
        "beats_naive": verdict, "gains_at_3": gains, "versus_shipped": versus, "recommendation": advice,
        "questions": kind, "evaluated_on": evaluated_on, "n": versus["n"],
        "part": "the --eval-qa file(s)" if user.eval_given else f"split by seed {job.split_seed}", "bench": result}}
    final.save(folder, manifest)
    for name in ("report.md", "report.png"):
        if (job.out / "report" / name).is_file():
            shutil.copyfile(job.out / "report" / name, folder / name)
    shutil.copyfile(job.out / "split.json", folder / "split.json")
    return {"policy": str(folder), "serve": advice, "beats_naive": verdict, "versus_shipped": versus,
            "gains_at_3": gains, "report": report["markdown"], "png": report["png"],
            "questions": json.loads(json.dumps(user.record()["sizes"])), "trained_on": trained_on,
            "evaluated_on": evaluated_on, "learner": learner or None,
            "left_out": {k: len(v) for k, v in user.left_out.items()}}
