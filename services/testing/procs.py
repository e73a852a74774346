"""Process facts from Linux /proc for tests and benchmarks: the process table, children, CPU time."""

from __future__ import annotations

import os
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after "(comm)": state, ppid, ..., utime at 11, stime at 12, starttime
    at 19. None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) for every live process (zombies left out)."""
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat_fields(int(entry.name))) is not None and fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), fields[19])
    return table


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (a server's workers), sorted."""
    return sorted(child for child, (ppid, _) in process_table().items() if ppid == pid)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process; 0 when it is gone."""
    fields = stat_fields(pid)
    return 0.0 if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
