"""The documentation's commands: every shell and Python block of README.md and docs/*.md that a reader is told to
run is run here, checked by a named test, or marked with why not (the convention: docs/architecture.md,
"Documentation").

- Every fenced block names its language; each `bash` / `sh` / `shell` / `console` / `python` / `py` block carries
  one marker (an HTML comment on the line before its opening fence, or on the line after its closing fence):
  `<!-- run -->`, `<!-- checked-by: tests/FILE.py::test_name[, ...] -->` or `<!-- not-run: reason -->`.
- `run` blocks run in a temporary folder per page (a page's blocks in order), the project's virtualenv first on
  PATH, against a real searcher (the packaged compact policy) and retriever (bm25s over ~300 real passages, live
  changes on) served in-process at the URLs the docs name; `curl` fails on an HTTP error status.
- `checked-by` blocks: each named test exists, and the sources of its module (and of the test-support modules it
  imports) hold every command's program and subcommand, or every Python block's imports.
- Every block: `plugsearch-*` subcommands and options are ones the program's `--help` lists, `bench/*.py` options
  ones the script's `--help` lists, repository paths named in commands exist; every page: each setting name
  (`RETRIEVER_*`, `SEARCHER_*`, ..., `PLUGSEARCH_*`) is read by the code.

The counts (run / checked-by / not-run) are printed at the end of the run (tests/docs/conftest.py).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SHELL = frozenset({"bash", "sh", "shell", "console"})
PYTHON = frozenset({"python", "py"})
MARKER = re.compile(r"^<!--\s*(run|checked-by|not-run)\s*(?::\s*(.*?))?\s*-->$")
FENCE = re.compile(r"^(\s*)```(.*)$")
SEARCHER_URL, RETRIEVER_URL = "http://127.0.0.1:8000", "http://127.0.0.1:8001"
TOKEN = "docs-internal-token-0123456789"
REPO_PATH_PREFIXES = ("bench/", "scripts/", "tests/", "k8s/", "deploy/", "docker/", "plugsearch/", "requirements/")
SETTING_NAME = re.compile(
    r"\b((?:RETRIEVER|SEARCHER|GENERATOR|JUDGE|TRAINER|PLUGSEARCH|COLLECTOR)_[A-Z0-9_]*[A-Z0-9])(?![A-Z0-9_*{])")
RUN_TIMEOUT_S = 180.0


# ------------------------------------------------------------------------------------------- reading the pages
@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence"""
    lang: str
    text: str
    marker: str | None
    arg: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO).as_posix()}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.lang in SHELL or self.lang in PYTHON


@dataclass(frozen=True)
class Page:
    blocks: tuple[Block, ...]
    problems: tuple[str, ...]
    """markers attached to no block, unlabelled fences, unclosed fences"""


def marker_of(line: str) -> tuple[str, str] | None:
    found = MARKER.match(line.strip())
    return (found.group(1), (found.group(2) or "").strip()) if found else None


@cache
def read_page(page: Path) -> Page:
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    used: set[int] = set()  # line numbers (0-based) of markers attached to a block
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.group(1), opening.group(2).strip()
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        where = f"{page.relative_to(REPO).as_posix()}:{i + 1}"
        if end == len(lines):
            problems.append(f"{where}: a fence that is never closed")
            break
        if not lang:
            problems.append(f"{where}: a fenced block without a language (`text` for output)")
        marker, arg = None, ""
        after_is_next_fence = end + 2 < len(lines) and FENCE.match(lines[end + 2]) is not None
        for at in (i - 1, end + 1):  # the line before the opening fence, else the one after the closing fence
            found = marker_of(lines[at]) if 0 <= at < len(lines) else None
            if found and not (at == end + 1 and after_is_next_fence):
                marker, arg = found
                used.add(at)
                break
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:end])
        blocks.append(Block(page, i + 1, lang, body, marker, arg))
        i = end + 1
    for n, line in enumerate(lines):
        if marker_of(line) and n not in used:
            problems.append(f"{page.relative_to(REPO).as_posix()}:{n + 1}: a marker attached to no block")
    return Page(tuple(blocks), tuple(problems))


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in read_page(page).blocks]


def command_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.is_command]


def counts() -> dict[str, int]:
    """Marked command blocks by marker, and the command lines (shell) or blocks (Python) in each kind."""
    out = {"run": 0, "checked-by": 0, "not-run": 0, "unmarked": 0}
    lines = {"run": 0, "checked-by": 0, "not-run": 0, "unmarked": 0}
    for block in command_blocks():
        kind = block.marker or "unmarked"
        out[kind] += 1
        lines[kind] += len([c for c in commands(block.text) if program(c)]) if block.lang in SHELL else 1
    return {**out, **{f"{k} commands": v for k, v in lines.items()}}


