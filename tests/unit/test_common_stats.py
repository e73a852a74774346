"""The one bootstrap interval (plugsearch/common/stats.py), used by the trainer's evaluation and the searcher's
corpus check: the numbers are pinned, so neither side's reported intervals move when the code does."""

from __future__ import annotations

import math

from plugsearch.common.stats import bootstrap_interval


def test_the_interval_brackets_the_mean_and_is_pinned() -> None:
    thirty_in_hundred = [1.0] * 30 + [0.0] * 70
    assert bootstrap_interval(thirty_in_hundred) == [0.22, 0.39]  # fixed seed: the same every run
    assert bootstrap_interval(thirty_in_hundred, resamples=500, seed=3) == [0.21, 0.39]
    paired = [1.0, 0.0, 1.0, 1.0, 0.0, -1.0, 0.0, 1.0, 0.0, 1.0]  # per-question differences a - b
    assert bootstrap_interval(paired) == [0.0, 0.8]
    assert bootstrap_interval([0.5] * 7 + [0.25] * 3) == [0.35, 0.5]
    assert bootstrap_interval([0.4] * 5) == [0.4, 0.4]


def test_no_values_have_no_interval() -> None:
    assert all(math.isnan(x) for x in bootstrap_interval([]))
