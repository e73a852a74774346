"""The services a local training/eval run needs, as real processes on free ports: Redis (when
`redis-server` exists), the retriever (BM25, index built once under `var/indexes/`, keyed by the corpus
content; not for the compact trainer, which retrieves in-process), the generator and judge (on an
OpenAI-compatible LLM: a given URL, else a llama.cpp SmolLM2 server started here) and optionally the
searcher. `plugsearch-stack` is the user-facing way to run them; `services_for` is the trainer commands'
`--local`.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from plugsearch.common.http import ClientSettings
from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS, llama_spec
from plugsearch.common.paths import REPOSITORY
from plugsearch.common.procgroup import ProcessExited, ProcessGroup, ProcessGroupError, ProcessSpec
from plugsearch.common.redis_server import redis_spec, redis_url
from plugsearch.common.workers import free_port
from plugsearch.stack import StackError
from plugsearch.stack.corpus import index_dir_for
from plugsearch.stack.specs import service_spec
from plugsearch.trainer.common.settings import TrainerSettings


class LocalServices:
    def __init__(self, var_dir: Path, *, corpus: Path, llm_url: str | None = None, searcher: bool = False,
                 llm_threads: int = 1, log_dir: Path | None = None, answering: bool = True,
                 retriever: bool = True) -> None:
        """`answering=False`: no LLM, generator or judge (the LLM-free `recall` reward needs only retrieval);
        `retriever=False`: no retriever service (a caller that retrieves in-process)."""
        self.var_dir = var_dir.resolve()
        self.corpus = corpus.resolve()
        self.llm_url = llm_url
        self.with_searcher = searcher
        self.answering = answering or searcher
        self.with_retriever = retriever or searcher
        self.llm_threads = llm_threads
        self.ready_timeout_s = 300.0
        self.urls: dict[str, str] = {}
        self.redis_url: str | None = None
        self.group = ProcessGroup(log_dir=log_dir or self.var_dir / "logs" / f"trainer-stack-{os.getpid()}", cwd=REPOSITORY)
        # per-run secrets, as plugsearch-stack has them: Redis and the LLM started here refuse anyone else
        self._redis_password = secrets.token_hex(24)
        self._llm_key = secrets.token_hex(24)

    def start(self) -> LocalServices:
        try:
            self._start()
        except ProcessGroupError as exc:
            self.stop()
            raise StackError(str(exc)) from exc
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        if shutil.which("redis-server"):
            port = free_port()
            self.group.up(redis_spec(port, self._redis_password), timeout_s=self.ready_timeout_s)
            self.redis_url = redis_url("127.0.0.1", port, self._redis_password)
        llm = {"BASE_URL": self.llm_url or "", "MODEL": DEFAULT_MODEL_ALIAS, "TIMEOUT_S": "600"}
        own_llm = self.llm_url is None and self.answering
        if own_llm:
            port = free_port()
            self.group.up(llama_spec("llm", port, self._llm_key, threads=self.llm_threads), timeout_s=self.ready_timeout_s)
            self.llm_url = llm["BASE_URL"] = f"http://127.0.0.1:{port}/v1"
            llm["API_KEY"] = self._llm_key
        services: dict[str, dict[str, str]] = {}
        if self.with_retriever:
            index_dir = index_dir_for(self.corpus, self.var_dir)
            if self.group.run(ProcessSpec("index", [sys.executable, "-m", "plugsearch.retriever.cli", "build",
                                                    "--corpus", str(self.corpus), "--index-dir", str(index_dir),
                                                    "--bm25", "bm25s", "--no-dense", "--quiet"])) != 0:
                raise StackError(f"index build failed: {self.group.tail('index')}")
            services["retriever"] = {"CORPUS": str(self.corpus), "INDEX_DIR": str(index_dir),
                                     "BM25_BACKEND": "bm25s", "BM25_THREADS": "1"}
        answer = {f"LLM__{k}": v for k, v in llm.items()}
        if self.answering:
            services.update({"generator": {**answer, "TOKENIZER_CACHE_DIR": str(self.var_dir / "tokenizers")},
                             "judge": answer})
        if services:
            self._start_services(services)
        if self.with_searcher:
            searcher = {"RETRIEVER__URL": self.urls["retriever"], "SEARCH_TIMEOUT_S": "800",
                        **{f"POLICY__{k}": v for k, v in llm.items()}}
            if own_llm:  # as `plugsearch-stack` does for its embedded SmolLM2: valid actions only under the grammar
                searcher["CONSTRAINED"] = "true"
            self._start_services({"searcher": searcher})

    def _service(self, name: str, env: dict[str, str]) -> ProcessSpec:
        port = free_port()
        self.urls[name] = f"http://127.0.0.1:{port}"
        return service_spec(name, port, {"LOG_LEVEL": "WARNING", "REQUEST_TIMEOUT_S": "900", **env},
                            redis=self.redis_url)

    def _start_services(self, envs: dict[str, dict[str, str]], attempts: int = 4) -> None:
        """Start these services together on free ports and wait until ready; a service that lost its port to
        another process between the pick and the bind is started again on a new one."""
        pending = list(envs)
        for attempt in range(attempts):
            self.group.add(*(self._service(name, envs[name]) for name in pending))
            self.group.start(*pending)
            retry = []
            for name in pending:
                try:
                    self.group.wait_ready(name, timeout_s=self.ready_timeout_s)
                except ProcessExited:
                    if "address already in use" not in self.group.tail(name) or attempt == attempts - 1:
                        raise
                    self.group.stop(name)
                    retry.append(name)
            if not retry:
                return
            pending = retry

    def settings(self, **updates: object) -> TrainerSettings:
        """Trainer settings pointing at these services."""
        def client(name: str, timeout: float) -> ClientSettings:
            return ClientSettings.model_validate({"url": self.urls.get(name, "http://127.0.0.1:1"),
                                                  "timeout_s": timeout})

        return TrainerSettings().model_copy(update={
            "retriever": client("retriever", 60.0), "generator": client("generator", 900.0),
            "judge": client("judge", 900.0), "searcher": client("searcher", 900.0),
            "redis_url": f"{self.redis_url}/9" if self.redis_url else None, **updates})

    def stop(self) -> None:
        self.group.close()

    def __enter__(self) -> LocalServices:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


KEPT_SETTINGS = ("baseline_k", "method", "reward", "format_lambda", "var_dir", "data_dir")


@contextmanager
def services_for(settings: TrainerSettings, local: bool, *, corpus: Path | None = None, **options: Any
                 ) -> Iterator[TrainerSettings]:
    """`settings` (the `TRAINER_*` services); with `local`, the same pointing at services started here
    (`LocalServices(**options)`, over `corpus`, default the shared combined corpus) for as long as the block
    runs."""
    if not local:
        yield settings
        return
    corpus = corpus or settings.data_dir / "corpus" / "combined.jsonl"
    with LocalServices(settings.var_dir, corpus=corpus, **options) as stack:
        yield stack.settings(**{k: getattr(settings, k) for k in KEPT_SETTINGS})
