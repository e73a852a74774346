"""The services a local training/eval run needs, as real processes on free ports: Redis (when
`redis-server` exists), the retriever (BM25 over `../shared/data/corpus/combined.jsonl`, index built
once under `var/indexes/`, keyed by the corpus content), the generator and judge (on an
OpenAI-compatible LLM: a given URL, else a llama.cpp SmolLM2 server started here) and optionally the
searcher. Used by `bench/train_step.py`, the eval run and the e2e tests; `plugsearch-stack` is the
user-facing way to run the same stack.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from services.common.http import ClientSettings
from services.common.llama_server import DEFAULT_MODEL_ALIAS
from services.common.procgroup import ProcessExited, ProcessGroup, ProcessGroupError, ProcessSpec
from services.common.redis_server import redis_url
from services.common.workers import free_port
from services.stack import REDIS_DB, index_dir_for, llama_spec, redis_spec
from trainer.settings import TrainerSettings

REPO = Path(__file__).resolve().parent.parent


class StackError(RuntimeError):
    pass


class LocalServices:
    def __init__(self, var_dir: Path, *, corpus: Path, llm_url: str | None = None, searcher: bool = False,
                 redis: bool = True, llm_threads: int = 1, log_dir: Path | None = None,
                 ready_timeout_s: float = 300.0, answering: bool = True) -> None:
        """`answering=False`: no LLM, generator or judge (the LLM-free `recall` reward needs only retrieval)."""
        self.var_dir = var_dir.resolve()
        self.corpus = corpus.resolve()
        self.llm_url = llm_url
        self.with_searcher = searcher
        self.answering = answering or searcher
        self.with_redis = redis and shutil.which("redis-server") is not None
        self.llm_threads = llm_threads
        self.log_dir = log_dir or self.var_dir / "logs" / f"trainer-stack-{os.getpid()}"
        self.ready_timeout_s = ready_timeout_s
        self.urls: dict[str, str] = {}
        self.redis_url: str | None = None
        self.group = ProcessGroup(log_dir=self.log_dir, cwd=REPO)
        # per-run secrets, as plugsearch-stack has them: Redis and the LLM started here refuse anyone else
        self._redis_password = secrets.token_hex(24)
        self._llm_key = secrets.token_hex(24)
        self._own_llm = False

    def index_dir(self) -> Path:
        return index_dir_for(self.corpus, self.var_dir)

    def _start_ready(self, spec: ProcessSpec) -> None:
        try:
            self.group.up(spec, timeout_s=self.ready_timeout_s)
        except ProcessGroupError as exc:
            raise StackError(str(exc)) from exc

    def start(self) -> LocalServices:
        try:
            if self.with_redis:
                port = free_port()
                self._start_ready(redis_spec(port, self._redis_password))
                self.redis_url = redis_url("127.0.0.1", port, 0, self._redis_password).removesuffix("/0")
            if self.llm_url is None and self.answering:
                port = free_port()
                self._start_ready(llama_spec("llm", port, self._llm_key, threads=self.llm_threads))
                self.llm_url = f"http://127.0.0.1:{port}/v1"
                self._own_llm = True
            llm_key = {"LLM__API_KEY": self._llm_key} if self._own_llm else {}
            index_dir = self.index_dir()
            if self.group.run(ProcessSpec("index", [sys.executable, "-m", "services.retriever.cli", "build",
                                                    "--corpus", str(self.corpus), "--index-dir", str(index_dir),
                                                    "--bm25", "bm25s", "--no-dense", "--quiet"])) != 0:
                raise StackError(f"index build failed: {self.group.tail('index')}")
            llm = {"LLM__BASE_URL": self.llm_url or "", "LLM__MODEL": DEFAULT_MODEL_ALIAS, "LLM__TIMEOUT_S": "600",
                   **llm_key}
            envs: dict[str, dict[str, str]] = {
                "retriever": {"RETRIEVER_CORPUS": str(self.corpus), "RETRIEVER_INDEX_DIR": str(index_dir),
                              "RETRIEVER_BM25_BACKEND": "bm25s", "RETRIEVER_BM25_THREADS": "1"},
                "generator": {**{f"GENERATOR_{k}": v for k, v in llm.items()},
                              "GENERATOR_TOKENIZER_CACHE_DIR": str(self.var_dir / "tokenizers")},
                "judge": {f"JUDGE_{k}": v for k, v in llm.items()},
            }
            self._start_services(["retriever", "generator", "judge"] if self.answering else ["retriever"], envs)
            if self.with_searcher:
                searcher = {"SEARCHER_RETRIEVER__URL": self.urls["retriever"], "SEARCHER_POLICY__BASE_URL": self.llm_url or "",
                            "SEARCHER_POLICY__MODEL": DEFAULT_MODEL_ALIAS, "SEARCHER_POLICY__TIMEOUT_S": "600",
                            "SEARCHER_SEARCH_TIMEOUT_S": "800",
                            **{f"SEARCHER_POLICY__{k.removeprefix('LLM__')}": v for k, v in llm_key.items()}}
                if self._own_llm:
                    # as `plugsearch-stack` does for its embedded SmolLM2: valid actions only under the grammar
                    searcher["SEARCHER_CONSTRAINED"] = "true"
                self._start_services(["searcher"], {"searcher": searcher})
        except BaseException:
            self.stop()
            raise
        return self

    def _service(self, name: str, env: dict[str, str]) -> ProcessSpec:
        port = free_port()
        self.urls[name] = f"http://127.0.0.1:{port}"
        prefix = name.upper()
        env = {f"{prefix}_PORT": str(port), f"{prefix}_LOG_LEVEL": "WARNING", f"{prefix}_REQUEST_TIMEOUT_S": "900",
               **env}
        if self.redis_url and name in REDIS_DB:
            env[f"{prefix}_REDIS_URL"] = f"{self.redis_url}/{REDIS_DB[name]}"
        return ProcessSpec(name, [sys.executable, "-m", f"services.{name}"], env=env,
                           ready_url=f"{self.urls[name]}/health/ready", port=port)

    def _start_services(self, names: Sequence[str], envs: dict[str, dict[str, str]], attempts: int = 4) -> None:
        """Start `names` together on free ports and wait until ready; a service that lost its port to
        another process between the pick and the bind is started again on a new one."""
        pending = list(names)
        for attempt in range(attempts):
            self.group.add(*(self._service(name, envs.get(name, {})) for name in pending))
            self.group.start(*pending)
            retry = []
            for name in pending:
                try:
                    self.group.wait_ready(name, timeout_s=self.ready_timeout_s)
                except ProcessExited as exc:
                    if "address already in use" not in self.group.tail(name) or attempt == attempts - 1:
                        raise StackError(str(exc)) from exc
                    self.group.stop(name)
                    retry.append(name)
                except ProcessGroupError as exc:
                    raise StackError(str(exc)) from exc
            if not retry:
                return
            pending = retry

    def settings(self, **updates: object) -> TrainerSettings:
        """Trainer settings pointing at these services."""
        def client(name: str, timeout: float) -> ClientSettings:
            return ClientSettings.model_validate({"url": self.urls.get(name, "http://127.0.0.1:1"),
                                                  "timeout_s": timeout})

        base = TrainerSettings()
        return base.model_copy(update={
            "retriever": client("retriever", 60.0), "generator": client("generator", 900.0),
            "judge": client("judge", 900.0), "searcher": client("searcher", 900.0),
            "redis_url": f"{self.redis_url}/9" if self.redis_url else None, **updates})

    def stop(self) -> None:
        self.group.close()

    def __enter__(self) -> LocalServices:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
