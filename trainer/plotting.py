"""PNG charts: the reward curve of a training run and the evaluation bar chart (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reward_curve(entries: Sequence[Mapping[str, Any]], path: Path, *, title: str = "reward per step") -> Path:
    """Mean reward (and GenAcc) per step from `rewards.jsonl` entries."""
    plt = _pyplot()
    steps = [int(e["step"]) for e in entries]
    fig, ax = plt.subplots(figsize=(7, 4))
    kind = entries[0]["kind"] if entries else ""
    rewards = [e["mean_reward"] for e in entries]
    name = "GBR reward (span check, - naive top-n)" if kind == "recall" else f"{kind} reward"
    ax.plot(steps, rewards, marker="o", label=f"mean {name}")
    if len(rewards) >= 10:
        window = 10
        smooth = [fmean(rewards[max(0, i - window + 1):i + 1]) for i in range(len(rewards))]
        ax.plot(steps, smooth, linewidth=2.5, label=f"mean {name}, last {window} steps")
    second = "share of searches whose documents hold the answer" if kind == "recall" else "mean GenAcc"
    ax.plot(steps, [e["mean_genacc"] for e in entries], marker=".", linestyle="--", label=second)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("step")
    return _save(plt, fig, ax, path, ylabel="reward", title=title)


def plot_eval_bars(table: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path, *,
                   metric: str = "genacc") -> Path:
    """Grouped bars: one group per dataset (+ average), one bar per method. `table[method][dataset][metric]`."""
    plt = _pyplot()
    methods = list(table)
    datasets = sorted({d for m in table.values() for d in m}, key=lambda d: (d == "average", d))  # average last
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(datasets)), 4))
    for i, method in enumerate(methods):
        xs = [j + i * width for j in range(len(datasets))]
        ax.bar(xs, [table[method].get(d, {}).get(metric, 0.0) for d in datasets], width, label=method)
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(datasets))])
    ax.set_xticklabels(datasets, rotation=20)
    return _save(plt, fig, ax, path, ylabel=metric, title=f"{metric} per dataset")


def _save(plt: Any, fig: Any, ax: Any, path: Path, *, ylabel: str, title: str) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
