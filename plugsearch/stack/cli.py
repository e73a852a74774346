"""`plugsearch-stack`: the local stack as supervised processes (the README's first command).

By default what a search needs: Redis (when `redis-server` is on PATH, else the services' in-process caches), the
retriever (its BM25 index built on first run into `var/indexes/`, in seconds; with the compact policy's dense
pool, its MiniLM dense index built in the background by the retriever itself while BM25 serves, then served:
the searcher switches to the dense pool within seconds) and the searcher with the compact policy. The
LLM-backed services, llama.cpp with SmolLM2, the generator and the judge, start when asked for: `--chat`,
`--policy base|trained`, `--with-llm` (training and evaluation call the generator and the judge).
Each runs as `python -m plugsearch.<svc>` with the `<SVC>_*` settings the containers use, as one `ProcessGroup`:
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
    plugsearch-stack --show-token            # the internal token of the stack running from this folder

The internal token (what changing documents needs: `plugsearch-index upload`, `sync`, ...) is written, owner-only
(0600), to `<--var-dir>/stack/internal-token` while the stack runs (`plugsearch-index` commands run from the same
folder find it there; `--show-token` prints it), and removed when it stops.

Default corpus: `$PLUGSEARCH_DATA/corpus/combined.jsonl` (PLUGSEARCH_DATA defaults to ../shared/data beside the
repository), else FlashRAG's public 1,000-passage Wikipedia sample, downloaded once into `var/corpus/`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plugsearch.common.files import atomic_write_json, atomic_write_text
from plugsearch.common.llama_server import DEFAULT_PROMPT_CACHE_MB
from plugsearch.common.paths import default_data_dir
from plugsearch.common.procgroup import (
    Output,
    ProcessExited,
    ProcessGroup,
    ProcessNotReady,
    ProcessSpec,
    RestartPolicy,
)
from plugsearch.stack import StackError
from plugsearch.stack.corpus import index_dir_for, resolve_corpus
from plugsearch.stack.policy import (
    POLICY_CHOICES,
    _compact_policy,
    _trained_policy,
    check_policy_corpus,
    serve_dense,
)
from plugsearch.stack.specs import (
    DEFAULT_PORTS,
    StackOptions,
    allocate_ports,
    build_specs,
    default_llm_threads,
    index_command,
    missing_llm_packages,
)

EXAMPLE_QUESTION = "who wrote the novel the call of the wild"


def curl_example(options: StackOptions) -> str:
    body = json.dumps({"question": EXAMPLE_QUESTION, "mode": "s3"})
    # The key itself is never printed: the example reads it from the environment.
    auth = ' -H "Authorization: Bearer $PLUGSEARCH_API_KEY"' if options.api_keys else ""
    return (f"curl -s -X POST {options.url('searcher')}/search -H 'Content-Type: application/json'{auth} "
            f"-d '{body}'")


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
                        help="compact: the compact learned searcher (plugsearch/searcher/trained/compact), in the "
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
    parser.add_argument("--show-token", action="store_true",
                        help="print the internal token of the stack running from --var-dir (it is kept, owner-only, "
                        "in <var-dir>/stack/internal-token while the stack runs) and exit")
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
              say: Callable[[str], None], token_path: Path | str = "<var-dir>/stack/internal-token") -> None:
    """The ready file (URLs, ports, the internal token: owner-only) and the banner with a curl to copy."""
    info: dict[str, Any] = {"searcher": options.url("searcher"),
                            "urls": {s.name: options.url(s.name) for s in specs if s.name != "redis"},
                            "ports": options.ports, "corpus": str(options.corpus),
                            "index_dir": str(options.index_dir), "pid": os.getpid(),
                            "internal_token": options.internal_token}
    if ready_file is not None:
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(ready_file, info, indent=2, mode=0o600)  # it holds the internal token
    say("")
    say(f"plugsearch is ready: POST {options.url('searcher')}/search   (Ctrl-C stops everything)")
    say(f"  {curl_example(options)}")
    say(f"  playground: {options.url('searcher')}/ui   (watch a search in your browser)")
    say(f"  internal services: {', '.join(f'{k} {v}' for k, v in info['urls'].items())}")
    say("  internal services require the internal token (PLUGSEARCH_INTERNAL_TOKEN, or this run's random one: "
        "plugsearch-index commands run from this folder read it from "
        f"{token_path}, `plugsearch-stack --show-token` prints it); secrets are never printed")
    say("")


def _show_token(var_dir: Path) -> int:
    from plugsearch.retriever.ingest.remote import token_file

    path = token_file(var_dir)
    try:
        sys.stdout.write(path.read_text().strip() + "\n")
    except OSError:
        sys.stderr.write(f"no stack is running from {var_dir} ({path} is not there): start one with "
                         "plugsearch-stack, or pass its --var-dir\n")
        return 1
    return 0


def _write_token(var_dir: Path, token: str) -> Path:
    """The internal token where its user's commands find it (`plugsearch.retriever.ingest.remote.token_file`):
    owner-only, written before the services start."""
    from plugsearch.retriever.ingest.remote import token_file

    path = token_file(var_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, token + "\n", mode=0o600)
    return path


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # a process killed by signal N: exit 128 + N, as shells do


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.show_token:
        return _show_token(args.var_dir)
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
                               feedback_db=var_dir / "feedback" / "searcher.sqlite3",
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
    token_path = _write_token(var_dir, options.internal_token)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda _sig, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        group.start()
        try:
            group.wait_ready(timeout_s=args.ready_timeout, stop=stop, interval_s=0.25,
                             on_ready=lambda name, seconds: say(f"{name} ready ({seconds:.1f} s)"))
        except ProcessNotReady as exc:
            say(f"error: not ready within {args.ready_timeout:g} s: {', '.join(exc.names)} "
                "(see their log lines above); stopping everything")
            return 1
        except ProcessExited as exc:
            say(f"{exc.name} exited before it was ready; stopping everything")
            return _exit_code(exc.returncode or 0)
        if stop.is_set():
            return 0
        _announce(options, specs, args.ready_file, say, token_path)
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
        token_path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
