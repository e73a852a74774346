"""The search playground's routes on the real searcher app (the page itself is driven in a browser by
tests/e2e/test_playground_browser.py): off unless `SEARCHER_UI=true`; when on, the page and its two assets
are served without a key (they hold no data; the searches they make need one), with a policy that keeps
the page to its own origin; nothing the page ships refers to another host."""

from __future__ import annotations

import re

import pytest

from plugsearch.searcher.api import create_app
from plugsearch.searcher.settings import SearcherSettings
from plugsearch.searcher.ui import ASSETS
from tests.api.test_searcher_api import Q, Stack
from tests.asgi import app_client

KEY = "ui-test-key-123"


async def test_the_playground_is_off_by_default() -> None:
    assert SearcherSettings().ui is False
    async with app_client(create_app(SearcherSettings())) as client:
        for path in ("/ui", "/ui/playground.js"):
            response = await client.get(path)
            assert response.status_code == 404 and response.json()["error"]["type"] == "not_found"


def test_the_setting_reads_searcher_ui(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCHER_UI", "true")
    assert SearcherSettings().ui is True


async def test_page_and_assets_are_served_without_a_key_and_kept_to_this_origin() -> None:
    stack = Stack(api_keys=KEY, ui=True)
    try:
        async with app_client(stack.app) as client:
            page = await client.get("/ui")
            assets = {name: await client.get(f"/ui/{name}") for name in ASSETS}
            search = await client.post("/search", json={"question": Q, "stream": True})
            missing = await client.get("/ui/secret.txt")
    finally:
        await stack.aclose()
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "script-src 'self'" in policy
    for name, response in assets.items():
        assert response.status_code == 200, name
        assert response.headers["content-type"].startswith(ASSETS[name])
        assert response.headers["x-content-type-options"] == "nosniff"
    assert search.status_code == 401  # the page is open, searching is not
    assert missing.status_code == 401  # not a page: guarded like any other path
    html = page.text
    # the page loads its own two files by relative URL, and nothing ships a URL of another host
    assert sorted(re.findall(r'(?:src|href)="([^"#]+)"', html)) == ["ui/playground.css", "ui/playground.js"]
    for text in [html, *(r.text for r in assets.values())]:
        assert "://" not in text and "@import" not in text and "<iframe" not in text
    assert 'id="api-key" name="api_key" type="password"' in html
