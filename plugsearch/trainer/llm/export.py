"""A trained LoRA adapter as a llama.cpp GGUF adapter, so the local llama.cpp server serves the trained
searcher (`--lora_path`) over the same SmolLM2 GGUF it already serves.

The layout of llama.cpp's own `convert_lora_to_gguf.py` (`blk.N.<name>.weight.lora_a` / `.lora_b`).
llama.cpp permutes the rows of the query and key projections for its rope layout, so adapters on
`q_proj` / `k_proj` are refused here rather than exported wrong.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from plugsearch.common.files import atomic_path

GGUF_NAMES = {
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
"""Hugging Face Llama module -> llama.cpp tensor name (per block)."""

EXPORTABLE_MODULES = ("v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn\.\w+|mlp\.\w+)\.lora_([AB])(?:\.default)?\.weight$")


class ExportError(ValueError):
    """The adapter cannot be written as a llama.cpp LoRA."""


def lora_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """PEFT adapter state (`lora_A` / `lora_B` weights) -> {gguf tensor name: float32 numpy array}."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        match = _KEY.match(key)
        if match is None:
            if "lora_" in key:
                raise ExportError(f"unexpected adapter tensor {key}")
            continue
        layer, module, which = match.groups()
        if module not in GGUF_NAMES:
            raise ExportError(f"llama.cpp permutes {module}'s rows; train without it (modules {EXPORTABLE_MODULES})")
        name = f"blk.{layer}.{GGUF_NAMES[module]}.weight.lora_{which.lower()}"
        out[name] = value.detach().float().cpu().numpy()
    if not out:
        raise ExportError("no LoRA tensors in the adapter")
    return out


def export_gguf(state: dict[str, Any], alpha: float, out: Path, *, arch: str = "llama",
                half: bool = True) -> Path:
    """Write the adapter `state` (PEFT keys) with scaling `alpha` to `out` (a `.gguf` file)."""
    import gguf
    import numpy as np

    tensors = lora_tensors(state)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        writer = gguf.GGUFWriter(str(tmp), arch)
        writer.add_type(gguf.GGUFType.ADAPTER)
        writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
        writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(alpha))
        for name in sorted(tensors, key=lambda n: (int(n.split(".")[1]), n.split(".", 2)[2])):  # block, then name
            array = tensors[name].astype(np.float16 if half else np.float32)
            writer.add_tensor(name, array)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return out


def export_peft_dir(adapter_dir: Path, out: Path, *, half: bool = True) -> Path:
    """A saved PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) -> GGUF."""
    import json

    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    if config.get("use_dora") or config.get("use_rslora"):
        raise ExportError("DoRA / rsLoRA adapters are not llama.cpp LoRAs")
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    # llama.cpp scales by alpha / rank, as PEFT does
    return export_gguf(state, float(config["lora_alpha"]), out, half=half)
