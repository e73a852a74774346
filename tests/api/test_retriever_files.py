"""`POST /documents/files` and `plugsearch-index upload`: files (txt, Markdown, HTML, PDF with and without a text
layer, JSONL passages, bad ones of every kind) put into a running retriever through its API, read and cut as
`plugsearch-index ingest` reads and cuts them; searched right after, each refused file with its reason."""

from __future__ import annotations

import base64
import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from plugsearch.retriever.api import create_app
from plugsearch.retriever.ingest.formats import NO_TEXT_LAYER
from tests.asgi import app_client
from tests.support.retriever import tiny_bm25s, tiny_settings
from tests.unit.test_ingest import NOTES, PAGE_HTML, PDF_PAGE_2, SETUP_MD, write_pdf, write_scanned_pdf
from tests.unit.test_live_changes import wait_ready

SEARCH_KEY, ADMIN_KEY, TOKEN = "search-key-123456", "admin-key-1234567", "internal-token-123"
SEARCH = {"Authorization": f"Bearer {SEARCH_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def tiny(data_dir: Path, var_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return tiny_bm25s(data_dir, var_dir, tmp_path_factory.mktemp("files"))


def b64(data: bytes | str) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def pdf_bytes(tmp_path: Path, name: str, pages: list[str] | None, title: str | None = None) -> bytes:
    path = tmp_path / name
    if pages is None:
        write_scanned_pdf(path)
    else:
        write_pdf(path, pages, title=title)
    return path.read_bytes()


async def top_ids(client: httpx.AsyncClient, query: str, k: int = 1) -> list[str]:
    found = await client.post("/retrieve", json={"queries": [query], "k": k}, headers=SEARCH)
    assert found.status_code == 200, found.text
    return [d["id"] for d in found.json()["results"][0]]


async def test_a_mixed_batch_puts_the_good_files_in_one_change_and_says_why_each_other_was_skipped(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", api_keys=SEARCH_KEY,
                             admin_keys=ADMIN_KEY, internal_token=TOKEN)
    files: list[dict[str, Any]] = [
        {"name": "notes.txt", "content_base64": b64(NOTES)},
        {"name": "guide/setup.md", "content_base64": b64(SETUP_MD)},
        {"name": "page.html", "content_base64": b64(PAGE_HTML), "id": "field-notes", "title": "Heron field notes"},
        {"name": "reports/q3.pdf", "content_base64": b64(pdf_bytes(tmp_path, "q3.pdf", [
            "The quarterly vexalith output doubled.", PDF_PAGE_2], title="Q3 report"))},
        {"name": "scan.pdf", "content_base64": b64(pdf_bytes(tmp_path, "scan.pdf", None))},
        {"name": "corrupt.pdf", "content_base64": b64(random.Random(0).randbytes(4096))},
        {"name": "bad.txt", "content_base64": "not base64 at all!"},
        {"name": "other/notes.txt", "content_base64": b64("A second file that claims the id notes.txt."),
         "id": "notes.txt"},
        {"name": "image.png", "content_base64": b64(b"\x89PNG\r\n\x1a\n" + bytes(64))},
        {"name": "faq.jsonl", "content_base64": b64(
            '{"id": "faq-1#0", "title": "FAQ", "text": "Refunds of drelmont orders take five days."}\n'
            '{"id": "faq-1#1", "title": "FAQ", "text": "Drelmont orders ship on Mondays."}\n'
            '{"id": "faq-2", "title": "FAQ", "text": "Shipping is free over fifty euros."}\n')},
        {"name": "empty.md", "content_base64": ""},
    ]
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        refused = await client.post("/documents/files", json={"files": files[:1]}, headers=SEARCH)
        assert refused.status_code == 403 and "search key" in refused.json()["error"]["message"]
        answer = await client.post("/documents/files", json={"files": files}, headers=ADMIN)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        outcome = {f["name"]: (f["status"], f["id"], f["format"], f["documents"], f["passages"], f["reason"])
                   for f in body["files"]}
        assert [f["name"] for f in body["files"]] == [f["name"] for f in files]  # the request's order
        assert {n: o[:4] for n, o in outcome.items() if o[0] == "put"} == {
            "notes.txt": ("put", "notes.txt", "text", 1), "guide/setup.md": ("put", "guide/setup.md", "markdown", 1),
            "page.html": ("put", "field-notes", "html", 1), "reports/q3.pdf": ("put", "reports/q3.pdf", "pdf", 1),
            "faq.jsonl": ("put", None, "jsonl", 2)}
        reasons = {n: o[5] for n, o in outcome.items() if o[0] == "skipped"}
        assert reasons["scan.pdf"] == NO_TEXT_LAYER
        assert reasons["corrupt.pdf"].startswith("not a PDF: no %PDF- header")
        assert reasons["bad.txt"].startswith("content_base64 is not valid base64")
        assert reasons["other/notes.txt"] == "duplicate document id 'notes.txt': already taken by notes.txt"
        assert reasons["image.png"].startswith("unknown extension '.png'") and outcome["image.png"][2] is None
        assert reasons["empty.md"] == "empty file"
        assert len(reasons) == 6
        assert body["seq"] == 1 and body["documents"] == 6  # one change: every file that read fine
        assert body["passages"] == sum(o[4] for o in outcome.values()) == 4 + 4 + 1 + 1 + 3
        assert body["index_id"].endswith("-c1")

        assert await top_ids(client, "quarterly vexalith output") == ["reports/q3.pdf#0"]
        assert await top_ids(client, "herons nest in colonies") == ["field-notes#1"]
        assert await top_ids(client, "clean solar panels dust") == ["notes.txt#0"]
        assert await top_ids(client, "drelmont orders ship", 2) == ["faq-1#1", "faq-1#0"]
        heron = await client.post("/retrieve", json={"queries": ["herons nest in colonies"], "k": 1}, headers=SEARCH)
        assert heron.json()["results"][0][0]["title"] == "Heron field notes"  # the title given
        version = (await client.get("/version")).json()
        assert version["details"]["changes"]["seq"] == 1

        # nothing readable: 422 with every file's reason, nothing changed
        bad = [files[4], files[6], files[8]]
        none = await client.post("/documents/files", json={"files": bad}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert none.status_code == 422 and none.json()["error"]["param"] == "files"
        message = none.json()["error"]["message"]
        assert f"scan.pdf: {NO_TEXT_LAYER}" in message and "bad.txt: content_base64 is not valid base64" in message
        assert "image.png: unknown extension" in message
        assert (await client.get("/version")).json()["details"]["changes"]["seq"] == 1
        # a .jsonl file names its own documents; bad input of the request itself is refused whole
        given_id = await client.post("/documents/files", headers=ADMIN, json={"files": [dict(files[9], id="x")]})
        assert given_id.status_code == 422 and "rows name their own documents" in given_id.json()["error"]["message"]
        for wrong in ({"files": []}, {"files": [{"name": "a.txt"}]}, {"files": files[:1], "words": 5},
                      {"files": [{"name": "a.txt", "content_base64": "", "id": " leading space"}]},
                      {"files": [{"name": "a.txt", "content_base64": "", "id": "line\nbreak"}]}):
            assert (await client.post("/documents/files", json=wrong, headers=ADMIN)).status_code == 422
        # any name a file system allows is an id (ingest %-encodes what an id cannot hold): put, then deleted
        spaced = await client.post("/documents/files", headers=ADMIN, json={"files": [
            {"name": "my notes/été 2024.txt", "content_base64": b64("The spacious wembleton note.")}]})
        assert spaced.status_code == 200 and spaced.json()["files"][0]["id"] == "my notes/été 2024.txt"
        assert await top_ids(client, "spacious wembleton") == ["my notes/été 2024.txt#0"]
        gone = await client.post("/documents/delete", headers=ADMIN, json={"ids": ["my notes/été 2024.txt"]})
        assert gone.status_code == 200 and gone.json()["passages"] == 1
        assert await top_ids(client, "spacious wembleton") != ["my notes/été 2024.txt#0"]


async def test_uploading_a_document_again_replaces_all_its_passages(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             api_keys=SEARCH_KEY, admin_keys=ADMIN_KEY)
    long = " ".join(f"Sentence {n} is about the glimmerfen marsh and its {n} herons." for n in range(12))
    async with app_client(create_app(settings)) as client:
        await wait_ready(client, TOKEN)
        first = await client.post("/documents/files", headers=ADMIN, json={"words": 20, "files": [
            {"name": "marsh.txt", "content_base64": b64(long), "id": "marsh"}]})
        assert first.status_code == 200, first.text
        n = first.json()["passages"]
        assert n > 1 and set(await top_ids(client, "glimmerfen marsh herons", 50)) >= {f"marsh#{i}" for i in range(n)}
        again = await client.post("/documents/files", headers=ADMIN, json={"files": [
            {"name": "renamed.md", "content_base64": b64("# Marsh\n\nThe quillomar lake replaced it."),
             "id": "marsh"}]})
        assert again.status_code == 200 and again.json()["seq"] == 2 and again.json()["passages"] == 1
        assert not any(i.startswith("marsh#") for i in await top_ids(client, "glimmerfen herons sentence", 50))
        assert [i for i in await top_ids(client, "quillomar lake", 50) if i.startswith("marsh#")] == ["marsh#0"]
    off = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "off", changes="off", internal_token=TOKEN)
    async with app_client(create_app(off)) as client:
        await wait_ready(client, TOKEN)
        refused = await client.post("/documents/files", headers={"Authorization": f"Bearer {TOKEN}"},
                                    json={"files": [{"name": "a.txt", "content_base64": b64("Some text.")}]})
        assert refused.status_code == 409 and "RETRIEVER_CHANGES=off" in refused.json()["error"]["message"]


def test_the_upload_command_sends_a_folder_in_batches_and_reports_what_was_skipped(
        tiny: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`plugsearch-index upload` against a real server (a thread, the project's HTTP client): files in batches
    under the body limit (a batch over it split, a file over it alone reported), the good ones searchable."""
    import time

    from plugsearch.retriever.cli import main
    from tests.asgi import served_in_thread

    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (docs / "notes.txt").write_text(NOTES)
    (docs / "guide" / "setup.md").write_text(SETUP_MD)
    (docs / "page.html").write_text(PAGE_HTML)
    write_pdf(docs / "report.pdf", ["The trelvane turbine report is here."])
    write_scanned_pdf(docs / "scan.pdf")
    (docs / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (docs / "big.txt").write_text("Many words in a file too big for one request. " * 200)  # 9 kB, 12 kB as base64
    settings = tiny_settings(*tiny, dense=False, changes_dir=tmp_path / "changes", internal_token=TOKEN,
                             max_body_bytes=8192)
    with served_in_thread(create_app(settings)) as url:
        for _ in range(600):
            if httpx.get(f"{url}/health/ready").status_code == 200:
                break
            time.sleep(0.05)
        with pytest.raises(SystemExit) as done:
            main(["upload", str(docs), "--url", url, "--token", TOKEN, "--batch", "3", "--batch-mb", "1", "--quiet",
                  "--root", str(docs)])
        assert done.value.code == 1  # some files refused
        summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        skipped = {Path(s["path"]).name: (s["kind"], s["reason"]) for s in summary["skipped"]}
        assert skipped.keys() == {"big.txt", "image.png", "scan.pdf"}
        assert skipped["scan.pdf"] == ("error", NO_TEXT_LAYER)
        assert skipped["image.png"][0] == "ignored" and skipped["image.png"][1].startswith("unknown extension")
        assert skipped["big.txt"][0] == "error" and "RETRIEVER_MAX_BODY_BYTES" in skipped["big.txt"][1]
        assert {k: summary[k] for k in ("files", "documents", "errors")} == {"files": 4, "documents": 4, "errors": 2}
        assert summary["seq"] >= 2  # more than one request
        found = httpx.post(f"{url}/retrieve", json={"queries": ["trelvane turbine"], "k": 1},
                           headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert found["results"][0][0]["id"] == "report.pdf#0"
        with pytest.raises(SystemExit) as done:
            main(["upload", str(docs / "notes.txt"), "--url", url, "--token", "wrong-token-123", "--quiet",
                  "--root", str(docs)])
        assert done.value.code == 1 and "answered 401" in capsys.readouterr().err
