"""Token counting for context budgets: the backend model's tokenizer where available, else an estimate
(`load_token_counter` says which, in which order). A configured tokenizer that cannot be loaded fails the
start: a silent fallback would break budgets on GPU nodes.
"""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class TokenCounter(Protocol):
    kind: str
    """"estimate" or "hf:<name>"; shown by /version."""

    def count(self, text: str) -> int: ...

    def truncate(self, text: str, max_tokens: int) -> str: ...


class EstimatedTokens:
    """About 4 characters per token (English BPE); cuts on a word boundary when it can."""

    kind = "estimate"
    chars_per_token = 4.0

    def count(self, text: str) -> int:
        return math.ceil(len(text) / self.chars_per_token)

    def truncate(self, text: str, max_tokens: int) -> str:
        limit = int(max_tokens * self.chars_per_token)
        if len(text) <= limit:
            return text
        cut = text[:limit]
        space = cut.rfind(" ")
        return cut[:space] if space > limit // 2 else cut


class FastTokens:
    """A `tokenizers.Tokenizer` (the Rust library, no transformers import): used for the saved copy of a
    tokenizer read from a GGUF, so later starts take about a second."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self.tokenizer = tokenizer
        self.kind = f"hf:{name}"

    def offsets(self, text: str) -> list[tuple[int, int]]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).offsets)

    def count(self, text: str) -> int:
        return len(self.offsets(text))

    def truncate(self, text: str, max_tokens: int) -> str:
        """Whole tokens' characters."""
        if max_tokens <= 0:
            return ""
        offsets = self.offsets(text)
        return text if len(offsets) <= max_tokens else text[:offsets[max_tokens - 1][1]]


class HFTokens(FastTokens):
    """A transformers tokenizer (special tokens excluded); a slow one truncates by decoding token ids."""

    def offsets(self, text: str) -> list[tuple[int, int]]:
        return list(self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"])

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def truncate(self, text: str, max_tokens: int) -> str:
        if max_tokens <= 0 or getattr(self.tokenizer, "is_fast", False):
            return super().truncate(text, max_tokens)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return text if len(ids) <= max_tokens else str(self.tokenizer.decode(ids[:max_tokens]))


def _gguf_tokens(path: Path, cache_dir: str | None) -> TokenCounter:
    """The tokenizer inside a GGUF file. transformers reads it (slow: it parses the whole vocabulary in
    Python); with `cache_dir` the result is saved once, keyed by the file's path, size and mtime."""
    saved: Path | None = None
    if cache_dir:
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        saved = Path(cache_dir) / f"{path.stem}-{key}"
        if (saved / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return FastTokens(Tokenizer.from_file(str(saved / "tokenizer.json")), path.name)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if saved is not None:
        saved.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(saved))
    return HFTokens(tokenizer, path.name)


def load_token_counter(spec: str | None, *, model: str, from_gguf: bool = True,
                       cache_dir: str | None = None) -> TokenCounter:
    """In order: `spec` (`LLMSettings.tokenizer`: an HF name or path, loaded with `local_files_only`, or a
    `.gguf` file); the packaged SmolLM2 GGUF when `model` is the local default; a 4-characters-per-token
    estimate. Blocking (reads files): call it from a thread in a lifespan."""
    if spec:
        path = Path(spec)
        try:
            counter: TokenCounter
            if path.suffix == ".gguf":
                if not path.is_file():
                    raise FileNotFoundError(spec)
                counter = _gguf_tokens(path, cache_dir)
            else:
                from transformers import AutoTokenizer

                counter = HFTokens(AutoTokenizer.from_pretrained(spec, local_files_only=True), spec)
        except Exception as exc:
            raise RuntimeError(f"cannot load tokenizer {spec!r}: {type(exc).__name__}: {exc}") from exc
        logger.info("token budgets use tokenizer %s", counter.kind)
        return counter
    if from_gguf:
        from plugsearch.common.llama_server import DEFAULT_MODEL_ALIAS, LlamaServerError, smollm2_gguf_path

        if model == DEFAULT_MODEL_ALIAS:
            try:
                gguf = smollm2_gguf_path()
                smollm2 = _gguf_tokens(gguf, cache_dir)
            except (LlamaServerError, ImportError, OSError, ValueError) as exc:
                logger.warning("SmolLM2 tokenizer unavailable (%s); token budgets are estimated",
                               type(exc).__name__)
            else:
                logger.info("token budgets use SmolLM2's tokenizer from %s", gguf.name)
                return smollm2
    logger.info("token budgets are estimated (4 characters per token)")
    return EstimatedTokens()
