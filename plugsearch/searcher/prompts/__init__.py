"""Prompt templates of the search loops: the packaged set, or a user's folder (`SEARCHER_PROMPTS_DIR`).

Each `<mode>.<part>.txt` is a `string.Template` that may use only its part's `VARIABLES` (checked at load;
`$information` is the block of documents, one `Doc i(Title: t) text` line each). A set's version is its
`VERSION` file plus a digest of every template, so any edit changes the cache keys. A folder need not hold
every file: what it lacks comes from the packaged set (a checkpoint usually overrides only the system prompt).
"""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from string import Template

VARIABLES: dict[str, frozenset[str]] = {
    "s3.system": frozenset({"select_k"}),
    "s3.initial": frozenset({"question", "information"}),
    "s3.information": frozenset({"information"}),
    "s3.last_information": frozenset({"information"}),
    "s3.duplicate": frozenset({"query"}),
    "s3.invalid": frozenset(),
    "qagent.system": frozenset({"max_turns", "max_queries"}),
    "qagent.question": frozenset({"question"}),
    "qagent.information": frozenset({"information"}),
    "qagent.duplicate": frozenset(),
    "qagent.invalid": frozenset(),
}
"""Every template of a set and the variables it may use."""


class PromptError(ValueError):
    """A prompt folder that cannot be used (unknown file, unknown variable, bad template)."""


def _placeholders(name: str, text: str) -> set[str]:
    found: set[str] = set()
    for match in Template.pattern.finditer(text):
        if match.group("invalid") is not None:
            raise PromptError(f"{name}: a `$` that starts no variable (write `$$` for a literal `$`)")
        named = match.group("named") or match.group("braced")
        if named:
            found.add(named)
    return found


class PromptSet:
    """The templates of every mode and part, checked, with their version."""

    def __init__(self, texts: dict[str, str], version_label: str, source: str) -> None:
        missing = sorted(set(VARIABLES) - set(texts))
        if missing:
            raise PromptError(f"prompt set {source} lacks {', '.join(missing)}")
        for name, text in texts.items():
            unknown = _placeholders(name, text) - VARIABLES[name]
            if unknown:
                allowed = ", ".join(f"${v}" for v in sorted(VARIABLES[name])) or "none"
                raise PromptError(f"{source}/{name}.txt uses {', '.join('$' + v for v in sorted(unknown))}; "
                                  f"allowed: {allowed}")
        self.texts = dict(texts)
        self.source = source
        self._templates = {name: Template(text) for name, text in texts.items()}
        digest = hashlib.sha256(b"".join(n.encode() + b"\0" + texts[n].encode() for n in sorted(texts)))
        self.version = f"{version_label}-{digest.hexdigest()[:8]}"

    def render(self, mode: str, part: str, **values: object) -> str:
        """Fill a template; the variables its part documents are all given by the loop."""
        return self._templates[f"{mode}.{part}"].safe_substitute({k: str(v) for k, v in values.items()})

    @classmethod
    def packaged(cls) -> PromptSet:
        return _packaged()

    @classmethod
    def load(cls, folder: Path | str | None) -> PromptSet:
        """The packaged set, with the templates (and `VERSION`) of `folder` in place of its own."""
        base = _packaged()
        if folder is None:
            return base
        root = Path(folder)
        if not root.is_dir():
            raise PromptError(f"prompt folder {root} does not exist")
        texts, label = _read_folder(root)
        return cls({**base.texts, **texts}, label or f"custom:{root.name}", str(root))


def _read_folder(root: Path | Traversable) -> tuple[dict[str, str], str | None]:
    """The templates of a folder (unknown names refused) and its `VERSION` label, if any."""
    texts: dict[str, str] = {}
    label = None
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name == "VERSION":
            label = entry.read_text(encoding="utf-8").strip()
        elif entry.name.endswith(".txt"):
            name = entry.name[:-4]
            if name not in VARIABLES:
                raise PromptError(f"{entry}: unknown template (known: {', '.join(sorted(VARIABLES))})")
            texts[name] = entry.read_text(encoding="utf-8")
    return texts, label


@cache
def _packaged() -> PromptSet:
    texts, label = _read_folder(resources.files(__name__))
    return PromptSet(texts, label or "v0", "plugsearch/searcher/prompts")


PROMPT_VERSION = _packaged().version
"""Version of the packaged set."""
