"""`plugsearch-train plot RUN`: the reward curve PNG of a run folder (its `rewards.jsonl`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def cmd_plot(args: argparse.Namespace) -> dict[str, Any]:
    from plugsearch.trainer.common.plotting import plot_reward_curve
    from plugsearch.trainer.llm.grpo import read_reward_log

    run = Path(args.run)
    entries = read_reward_log(run / "rewards.jsonl")
    if not entries:
        raise SystemExit(f"no reward log in {run}")
    png = plot_reward_curve(entries, run / "reward_curve.png")
    if png is None:
        from plugsearch.trainer.common.plotting import MISSING

        raise SystemExit(f"error: {MISSING}")
    return {"png": str(png), "steps": len(entries)}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="reward curve PNG of a run folder")
    p.add_argument("run")
    p.set_defaults(func=cmd_plot)
