"""veRL's train / val parquet from question files in the `../shared/data/qa/*.jsonl` format.

    python -m plugsearch.trainer.verl.data --out var/verl/data [--data-dir DIR] [--datasets nq hotpotqa]
        [--per-dataset N] [--val-per-dataset 100] [--agent plugsearch_s3] [--s3-filter]

One row per question in veRL's RLHFDataset format. Splits are the trainer's (`plugsearch.common.qa`): train never
holds an evaluation question; val = the first `--val-per-dataset` held-out questions of each set.
`prompt` is the environment's first observation without documents (the rollout rebuilds it with the
naive top-k it retrieves then), for veRL's length filter and logs; `prompt_version` lets the agent loop
refuse rows built with other prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from plugsearch.common.qa import TRAIN_DATASETS, QAItem, eval_split, s3_filter, train_split
from plugsearch.common.schemas.base import Document
from plugsearch.common.schemas.searcher import SearchParams
from plugsearch.searcher.env import SearchEnv
from plugsearch.searcher.prompts import PromptSet
from plugsearch.trainer.common.baseline import BaselineConfig, BaselineStore
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.verl import CONFIG_DIR

logger = logging.getLogger(__name__)


def agent_search_params() -> dict[str, SearchParams]:
    """agent_name -> the search setting its agent loop runs (`agent_loop.yaml`, what every worker reads)."""
    from omegaconf import OmegaConf

    entries = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "agent_loop.yaml"))
    if not isinstance(entries, list):
        raise ValueError("agent_loop.yaml must be a list of agent loops")
    return {str(e["name"]): SearchParams.model_validate(e.get("search") or {}) for e in entries}


class _NoDocuments:
    """A retriever that finds nothing: the environment's first messages without the retrieval."""

    async def retrieve(self, queries: list[str], k: int, method: str | None) -> list[list[Document]]:
        return [[] for _ in queries]


def first_messages(question: str, params: SearchParams, prompts: PromptSet) -> list[dict[str, str]]:
    """The chat messages the search environment starts with, its information block left empty."""
    env = SearchEnv(question, params, _NoDocuments(), prompts=prompts)
    return [m.model_dump() for m in asyncio.run(env.reset())]


def rows(items: Sequence[QAItem], *, split: str, agent: str, prompts: PromptSet) -> list[dict[str, Any]]:
    agents = agent_search_params()
    if agent not in agents:
        raise ValueError(f"unknown agent {agent!r} (agent_loop.yaml has {', '.join(sorted(agents))})")
    params = agents[agent]
    return [{"data_source": item.dataset, "prompt": first_messages(item.question, params, prompts), "ability": "search",
             "reward_model": {"style": "rule", "ground_truth": list(item.golden_answers)},
             "extra_info": {"index": index, "id": item.id, "question": item.question, "split": split,
                            "prompt_version": prompts.version},
             "agent_name": agent}
            for index, item in enumerate(items)]


def write_parquet(records: Sequence[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not records:
        raise ValueError(f"no questions for {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(records)), path)


def build(data_dir: Path, out: Path, *, datasets: Sequence[str] = TRAIN_DATASETS, per_dataset: int | None = None,
          val_per_dataset: int = 100, eval_holdout: int = 200, agent: str = "plugsearch_s3",
          prompts: PromptSet | None = None, baselines: dict[str, float] | None = None) -> dict[str, Any]:
    """Write `train.parquet` and `val.parquet` under `out`; returns a summary."""
    if val_per_dataset > eval_holdout:
        raise ValueError(f"val questions ({val_per_dataset}) must come from the {eval_holdout} held out per set")
    prompts = prompts or PromptSet.packaged()
    train = train_split(data_dir, datasets, per_dataset=per_dataset, eval_holdout=eval_holdout)
    candidates = len(train)
    if baselines is not None:
        train = s3_filter(train, baselines)
    val = [item for name in datasets for item in eval_split(data_dir, name, val_per_dataset)]
    held_out = {item.id for name in datasets for item in eval_split(data_dir, name, eval_holdout)}
    leaked = held_out & {item.id for item in train}
    if leaked:
        raise ValueError(f"{len(leaked)} evaluation questions in the training split, e.g. {sorted(leaked)[:3]}")
    write_parquet(rows(train, split="train", agent=agent, prompts=prompts), out / "train.parquet")
    write_parquet(rows(val, split="val", agent=agent, prompts=prompts), out / "val.parquet")
    return {"train": len(train), "train_candidates": candidates, "val": len(val), "datasets": list(datasets),
            "agent": agent, "prompt_version": prompts.version, "out": str(out)}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m plugsearch.trainer.verl.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for train.parquet and val.parquet")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="holds qa/<set>.jsonl (default: TRAINER_DATA_DIR, else the shared data)")
    parser.add_argument("--datasets", nargs="+", default=list(TRAIN_DATASETS))
    parser.add_argument("--per-dataset", type=int, default=None, help="training questions per set (default: all)")
    parser.add_argument("--val-per-dataset", type=int, default=100)
    parser.add_argument("--eval-holdout", type=int, default=200, help="first questions of each set kept out of training (rows 100-199 are reserved)")
    parser.add_argument("--agent", choices=sorted(agent_search_params()), default="plugsearch_s3")
    parser.add_argument("--prompts-dir", type=Path, default=None, help="prompt set folder (as SEARCHER_PROMPTS_DIR)")
    parser.add_argument("--s3-filter", action="store_true",
                        help="keep naive-RAG GenAcc 0, non yes/no questions (baselines of `plugsearch-train baseline`)")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    settings = TrainerSettings()
    baselines = None
    if args.s3_filter:
        config = BaselineConfig(k=settings.baseline_k, method=settings.method)
        baselines = BaselineStore(settings.var_dir / "baselines", config).genacc_by_id()
    summary = build(args.data_dir or settings.data_dir, args.out, datasets=args.datasets,
                    per_dataset=args.per_dataset, val_per_dataset=args.val_per_dataset,
                    eval_holdout=args.eval_holdout, agent=args.agent, prompts=PromptSet.load(args.prompts_dir),
                    baselines=baselines)
    logger.info("wrote %s", json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
