"""One way to run local processes: start commands with their env, wait until they are ready, log their output
(prefixed lines on one stream, or a file each), stop them, revive one.

- Every process starts in its own session, so its process group holds it and whatever it starts (a service's
  worker processes). A terminal's Ctrl-C reaches only the supervisor, which stops the group.
- Stop: SIGTERM (or the signal asked for) to the process, up to `grace_s` to exit, then SIGKILL to its whole
  process group, so nothing it started is left behind.
- Ready: `ProcessSpec.ready` (a predicate) when given, else HTTP 200 from `ready_url` (with `ready_secret` as a
  bearer key), else Redis answering PING on `port` (after AUTH with `ready_secret`).
- Supervise: with a `RestartPolicy`, a member that exits is started again after a backoff (doubling from
  `backoff_s`), logged, while the others keep running; one that exits more than `max_restarts` times within
  `window_s` is given up on (then `supervise` returns it, and the caller decides: the stack stops).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Self, TextIO

COLOURS = ("36", "33", "32", "35", "34", "31", "96", "93")
"""ANSI colours of the prefixes, one per process in the order they first print."""


class ProcessGroupError(RuntimeError):
    """A process could not start, exited before it was ready, or was not ready in time."""


class ProcessExited(ProcessGroupError):
    def __init__(self, name: str, returncode: int | None, tail: str = "") -> None:
        super().__init__(f"{name} exited with {returncode} before it was ready" + (f":\n{tail}" if tail else ""))
        self.name = name
        self.returncode = returncode


class ProcessNotReady(ProcessGroupError):
    def __init__(self, names: Sequence[str], timeout_s: float, tail: str = "") -> None:
        super().__init__(f"not ready within {timeout_s:g} s: {', '.join(names)}" + (f":\n{tail}" if tail else ""))
        self.names = list(names)


@dataclass(frozen=True)
class RestartPolicy:
    """How `ProcessGroup.supervise` restarts a member that exited."""

    max_restarts: int = 5
    """restarts allowed within `window_s`; one more exit in that window gives up on the member"""
    window_s: float = 600.0
    backoff_s: float = 1.0
    """pause before the first restart in the window; doubled for each later one, at most `max_backoff_s`"""
    max_backoff_s: float = 30.0

    def delay(self, restarts: int) -> float:
        """The pause before a restart, `restarts` restarts already made within the window."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** restarts)


def describe_exit(returncode: int | None) -> str:
    """`rc=1`, or `rc=-11, SIGSEGV` for a process a signal ended."""
    if returncode is not None and returncode < 0:
        with contextlib.suppress(ValueError):
            return f"rc={returncode}, {signal.Signals(-returncode).name}"
    return f"rc={returncode}"


@dataclass
class ProcessSpec:
    """One process: its command, the env it adds to ours, and how to tell it is ready."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ready_url: str | None = None
    """GET this until 200; None: Redis PING on `port` (unless `ready` is given)."""
    port: int = 0
    ready_secret: str | None = field(default=None, repr=False)
    """What the readiness check presents: Redis's password (AUTH), or the HTTP bearer key."""
    ready: Callable[[], bool] | None = field(default=None, repr=False)
    """A readiness predicate that replaces the URL / PING check."""
    log: Path | None = None
    """Its output file (log-file mode); default `<log_dir>/<name>.log`."""


def http_ok(url: str, bearer: str | None = None, timeout_s: float = 3.0) -> bool:
    headers = {} if bearer is None else {"Authorization": f"Bearer {bearer}"}
    try:
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - loopback URL
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - loopback URL
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def probe(spec: ProcessSpec) -> bool:
    """One readiness check of `spec` (see the module's docstring)."""
    if spec.ready is not None:
        return spec.ready()
    if spec.ready_url is not None:
        return http_ok(spec.ready_url, spec.ready_secret)
    import redis

    try:
        with redis.Redis(host="127.0.0.1", port=spec.port, password=spec.ready_secret, socket_timeout=1.0,
                         socket_connect_timeout=1.0) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


class Output:
    """Log lines of many processes on one stream: `HH:MM:SS name | line`, names padded to `width`."""

    def __init__(self, stream: TextIO, *, colour: bool = False, width: int = 0) -> None:
        self.stream = stream
        self.colour = colour
        self.width = width
        self._colours: dict[str, str] = {}
        self._lock = threading.Lock()

    def line(self, name: str, text: str) -> None:
        prefix = f"{datetime.now():%H:%M:%S} {name.ljust(self.width)} |"
        with self._lock:
            if self.colour:
                code = self._colours.setdefault(name, COLOURS[len(self._colours) % len(COLOURS)])
                prefix = f"\033[{code}m{prefix}\033[0m"
            self.stream.write(f"{prefix} {text}\n")
            self.stream.flush()


