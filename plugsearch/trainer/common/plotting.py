"""PNG charts: the reward curve of a training run and the evaluation bar chart (matplotlib, Agg).

matplotlib is in the test and training part of the lock (`bash scripts/install.sh --all`), not in the default
install's: without it every chart is skipped (its function returns None) and the run goes on; `MISSING` is the
line that says so, which the training commands print at their start."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from statistics import fmean
from typing import Any, cast

MISSING = ("matplotlib is not installed: the charts (reward_curve.png, report.png) are skipped, the tables and "
           "JSON reports are written; `bash scripts/install.sh --all` installs it")


class _NoPlots(Exception):
    """matplotlib is missing: the chart is skipped."""


def available() -> bool:
    """Whether the charts can be drawn here (matplotlib importable)."""
    import importlib.util

    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):
        return False


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise _NoPlots from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_reward_curve(entries: Sequence[Mapping[str, Any]], path: Path, *, title: str = "reward per step") -> Path:
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


def _plot_eval_bars(table: Mapping[str, Mapping[str, Mapping[str, float]]], path: Path, *,
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


def _plot_recall_bars(result: Mapping[str, Any], systems: Sequence[str], path: Path, *, budget: int = 3,
                     title: str = "answer recall", labels: Mapping[str, str] | None = None) -> Path:
    """Grouped bars with 95% intervals: one group per set (and `all`), one bar per searcher, answer recall at
    `budget` documents (`plugsearch.trainer.common.evaluation.budget_summary`'s result); `labels` name the searchers."""
    labels = labels or {}
    plt = _pyplot()
    sets = [(name, block) for name, block in result.get("datasets", {}).items() if block.get(f"budget{budget}")]
    groups = sets + ([("all", result["all"])] if len(sets) != 1 and result.get("all", {}).get(f"budget{budget}") else [])
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups) + 4), 4.5))
    for i, system in enumerate(systems):
        means, low, high = [], [], []
        for _, block in groups:
            recall = block[f"budget{budget}"]["answer_recall"]
            mean = recall.get(system) or 0.0
            ci = recall.get(f"{system}_ci95") or [mean, mean]
            means.append(mean)
            low.append(max(0.0, mean - ci[0]))
            high.append(max(0.0, ci[1] - mean))
        xs = [j + i * width for j in range(len(groups))]
        bars = ax.bar(xs, means, width, yerr=[low, high], capsize=3, label=labels.get(system, system))
        ax.bar_label(bars, labels=[f"{m:.2f}" for m in means], fontsize=7, padding=2)
    ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{name}\n(n={block.get('n', 0)})" for name, block in groups])
    ax.set_ylim(0, 1.1)
    return _save(plt, fig, ax, path, ylabel=f"answer recall at {budget} documents", title=title, outside=True)


def _save(plt: Any, fig: Any, ax: Any, path: Path, *, ylabel: str, title: str, outside: bool = False) -> Path:
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if outside:  # beside the bars, never over them
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _skipping(draw: Any) -> Any:
    def chart(*args: Any, **kwargs: Any) -> Path | None:
        try:
            return cast(Path, draw(*args, **kwargs))
        except _NoPlots:
            return None

    chart.__doc__ = draw.__doc__
    chart.__name__ = draw.__name__.lstrip("_")
    return chart


plot_reward_curve: Callable[..., Path | None] = _skipping(_plot_reward_curve)
plot_eval_bars: Callable[..., Path | None] = _skipping(_plot_eval_bars)
plot_recall_bars: Callable[..., Path | None] = _skipping(_plot_recall_bars)
