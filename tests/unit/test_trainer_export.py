"""A PEFT LoRA exported to llama.cpp's GGUF adapter format is applied by llama.cpp exactly as PEFT applies it:
teacher-forced over the same tokens, llama.cpp with the adapter picks PEFT-with-adapter's argmax at every
position (and differs from the base model), on the SmolLM2 GGUF the local stack serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from plugsearch.trainer.llm.export import ExportError, export_peft_dir, lora_tensors


def test_query_and_key_adapters_are_refused() -> None:
    import torch

    with pytest.raises(ExportError, match="q_proj"):
        lora_tensors({"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight": torch.zeros(2, 4)})
    names = lora_tensors({"base_model.model.model.layers.3.mlp.down_proj.lora_B.weight": torch.zeros(4, 2)})
    assert list(names) == ["blk.3.ffn_down.weight.lora_b"]


def test_llama_cpp_applies_the_exported_adapter_like_peft(var_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp.llama_cpp as lib
    import torch
    from llama_cpp import Llama
    from peft import LoraConfig, get_peft_model

    from plugsearch.common.llama_server import apply_weight_repacking, smollm2_gguf_path
    from plugsearch.trainer.llm.model import default_policy_path, load_policy

    monkeypatch.setattr(lib, "llama_model_default_params", lib.llama_model_default_params)  # restored after
    apply_weight_repacking()  # as the served llama.cpp does (off on CPUs with AMX)

    torch.manual_seed(0)
    model, tokenizer = load_policy(default_policy_path(var_dir))
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "o_proj", "gate_proj",
                                                                              "up_proj", "down_proj"],
                                            layers_to_transform=list(range(10, 30)), lora_dropout=0.0))
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.3)  # large enough to change the model's choices
    peft.save_pretrained(str(tmp_path / "adapter"))
    gguf = export_peft_dir(tmp_path / "adapter", tmp_path / "adapter.gguf", half=False)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Who wrote Hamlet?"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = [int(t) for t in tokenizer(prompt + "Hamlet was written by William Shakespeare around 1600.",
                                     add_special_tokens=False)["input_ids"]]
    peft.eval()
    with torch.no_grad():
        adapted = peft(input_ids=torch.tensor([ids])).logits[0].numpy()
        with peft.disable_adapter():
            base = peft(input_ids=torch.tensor([ids])).logits[0].numpy()

    def llama_logits(lora: Path | None) -> Any:
        llm = Llama(model_path=str(smollm2_gguf_path()), lora_path=str(lora) if lora else None, n_ctx=256,
                    n_threads=1, logits_all=True, verbose=False)
        try:
            llm.eval(ids)
            return np.array(llm.scores[:len(ids)])
        finally:
            llm.close()

    served = llama_logits(gguf)
    # llama.cpp multiplies the Q4_1 weights by 8-bit-quantised activations: a near tie may flip, and the
    # logits differ by a little; the adapter moves them by much more, and llama.cpp moves them the same way
    assert (served.argmax(-1) == adapted.argmax(-1)).mean() >= 0.9
    assert (served.argmax(-1) == base.argmax(-1)).mean() < 0.85
    off, moved = np.abs(served - adapted).mean(), np.abs(adapted - base).mean()
    assert off < 0.25 * moved, (off, moved)
    assert np.corrcoef(served.ravel(), adapted.ravel())[0, 1] > 0.99


def test_records_name_no_folder_of_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plugsearch.trainer.cli.common import portable

    monkeypatch.chdir(tmp_path)
    record = {"prompts_dir": tmp_path / "services" / "p", "png": str(tmp_path / "var" / "c.png"),
              "runs": [{"out": str(tmp_path)}], "other": "/elsewhere/x", "text": "a / b", "n": 3}
    assert portable(record) == {"prompts_dir": "services/p", "png": "var/c.png", "runs": [{"out": "."}],
                                 "other": "/elsewhere/x", "text": "a / b", "n": 3}
