"""bench/chaos.py's accounting: what counts as an error, lost, hung, and when throughput is back."""

from __future__ import annotations

from collections import Counter

from bench.chaos import Fault, per_second, recovery, summarise
from bench.load import PhaseResult


def test_recovery_is_when_two_seconds_average_90_percent_of_before() -> None:
    buckets = [10, 10, 10, 10, 10, 0, 0, 4, 9, 10, 10]
    assert recovery(buckets, 5.0) == 3.0  # (9 + 10) / 2 >= 9 from second 8
    assert recovery([10] * 5 + [0] * 6, 5.0) is None  # never back within the window
    assert recovery([10, 10, 10, 10, 10, 10, 10], 5.0) == 0.0


def test_answers_are_counted_in_the_window_of_the_fault_they_follow() -> None:
    start = 100.0
    events: list[tuple[float, float, int | str]] = [
        (100.0, 100.5, 200), (100.0, 101.5, 200), (101.0, 102.5, "degraded"), (101.0, 102.6, 503),
        (102.0, 103.2, "ClientConnectionError"), (102.0, 104.5, "TimeoutError"), (103.0, 104.8, 200)]
    result = PhaseResult(1, 5.0, Counter(), Counter(), [], 0, events)
    faults = [Fault("policy_llm", 2.0, injected=102.0), Fault("redis", 4.0, injected=104.0)]
    summary = summarise(result, faults, start, 105.0)
    assert summary["policy_llm"] == {"at_s": 2.0, "errors": 3, "lost": 1, "hung": 0, "recovery_s": None,
                                     "answers": {"degraded": 1, "503": 1, "ClientConnectionError": 1}}
    assert summary["redis"]["errors"] == 1 and summary["redis"]["hung"] == 1 and summary["redis"]["lost"] == 0
    assert per_second(events, start, 6) == [1, 1, 0, 0, 1, 0]
