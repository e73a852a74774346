"""`<SERVICE>_WORKERS` > 1 on a real process (the searcher; nothing upstream is needed for what is checked):
the workers share the port and both serve, `/metrics` from any of them counts the requests all of them served, a worker
killed with SIGKILL is replaced, and SIGTERM stops the whole group and removes the metrics directory.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, free_port
from tests.support.procs import children, stat_fields

pytestmark = pytest.mark.e2e

if not Path("/proc/self/stat").exists():  # pragma: no cover - Linux only (reads /proc)
    pytest.skip("needs /proc", allow_module_level=True)


def workers_of(pid: int) -> list[int]:
    """The uvicorn workers (multiprocessing spawn children) of a service process."""
    found = []
    for child in children(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def wait_for(check, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def answers(url: str) -> bool:
    """GET url answers 200 (False while nothing accepts the connection)."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def requests_counted(url: str) -> float:
    with httpx.Client(timeout=10) as client:  # a new connection: any worker may answer
        text = client.get(f"{url}/metrics").text
    found = re.search(r'^searcher_http_requests_total\{method="POST",route="/search",status="422"\} (\S+)$',
                      text, re.M)
    return float(found.group(1)) if found else 0.0


def test_workers_share_the_port_metrics_and_lifecycle(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SEARCHER_WORKERS": "2", "SEARCHER_PORT": str(port), "SEARCHER_LOG_LEVEL": "warning",
           "SEARCHER_RETRIEVER__URL": f"http://127.0.0.1:{free_port()}", "SEARCHER_CACHE_ENABLED": "false"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    log = (tmp_path / "searcher.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "plugsearch.searcher"], cwd=REPO, env=env,  # noqa: S603
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        workers = wait_for(lambda: len(workers_of(proc.pid)) == 2 and workers_of(proc.pid), 60, "two workers")
        metrics_dir = Path(environ(workers[0])["PROMETHEUS_MULTIPROC_DIR"])
        assert metrics_dir.is_dir()

        def live() -> bool:
            return answers(f"{url}/health/live")

        wait_for(live, 60, "the port to answer")
        def served_by() -> set[str]:
            return {name.split("_")[-1].split(".")[0] for name in os.listdir(metrics_dir)
                    if name.startswith("counter_")}

        sent = 0
        # Invalid searches (422) on fresh connections until both workers have served some (the kernel
        # picks the accepting worker): at least 40, at most 1,000.
        while sent < 40 or not served_by() >= {str(pid) for pid in workers}:
            assert sent < 1000, (served_by(), workers)
            with httpx.Client(timeout=10) as client:
                assert client.post(f"{url}/search", json={"question": ""}).status_code == 422
            sent += 1
        # Every worker reports the sum over all of them.
        assert {requests_counted(url) for _ in range(6)} == {float(sent)}

        os.kill(workers[0], signal.SIGKILL)  # the supervisor replaces a dead worker
        replaced = wait_for(lambda: (found := workers_of(proc.pid)) and len(found) == 2 and workers[0] not in found
                            and found, 60, "a replacement worker")
        assert len(replaced) == 2
        wait_for(live, 60, "the port to answer after the restart")
        with httpx.Client(timeout=10) as client:
            assert client.post(f"{url}/search", json={"question": ""}).status_code == 422

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not workers_of(proc.pid) or all(not Path(f"/proc/{pid}").exists() for pid in replaced)
        assert not metrics_dir.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


# ---------------------------------------------------------------- the supervisor on its own (a tiny app)
def pid_app() -> object:
    """Worker factory: an ASGI app answering its worker's pid."""
    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": str(os.getpid()).encode()})
    return app


def broken_app() -> object:
    raise RuntimeError("this app cannot start")


def supervise(factory: str, port: int, workers: int = 2) -> subprocess.Popen[bytes]:
    code = ("import sys; from plugsearch.common.workers import Supervisor; "
            f"sys.exit(Supervisor('tests.e2e.test_workers:{factory}', dict(host='127.0.0.1', port={port}, "
            f"log_level='warning', log_config=None), {workers}, poll_s=0.1).run())")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO,  # noqa: S603
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def gone(pid: int) -> bool:
    """Dead: no /proc entry, or a zombie (state Z) waiting to be reaped."""
    fields = stat_fields(pid)
    return fields is None or fields[0] == "Z"


def pids_of_fresh_connections(url: str, n: int, timeout_s: float = 5.0) -> list[int]:
    out = []
    for _ in range(n):
        with httpx.Client(timeout=timeout_s) as client:  # a new connection each time
            out.append(int(client.get(url).text))
    return out


def test_every_worker_listens_on_its_own_socket_and_gets_a_share(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = supervise("pid_app", port)
    try:
        workers = wait_for(lambda: len(workers_of(proc.pid)) == 2 and workers_of(proc.pid), 60, "two workers")

        wait_for(lambda: answers(url) and len(set(pids_of_fresh_connections(url, 10))) == 2, 60, "both listening")
        # The kernel spreads new connections over the workers' sockets by hash: each gets a fair share.
        counts = {pid: 0 for pid in workers}
        for pid in pids_of_fresh_connections(url, 60):
            counts[pid] += 1
        assert min(counts.values()) >= 12, counts
        # The supervisor keeps no copy of a worker's socket: once a worker is killed, no new connection
        # is left waiting on its socket (each would time out), the other worker answers them all.
        os.kill(workers[0], signal.SIGKILL)
        wait_for(lambda: gone(workers[0]), 10, "the killed worker to be gone")
        assert all(pid != workers[0] for pid in pids_of_fresh_connections(url, 20, timeout_s=3.0))
        # ...and it is replaced
        wait_for(lambda: len(found := workers_of(proc.pid)) == 2 and workers[0] not in found, 60, "a replacement")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_busy_port_is_refused_and_a_broken_app_stops_the_group() -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = supervise("pid_app", holder.getsockname()[1])
        assert busy.wait(timeout=30) == 1  # refused before any worker started (no silent sharing)
    broken = supervise("broken_app", free_port())
    assert broken.wait(timeout=60) == 3  # uvicorn's startup failure, not a restart loop
