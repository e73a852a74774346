"""Multiprocess metrics bookkeeping: a replaced worker's live gauges are dropped, live workers' kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from plugsearch.common.metrics import MULTIPROCESS_ENV, forget_dead_workers


def test_live_gauges_of_dead_workers_are_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])  # noqa: S603
    gone.wait()
    names = [f"gauge_livesum_{gone.pid}.db", f"gauge_livesum_{os.getpid()}.db", f"counter_{gone.pid}.db",
             f"gauge_all_{gone.pid}.db"]
    for name in names:
        (tmp_path / name).write_bytes(b"")
    monkeypatch.setenv(MULTIPROCESS_ENV, str(tmp_path))
    forget_dead_workers()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])