class ProcessGroup:
    """Processes started from `ProcessSpec`s. Output goes to `output` (prefixed lines, the last ones kept for
    error messages) or, without it, to a file per process (`spec.log`, else `<log_dir>/<name>.log`, else a
    temporary file). A context manager: `close()` on exit stops everything."""

    def __init__(self, *, output: Output | None = None, log_dir: Path | None = None, cwd: Path | None = None,
                 grace_s: float = 15.0, label: str = "stack") -> None:
        self.output, self.log_dir, self.cwd, self.label, self.grace_s = output, log_dir, cwd, label, grace_s
        self.specs: dict[str, ProcessSpec] = {}
        """The members, in start order (stopped in reverse)."""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._tails: dict[str, deque[str]] = {}
        self._readers: dict[str, threading.Thread] = {}

    def say(self, text: str) -> None:
        """The supervisor's own lines (prefixed with `label`; printed only with an `output`)."""
        if self.output is not None:
            for line in text.splitlines() or [""]:
                self.output.line(self.label, line)

    def tail(self, name: str, chars: int = 2000) -> str:
        if name in self._tails:
            return "\n".join(list(self._tails[name]))[-chars:]  # a copy: the reader thread appends
        log = self._logs.get(name)
        if log is None:
            return ""
        try:
            log.flush()
            size = log.seek(0, os.SEEK_END)
            log.seek(max(0, size - chars))
            return log.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def log_text(self, name: str) -> str:
        """Everything a process wrote (since the group first started it)."""
        return self.tail(name, chars=1 << 40)

    def _sink(self, spec: ProcessSpec) -> int | IO[bytes]:
        if self.output is not None:
            self._tails.setdefault(spec.name, deque(maxlen=200))
            return subprocess.PIPE
        if spec.name not in self._logs:  # a restart appends to the same file
            path = spec.log or (self.log_dir / f"{spec.name}.log" if self.log_dir is not None else None)
            log: IO[bytes]
            if path is None:
                log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in close()
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                log = path.open("w+b")
            # O_APPEND: the process writes at the end whatever offset `tail` leaves the shared file description at
            fcntl.fcntl(log.fileno(), fcntl.F_SETFL, fcntl.fcntl(log.fileno(), fcntl.F_GETFL) | os.O_APPEND)
            self._logs[spec.name] = log
        return self._logs[spec.name]

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        assert self.output is not None
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                self._tails[name].append(line)
                self.output.line(name, line)

    def add(self, *specs: ProcessSpec) -> None:
        self.specs.update((spec.name, spec) for spec in specs)

    def _spawn(self, spec: ProcessSpec) -> subprocess.Popen[bytes]:
        running = self.procs.get(spec.name)
        if running is not None and running.poll() is None:
            raise ProcessGroupError(f"{spec.name} is already running")
        proc = subprocess.Popen(spec.argv, env={**os.environ, "PYTHONUNBUFFERED": "1", **spec.env},  # noqa: S603
                                cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=self._sink(spec),
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[spec.name] = proc
        if self.output is not None:
            assert proc.stdout is not None
            reader = threading.Thread(target=self._pump, args=(spec.name, proc.stdout), daemon=True,
                                      name=f"log-{spec.name}")
            self._readers[spec.name] = reader
            reader.start()
        self.say(f"{spec.name} started (pid={proc.pid})")
        return proc

    def start(self, *names: str) -> None:
        """Start these members (default: all of them, in order)."""
        for name in names or tuple(self.specs):
            self._spawn(self.specs[name])

    def up(self, *specs: ProcessSpec, timeout_s: float = 300.0) -> Self:
        """Add `specs`, start them and wait until they are ready; on any failure stop the whole group, then raise."""
        self.add(*specs)
        names = [spec.name for spec in specs]
        try:
            self.start(*names)
            self.wait_ready(*names, timeout_s=timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def run(self, spec: ProcessSpec, timeout_s: float | None = None) -> int:
        """Run a command to its end (a build step), its output logged like a member's; its exit code."""
        proc = self._spawn(spec)
        try:
            return proc.wait(timeout=timeout_s)
        finally:
            self.stop(spec.name)

    def _check(self, names: Sequence[str]) -> None:
        for name in names:
            proc = self.procs.get(name)
            if proc is None:
                raise ProcessGroupError(f"{name} was not started")
            if proc.poll() is not None:
                if name in self._readers:
                    self._readers[name].join(timeout=5)
                raise ProcessExited(name, proc.returncode, self.tail(name))

    def wait_ready(self, *names: str, timeout_s: float = 300.0, stop: threading.Event | None = None,
                   on_ready: Callable[[str, float], None] | None = None, interval_s: float = 0.1) -> None:
        """Poll these members (default: every started one) until all are ready, calling `on_ready(name, seconds)`
        for each. Raises `ProcessExited` when one exits first, `ProcessNotReady` when the timeout passes; returns early
        when `stop` is set."""
        names = names or tuple(self.procs)
        t0 = time.monotonic()
        pending = list(names)
        stop = stop or threading.Event()
        while pending:
            self._check(names)
            for name in list(pending):
                if probe(self.specs[name]):
                    pending.remove(name)
                    if on_ready is not None:
                        on_ready(name, time.monotonic() - t0)
            if not pending or time.monotonic() - t0 > timeout_s or stop.wait(interval_s):
                break
        if pending and not stop.is_set():
            tails = "" if self.output is not None else "\n".join(f"{n}: {self.tail(n)}" for n in pending)
            raise ProcessNotReady(pending, timeout_s, tails)

    def supervise(self, stop: threading.Event, interval_s: float = 0.25, restart: RestartPolicy | None = None
                  ) -> tuple[str, int] | None:
        """Until `stop` is set (None) or a member exits for good: that member (the first in start order), with
        its exit code. Without `restart`, the first exit is for good; with it, a member that exits is started
        again after the policy's backoff (logged: why it exited, when it restarts, when it is ready again) while
        the others keep running, until it exits more than `max_restarts` times within `window_s`."""
        restarts: dict[str, list[float]] = {}
        due: dict[str, float] = {}
        """members waiting for their restart, and when it is due"""
        while not stop.wait(interval_s):
            now = time.monotonic()
            for name, proc in list(self.procs.items()):
                if name in due or proc.poll() is None:
                    continue
                if name in self._readers:
                    self._readers[name].join(timeout=1)  # its last lines first
                if restart is None:
                    return name, proc.returncode
                recent = [t for t in restarts.get(name, []) if now - t < restart.window_s]
                restarts[name] = recent
                if len(recent) >= restart.max_restarts:
                    self.say(f"{name} exited ({describe_exit(proc.returncode)}) after {len(recent)} restarts "
                             f"within {restart.window_s:g} s: giving up")
                    return name, proc.returncode
                delay = restart.delay(len(recent))
                self.say(f"{name} exited ({describe_exit(proc.returncode)}); restarting it in {delay:.1f} s "
                         f"(restart {len(recent) + 1} of at most {restart.max_restarts} within "
                         f"{restart.window_s:g} s); the others keep running")
                due[name] = now + delay
            for name, at in list(due.items()):
                if now < at:
                    continue
                del due[name]
                self._stop([name], quiet=True)  # what the dead member left in its process group goes too
                restarts[name].append(time.monotonic())
                self._watch_ready(name, self._spawn(self.specs[name]), stop)
        return None

    def _watch_ready(self, name: str, proc: subprocess.Popen[bytes], stop: threading.Event) -> None:
        """Say when a restarted member is ready again (polled in a thread: a probe of a busy member may take
        seconds, and supervision goes on meanwhile)."""
        def watch() -> None:
            t0 = time.monotonic()
            while self.procs.get(name) is proc and proc.poll() is None and not stop.is_set():
                if probe(self.specs[name]):
                    self.say(f"{name} ready again ({time.monotonic() - t0:.1f} s after its restart)")
                    return
                stop.wait(0.25)

        threading.Thread(target=watch, daemon=True, name=f"ready-{name}").start()

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        """Stop one member: `sig` to it, then (after up to `grace_s`) SIGKILL to its process group."""
        self._stop([name], sig)

    def revive(self, timeout_s: float = 120.0) -> None:
        """Start again every member that is not running, and wait until they are ready."""
        dead = [name for name in self.specs if name not in self.procs or self.procs[name].poll() is not None]
        for name in dead:
            self.stop(name)  # what a killed member left in its process group goes too
            self._spawn(self.specs[name])
        if dead:
            self.wait_ready(*dead, timeout_s=timeout_s)

    def close(self) -> None:
        """Stop every member at once (SIGTERM, a shared grace period, then SIGKILL to each process group)."""
        self._stop(list(reversed(self.procs)))
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def _stop(self, names: Sequence[str], sig: int = signal.SIGTERM, *, quiet: bool = False) -> None:
        procs = [(name, self.procs.pop(name)) for name in names if name in self.procs]
        for _name, proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + self.grace_s
        for name, proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing is left in its group
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader = self._readers.pop(name, None)
            if reader is not None:
                reader.join(timeout=5)
            if not quiet:
                self.say(f"{name} stopped (rc={proc.returncode})")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
