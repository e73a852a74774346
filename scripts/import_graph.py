"""The import graph of the `plugsearch` package, by package: what imports what, the cycles, the largest rooms.

    python scripts/import_graph.py                      # every package of plugsearch/, one line of JSON each part
    python scripts/import_graph.py --under plugsearch.retriever --depth 3

A package is a module's dotted name cut to `--depth` parts (`plugsearch.retriever.backends` at depth 3; a module
directly under the cut, `plugsearch.retriever.api`, is its own package). An arrow A -> B means some module of A
imports some module of B, at the top of the file or inside a function (`lazy`: only inside functions, which
defers the import's cost but not the dependency). Cycles are the strongly connected components of the package
graph with more than one package, counted twice: over every import, and over top-level imports alone; and the same
between modules (a top-level cycle between modules is what can fail at import time). Reads the source with `ast`;
imports nothing.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str, is_package: bool) -> list[tuple[str, bool]]:
    """(imported module, at top level) for every `plugsearch` import of the file."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}  # `if TYPE_CHECKING:` imports are never run
    top = {id(node) for node in tree.body}
    top |= {id(n) for node in tree.body if isinstance(node, ast.If | ast.Try) for n in ast.walk(node)}
    out: list[tuple[str, bool]] = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names if alias.name.startswith("plugsearch")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.startswith("plugsearch"):
                # `from plugsearch.retriever import serving`: the submodule, where it is one
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    known = (REPO / Path(*sub.split("."))).with_suffix(".py").is_file() or \
                        (REPO / Path(*sub.split(".")) / "__init__.py").is_file()
                    out.append((sub if known else module, id(node) in top))
    return out


def package_of(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth])


def components(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan), those of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    sys.setrecursionlimit(10_000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--under", default="plugsearch", help="only modules under this dotted name")
    parser.add_argument("--depth", type=int, default=3, help="dotted parts that name a package")
    args = parser.parse_args()
    files = {module_name(p): p for p in (REPO / "plugsearch").rglob("*.py")}
    inside = {m: p for m, p in files.items() if m == args.under or m.startswith(args.under + ".")}
    lines: dict[str, int] = defaultdict(int)
    modules: dict[str, int] = defaultdict(int)
    edges: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])  # (top-level imports, lazy ones)
    module_edges: dict[str, set[str]] = defaultdict(set)  # top-level imports between modules
    module_all: dict[str, set[str]] = defaultdict(set)  # every import between modules
    for name, path in inside.items():
        pkg = package_of(name, args.depth)
        lines[pkg] += len(path.read_text().splitlines())
        modules[pkg] += 1
        for target, at_top in imports_of(path, name, path.name == "__init__.py"):
            if not (target == args.under or target.startswith(args.under + ".")):
                continue
            other = package_of(target, args.depth)
            if target != name and target in inside:
                module_all[name].add(target)
                if at_top:
                    module_edges[name].add(target)
            if other != pkg:
                edges[(pkg, other)][0 if at_top else 1] += 1
    all_edges: dict[str, set[str]] = defaultdict(set)
    top_edges: dict[str, set[str]] = defaultdict(set)
    for (a, b), (top, _) in edges.items():
        all_edges[a].add(b)
        if top:
            top_edges[a].add(b)
    packages = set(lines)
    largest = max(packages, key=lambda p: lines[p])
    module_cycles = components(set(module_edges), module_edges)
    module_cycles_all = components(set(module_all), module_all)
    out = [{"packages": {p: {"modules": modules[p], "lines": lines[p]} for p in sorted(packages)}},
           {"arrows": [f"{a} -> {b}" + ("" if top else " (lazy)") for (a, b), (top, _) in sorted(edges.items())]},
           {"packages_n": len(packages), "arrows_n": len(edges), "package_cycles": components(packages, all_edges),
            "package_cycles_top_level": components(packages, top_edges), "modules_n": len(inside),
            "module_arrows_n": sum(len(v) for v in module_all.values()), "module_cycles": module_cycles_all,
            "module_cycles_top_level": module_cycles,
            "largest": {"package": largest, "lines": lines[largest], "modules": modules[largest]}}]
    sys.stdout.write("".join(json.dumps(part) + "\n" for part in out))


if __name__ == "__main__":
    main()
