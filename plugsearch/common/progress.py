"""Progress of a long step as log lines: what a line-prefixed log (the stack's, a container's) shows, where a
progress bar's carriage-return updates arrive as one line at the end, or not at all.

    progress = ProgressLog("encoding", total=23_652, unit="passages", log=logger)
    progress.update(512)   # every `every_s` seconds at most: "encoding: 4,096 / 23,652 passages (17%),
    ...                    #  41 passages/s, about 7 min 55 s left"
    progress.close()       # "encoding: 23,652 passages in 9 min 40 s (40.8 passages/s)"
"""

from __future__ import annotations

import logging
import time


def duration(seconds: float) -> str:
    """`9 min 40 s`, `1 h 02 min`, `12 s`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class ProgressLog:
    """`update(n)` as work is done; a line every `every_s` seconds (and the first after `first_s`): done / total,
    the rate of this run and the time left at that rate; `close()` a last line with the totals. `initial`:
    work already done by an earlier run (resumed), counted in done but not in the rate."""

    def __init__(self, what: str, total: int, unit: str, *, log: logging.Logger, every_s: float = 15.0,
                 first_s: float = 5.0, initial: int = 0) -> None:
        self.what, self.total, self.unit, self.log = what, total, unit, log
        self.every_s = every_s
        self.done = initial
        self.initial = initial
        self.started = time.monotonic()
        self._next = self.started + first_s
        if initial:
            log.info("%s: resuming at %s / %s %s", what, f"{initial:,}", f"{total:,}", unit)

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return (self.done - self.initial) / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        rate = self.rate()
        left = self.total - self.done
        eta = f", about {duration(left / rate)} left" if rate > 0 and left > 0 else ""
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.what}: {self.done:,} / {self.total:,} {self.unit} ({pct:.0f}%), "
                f"{rate:.1f} {self.unit}/s{eta}")

    def update(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now >= self._next and self.done < self.total:
            self._next = now + self.every_s
            self.log.info("%s", self.line())

    def close(self) -> None:
        elapsed = time.monotonic() - self.started
        self.log.info("%s: %s %s in %s (%.1f %s/s)", self.what, f"{self.done - self.initial:,}", self.unit,
                      duration(elapsed), self.rate(), self.unit)
