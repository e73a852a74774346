"""Reading files and cutting text off the event loop, bounded: a pool of worker processes of its own.

Every parse and cut goes through one `ParsePool`: the retriever's `POST /documents/files` and `PUT /documents` (a
document's text), and `plugsearch-index ingest`, `upload`'s and `sync`'s local reads. Each worker is a process of
its own (`python -m plugsearch.retriever.ingest.pool`, speaking length-prefixed pickles on its stdin and stdout), so

- no parse holds the service's event loop or its Python lock (a 2 MB text cut beside searches), nor the default
  thread pool that writes to the change log (a slow PDF kept other writers waiting before);
- PDFium, which is not thread-safe, is called by one job at a time per process;
- each job has a CPU budget (`ParseLimits`: `cpu_s` plus `cpu_s_per_mb` per MB of input, at most `max_cpu_s`),
  set as the worker's soft CPU limit (RLIMIT_CPU): past it the job stops with the reason ("over its CPU budget of
  N s") and the worker serves the next one; a job stuck in a library past twice its budget in wall time (or past
  `memory_mb`, RLIMIT_AS) costs its worker, which is killed and replaced;
- a job whose request ends (the caller's deadline, a client that hung up: the awaiting task is cancelled) kills
  its worker at once, so no CPU burns for an answer nobody waits for;
- at most `workers` jobs run and `queue` wait; one more is refused (`Overloaded`, 429 with Retry-After).

Jobs are named functions of this module (`JOBS`): `read` (a file's bytes: `ingest.reading.read_data`), `read_path` (a
file on disk, read by the worker: what `ingest` and `sync` send), `upload` (a file sent to `POST /documents/files`,
base64: `ingest.reading.read_upload`), `documents` (documents sent to `PUT /documents`: a text cut as a text file is, or
ready-cut passages normalised). What a job refuses comes back as `SkipFile` with its reason; a worker that died or overran as
`ParseRefused`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import pickle
import resource
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, Field

logger = logging.getLogger(__name__)

MB = 1 << 20
_HEADER = struct.Struct("!Q")


class ParseLimits(BaseModel):
    """How much reading one file (or cutting one request's text) may cost. Env (the retriever):
    `RETRIEVER_PARSE__WORKERS`, `RETRIEVER_PARSE__CPU_S`, ..."""

    workers: int = Field(2, ge=1, le=64, description="worker processes that read files and cut text")
    queue: int = Field(1000, ge=0, le=100_000, description="jobs waiting for a worker before one more is refused "
                       "(429): a request of files is one job per file (up to 100)")
    cpu_s: float = Field(10.0, gt=0, le=3600, description="CPU seconds a job may use, plus `cpu_s_per_mb`")
    cpu_s_per_mb: float = Field(4.0, ge=0, le=3600, description="more CPU seconds per MB of the file or text")
    max_cpu_s: float = Field(300.0, gt=0, le=86400, description="the most CPU seconds any one job may use")
    memory_mb: int = Field(4096, ge=256, le=1 << 20, description="address space of a worker (RLIMIT_AS)")

    def budget(self, size: int) -> float:
        """The CPU seconds a job over `size` bytes may use."""
        return min(self.max_cpu_s, self.cpu_s + self.cpu_s_per_mb * size / MB)


class ParseRefused(Exception):
    """The job did not finish: over its CPU budget, its time or its memory (its worker was replaced)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _OverBudget(BaseException):
    """SIGXCPU in a worker: the job's CPU budget is spent (a BaseException, so a reader's `except Exception`
    cannot swallow it)."""


# ------------------------------------------------------------------------------------------------ the jobs

def _job_read(name: str, data: bytes, doc_id: str, words: int, max_bytes: int, title: str | None
              ) -> tuple[str, list[Any]]:
    from plugsearch.retriever.ingest.reading import read_data

    return read_data(name, data, doc_id=doc_id, words=words, max_bytes=max_bytes, title=title)


def _job_read_path(path: str, name: str, doc_id: str, words: int, max_bytes: int) -> tuple[str, list[Any], str]:
    """A file on disk: (format, passages, the sha256 of the bytes read)."""
    import hashlib

    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.reading import read_data

    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise SkipFile(f"too large: over the limit of {max_bytes / MB:g} MB per file")
    kind, passages = read_data(name, data, doc_id=doc_id, words=words, max_bytes=max_bytes)
    return kind, passages, hashlib.sha256(data).hexdigest()


def _job_documents(documents: list[tuple[str, str, str | None, list[tuple[str, str]] | None]], words: int
                   ) -> list[list[Any]]:
    """Documents given through the API as (id, title, text, passages): each one's passages, its text cut as a text
    file is (`ingest.reading.cut_file`), or its ready-cut passages (title, text) normalised and numbered; SkipFile
    naming a document with no text."""
    from plugsearch.common.text import normalize, ws
    from plugsearch.retriever.ingest.formats import SkipFile
    from plugsearch.retriever.ingest.passages import numbered
    from plugsearch.retriever.ingest.reading import cut_file

    out = []
    for doc_id, title, text, given in documents:
        try:
            if given is not None:
                parts = [(ws(normalize(part_title or title)), normalize(part_text)) for part_title, part_text in given]
                if empty := [i for i, (_, t) in enumerate(parts) if not t.strip()]:
                    raise SkipFile(f"passage {empty[0]} has no text")
                out.append(numbered(doc_id, parts))
            else:
                out.append(cut_file("text", (text or "").encode(), name=title, doc_id=doc_id, source=doc_id,
                                    words=words))
            if not out[-1]:
                raise SkipFile("no text")
        except SkipFile as exc:
            raise SkipFile(f"document {doc_id!r}: {exc.reason}") from exc
    return out


def _job_upload(name: str, content_base64: str, doc_id: str | None, title: str | None, words: int,
                max_bytes: int) -> tuple[list[Any], dict[str, str]]:
    from plugsearch.retriever.ingest.reading import read_upload

    return read_upload(name, content_base64, doc_id=doc_id, title=title, words=words, max_bytes=max_bytes)


JOBS: dict[str, Callable[..., Any]] = {"read": _job_read, "read_path": _job_read_path, "documents": _job_documents,
                                       "upload": _job_upload}


# ------------------------------------------------------------------------------------------- the worker side

def _send(stream: IO[bytes], payload: Any) -> None:
    body = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(body)))
    stream.write(body)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    size = _HEADER.unpack(head)[0]
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(body)  # noqa: S301 - our own pipe, to a child we started


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _run_job(name: str, args: tuple[Any, ...], budget: float) -> tuple[str, Any]:
    """One job under its CPU budget: ("ok", result) | ("skip", (reason, ignored)) | ("cpu", seconds) |
    ("memory", None) | ("error", message)."""
    from plugsearch.retriever.ingest.formats import SkipFile

    soft = math.ceil(_cpu_used() + budget)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.RLIM_INFINITY))
    try:
        return "ok", JOBS[name](*args)
    except _OverBudget:
        return "cpu", budget
    except MemoryError:
        return "memory", None
    except SkipFile as exc:
        return "skip", (exc.reason, exc.ignored)
    except Exception as exc:  # a reader's failure is this job's, never the worker's
        logger.warning("parse job %s failed", name, exc_info=True)
        return "error", f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def _on_xcpu(_signum: int, _frame: object) -> None:
    raise _OverBudget


