"""The parse pool (plugsearch/retriever/ingest/pool.py): files read in worker processes of its own, each job under a
CPU budget, a cancelled job's worker killed at once, a bounded queue; what ingest and the retriever read through."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from plugsearch.common.errors import Overloaded
from plugsearch.retriever.ingest.formats import SkipFile
from plugsearch.retriever.ingest.pool import ParseLimits, ParsePool, ParseRefused
from tests.support.pdfs import shared_stream_pdf
from tests.unit.test_ingest import PDF_PAGE_1, write_pdf


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")  # a zombie is gone


def worker_pids(pool: ParsePool) -> list[int]:
    return [w.process.pid for w in pool._idle]


def test_a_costly_pdf_is_refused_at_its_cpu_budget_and_the_worker_reads_the_next_file(tmp_path: Path) -> None:
    write_pdf(tmp_path / "good.pdf", [PDF_PAGE_1])
    good = (tmp_path / "good.pdf").read_bytes()
    bomb = shared_stream_pdf(200)  # ~40 KB, ~40 s of CPU to read whole
    with ParsePool(ParseLimits(workers=1, cpu_s=1.0, cpu_s_per_mb=0.0)) as pool:
        kind, passages = pool.run_sync("read", "good.pdf", good, "good.pdf", 100, 1 << 20, None, size=len(good))
        assert kind == "pdf" and passages[0].text == PDF_PAGE_1
        first = worker_pids(pool)
        t0 = time.process_time()
        with pytest.raises(ParseRefused, match=r"over its CPU budget of 1 s \(RETRIEVER_PARSE__CPU_S"):
            pool.run_sync("read", "bomb.pdf", bomb, "bomb.pdf", 100, 1 << 20, None, size=len(bomb))
        assert time.process_time() - t0 < 1.0  # the work was the worker's, not this process's
        assert worker_pids(pool) == first  # the same worker, which reads the next file
        assert pool.run_sync("read", "good.pdf", good, "good.pdf", 100, 1 << 20, None, size=len(good))[0] == "pdf"
        with pytest.raises(SkipFile, match="not a readable PDF"):
            pool.run_sync("read", "bad.pdf", b"%PDF-1.4 nothing", "bad.pdf", 100, 1 << 20, None, size=16)


async def test_a_cancelled_job_kills_its_worker_and_the_next_job_gets_a_new_one() -> None:
    bomb = shared_stream_pdf(400)
    with ParsePool(ParseLimits(workers=1, cpu_s=300.0)) as pool:
        job = asyncio.create_task(pool.run("read", "bomb.pdf", bomb, "bomb.pdf", 100, 1 << 20, None, size=len(bomb)))
        await asyncio.sleep(1.5)  # its worker reads it
        assert pool.busy == 1
        pids = await asyncio.to_thread(lambda: {int(p.name) for p in Path("/proc").iterdir()
                                                if p.name.isdigit() and _is_worker(p)})
        assert pids, "no worker process runs the job"
        job.cancel()  # the request ended (its deadline, or the client hung up)
        with pytest.raises(asyncio.CancelledError):
            await job
        for _ in range(200):
            if not any(alive(pid) for pid in pids):
                break
            await asyncio.sleep(0.05)
        assert not any(alive(pid) for pid in pids)  # no CPU burns for an answer nobody waits for
        assert pool.stats.killed >= 1 and pool.busy == 0
        cut = await pool.run("documents", [("d", "T", "A new worker cuts this text.", None)], 100, size=30)
        assert cut[0][0].text == "A new worker cuts this text."


def _is_worker(proc: Path) -> bool:
    try:
        cmdline = (proc / "cmdline").read_bytes().split(b"\x00")
        status = (proc / "status").read_text()
    except OSError:
        return False
    parent = next((line.split()[1] for line in status.splitlines() if line.startswith("PPid:")), "")
    return b"plugsearch.retriever.ingest.pool" in cmdline and parent == str(os.getpid())


async def test_past_its_queue_the_pool_refuses_with_a_retry_after() -> None:
    bomb = shared_stream_pdf(100)
    with ParsePool(ParseLimits(workers=1, queue=1, cpu_s=2.0, cpu_s_per_mb=0.0)) as pool:
        jobs = [asyncio.create_task(pool.run("read", "b.pdf", bomb, "b.pdf", 100, 1 << 20, None, size=len(bomb)))
                for _ in range(2)]
        await asyncio.sleep(0.2)  # one runs, one waits
        with pytest.raises(Overloaded) as refused:
            await pool.run("read", "b.pdf", bomb, "b.pdf", 100, 1 << 20, None, size=len(bomb))
        assert refused.value.retry_after and pool.stats.refused == 1
        outcomes = await asyncio.gather(*jobs, return_exceptions=True)
        assert all(isinstance(o, ParseRefused) for o in outcomes)


def test_map_keeps_the_order_and_hands_back_refusals(tmp_path: Path) -> None:
    texts = [f"Document number {n} is here." for n in range(7)]
    calls = [("documents", ([(f"d{n}", "", text, None)], 100), len(text)) for n, text in enumerate(texts)]
    calls.insert(3, ("documents", ([("empty", "", "   ", None)], 100), 3))
    with ParsePool(ParseLimits(workers=2)) as pool:
        out = list(pool.map(iter(calls)))
    assert isinstance(out[3], SkipFile) and out[3].reason == "document 'empty': no text"
    assert [o[0][0].text for i, o in enumerate(out) if i != 3] == texts
