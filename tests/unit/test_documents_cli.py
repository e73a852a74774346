"""The commands that change a running retriever's documents, as a user meets them: the stack's token found where the
stack wrote it, an upload that waits out a retriever restart and ends with its summary, statuses reported as the
retriever answered them, and one file of an ingested folder uploaded replacing its document."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from plugsearch.retriever.api import create_app
from plugsearch.retriever.cli import main as index_main
from plugsearch.retriever.ingest.remote import token_file, token_of
from plugsearch.stack.cli import _write_token
from plugsearch.stack.cli import main as stack_main
from tests.support.retriever import tiny_bm25s, tiny_settings
from tests.unit.test_ingest import NOTES, SETUP_MD

TOKEN = "internal-token-12345"


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("cli"))


def test_the_stack_writes_its_token_for_its_user_and_the_commands_find_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    var = tmp_path / "var"
    assert stack_main(["--show-token", "--var-dir", str(var)]) == 1
    assert "no stack is running from" in capsys.readouterr().err
    path = _write_token(var, "the-run-token-123")
    assert path == var / "stack" / "internal-token" == token_file(var)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the user's alone
    assert stack_main(["--show-token", "--var-dir", str(var)]) == 0
    assert capsys.readouterr().out == "the-run-token-123\n"
    for name in ("PLUGSEARCH_INTERNAL_TOKEN", "RETRIEVER_ADMIN_KEY", "PLUGSEARCH_VAR_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # a command run from the folder the stack was started in: var/ beside it
    assert token_of(None) == "the-run-token-123"
    assert token_of("given-token-1234") == "given-token-1234"
    monkeypatch.setenv("PLUGSEARCH_INTERNAL_TOKEN", "env-token-12345")
    assert token_of(None) == "env-token-12345"
    monkeypatch.delenv("PLUGSEARCH_INTERNAL_TOKEN")
    path.unlink()
    with pytest.raises(SystemExit, match="plugsearch-stack --show-token"):
        token_of(None)


@contextmanager
def served_on(app: object, port: int) -> Iterator[str]:
    import uvicorn

    from plugsearch.common.process import uvicorn_options

    options = uvicorn_options(app.state.settings)  # type: ignore[attr-defined]
    options.update(host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(uvicorn.Config(app, **options))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def test_an_upload_waits_out_a_retriever_restart_and_ends_with_its_summary(
        tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from plugsearch.common.workers import free_port

    docs = tmp_path / "docs"
    docs.mkdir()
    for n in range(6):
        (docs / f"note{n}.txt").write_text(f"Note {n} of the harbeck survey. " + NOTES)
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             api_keys="search-key-123456")
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def restart_later() -> None:  # the retriever is down when the upload starts, back ~3 s later
        time.sleep(3)
        with served_on(create_app(settings), port):
            done.wait(120)

    done = threading.Event()
    back = threading.Thread(target=restart_later, daemon=True)
    back.start()
    try:
        with pytest.raises(SystemExit) as exit_info:
            index_main(["upload", str(docs), "--root", str(tmp_path), "--url", url, "--token", TOKEN,
                        "--batch", "2", "--quiet", "--wait-s", "60"])
        captured = capsys.readouterr()
        assert exit_info.value.code == 0, captured.err
        assert "did not answer" in captured.err and "trying again for up to 60 s" in captured.err
        summary = json.loads(captured.out.strip().splitlines()[-1])
        assert {k: summary[k] for k in ("files", "documents", "errors")} == {"files": 6, "documents": 6, "errors": 0}
        # a search key may not change documents: said as the retriever answered it, with the summary
        with pytest.raises(SystemExit) as exit_info:
            index_main(["upload", str(docs / "note0.txt"), "--root", str(tmp_path), "--url", url, "--token",
                        "search-key-123456", "--quiet"])
        captured = capsys.readouterr()
        assert exit_info.value.code == 1 and f"the retriever at {url} answered 403" in captured.err
        summary = json.loads(captured.out.strip().splitlines()[-1])
        assert summary["status"] == 403 and summary["files"] == 0
        assert summary["skipped"][0]["reason"].startswith(f"not sent: the retriever at {url} answered 403")
    finally:
        done.set()
        back.join(60)
    # nothing listens any more: the command gives up after --wait-s, with its summary
    with pytest.raises(SystemExit) as exit_info:
        index_main(["delete", "docs/note0.txt", "--url", url, "--token", TOKEN, "--wait-s", "1"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 1 and f"the retriever at {url} did not answer" in captured.err
    assert json.loads(captured.out)["failed"].startswith(f"the retriever at {url} did not answer")


def test_one_file_of_an_ingested_folder_uploaded_replaces_its_document(
        tiny: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The issue: `upload` of one file gave it another id than `ingest` had (ids followed the path typed). With one
    root (the current folder here, as a user types the commands), the file keeps its id and its document is
    replaced."""
    from tests.asgi import served_in_thread

    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "docs" / "guide" / "setup.md").write_text(SETUP_MD)
    (tmp_path / "docs" / "notes.txt").write_text(NOTES)
    with pytest.raises(SystemExit) as exit_info:
        index_main(["ingest", "docs", "--out", "mine.jsonl", "--quiet"])
    assert exit_info.value.code == 0
    rows = [json.loads(line) for line in Path("mine.jsonl").read_text().splitlines()]
    assert {r["doc_id"] for r in rows} == {"docs/guide/setup.md", "docs/notes.txt"}
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN)
    with served_in_thread(create_app(settings)) as url:
        for _ in range(600):
            if httpx.get(f"{url}/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        with pytest.raises(SystemExit):
            index_main(["put", "mine.jsonl", "--url", url, "--token", TOKEN, "--quiet"])
        (tmp_path / "docs" / "guide" / "setup.md").write_text("# Setup\n\nThe vorlash installer was replaced.\n")
        os.chdir(tmp_path / "docs" / "guide")  # typed from elsewhere, the root named: the same id
        with pytest.raises(SystemExit) as exit_info:
            index_main(["upload", "setup.md", "--root", str(tmp_path), "--url", url, "--token", TOKEN, "--quiet"])
        assert exit_info.value.code == 0
        capsys.readouterr()
        listed = httpx.get(f"{url}/documents", params={"prefix": "docs/"},
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()["documents"]
        assert [(d["id"], d["passages"]) for d in listed] == [("docs/guide/setup.md", 1), ("docs/notes.txt", 1)]
        found = httpx.post(f"{url}/retrieve", json={"queries": ["vorlash installer"], "k": 1},
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()["results"][0]
        assert found[0]["id"] == "docs/guide/setup.md#0"


def test_put_reads_a_corpus_by_the_retrievers_row_rule(tmp_path: Path) -> None:
    """`plugsearch-index put`'s documents: adjacent rows of one document together, blank lines skipped, a row
    without a document part its own document; a bad row or an unreadable file is an error naming it."""
    from plugsearch.retriever.ingest.upload import documents_of

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": "a#0", "title": "A", "text": "one"}\n\n{"id": "a#1", "title": "A", "text": "two"}\n'
                      '{"id": "b", "contents": "\\"B\\"\\nthree"}\n')
    assert list(documents_of(corpus)) == [
        {"id": "a", "passages": [{"title": "A", "text": "one"}, {"title": "A", "text": "two"}]},
        {"id": "b", "passages": [{"title": "B", "text": "three"}]}]
    corpus.write_text('{"id": "a#0", "title": "A", "text": "one"}\n{"title": "no id"}\n')
    with pytest.raises(SystemExit, match=r"corpus\.jsonl:2: missing 'id'"):
        list(documents_of(corpus))
    folder = tmp_path / "folder.jsonl"
    folder.mkdir()
    with pytest.raises(SystemExit, match="cannot read corpus"):
        list(documents_of(folder))
