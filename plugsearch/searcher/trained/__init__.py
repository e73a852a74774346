"""The searcher policies trained here and shipped with the package.

- `compact/` (`COMPACT_DIR`): the compact learned policy (`plugsearch.searcher.compact`: weights.npz +
  manifest.json with its digest, its evaluation and the search setting it was trained in). The default
  everywhere: the searcher service serves it unless told otherwise (`SEARCHER_POLICY_KIND`), and
  `plugsearch-stack --policy auto` picks it while its recorded evaluation beats naive top-k.
- `smollm2-s3/` (`LORA_DIR`, `TrainedSearcher`): a LoRA adapter over SmolLM2-135M-Instruct (llama.cpp's GGUF
  adapter format), its prompt templates, and `manifest.json` (how it was trained and the search setting it must
  be served with). Served by `plugsearch-stack --policy trained`, on a second llama.cpp process so the generator
  and judge keep the plain model (`--policy base`: the untrained model).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plugsearch.common.schemas.searcher import SearchParams

LORA_DIR = Path(__file__).resolve().parent / "smollm2-s3"
"""The LoRA searcher (`TrainedSearcher`): a SmolLM2-135M adapter, its prompts and manifest."""
COMPACT_DIR = Path(__file__).resolve().parent / "compact"
"""The compact CPU policy (`plugsearch.searcher.compact`): weights.npz + manifest.json."""
MANIFEST = "manifest.json"
ADAPTER = "adapter.gguf"


class TrainedSearcherError(RuntimeError):
    """The trained searcher's files are missing, altered, or do not fit the served base model."""


def sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


@dataclass(frozen=True)
class TrainedSearcher:
    folder: Path
    manifest: dict[str, Any]

    @property
    def adapter(self) -> Path:
        return self.folder / ADAPTER

    @property
    def prompts_dir(self) -> Path:
        return self.folder / "prompts"

    @property
    def search(self) -> SearchParams:
        return SearchParams(**self.manifest["search"])

    @property
    def serve_by_default(self) -> bool:
        """Whether its recorded evaluation showed it beating the untrained policy (what `--policy auto`
        needs to serve it)."""
        evaluation = self.manifest.get("evaluation") or {}
        return bool(evaluation.get("beats_base"))

    @property
    def model_alias(self) -> str:
        return str(self.manifest.get("model_alias", "smollm2-135m-searcher"))

    @staticmethod
    def shipped(folder: Path = LORA_DIR) -> bool:
        return (folder / MANIFEST).is_file()

    @classmethod
    def load(cls, folder: Path = LORA_DIR) -> TrainedSearcher:
        """The searcher in `folder`, its adapter checked against the digest its manifest records."""
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file() or not (folder / ADAPTER).is_file():
            raise TrainedSearcherError(f"no trained searcher in {folder} ({MANIFEST} and {ADAPTER} needed)")
        manifest = json.loads(manifest_path.read_text())
        digest = sha256(folder / ADAPTER)
        if manifest.get("adapter_sha256") != digest:
            raise TrainedSearcherError(f"{folder / ADAPTER} does not match its manifest (sha256 {digest[:12]})")
        return cls(folder, manifest)

    def check_base(self, gguf: Path) -> None:
        """The adapter was trained on one base model: refuse to put it on another."""
        want = self.manifest.get("base_gguf_sha256")
        if want and sha256(gguf) != want:
            raise TrainedSearcherError(f"the trained searcher adapts {self.manifest.get('base_model')}, not {gguf.name}; "
                                       "serve it on that model or use --policy base")

    def searcher_env(self) -> dict[str, str]:
        """`SEARCHER_*` settings (without the prefix) that serve it as trained: its manifest (whose `search`
        setting, retrieve_k, select_k and max_turns, the searcher reads as the defaults of its s3 searches, as it
        reads a compact policy's), its prompts and how its outputs are sampled."""
        s = self.search
        env = {"POLICY_MANIFEST": str(self.folder / MANIFEST), "PROMPTS_DIR": str(self.prompts_dir),
               "MAX_NEW_TOKENS": str(s.max_new_tokens), "CONSTRAINED": "true"}
        if s.doc_chars is not None:
            env["DOC_CHARS"] = str(s.doc_chars)
        return env
