"""The production packages never import test support (tests/support: fakes, process fixtures)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_production_code_does_not_import_tests() -> None:
    offenders = []
    for package in ("services", "trainer", "plugsearch"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                offenders += [f"{path.relative_to(REPO)}: {name}" for name in names
                              if name == "tests" or name.startswith("tests.")]
    assert not offenders, offenders
    assert not list((REPO / "services" / "testing").glob("*.py"))
