"""`<SERVICE>_WORKERS` > 1: worker processes that each listen on their own SO_REUSEPORT socket.

uvicorn's supervisor shares one socket: whichever worker wakes first accepts every connection waiting, so
a burst of new connections tends to land on one worker. Here the kernel spreads connections over the
workers' own sockets. A port something else holds is refused first (a bind without SO_REUSEPORT) instead of
silently sharing its traffic; a worker that dies is replaced, one that could not start (exit 3) stops the
group with that code; SIGTERM / SIGINT: SIGTERM to every worker, `grace_s`, then kill; exit 0. The
supervisor keeps no copy of a worker's socket: one nobody accepts on would still get its share.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import sys
import time
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

STARTUP_FAILURE = 3
"""uvicorn's exit code for a server that could not start (`uvicorn.config.STARTUP_FAILURE`)."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel's pick), for tests, benches and `--free-ports`."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens there: a plain (non-SO_REUSEPORT) socket can bind host:port right now. SO_REUSEADDR as
    the servers use it: connections of a process stopped a moment ago (TIME_WAIT) do not count, so a
    Ctrl-C and an immediate restart works."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT (not yet listening: the worker's server listens)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _worker_main(factory: str, options: dict[str, Any], sock: socket.socket) -> None:
    """One worker (a spawned process): uvicorn serving `factory()` on its own socket."""
    import uvicorn

    server = None
    try:
        server = uvicorn.Server(uvicorn.Config(factory, factory=True, **options))
        server.run(sockets=[sock])
    except Exception:
        if server is not None and server.started:
            raise
        logger.exception("worker could not start %s", factory)
    if server is None or not server.started:
        sys.exit(STARTUP_FAILURE)


class Supervisor:
    """Runs `workers` processes of `factory` ("module:function") on host:port; `run()` returns the exit code."""

    def __init__(self, factory: str, options: dict[str, Any], workers: int, *, poll_s: float = 0.5,
                 grace_s: float = 15.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.factory = factory
        self.options = options
        self.host = str(options["host"])
        self.port = int(options["port"])
        self.workers = workers
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.processes: list[BaseProcess] = []
        self._stop = False
        self._context = multiprocessing.get_context("spawn")

    def _spawn(self) -> BaseProcess:
        sock = reuse_port_socket(self.host, self.port)
        try:
            process = self._context.Process(target=_worker_main, args=(self.factory, self.options, sock),
                                            name="plugsearch-worker")
            process.start()  # the child holds its own descriptor once start() returns
        finally:
            sock.close()
        logger.info("started worker [%s] on %s:%s", process.pid, self.host, self.port)
        return process

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        logger.info("received %s, stopping %s workers", signal.Signals(signum).name, len(self.processes))
        self._stop = True

    def run(self) -> int:
        if not port_is_free(self.port, self.host):
            logger.error("cannot listen on %s:%s: address already in use", self.host, self.port)
            return 1
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            self.processes = [self._spawn() for _ in range(self.workers)]
            while not self._stop:
                time.sleep(self.poll_s)
                for index, process in enumerate(self.processes):
                    if self._stop or process.is_alive():
                        continue
                    process.join()
                    if process.exitcode == STARTUP_FAILURE:
                        logger.error("worker [%s] failed to start; stopping", process.pid)
                        code = STARTUP_FAILURE
                        self._stop = True
                        break
                    logger.warning("worker [%s] died (exit code %s); starting another", process.pid,
                                   process.exitcode)
                    self.processes[index] = self._spawn()
        finally:
            self._shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    def _shutdown(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()  # SIGTERM: uvicorn's graceful shutdown
        deadline = time.monotonic() + self.grace_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("worker [%s] still running after %.0f s; killing it", process.pid, self.grace_s)
                process.kill()
                process.join()
