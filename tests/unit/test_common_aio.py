"""Async code from synchronous code (plugsearch/common/aio.py AsyncRunner: anyio's blocking portal), what the blocking
client and TRL's trainer run on: one loop for the runner's life, usable inside a running loop, a deadline, and a
runner nobody closed never holds the interpreter at exit."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from plugsearch.common.aio import AsyncRunner

REPO = Path(__file__).resolve().parents[2]


async def _loop_id() -> int:
    return id(asyncio.get_running_loop())


def test_coroutines_run_on_one_loop_for_the_runner_s_life() -> None:
    with AsyncRunner() as runner:
        first, second = runner.run(_loop_id()), runner.run(_loop_id())
        assert first == second  # a connection pool made on the first call serves the next
        with pytest.raises(ValueError, match="bad"):
            runner.run(_raise(ValueError("bad")))
        assert runner.run(asyncio.sleep(0, result="after a failure")) == "after a failure"
    assert runner.closed
    with pytest.raises(RuntimeError, match="closed"):
        runner.run(_loop_id())


async def _raise(exc: Exception) -> None:
    raise exc


async def test_it_works_where_the_calling_thread_already_runs_a_loop() -> None:
    with AsyncRunner() as runner:  # as in Jupyter: this test's own loop is running
        assert runner.run(_loop_id()) != id(asyncio.get_running_loop())


def test_a_deadline_and_closing_cancels_what_still_runs() -> None:
    cancelled: list[bool] = []

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    runner = AsyncRunner()
    with pytest.raises(TimeoutError):
        runner.run(slow(), timeout=0.05)
    runner.close()  # at once, not after the 30 s
    assert cancelled == [True]


def test_a_runner_nobody_closed_does_not_hold_the_exit() -> None:
    script = textwrap.dedent("""
        from plugsearch.common.aio import AsyncRunner
        import asyncio
        kept = AsyncRunner()
        print(kept.run(asyncio.sleep(0, result="ran")))
        AsyncRunner().run(asyncio.sleep(0))  # dropped at once
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, cwd=REPO)
    assert done.returncode == 0 and done.stdout.strip() == "ran", done.stderr
