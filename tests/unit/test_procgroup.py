"""`plugsearch.common.procgroup`: start, readiness, prefixed logs, stop of the whole process group, revive (real
short-lived processes)."""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from plugsearch.common.procgroup import (
    Output,
    ProcessExited,
    ProcessGroup,
    ProcessNotReady,
    ProcessSpec,
    RestartPolicy,
)

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")

# a parent that starts a grandchild which would outlive it, says the grandchild's pid, then waits
PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(60)\n")


def python(name: str, code: str, **kw: object) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", code], **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def gone(*pids: int, within_s: float = 5.0) -> bool:
    """Every pid has ended (a SIGKILLed orphan needs a moment before its new parent reaps it)."""
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def first_line(group: ProcessGroup, name: str) -> str:
    group.wait_ready(name, timeout_s=30, interval_s=0.02)
    return group.tail(name).splitlines()[0]


def test_stop_ends_the_process_and_everything_it_started(tmp_path: Path) -> None:
    with ProcessGroup(log_dir=tmp_path) as group:
        group.add(python("parent", PARENT, ready=lambda: bool(group.tail("parent").strip())))
        group.start()
        grandchild = int(first_line(group, "parent"))
        parent = group.procs["parent"].pid
        assert alive(grandchild) and os.getpgid(parent) == parent  # its own process group
        group.stop("parent")
        assert gone(parent, grandchild)
        assert "parent" not in group.procs and (tmp_path / "parent.log").read_text().strip() == str(grandchild)


def test_close_stops_every_member_even_one_that_ignores_sigterm() -> None:
    group = ProcessGroup(grace_s=0.5)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    group.add(python("stubborn", stubborn, ready=lambda: "up" in group.tail("stubborn")), python("parent", PARENT))
    group.start()
    group.wait_ready("stubborn", timeout_s=30, interval_s=0.02)
    pids = [proc.pid for proc in group.procs.values()]
    group.close()
    assert gone(*pids) and not group.procs


def test_prefixed_output_run_and_exit_codes() -> None:
    out = io.StringIO()
    group = ProcessGroup(output=Output(out, width=9), label="stack")
    assert group.run(python("build", "print('built'); import sys; sys.exit(3)")) == 3
    group.say("done")
    text = out.getvalue()
    assert re.search(r"^\d\d:\d\d:\d\d build     \| built$", text, re.M), text
    assert re.search(r"^\d\d:\d\d:\d\d stack     \| build started \(pid=\d+\)$", text, re.M), text
    assert "stack     | build stopped (rc=3)" in text and text.rstrip().endswith("| done")
    assert group.tail("build") == "built"


def test_wait_ready_reports_an_early_exit_and_a_timeout() -> None:
    with ProcessGroup() as group:
        group.add(python("dies", "import sys; print('bad setting'); sys.exit(2)", ready=lambda: False),
                  python("slow", "import time; time.sleep(60)", ready=lambda: False))
        group.start()
        with pytest.raises(ProcessExited, match="dies exited with 2") as exited:
            group.wait_ready("dies", timeout_s=30, interval_s=0.02)
        assert exited.value.name == "dies" and "bad setting" in str(exited.value)
        with pytest.raises(ProcessNotReady, match="not ready within 0.2 s: slow") as late:
            group.wait_ready("slow", timeout_s=0.2, interval_s=0.02)
        assert late.value.names == ["slow"]
        assert group.supervise(threading.Event(), interval_s=0.01) == ("dies", 2)


def test_revive_starts_again_what_was_killed() -> None:
    with ProcessGroup() as group:
        group.add(python("svc", "import os, time; print(os.getpid(), flush=True); time.sleep(60)",
                         ready=lambda: bool(group.tail("svc").strip())))
        group.start()
        group.wait_ready(timeout_s=30, interval_s=0.02)
        first = group.procs["svc"].pid
        os.kill(first, signal.SIGKILL)
        group.procs["svc"].wait()
        group.revive(timeout_s=30)
        second = group.procs["svc"].pid
        assert second != first and group.procs["svc"].poll() is None


# --------------------------------------------------------------------------------- supervision
def supervising(group: ProcessGroup, policy: RestartPolicy, stop: threading.Event
                ) -> tuple[threading.Thread, list[tuple[str, int] | None]]:
    result: list[tuple[str, int] | None] = []
    thread = threading.Thread(target=lambda: result.append(group.supervise(stop, interval_s=0.02, restart=policy)))
    thread.start()
    return thread, result


def wait_for(condition: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition never reached"
        time.sleep(0.02)


def test_a_member_that_dies_is_restarted_while_the_others_keep_running() -> None:
    out = io.StringIO()
    stop = threading.Event()
    with ProcessGroup(output=Output(out, width=6), grace_s=2) as group:
        code = "import os, time; print('up', os.getpid(), flush=True); time.sleep(60)"
        group.add(python("crashy", code, ready=lambda: "up" in group.tail("crashy")),
                  python("steady", code, ready=lambda: "up" in group.tail("steady")))
        group.start()
        group.wait_ready(timeout_s=30, interval_s=0.02)
        steady, crashy = group.procs["steady"].pid, group.procs["crashy"].pid
        thread, result = supervising(group, RestartPolicy(max_restarts=3, backoff_s=0.05), stop)
        try:
            os.kill(crashy, signal.SIGSEGV)
            wait_for(lambda: "crashy ready again" in out.getvalue())
            assert group.procs["crashy"].pid != crashy and group.procs["crashy"].poll() is None
            assert group.procs["steady"].pid == steady and alive(steady)  # untouched
            assert not result  # still supervising
        finally:
            stop.set()
            thread.join(timeout=30)
    text = out.getvalue()
    assert result == [None], text
    assert re.search(r"stack  \| crashy exited \(rc=-11, SIGSEGV\); restarting it in 0\.1 s \(restart 1 of at most 3 "
                     r"within 600 s\)", text), text
    assert "steady exited" not in text


def test_a_member_that_keeps_dying_is_given_up_on_with_backoff() -> None:
    out = io.StringIO()
    stop = threading.Event()
    with ProcessGroup(output=Output(out, width=6)) as group:
        group.add(python("dies", "import time, sys; print('up', flush=True); time.sleep(0.1); sys.exit(4)",
                         ready=lambda: True))
        group.start()
        t0 = time.monotonic()
        thread, result = supervising(group, RestartPolicy(max_restarts=2, backoff_s=0.2), stop)
        thread.join(timeout=60)
        elapsed = time.monotonic() - t0
    assert result == [("dies", 4)]
    text = out.getvalue()
    delays = re.findall(r"dies exited \(rc=4\); restarting it in ([0-9.]+) s", text)
    assert delays == ["0.2", "0.4"], text  # doubling backoff
    assert "dies exited (rc=4) after 2 restarts within 600 s: giving up" in text
    assert text.count("dies started (pid=") == 3 and elapsed >= 0.6


def test_restart_policy_backoff_is_capped() -> None:
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.delay(n) for n in range(7)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
