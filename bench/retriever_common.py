"""Helpers shared by the retriever benches: index builds (cached under var/), a served retriever process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from bench.common import CORPUS, DATA, REPO, log
from plugsearch.common.procgroup import ProcessGroup, ProcessSpec, http_ok
from plugsearch.common.workers import free_port

INDEX_DIR = REPO / "var" / "indexes" / "combined"
# question sets that have a corpus (bamboogle and triviaqa have none; see ../shared/data/README.md)
DATASETS = ["nq", "popqa", "hotpotqa", "2wikimultihopqa", "musique"]


def ensure_indexes(*, bm25: list[str], dense: bool) -> None:
    """Build whatever is missing or stale (no-op when the cached indexes match the corpus)."""
    from plugsearch.retriever.indexing.build import build
    from plugsearch.retriever.settings import RetrieverSettings

    s = RetrieverSettings(corpus=CORPUS, index_dir=INDEX_DIR, bm25=True, dense=dense)
    built = build(s, bm25=bm25, dense=dense, force=False, show_progress=False)
    if built:
        log(f"built {built}")


def dense_available() -> bool:
    from plugsearch.retriever.store.manifest import Manifest

    try:
        Manifest.read(INDEX_DIR / "dense-flat")
    except Exception:
        return False
    return True


class ServedRetriever(ProcessGroup):
    """`python -m plugsearch.retriever` as a child process on a free port, stopped on exit. With
    `RETRIEVER_WORKERS` > 1 in `env`, ready means every worker has finished loading its index."""

    def __init__(self, env: dict[str, str], timeout: float = 600.0, *, corpus: Path = CORPUS,
                 index_dir: Path = INDEX_DIR) -> None:
        super().__init__(cwd=REPO)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # the query-vector cache off: these benches repeat their questions and measure the encoder
        full = {"RETRIEVER_CORPUS": str(corpus), "RETRIEVER_INDEX_DIR": str(index_dir),
                "RETRIEVER_PORT": str(self.port), "RETRIEVER_LOG_LEVEL": "INFO",
                "RETRIEVER_ENCODER__QUERY_CACHE": "0", **env}
        workers = int({**os.environ, **full}.get("RETRIEVER_WORKERS", "1"))

        def ready() -> bool:  # every worker has loaded (a started worker answers 503 while it loads)
            return (http_ok(f"{self.url}/health/ready", timeout_s=1.0)
                    and self.log_text("retriever").count("retriever ready in") >= workers)

        self.up(ProcessSpec("retriever", [sys.executable, "-m", "plugsearch.retriever"], env=full, ready=ready),
                timeout_s=timeout)

    def peak_rss_mb(self) -> float:
        """Peak RSS of the service, summed over its workers (each holds its own index)."""
        from tests.support.procs import children

        pid = self.procs["retriever"].pid
        return sum(peak_rss_mb(p) for p in [pid, *children(pid)])


def peak_rss_mb(pid: int | str = "self") -> float:
    """A process's peak RSS since its exec (VmHWM) in MB; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return next((int(line.split()[1]) / 1024 for line in fh if line.startswith("VmHWM:")), 0.0)
    except OSError:
        return 0.0


def dense_subset() -> tuple[Path, Path]:
    """A ~300-passage subset of the shared corpora with bm25s + MiniLM flat indexes (cached under var/):
    stands in for dense/hybrid serving figures when the full dense index has not been built."""
    from tests.support import retriever as tiny

    corpus = tiny.write_tiny_corpus(DATA, REPO / "var" / "cache" / "bench-subset" / "subset.jsonl")
    index_dir = tiny.cached_index_dir(REPO / "var", corpus)
    tiny.ensure_tiny_indexes(tiny.tiny_settings(corpus, index_dir), bm25=["bm25s"], dense=True)
    return corpus, index_dir
