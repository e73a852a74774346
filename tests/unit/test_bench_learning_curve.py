"""bench/learning_curve.py's bookkeeping: nested seeded draws, the runs it plans, and the smallest number of
questions at which every seed's policy is above naive BM25 with its interval above 0; and the RL steps a run on
a user's questions takes when `--steps` is not given."""

from __future__ import annotations

from typing import Any

from bench.learning_curve import draw, plan, smallest_n
from plugsearch.common.qa import QAItem
from plugsearch.trainer.compact.config import CompactConfig
from plugsearch.trainer.compact.run import MIN_RL_STEPS, rl_steps_for


def test_draws_are_seeded_and_nested() -> None:
    pool = [QAItem(id=f"q{i}", question="q?", golden_answers=["a"]) for i in range(300)]
    small, large = draw(pool, 25, 0, "set"), draw(pool, 100, 0, "set")
    assert large[:25] == small and len({q.id for q in large}) == 100
    assert draw(list(reversed(pool)), 25, 0, "set") == small  # the pool's order changes nothing
    assert draw(pool, 25, 1, "set") != small and len(draw(pool, 0, 0, "set")) == 300


def test_the_plan_runs_smallest_first_with_seeds_up_to_100_and_scratch_at_100_and_all() -> None:
    runs = plan([25, 50, 100, 200, 400, 0], pool=302, seeds=2, variants=["shipped", "scratch"], mix=200)
    sizes = [r["n"] for r in runs]
    assert sizes == sorted(sizes, key=lambda n: n or 10**9) and 400 not in sizes  # more than the pool: left out
    assert sum(1 for r in runs if r["n"] == 25) == 3 and sum(1 for r in runs if r["n"] == 200) == 2
    assert {(r["n"], r["seed"], r["mix"]) for r in runs if r["start"] == "scratch"} == {
        (100, 0, 0), (100, 1, 0), (100, 0, 200), (0, 0, 0), (0, 0, 200)}
    assert len(plan([25, 0], pool=302, seeds=2, variants=["shipped"], mix=200, mix_seeds=2)) == 6
    assert 0 not in {r["n"] for r in plan([25, 0], pool=7271, seeds=1, variants=["shipped"], mix=0)}


def row(n: int, seed: int, low: float, start: str = "shipped", mix: int = 0) -> dict[str, Any]:
    return {"n_train": n, "seed": seed, "start": start, "mix": mix,
            "final": {"minus_bm25_ci95": [low, low + 0.1]}, "warm": {"minus_bm25_ci95": [-0.1, 0.0]}}


def test_the_smallest_n_needs_every_seed_above_naive() -> None:
    rows = [row(25, 0, -0.05), row(25, 1, 0.01), row(50, 0, 0.01), row(50, 1, 0.002), row(100, 0, 0.03),
            row(50, 0, 0.05, mix=200)]
    assert smallest_n(rows, start="shipped", mix=0) == 50
    assert smallest_n(rows, start="shipped", mix=200) == 50
    assert smallest_n(rows, start="shipped", mix=0, stage="warm") is None
    assert smallest_n(rows, start="scratch", mix=0) is None


def test_rl_steps_scale_with_the_training_questions() -> None:
    config = CompactConfig()
    assert rl_steps_for(5, config) == MIN_RL_STEPS and rl_steps_for(100, config) == 25
    assert rl_steps_for(1016, config) == 254 and rl_steps_for(50_000, config) == config.rl_steps
