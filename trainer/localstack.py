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
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from services.common.http import ClientSettings
from services.common.llama_server import DEFAULT_MODEL_ALIAS, LlamaServer
from services.common.redis_server import PASSWORD_ENV, redis_argv, redis_url
from services.common.workers import free_port
from trainer.settings import TrainerSettings


class StackError(RuntimeError):
    pass


SERVICE_DB = {"generator": 1, "judge": 2, "searcher": 3}
"""Redis databases of the services that cache (the retriever keeps no result cache)."""


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
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._llama: LlamaServer | None = None
        # per-run secrets, as plugsearch-stack has them: Redis and the LLM started here refuse anyone else
        self._redis_password = secrets.token_hex(24)
        self._llm_key = secrets.token_hex(24)

    def _spawn(self, name: str, argv: Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / f"{name}.log").open("wb")
        proc = subprocess.Popen(list(argv), env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
        log.close()
        self._procs.append((name, proc))
        return proc

    def _wait_http(self, name: str, url: str, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-2000:]
                raise StackError(f"{name} exited with {proc.returncode}: {tail}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise StackError(f"{name} not ready after {self.ready_timeout_s:g} s")
            time.sleep(0.2)

    def index_dir(self) -> Path:
        from services.stack import index_dir_for

        return index_dir_for(self.corpus, self.var_dir)

    def start(self) -> LocalServices:
        py = sys.executable
        try:
            if self.with_redis:
                port = free_port()
                self._spawn("redis", redis_argv(port), {PASSWORD_ENV: self._redis_password})
                deadline = time.monotonic() + 10
                while True:
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise StackError("redis-server did not start") from None
                        time.sleep(0.02)
                self.redis_url = redis_url("127.0.0.1", port, 0, self._redis_password).removesuffix("/0")
            if self.llm_url is None and self.answering:
                self._llama = LlamaServer(n_threads=self.llm_threads, log_path=self.log_dir / "llm.log",
                                          api_key=self._llm_key).start()
                self.llm_url = self._llama.base_url
            llm_key = {"LLM__API_KEY": self._llm_key} if self._llama is not None else {}
            index_dir = self.index_dir()
            build = subprocess.run([py, "-m", "services.retriever.cli", "build", "--corpus", str(self.corpus),
                                    "--index-dir", str(index_dir), "--bm25", "bm25s", "--no-dense", "--quiet"],
                                   capture_output=True, text=True, check=False)
            if build.returncode != 0:
                raise StackError(f"index build failed: {build.stdout[-1000:]}{build.stderr[-1000:]}")
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
                if self._llama is not None:
                    # as `plugsearch-stack` does for its embedded SmolLM2: valid actions only under the grammar
                    searcher["SEARCHER_CONSTRAINED"] = "true"
                self._start_services(["searcher"], {"searcher": searcher})
        except BaseException:
            self.stop()
            raise
        return self

    def _start_services(self, names: Sequence[str], envs: dict[str, dict[str, str]], attempts: int = 4) -> None:
        """Start `names` together on free ports and wait until ready; a service that lost its port to
        another process between the pick and the bind is started again on a new one."""
        pending = list(names)
        for attempt in range(attempts):
            procs = {}
            for name in pending:
                port = free_port()
                self.urls[name] = f"http://127.0.0.1:{port}"
                prefix = name.upper()
                env = {f"{prefix}_PORT": str(port), f"{prefix}_LOG_LEVEL": "WARNING",
                       f"{prefix}_REQUEST_TIMEOUT_S": "900", **envs.get(name, {})}
                if self.redis_url and name in SERVICE_DB:
                    env[f"{prefix}_REDIS_URL"] = f"{self.redis_url}/{SERVICE_DB[name]}"
                procs[name] = self._spawn(name, [sys.executable, "-m", f"services.{name}"], env)
            retry = []
            for name, proc in procs.items():
                try:
                    self._wait_http(name, f"{self.urls[name]}/health/ready", proc)
                except StackError:
                    log = (self.log_dir / f"{name}.log").read_text(errors="replace")
                    if "address already in use" not in log or attempt == attempts - 1:
                        raise
                    retry.append(name)
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
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        if self._llama is not None:
            self._llama.stop()
            self._llama = None

    def __enter__(self) -> LocalServices:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
