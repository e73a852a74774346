"""The shape of what is installed: one top-level package (`plugsearch`), production code that never imports test
support (tests/support: fakes, process fixtures), and a client that does not pull in the server."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_production_code_does_not_import_tests() -> None:
    offenders = []
    for path in (REPO / "plugsearch").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}: {name}" for name in names
                          if name == "tests" or name.startswith("tests.")]
    assert not offenders, offenders


def test_one_top_level_package_is_installed() -> None:
    """No `services` or `trainer` beside a user's own packages: the wheel's only import name is `plugsearch`."""
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"][
        "include"] == ["plugsearch*"]
    tops = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()} - {"tests"}
    assert tops == {"plugsearch"}, tops


CLIENT_PROBE = """
import asyncio, importlib.abc, sys
SERVER = {"fastapi", "starlette", "uvicorn", "redis", "prometheus_client", "aiohttp", "pydantic_settings",
          "numpy", "regex", "tqdm", "torch", "faiss", "bm25s"}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in SERVER:
            raise ImportError(f"the client imported {name}")

sys.meta_path.insert(0, Refuse())
import httpx
import plugsearch

def answer(request):
    assert request.url.path == "/search"
    return httpx.Response(200, json={"question": "q", "mode": "naive", "documents": [], "context": "",
                                     "queries": ["q"], "turns": 1, "stop_reason": "naive", "timings": {},
                                     "valid_actions": 0, "invalid_actions": 0, "prompt_version": "v"})

async def main():
    async with plugsearch.AsyncSearchClient("http://searcher", transport=httpx.MockTransport(answer)) as client:
        result = await client.search("q", mode="naive")
    print(type(result).__name__, result.stop_reason)
    try:
        plugsearch.SearchClient("http://searcher").search("")
    except plugsearch.BadRequest as exc:
        print("refused:", exc.message[:40])

asyncio.run(main())
"""


def test_the_client_runs_without_the_server_packages() -> None:
    """What `pip install plugsearch` gives (httpx, pydantic, orjson, the tracing API) is enough for the client: a
    search through it, and a bad request refused before the network, with every server package refused."""
    done = subprocess.run([sys.executable, "-c", CLIENT_PROBE], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[0] == "SearchResponse naive", done.stdout
    assert done.stdout.splitlines()[1].startswith("refused:"), done.stdout


@pytest.mark.parametrize(("under", "depth", "rooms"), [("plugsearch", 2, 10), ("plugsearch.retriever", 3, 10),
                                                      ("plugsearch.trainer", 3, 5)])
def test_the_rooms_import_one_way(under: str, depth: int, rooms: int) -> None:
    """No cycle between rooms, lazy imports counted (scripts/import_graph.py): between the top-level rooms (the
    searcher never reaches into the trainer, common into no service) and between the retriever's rooms (backends,
    encoders, store, indexing, live, ingest: ingest never reaches into live) and the trainer's."""
    import json

    done = subprocess.run([sys.executable, "scripts/import_graph.py", "--under", under, "--depth", str(depth)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures["packages_n"] >= rooms, figures  # the graph saw the rooms (the top level: 10, as it always asked)
    assert figures["package_cycles"] == [], figures["package_cycles"]
    assert figures["module_cycles"] == [], figures["module_cycles"]
