"""Process facts from Linux /proc for tests and benchmarks: the process table, children, descendants, CPU time,
memory and open files."""

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


def descendants(pid: int) -> list[int]:
    """`pid` and every live process under it."""
    table = process_table()
    out, todo = [pid], [pid]
    while todo:
        parent = todo.pop()
        found = [child for child, (ppid, _) in table.items() if ppid == parent]
        out += found
        todo += found
    return out


def rss_and_fds(pid: int) -> tuple[float, int]:
    """(resident memory in MB, open file descriptors) of a process and its descendants; a process gone counts 0."""
    rss_kb = 0
    fds = 0
    for p in descendants(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss_kb += int(line.split()[1])
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
    return rss_kb / 1024, fds
