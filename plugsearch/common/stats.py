"""The one bootstrap interval, shared by the trainer's evaluation at equal budget and the searcher's corpus check.

Percentile bootstrap of the mean: `resamples` resamples of the values (with replacement, each as long as the
values), drawn by Python's `random.Random(seed)`, their means sorted, the 2.5th and 97.5th percentiles rounded to
3 decimals. Fixed seed: the same values always give the same interval. For a paired comparison, pass the per-item
differences (a - b): the interval of the mean difference.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


def bootstrap_interval(values: Sequence[float], *, resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% percentile bootstrap interval of the mean of `values` (NaN, NaN for none)."""
    if not values:
        return [float("nan"), float("nan")]
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return [round(means[int(0.025 * resamples)], 3), round(means[int(0.975 * resamples) - 1], 3)]