def worker_main(memory_mb: int) -> None:
    """A worker: jobs from stdin, answers on stdout, until stdin closes."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGXCPU, _on_xcpu)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group: the parent decides
    with contextlib.suppress(ValueError, OSError):
        limit = memory_mb * MB
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import plugsearch.retriever.ingest.formats  # noqa: F401 - the readers' libraries, once, before the first job

    jobs, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # a library's print must not corrupt the answers
    try:
        _send(answers, ("ready", os.getpid()))
        while True:
            try:
                name, args, budget = _receive(jobs)
            except EOFError:
                return
            _send(answers, _run_job(name, args, budget))
    except BrokenPipeError:  # the service stopped waiting (its request ended, or it stopped): nothing to answer
        return


# ------------------------------------------------------------------------------------------- the parent side

class WorkerStartError(RuntimeError):
    """A worker process could not start (an installation problem, never a file's): its error is on stderr."""


def _package_root() -> str:
    """The folder holding the `plugsearch` package this process runs: a worker imports the same code."""
    import plugsearch

    return str(Path(plugsearch.__file__).resolve().parent.parent)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, memory_mb: int) -> None:
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": _package_root() + (os.pathsep + path if path else "")}
        self.process = subprocess.Popen(  # noqa: S603 - this interpreter, this module
            [sys.executable, "-m", "plugsearch.retriever.ingest.pool", str(memory_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.started = False
        self.lock = threading.Lock()

    @property
    def stdin(self) -> IO[bytes]:
        assert self.process.stdin is not None
        return self.process.stdin

    @property
    def stdout(self) -> IO[bytes]:
        assert self.process.stdout is not None
        return self.process.stdout

    def call(self, name: str, args: tuple[Any, ...], budget: float) -> tuple[str, Any]:
        """Send a job and wait for its answer (blocking: a thread of the pool's own); EOFError when the worker
        died or was killed meanwhile (its pipes then closed here, by the thread that read them)."""
        with self.lock:
            try:
                if not self.started:
                    try:
                        _receive(self.stdout)  # its ("ready", pid)
                    except (EOFError, OSError, ValueError) as exc:
                        raise WorkerStartError(f"a parse worker could not start (exit code {self.process.poll()}):"
                                               " its error is in the log above") from exc
                    self.started = True
                try:
                    _send(self.stdin, (name, args, budget))
                    answer: tuple[str, Any] = _receive(self.stdout)
                    return answer
                except (BrokenPipeError, ValueError, OSError) as exc:
                    raise EOFError(f"the worker is gone ({exc})") from exc
            except BaseException:
                self._close()
                raise

    def alive(self) -> bool:
        return self.process.poll() is None

    def _close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()

    def kill(self) -> None:
        """Stop the process (SIGKILL); its pipes are closed here unless a thread is reading them (that thread closes
        them when the read ends, which the kill makes it do at once)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)
        if self.lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self.lock.release()


def _outcome(answer: tuple[str, Any]) -> Any:
    from plugsearch.retriever.ingest.formats import SkipFile

    kind, value = answer
    if kind == "ok":
        return value
    if kind == "skip":
        raise SkipFile(value[0], ignored=value[1])
    if kind == "cpu":
        raise ParseRefused(f"over its CPU budget of {value:g} s (RETRIEVER_PARSE__CPU_S plus "
                           "RETRIEVER_PARSE__CPU_S_PER_MB per MB): a file that costs this much to read is refused")
    if kind == "memory":
        raise ParseRefused("over the memory a reader may use (RETRIEVER_PARSE__MEMORY_MB)")
    raise ParseRefused(f"could not be read ({value})")


@dataclass
class PoolStats:
    jobs: int = 0
    refused: int = 0
    killed: int = 0


class ParsePool:
    """`workers` processes, started when first needed and kept; `await run(job, *args, size=...)` from the
    service, `run_sync` from a command (module docstring)."""

    def __init__(self, limits: ParseLimits | None = None) -> None:
        self.limits = limits or ParseLimits()
        self._idle: list[_Worker] = []
        self._io = ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="parse-io")
        self._slots = threading.BoundedSemaphore(self.limits.workers)
        self._async_slots: asyncio.Semaphore | None = None
        self._waiting = 0
        self._lock = threading.Lock()
        self._closed = False
        self.stats = PoolStats()
        self.busy = 0
        """Jobs running now (what a test watches)."""

    # ---- workers
    def _take(self) -> _Worker:
        with self._lock:
            while self._idle:
                worker = self._idle.pop()
                if worker.alive():
                    return worker
                worker.kill()
        return _Worker(self.limits.memory_mb)

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            if self._closed or not worker.alive():
                worker.kill()
            else:
                self._idle.append(worker)

    def _wall_s(self, budget: float) -> float:
        return 2 * budget + 10.0  # a job waits for CPU on a busy machine; past this it is stuck, not slow

    def _call(self, worker: _Worker, name: str, args: tuple[Any, ...], budget: float) -> Any:
        """Run on `worker` (blocking, in the caller's thread), killed past its wall time."""
        timer = threading.Timer(self._wall_s(budget), worker.kill)
        timer.daemon = True
        timer.start()
        t0 = time.monotonic()
        try:
            answer = worker.call(name, args, budget)
        except EOFError:
            worker.kill()
            self.stats.killed += 1
            if time.monotonic() - t0 >= self._wall_s(budget) - 0.5:
                raise ParseRefused(f"took over {self._wall_s(budget):g} s (its CPU budget {budget:g} s): "
                                   "stopped") from None
            raise ParseRefused("its reader stopped (over the memory a reader may use, or a crash)") from None
        except BaseException:
            worker.kill()  # whatever else happened, this worker reads no more: its process and pipes go
            raise
        finally:
            timer.cancel()
        self._give_back(worker)
        return answer

    # ---- the service's side
    async def run(self, name: str, *args: Any, size: int) -> Any:
        """The job's result; SkipFile or ParseRefused when it is refused, Overloaded when too many wait. A
        cancelled caller kills the job's worker."""
        from plugsearch.common.errors import Overloaded

        if self._async_slots is None:
            self._async_slots = asyncio.Semaphore(self.limits.workers)
        if self._async_slots.locked() and self._waiting >= self.limits.queue:
            self.stats.refused += 1
            raise Overloaded(f"{self._waiting} files or texts are waiting to be read: retry later",
                             retry_after=2.0)
        budget = self.limits.budget(size)
        self._waiting += 1
        try:
            await self._async_slots.acquire()
        finally:
            self._waiting -= 1
        loop = asyncio.get_running_loop()
        self.busy += 1
        try:
            taking = loop.run_in_executor(self._io, self._take)
            try:
                worker = await asyncio.shield(taking)
            except asyncio.CancelledError:  # cancelled while its worker starts: that worker is killed once there
                taking.add_done_callback(lambda done: None if done.cancelled() or done.exception() is not None
                                         else done.result().kill())
                raise
            future = loop.run_in_executor(self._io, self._call, worker, name, args, budget)
            try:
                answer = await asyncio.shield(future)
            except asyncio.CancelledError:
                worker.kill()  # the request ended: nobody waits for this answer, no CPU burns for it
                self.stats.killed += 1
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(future, 10)
                raise
            self.stats.jobs += 1
            return _outcome(answer)
        finally:
            self.busy -= 1
            self._async_slots.release()

    # ---- a command's side
    def run_sync(self, name: str, *args: Any, size: int) -> Any:
        """`run` for a command (blocking; threads may call it at once, `workers` of them run)."""
        budget = self.limits.budget(size)
        with self._slots:
            worker = self._take()
            self.busy += 1
            try:
                answer = self._call(worker, name, args, budget)
            finally:
                self.busy -= 1
        self.stats.jobs += 1
        return _outcome(answer)

    def map(self, calls: Iterator[tuple[str, tuple[Any, ...], int]], window: int | None = None
            ) -> Iterator[Any]:
        """Each (job, args, size) of `calls` run, `workers` at once, the outcomes in order: the result, or the
        SkipFile / ParseRefused it raised (returned, not raised)."""
        window = window or 2 * self.limits.workers
        pending: list[Any] = []
        with ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="parse-map") as threads:
            def outcome(future: Any) -> Any:
                try:
                    return future.result()
                except Exception as exc:  # SkipFile, ParseRefused: the caller reports them
                    return exc

            for name, args, size in calls:
                pending.append(threads.submit(self.run_sync, name, *args, size=size))
                if len(pending) >= window:
                    yield outcome(pending.pop(0))
            while pending:
                yield outcome(pending.pop(0))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            with contextlib.suppress(OSError, ValueError):
                worker.stdin.close()  # a worker ends when its jobs' pipe closes
            worker.kill()
        self._io.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ParsePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def file_size(path: Path) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size
    return 0


if __name__ == "__main__":
    worker_main(int(sys.argv[1]) if len(sys.argv) > 1 else ParseLimits().memory_mb)
