"""`plugsearch-train baseline`: the naive-RAG GenAcc of every training candidate (resumable), and the s3 filter
built on it (`select_training_questions`, what `train --reward gbr` trains on)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

from plugsearch.common.answers import is_yes_no
from plugsearch.common.qa import QAItem, s3_filter, train_split
from plugsearch.trainer.cli.common import add_common, add_train_set, baseline_store, settings_from
from plugsearch.trainer.common.baseline import ensure_baselines
from plugsearch.trainer.common.settings import TrainerSettings
from plugsearch.trainer.common.upstreams import ServiceStack

logger = logging.getLogger("plugsearch.trainer.cli")


def candidates(settings: TrainerSettings, args: argparse.Namespace) -> list[QAItem]:
    return train_split(settings.data_dir, args.datasets, per_dataset=args.per_dataset, eval_holdout=args.eval_holdout)


async def compute(settings: TrainerSettings, items: list[QAItem], batch: int, progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    store = baseline_store(settings)
    bar = tqdm(total=len(items), desc="baseline", disable=not progress)
    bar.update(sum(1 for it in items if it.id in store))
    try:
        async with ServiceStack(settings) as stack:
            counts = await ensure_baselines(stack, store, items, batch=batch, progress=bar.update)
    finally:
        bar.close()
        await store.aclose()
    genacc = store.genacc_by_id()
    kept = s3_filter(items, genacc)
    return {**counts, "file": str(store.path), "filtered": len(kept),
            "naive_genacc": sum(genacc[it.id] for it in items) / max(1, len(items))}


def select_training_questions(settings: TrainerSettings, items: list[QAItem], want: int, *, batch: int = 8,
                              progress: bool = True) -> list[QAItem]:
    """s3's training set: candidates whose naive-RAG baseline is 0 and that are not yes/no. Baselines are
    computed in file order, a round at a time, until `want` questions survive the filter."""
    kept: list[QAItem] = []
    start = 0
    while len(kept) < want and start < len(items):
        size = max(batch, want - len(kept))
        # yes/no questions are dropped without spending a baseline on them
        round_items = [it for it in items[start:start + size] if not is_yes_no(it.golden_answers)]
        start += size
        if round_items:
            logger.info("baselines: %s", asyncio.run(compute(settings, round_items, batch, progress)))
        store = baseline_store(settings)
        kept += s3_filter(round_items, store.genacc_by_id())
    return kept[:want]


def cmd_baseline(args: argparse.Namespace) -> dict[str, Any]:
    settings = settings_from(args)
    return asyncio.run(compute(settings, candidates(settings, args), args.batch, not args.quiet))


def add_parser(sub: Any) -> None:
    b = sub.add_parser("baseline", help="naive-RAG GenAcc of every training candidate (resumable)")
    add_common(b)
    add_train_set(b)
    b.set_defaults(func=cmd_baseline)
