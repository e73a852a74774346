"""Progress of long steps as log lines (a line-prefixed log never shows a progress bar's carriage returns):
done / total, rate, time left, at most every few seconds, and a last line with the totals."""

from __future__ import annotations

import logging

import pytest

from plugsearch.common import progress
from plugsearch.common.progress import ProgressLog, duration


def test_durations_read_like_a_person_writes_them() -> None:
    assert [duration(s) for s in (0.4, 12, 61, 580, 3725)] == ["0 s", "12 s", "1 min 01 s", "9 min 40 s", "1 h 02 min"]


def test_lines_say_done_rate_and_time_left_at_most_every_interval(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    clock = [100.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    log = logging.getLogger("test.progress")
    caplog.set_level(logging.INFO, logger="test.progress")
    bar = ProgressLog("encoding", total=23_652, unit="passages", log=log, every_s=15, first_s=5, initial=2_048)
    for _ in range(8):  # 512 passages every 12.8 s: 40 passages/s
        clock[0] += 12.8
        bar.update(512)
    bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "encoding: resuming at 2,048 / 23,652 passages"
    assert lines[1] == "encoding: 2,560 / 23,652 passages (11%), 40.0 passages/s, about 8 min 47 s left"
    assert len(lines) == 2 + 6 // 2 + 1  # one line per 15 s at most after the first, then the totals
    assert lines[-1] == "encoding: 4,096 passages in 1 min 42 s (40.0 passages/s)"