# ---------------------------------------------------------------------------------------- reading the commands
def commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split on ; && || | &."""
    out: list[list[str]] = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        if line.strip().startswith("#"):
            continue
        line = re.sub(r"\$\([^()]*\)", "SUBSTITUTED", line)  # a command substitution is a value here
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            lexer.commenters = "#"
            words = list(lexer)
        except ValueError:  # an unbalanced quote in an example body: the plain words still name the command
            words = line.split("#", 1)[0].split()
        current: list[str] = []
        for word in words:
            if word and set(word) <= set(";&|"):
                out.append(current)
                current = []
            else:
                current.append(word)
        out.append(current)
    return [c for c in out if c]


def program(words: list[str]) -> tuple[str, list[str]] | None:
    """(program, its arguments) of one simple command: variable assignments and `export` skipped, `python -m MOD`
    is MOD, `python FILE.py` and `bash FILE.sh` are the file, `.venv/bin/X` is X; None for assignments alone."""
    rest = list(words)
    while rest and (rest[0] in ("export", "env") or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", rest[0])):
        rest.pop(0)
    if not rest:
        return None
    name, args = rest[0].removeprefix(".venv/bin/"), rest[1:]
    if name in ("python", "python3") or name.endswith("/python"):
        if args[:1] == ["-m"] and len(args) > 1:
            return args[1], args[2:]
        if args and args[0].endswith(".py"):
            return args[0], args[1:]
        return "python", args
    if name in ("bash", "sh") and args and args[0].endswith(".sh"):
        return args[0], args[1:]
    return name, args


def options(args: list[str]) -> list[str]:
    """The long options given (`--x=1` is `--x`; `[--x` is `--x`), up to a bare `--` (what follows is passed on)."""
    found = []
    for arg in args:
        if arg == "--":
            break
        arg = arg.strip("[]")
        if re.match(r"^--[a-z][a-z0-9-]*", arg):
            found.append(arg.split("=", 1)[0])
    return found


def repo_paths(words: list[str]) -> list[str]:
    """Repository paths a command names (a pytest node id is its file)."""
    found = []
    for word in words:
        for part in re.split(r"[=:,]", word.strip("'\"[]()")):
            if part.startswith(REPO_PATH_PREFIXES) and not any(c in part for c in "*$<>{"):
                found.append(part.split("::")[0].rstrip("."))
    return found


@cache
def console_scripts() -> dict[str, str]:
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def aliases(name: str) -> set[str]:
    """How a test may name a program: itself, and for a console script its module and package."""
    names = {name}
    target = console_scripts().get(name)
    if target:
        module = target.split(":")[0]
        names |= {module, module.removesuffix(".__main__").removesuffix(".cli")}
    if name.endswith((".py", ".sh")):
        names.add(Path(name).name)
    return names


# --------------------------------------------------------------------------------------------- --help, in-process
@cache
def cli_help(name: str, path: tuple[str, ...]) -> str:
    """A plugsearch-* program's `--help` for the subcommand path, run in-process (argparse prints and exits)."""
    module_name, function = console_scripts()[name].split(":")
    main = getattr(importlib.import_module(module_name), function)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main([*path, "--help"])
    return out.getvalue()


def choices(help_text: str) -> set[str]:
    """The subcommands a `--help` lists (`{build,check,...}` not after an option, whose values look the same)."""
    found: set[str] = set()
    for group in re.finditer(r"\{([a-z0-9_,-]+)\}", help_text):
        before = help_text[:group.start()].split()
        if not (before and before[-1].lstrip("[").startswith("-")):
            found |= set(group.group(1).split(","))
    return found


def argparse_programs() -> set[str]:
    """The console scripts whose main takes argv (the services' entrypoints read settings from the environment)."""
    return {n for n, target in console_scripts().items() if not target.split(":")[0].endswith("__main__")}


def check_cli(name: str, args: list[str]) -> list[str]:
    if name not in argparse_programs():
        return [f"{name} takes its settings from the environment, not {o}" for o in options(args)]
    path: list[str] = []
    words = [a for a in args if not a.startswith("-")]
    while words and words[0] in choices(cli_help(name, tuple(path))):
        path.append(words.pop(0))
    if choices(cli_help(name, tuple(path))) and not path:
        given = words[0] if words else "(none)"
        return [f"{name}: {given} is not one of its subcommands {sorted(choices(cli_help(name, ())))}"]
    text = cli_help(name, tuple(path))
    return [f"{name} {' '.join(path)}: no option {o}" for o in options(args)
            if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text)]


