"""Versioned prompt files: `<prefix>_<version>.<part>.txt` inside a package.

The effective version is `<version>-<digest of the files>`, so editing a file changes every cache key
that includes it.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from string import Template
from typing import Any


def load_prompt_files(package: str, prefix: str, version: str, parts: tuple[str, ...]) -> dict[str, Any]:
    """`{"version": the effective version, part: its string.Template}`; ValueError when a part is missing."""
    root = resources.files(package)
    texts: dict[str, str] = {}
    for part in parts:
        entry = root / f"{prefix}_{version}.{part}.txt"
        if not entry.is_file():
            raise ValueError(f"{prefix} prompt version {version!r} has no {part} file")
        texts[part] = entry.read_text(encoding="utf-8").rstrip("\n")
    digest = hashlib.sha256("\0".join(texts[p] for p in parts).encode()).hexdigest()[:8]
    return {"version": f"{version}-{digest}", **{part: Template(text) for part, text in texts.items()}}
