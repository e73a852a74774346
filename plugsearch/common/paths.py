"""Where the project's data lives, decided in one place.

`default_data_dir()`: `$PLUGSEARCH_DATA` when set, else `../shared/data` beside the repository (the folder that
holds the `plugsearch` package), whatever the current directory. The stack, the trainer, the benches and the
tests all call it; the data is never copied into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
"""The source checkout: the folder that holds `plugsearch/` and `pyproject.toml`."""


def default_data_dir() -> Path:
    """`$PLUGSEARCH_DATA`, else `<repository>/../shared/data`."""
    env = os.environ.get("PLUGSEARCH_DATA")
    if env:
        return Path(env)
    return REPOSITORY.parent / "shared" / "data"