# ------------------------------------------------------------------------------------------------ settings names
def env_names(cls: type[BaseModel], prefix: str) -> set[str]:
    names: set[str] = set()
    for name, info in cls.model_fields.items():
        key = f"{prefix}{name.upper()}"
        names.add(key)
        for kind in (info.annotation, *typing.get_args(info.annotation)):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                names |= env_names(kind, f"{key}__")
    return names


@cache
def known_setting_names() -> frozenset[str]:
    """Every setting a settings class reads, and every such name the code, scripts and deployment files use."""
    from plugsearch.trainer.common.settings import TrainerSettings

    names: set[str] = set()
    classes = [importlib.import_module(f"plugsearch.{s}.settings").__dict__[f"{s.capitalize()}Settings"]
               for s in ("retriever", "searcher", "generator", "judge")]
    for cls in (*classes, TrainerSettings):
        names |= env_names(cls, str(cls.model_config.get("env_prefix", "")))
    sources = [*REPO.glob("plugsearch/**/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("tests/**/*.py"),
               *REPO.glob("scripts/*"), *REPO.glob("deploy/**/*"), *REPO.glob("docker/*"), *REPO.glob("k8s/**/*"),
               REPO / "docker-compose.yml", REPO / ".ci" / "run"]
    text = "\n".join(p.read_text(errors="replace") for p in sources if p.is_file())
    names |= set(SETTING_NAME.findall(text))
    return frozenset(names)


# -------------------------------------------------------------------------------------------- checked-by sources
def sources_of_test(module: Path, seen: set[Path] | None = None) -> set[Path]:
    """A test module and the tests.* modules it imports, transitively."""
    seen = set() if seen is None else seen
    if module in seen or not module.is_file():
        return seen
    seen.add(module)
    for node in ast.walk(ast.parse(module.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            if name == "tests" or name.startswith("tests."):
                path = REPO / Path(*name.split("."))
                sources_of_test(path.with_suffix(".py") if path.with_suffix(".py").is_file()
                                  else path / "__init__.py", seen)
    return seen


def named_tests(arg: str) -> list[tuple[Path, str]]:
    out = []
    for item in (x.strip() for x in arg.split(",") if x.strip()):
        file, _, name = item.partition("::")
        out.append((REPO / file, name))
    return out


def has_test_function(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    owner, _, function = name.rpartition("::")
    body = tree.body
    if owner:
        classes = [n for n in body if isinstance(n, ast.ClassDef) and n.name == owner]
        body = classes[0].body if classes else []
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == (function or name)
               for n in body)


def what_a_test_must_show(block: Block) -> list[set[str]]:
    """For each command of the block, the names one of which the named tests' sources must hold: its program
    (or an alias), its subcommand, a curl's URL path; for Python, each imported module or name."""
    needed: list[set[str]] = []
    if block.lang in PYTHON:
        for line in block.text.splitlines():
            line = line.split("#", 1)[0]
            if found := re.match(r"^\s*from\s+(\S+)\s+import\s+(.+)$", line):
                needed.append({found.group(1)} | {n.strip() for n in found.group(2).split(",")})
            elif found := re.match(r"^\s*import\s+(\S+)", line):
                needed.append({found.group(1)})
        return needed
    for words in commands(block.text):
        found = program(words)
        if found is None:
            continue
        name, args = found
        if name == "curl":
            paths = [m.group(1) for a in args for m in [re.match(r"^https?://[^/\s]+(/[^\s?'\"]*)", a)] if m]
            needed += [{p} for p in paths]
            continue
        needed.append(aliases(name))
        if args and re.match(r"^[a-z][a-z0-9-]*$", args[0]) and name in argparse_programs():
            needed.append({args[0]})
    return needed


# ---------------------------------------------------------------------------------------------------- the checks
def test_every_command_block_is_marked_and_every_marker_belongs_to_a_block() -> None:
    problems = [p for page in PAGES for p in read_page(page).problems]
    for block in all_blocks():
        if block.is_command and block.marker is None:
            problems.append(f"{block.id}: a {block.lang} block without a marker (run / checked-by / not-run)")
        if not block.is_command and block.marker is not None:
            problems.append(f"{block.id}: a marker on a {block.lang} block, which is not a command")
        if block.marker == "not-run" and len(block.arg) < 10:
            problems.append(f"{block.id}: not-run says no reason")
        if block.marker == "run" and block.arg:
            problems.append(f"{block.id}: `run` takes no argument")
    assert not problems, "\n".join(problems)
    tally = counts()
    assert tally["run"] and tally["checked-by"] and tally["not-run"], tally


def test_the_readme_opens_with_the_two_set_up_commands() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert lines[:6] == [
        "# plugsearch", "", "```bash",
        "bash scripts/run-stack.sh     # install what a search needs into .venv, start the local stack, serve POST "
        "/search on :8000",
        "bash scripts/test.sh          # install the whole lock into .venv, run ruff, mypy and every test (unit, "
        "api, e2e)",
        "```"]
    assert len(lines) <= 160, f"README.md is the front door: {len(lines)} lines"


def readme_first_search() -> Block:
    (block,) = [b for b in read_page(REPO / "README.md").blocks if b.lang in SHELL and "curl" in b.text]
    return block


def test_the_readmes_first_search_is_the_curl_the_stack_prints() -> None:
    from plugsearch.stack.cli import curl_example
    from plugsearch.stack.specs import DEFAULT_PORTS, StackOptions

    printed = curl_example(StackOptions(ports=dict(DEFAULT_PORTS), corpus=Path("c.jsonl"), index_dir=Path("i")))
    assert " ".join(readme_first_search().text.replace("\\\n", " ").split()) == " ".join(printed.split())


def test_checked_by_names_a_test_that_runs_the_same_command() -> None:
    problems = []
    for block in command_blocks():
        if block.marker != "checked-by":
            continue
        tests = named_tests(block.arg)
        if not tests:
            problems.append(f"{block.id}: checked-by names no test")
        sources = ""
        for path, name in tests:
            if not path.is_file() or not name or not has_test_function(path, name):
                problems.append(f"{block.id}: no test {path.relative_to(REPO) if path.is_relative_to(REPO) else path}"
                                f"::{name}")
                continue
            sources += "\n".join(p.read_text() for p in sources_of_test(path))
        for names in what_a_test_must_show(block):
            if sources and not any(n in sources for n in names):
                problems.append(f"{block.id}: {sorted(names)} is in none of the named tests' sources")
    assert not problems, "\n".join(problems)


def test_programs_subcommands_options_and_paths_exist() -> None:
    problems = []
    for block in command_blocks():
        if block.lang not in SHELL:
            continue
        for words in commands(block.text):
            found = program(words)
            if found is None:
                continue
            name, args = found
            if name != "kubectl":  # kubectl names resources (deploy/searcher), not files
                problems += [f"{block.id}: no such path {p}" for p in repo_paths(words) if not (REPO / p).exists()]
            if name.startswith("plugsearch-"):
                if name not in console_scripts():
                    problems.append(f"{block.id}: no console script {name}")
                    continue
                problems += [f"{block.id}: {p}" for p in check_cli(name, args)]
    assert not problems, "\n".join(problems)


def test_commands_named_in_the_text_exist_with_their_options() -> None:
    """`plugsearch-index ingest --max-mb` in a sentence is held to the same rule as in a block."""
    problems = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`(plugsearch-[a-z]+(?: [^`]*)?)`", text):
            for words in commands(" ".join(span.split())):
                found = program(words)
                if found and found[0] in console_scripts():
                    problems += [f"{page.name}: `{span}`: {p}" for p in check_cli(*found)]
    assert not problems, "\n".join(problems)


def test_every_benchmark_script_has_its_section() -> None:
    """docs/benchmarks.md holds every script under bench/ that runs (a parser of its own): what it measures, its
    command, its figures."""
    headings = set(re.findall(r"^### (bench/\S+\.py)$", (REPO / "docs" / "benchmarks.md").read_text(), re.M))
    scripts = {p.relative_to(REPO).as_posix() for p in (REPO / "bench").glob("*.py")
               if "ArgumentParser" in p.read_text()}
    assert scripts <= headings, sorted(scripts - headings)


def test_every_setting_a_page_names_is_read_by_the_code() -> None:
    known = known_setting_names()
    problems = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            problems += [f"{page.relative_to(REPO).as_posix()}:{n}: {name} is read nowhere"
                         for name in SETTING_NAME.findall(line) if name not in known]
    assert not problems, "\n".join(problems)


HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
helps = {}
for script in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [script, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(script, run_name="__main__")
        helps[script] = ""
    except SystemExit as stop:
        helps[script] = out.getvalue() if stop.code in (0, None) else ""
print(json.dumps(helps))
"""
"""Each script's `--help`, one after another in one process (argparse prints and exits before any work)."""


@pytest.mark.e2e
def test_bench_options_are_ones_the_script_takes() -> None:
    """`python bench/X.py --help` of every benchmark the pages name (in one child process), against the options
    the pages give it."""
    wanted: dict[str, list[tuple[str, str]]] = {}
    for block in command_blocks():
        if block.lang not in SHELL:
            continue
        for words in commands(block.text):
            found = program(words)
            if found and found[0].startswith("bench/") and found[0].endswith(".py"):
                wanted.setdefault(found[0], []).extend((block.id, o) for o in options(found[1]))
    assert wanted

    scripts = sorted(s for s in wanted if "ArgumentParser" in (REPO / s).read_text())
    done = subprocess.run([sys.executable, "-c", HELP_OF_EACH, *scripts], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    helps = {s: "" for s in wanted} | json.loads(done.stdout.splitlines()[-1])
    problems = [f"{script}: no --help (an argparse parser) to check its options against" for script, text
                in helps.items() if not text]
    problems += [f"{where}: {script} has no option {option}" for script, given in wanted.items() if helps[script]
                 for where, option in given if not re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])",
                                                             helps[script])]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------------------------- running them
@dataclass
class Sandbox:
    env: dict[str, str]
    searcher: str
    retriever: str
    corpus: Path
    root: Path
    folders: dict[Path, Path]

    def folder(self, page: Path) -> Path:
        """One folder per page, its files made once: a page's blocks run in order and may build on each other."""
        if page not in self.folders:
            from tests.unit.test_ingest import NOTES, PAGE_HTML, PDF_PAGE_1, PDF_PAGE_2, SETUP_MD, write_pdf

            folder = self.root / page.stem
            (folder / "notes").mkdir(parents=True)
            (folder / "notes" / "setup.md").write_text(SETUP_MD)
            (folder / "notes" / "notes.txt").write_text(NOTES)
            (folder / "notes" / "page.html").write_text(PAGE_HTML)
            (folder / "reports").mkdir()
            write_pdf(folder / "reports" / "q3.pdf", [PDF_PAGE_1, PDF_PAGE_2], title="Quarterly report")
            shutil.copy(self.corpus, folder / "my-corpus.jsonl")
            self.folders[page] = folder
        return self.folders[page]


@pytest.fixture(scope="module")
def sandbox(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    """The searcher (packaged compact policy, corpus check off) and the retriever (bm25s over the tiny corpus,
    changes into a scratch log, the internal token) served in-process; a `curl` that fails on an HTTP error."""
    from plugsearch.retriever.api import create_app as retriever_app
    from plugsearch.searcher.api import create_app as searcher_app
    from plugsearch.searcher.settings import SearcherSettings
    from tests.asgi import served_in_thread
    from tests.support.retriever import tiny_bm25s, tiny_settings

    root = tmp_path_factory.mktemp("docs")
    corpus, index_dir = tiny_bm25s(data_dir, var_dir, root / "corpus")
    retriever = retriever_app(tiny_settings(corpus, index_dir, dense=False, changes_dir=root / "changes",
                                            internal_token=TOKEN))
    real_curl = shutil.which("curl")
    shims = root / "bin"
    shims.mkdir()
    if real_curl:
        (shims / "curl").write_text(f'#!/bin/sh\nexec {shlex.quote(real_curl)} --fail-with-body "$@"\n')
        (shims / "curl").chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SEARCHER_", "RETRIEVER_", "PLUGSEARCH_"))},
           "PATH": os.pathsep.join([str(shims), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
           "PYTHONPATH": str(REPO), "PLUGSEARCH_INTERNAL_TOKEN": TOKEN, "PLUGSEARCH_DATA": str(data_dir),
           "PYTHONUNBUFFERED": "1"}
    with served_in_thread(retriever) as retriever_url:
        searcher = searcher_app(SearcherSettings(retriever={"url": retriever_url, "token": TOKEN},
                                                 corpus_check="off"))
        with served_in_thread(searcher) as searcher_url:
            yield Sandbox(env, searcher_url, retriever_url, corpus, root, {})


RUN_BLOCKS = [b for b in command_blocks() if b.marker == "run"]


@pytest.mark.e2e
@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_run_block(block: Block, sandbox: Sandbox) -> None:
    if "curl" in block.text and not shutil.which("curl"):
        pytest.skip("curl is not installed")
    folder = sandbox.folder(block.page)
    text = block.text.replace(SEARCHER_URL, sandbox.searcher).replace(RETRIEVER_URL, sandbox.retriever)
    if block.lang in SHELL:
        argv = ["bash", "-euo", "pipefail", "-c", text]
    else:
        script = folder / f"block_{block.line}.py"
        script.write_text(text)
        argv = [sys.executable, script.name]
    done = subprocess.run(argv, cwd=folder, env=sandbox.env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (f"{block.id} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n"
                                  f"--- stderr\n{done.stderr[-3000:]}")
