"""`plugsearch-train export`: a trained LoRA adapter as the LLM searcher `plugsearch-stack --policy trained`
serves (`adapter.gguf`, its prompts, `manifest.json` with the runs that made it and its evaluation)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from plugsearch.common.files import atomic_write_text
from plugsearch.trainer.cli.common import RUN_RECORD, portable


def beats_base(evaluation: dict[str, Any]) -> bool:
    """From `bench/search_quality.py`'s result over every set: the trained searcher gains more over naive
    top-n at its own budget than the untrained one does over naive top-n at its budget, and it is not worse
    than the untrained one at a budget of 3 documents. `plugsearch-stack --policy auto` serves it only then."""
    overall = evaluation.get("all") or {}
    matched, fixed = overall.get("matched") or {}, overall.get("budget3") or {}
    try:
        return bool(matched["gain_s3_trained"] > matched["gain_s3_base"] and fixed["s3_trained"] >= fixed["s3_base"])
    except KeyError:
        return False


def cmd_export(args: argparse.Namespace) -> dict[str, Any]:
    """A trained adapter as the searcher the stack serves: `<out>/adapter.gguf`, the prompts it was trained
    with, and `manifest.json` with the search setting and the record of every run that made it."""
    import shutil

    from plugsearch.common.llama_server import smollm2_gguf_path
    from plugsearch.searcher.trained import ADAPTER, MANIFEST, sha256
    from plugsearch.trainer.llm.export import export_peft_dir

    adapter = Path(args.adapter)
    out = Path(args.out)
    runs = [Path(r) for r in args.runs] if args.runs else [adapter.parent]
    records = [json.loads((r / RUN_RECORD).read_text()) for r in runs if (r / RUN_RECORD).is_file()]
    if not records:
        raise SystemExit(f"no {RUN_RECORD} in {', '.join(map(str, runs))}: which runs made this adapter?")
    last = records[-1]
    out.mkdir(parents=True, exist_ok=True)
    gguf = export_peft_dir(adapter, out / ADAPTER, half=not args.fp32)
    prompts = Path(last["prompts_dir"]) if last.get("prompts_dir") else None
    if prompts is not None and prompts.resolve() != (out / "prompts").resolve():  # else already in place
        shutil.rmtree(out / "prompts", ignore_errors=True)
        shutil.copytree(prompts, out / "prompts")
    base = smollm2_gguf_path()
    evaluation = json.loads(Path(args.evaluation).read_text()) if args.evaluation else None
    if evaluation is not None:
        evaluation["beats_base"] = beats_base(evaluation)
    manifest = {"model_alias": args.alias, "base_model": base.name, "base_gguf_sha256": sha256(base),
                "adapter_sha256": sha256(gguf), "search": last["search"], "summary": args.summary or "",
                "runs": records, "evaluation": evaluation}
    atomic_write_text(out / MANIFEST, json.dumps(portable(manifest), indent=2) + "\n")
    return {"folder": str(out), "adapter_bytes": gguf.stat().st_size, "runs": len(records)}


def add_parser(sub: Any) -> None:
    x = sub.add_parser("export", help="a trained LoRA adapter as the searcher plugsearch-stack serves")
    x.add_argument("adapter", help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    x.add_argument("out", help="output folder (adapter.gguf, prompts/, manifest.json), e.g. "
                               "plugsearch/searcher/trained/smollm2-s3")
    x.add_argument("--runs", nargs="+",
                   help="run folders whose run.json go into the manifest, in order (default: the adapter's parent)")
    x.add_argument("--evaluation", help="bench/search_quality.py's final JSON line (a file) to record in "
                   "the manifest; it decides whether plugsearch-stack serves the searcher by default (beats_base)")
    x.add_argument("--summary", help="one line on what the searcher is")
    x.add_argument("--alias", default="smollm2-135m-searcher", help="model name the policy server answers to")
    x.add_argument("--fp32", action="store_true", help="float32 tensors (default float16)")
    x.set_defaults(func=cmd_export)
