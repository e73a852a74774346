"""The search playground in a real browser (Debian's headless Chromium, driven by Playwright) against real
processes: the retriever (bm25s over the shared corpus), the scripted policy (`fake_llm` +
`tests.support.fake_policy`: valid s3 actions, instantly, deterministic) and the searcher with
`SEARCHER_UI=true` and an API key.

Keyboard only, as a person would: the question is typed and sent with Enter; without a key the page says
so in words (401) and moves the focus to the key field; with the key the search streams in. The turns, the
documents the policy selected, the documents returned and naive top-k shown on the page are then checked
against the API's own answers (the trace of the same search, and naive top-k for the same budget); the
context is copied to the clipboard with the keyboard; long documents are collapsed; no request left the
searcher's origin. A screenshot goes to var/test-output/playground.png.

The other failures a person may meet (429 with Retry-After, 503, a failure after the stream began, a
degraded result) are answered in the browser exactly as the searcher sends them, and must be said in words.

Marks from use: each returned document has two toggle buttons (Helped / Did not help, `aria-pressed`), reached and
pressed with the keyboard, their focus visible; each press saves the search's whole mark (`POST /feedback`), which
the API then reads back as the page said it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import (
    ensure_bm25_index,
    retriever_process,
    scripted_policy_process,
    searcher_process,
)

pytestmark = pytest.mark.e2e

KEY = "e2e-playground-key"
QUESTION = "who wrote the novel the call of the wild"
BUDGET = 5
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
BROWSER_ENV = "PLUGSEARCH_CHROMIUM"


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium (scripts/install.sh installs it); `PLUGSEARCH_CHROMIUM` names another binary."""
    found = os.environ.get(BROWSER_ENV) or next(filter(None, map(shutil.which, BROWSERS)), None)
    if found is None:
        pytest.skip(f"no Chromium found ({', '.join(BROWSERS)} on PATH, or {BROWSER_ENV}): "
                    "scripts/install.sh installs Debian's chromium")
    return found


@pytest.fixture(scope="module")
def retriever_url(data_dir: Path, var_dir: Path) -> Iterator[str]:
    corpus = data_dir / "corpus" / "combined.jsonl"
    with retriever_process(corpus, ensure_bm25_index(corpus, var_dir),
                           var_dir / "logs" / "playground_retriever.log") as url:
        yield url


@pytest.fixture(scope="module")
def searcher_url(retriever_url: str, var_dir: Path) -> Iterator[str]:
    logs = var_dir / "logs"
    with scripted_policy_process(logs / "playground_policy.log") as policy, \
            searcher_process(retriever_url, policy, logs / "playground_searcher.log", policy_model="scripted-policy",
                             extra={"api_keys": KEY, "ui": "true", "policy_kind": "llm"}) as url:
        yield url


@pytest.fixture(scope="module")
def compact_url(retriever_url: str, var_dir: Path) -> Iterator[str]:
    """The searcher with the packaged compact policy (its pool of 30 BM25 documents per block)."""
    logs = var_dir / "logs"
    with searcher_process(retriever_url, "http://127.0.0.1:9/v1", logs / "playground_compact.log",
                          extra={"api_keys": KEY, "ui": "true", "policy_kind": "compact",
                                 "corpus_check": "off"}) as url:  # the policy's own search is what is drawn
        yield url


SHOWN = "const shown = (el) => el !== null && getComputedStyle(el).display !== 'none';"
"""What a person sees: an element that is displayed (a badge hidden by the page is not)."""

SHOWN_TURNS = "() => { " + SHOWN + """
  return [...document.querySelectorAll('#turns > li.turn')].map(card => {
    const docs = [...card.querySelectorAll('li.doc')].sort((a, b) => a.dataset.rank - b.dataset.rank);
    return {block: Number(card.dataset.block), turn: Number(card.dataset.turn),
            queries: [...card.querySelectorAll('.queries q')].map(q => q.textContent),
            document_ids: docs.map(d => d.dataset.docId),
            selected: docs.flatMap((d, i) => shown(d.querySelector('.badge.selected')) ? [i + 1] : [])};
  });
}"""

SHOWN_DOCS = "(list) => { " + SHOWN + """
  return [...document.querySelectorAll(`#${list} li.doc`)].map(d => ({
    id: d.dataset.docId, both: shown(d.querySelector('.badge.both')), open: d.querySelector('details').open}));
}"""


def tab_to(page: Any, element_id: str, presses: int = 150) -> None:
    """Press Tab until the element has the focus (keyboard-only navigation)."""
    for _ in range(presses):
        if page.evaluate("() => document.activeElement && document.activeElement.id") == element_id:
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"#{element_id} cannot be reached with the Tab key")


def tab_to_selector(page: Any, selector: str, presses: int = 150) -> None:
    """Press Tab until the focused element matches `selector`."""
    for _ in range(presses):
        if page.evaluate("(s) => document.activeElement !== null && document.activeElement.matches(s)", selector):
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"{selector} cannot be reached with the Tab key")


def test_playground_shows_the_search_as_the_api_traces_it(searcher_url: str, chromium: str,
                                                          var_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    auth = {"Authorization": f"Bearer {KEY}"}
    requests: list[str] = []
    problems: list[str] = []
    screenshot = var_dir / "test-output" / "playground.png"
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 900})
            context.grant_permissions(["clipboard-read", "clipboard-write"], origin=searcher_url)
            page = context.new_page()
            page.on("request", lambda request: requests.append(request.url))
            page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
            page.on("console", lambda message: message.type == "error" and "401" not in message.text
                    and problems.append(f"console: {message.text}"))
            page.goto(f"{searcher_url}/ui")

            # keyboard only: the question box has the focus; Tab to the budget; Enter sends the form
            expect(page.locator("#question")).to_be_focused()
            page.keyboard.type(QUESTION)
            tab_to(page, "budget")
            page.keyboard.type(str(BUDGET))
            page.keyboard.press("Enter")
            # no key yet: 401 in words, and the focus goes where the key is typed
            expect(page.locator("#error")).to_be_visible()
            expect(page.locator("#error")).to_contain_text("requires an API key")
            expect(page.locator("#results")).to_have_attribute("data-state", "error")
            expect(page.locator("#api-key")).to_be_focused()
            page.keyboard.type(KEY)
            page.keyboard.press("Enter")
            expect(page.locator("#results")).to_have_attribute("data-state", "done", timeout=30_000)
            expect(page.locator("#error")).to_be_hidden()

            shown_turns = page.evaluate(SHOWN_TURNS)
            shown_final = page.evaluate(SHOWN_DOCS, "final-docs")
            shown_naive = page.evaluate(SHOWN_DOCS, "naive-docs")
            summary = page.locator("#summary").inner_text()

            # copy the context with the keyboard
            tab_to(page, "copy-button")
            page.keyboard.press("Enter")
            expect(page.locator("#copy-status")).to_contain_text("Context copied")
            copied = page.evaluate("() => navigator.clipboard.readText()")

            # long documents are collapsed; Enter on one's summary opens it
            first = page.locator("#turns li.doc details").first
            first.locator("summary").focus()
            page.keyboard.press("Enter")
            expect(first).to_have_attribute("open", "")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()

    # the API's own answer for the same search (the page's run filled the cache: the same run's trace)
    api = httpx.post(f"{searcher_url}/search", headers=auth, timeout=30,
                     json={"question": QUESTION, "mode": "s3", "return_trace": True}).json()
    assert api["cached"] and api["trace"] is not None
    blocks = api["trace"]["blocks"]
    assert len(blocks) == 4 and all(b["selected"] == [1, 2] for b in blocks)  # the scripted policy's run
    assert shown_turns == [{"block": i, "turn": b["turn"], "queries": b["queries"],
                            "document_ids": b["document_ids"], "selected": b["selected"] or []}
                           for i, b in enumerate(blocks)]
    assert [d["id"] for d in shown_final] == [d["id"] for d in api["documents"]]
    assert copied == api["context"]
    assert "the policy said the search was complete" in summary and f"{len(api['queries'])} queries" in summary
    # naive top-k for the same budget, the documents both return marked on both sides
    assert len(api["documents"]) <= BUDGET  # the searcher's whole answer fits the budget: all shown, all copied
    naive = httpx.post(f"{searcher_url}/search", headers=auth, timeout=30, json={
        "question": QUESTION, "mode": "naive", "retrieve_k": BUDGET}).json()
    naive_ids = [d["id"] for d in naive["documents"]]
    assert [d["id"] for d in shown_naive] == naive_ids
    searcher_ids = {d["id"] for d in api["documents"]}
    assert [d["both"] for d in shown_naive] == [i in searcher_ids for i in naive_ids]
    assert [d["both"] for d in shown_final] == [d["id"] in set(naive_ids) for d in shown_final]
    assert 0 < sum(d["both"] for d in shown_naive) < BUDGET  # some shared, some only naive top-k found
    assert not any(d["open"] for d in shown_final + shown_naive)  # collapsed until opened
    assert requests and all(url.startswith(f"{searcher_url}/") for url in requests), requests
    assert not problems, problems
    assert screenshot.stat().st_size > 10_000


def sse_body(*events: tuple[str, Any]) -> str:
    return "".join(f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in events)


def test_playground_says_failures_in_words(searcher_url: str, chromium: str) -> None:
    """429, 503, a failure after the stream began and a degraded result, each as the searcher sends it
    (status, Retry-After, envelope, events), answered in the browser; the page's own searcher serves it."""
    from playwright.sync_api import expect, sync_playwright

    auth = {"Authorization": f"Bearer {KEY}"}
    real = httpx.post(f"{searcher_url}/search", headers=auth, timeout=30,
                      json={"question": QUESTION, "mode": "naive", "retrieve_k": 2}).json()
    # retrieval time is summed over the calls, and a pool's methods are retrieved at once: past the total
    timings = {"total_ms": 163.0, "policy_ms": 7.0, "policy_calls": 1, "retrieval_ms": 240.0, "retrieval_calls": 3,
               "overhead_ms": 0.0}
    degraded = {**real, "mode": "s3", "stop_reason": "policy_error", "degraded": True,
                "degraded_reason": "policy failed: upstream timed out", "timings": timings}
    envelope = {"error": {"type": "upstream_unavailable", "message": "retriever unreachable: ConnectError",
                          "param": None, "request_id": "r1"}}
    answers: list[dict[str, Any]] = [
        {"status": 429, "headers": {"Retry-After": "7"}, "json": {"error": {
            "type": "overloaded", "message": "too many requests in flight; retry later"}}},
        {"status": 503, "headers": {"Retry-After": "2"}, "json": envelope},
        {"status": 200, "content_type": "text/event-stream", "body": sse_body(
            ("retrieval", {"block": 0, "turn": 0, "queries": [QUESTION], "documents": real["documents"], "step": 0,
                           "elapsed_ms": 5.0}), ("error", envelope))},
        {"status": 200, "content_type": "text/event-stream", "body": sse_body(
            ("end", {"step": 1, "stop_reason": "policy_error", "degraded": True, "elapsed_ms": 9.0}),
            ("result", degraded))},
    ]
    expected = ["busy (too many requests at once). Try again in 7 s.",
                "cannot search right now (not ready, or its retriever is unavailable): retriever unreachable",
                "The search failed after it started: retriever unreachable", None]

    def answer(route: Any) -> None:
        body = route.request.post_data_json
        if body.get("mode") == "naive":
            route.continue_()  # naive top-k from the real searcher
        else:
            route.fulfill(**answers.pop(0))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page()
            page.route("**/search", answer)
            page.goto(f"{searcher_url}/ui")
            page.fill("#api-key", KEY)
            page.fill("#budget", "2")
            for words in expected:
                page.fill("#question", QUESTION)
                page.press("#question", "Enter")
                if words is None:
                    expect(page.locator("#results")).to_have_attribute("data-state", "done")
                    expect(page.locator("#error")).to_be_hidden()
                    expect(page.locator("#degraded")).to_be_visible()
                    expect(page.locator("#degraded")).to_contain_text(
                        "Degraded result: policy failed: upstream timed out. The documents shown are what the "
                        "search gathered before that.")
                    expect(page.locator("#summary")).to_contain_text("the policy LLM failed")
                    expect(page.locator("#summary")).to_contain_text(
                        "total 163 ms (policy 7 ms in 1 call, retrieval 240 ms summed over 3 calls, some concurrent)")
                else:
                    expect(page.locator("#results")).to_have_attribute("data-state", "error")
                    expect(page.locator("#error")).to_be_visible()
                    expect(page.locator("#error")).to_contain_text(words)
                    expect(page.locator("#error")).to_be_focused()
        finally:
            browser.close()
    assert not answers


CARDS = "() => { " + SHOWN + """
  return [...document.querySelectorAll('#turns > li.turn')].map(card => ({
    block: Number(card.dataset.block),
    kept: [...card.querySelectorAll('ol.kept > li.doc')].map(d => ({id: d.dataset.docId, rank: Number(d.dataset.rank),
                                                                    shown: shown(d)})),
    rest: card.querySelectorAll('details.rest li.doc').length,
    rest_open: card.querySelector('details.rest').open,
    rest_label: shown(card.querySelector('details.rest')) ? card.querySelector('details.rest > summary').textContent : null,
  }));
}"""


def test_the_compact_policys_search_fits_the_first_screen(compact_url: str, chromium: str, var_dir: Path) -> None:
    """The compact policy retrieves pools of 30: each turn shows its query, the documents it selected and a count
    of the rest (closed until opened), so the documents for the user's LLM are on the first screen."""
    from playwright.sync_api import expect, sync_playwright

    screenshot = var_dir / "test-output" / "playground-compact.png"
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{compact_url}/ui")
            page.fill("#api-key", KEY)
            page.fill("#question", QUESTION)
            page.press("#question", "Enter")
            expect(page.locator("#results")).to_have_attribute("data-state", "done", timeout=60_000)
            final = page.evaluate("""() => [...document.querySelectorAll('#final-docs li.doc')].map(d => {
                const box = d.getBoundingClientRect();
                return {id: d.dataset.docId, top: box.top, bottom: box.bottom};
            })""")
            viewport = page.evaluate("() => window.innerHeight")
            height = page.evaluate("() => document.documentElement.scrollHeight")
            cards = page.evaluate(CARDS)
            # the rest of a turn opens with the keyboard, and shows its documents
            rest = page.locator("#turns details.rest").first
            rest.locator(":scope > summary").focus()
            page.keyboard.press("Enter")
            expect(rest).to_have_attribute("open", "")
            opened = page.evaluate("() => [...document.querySelector('#turns details.rest').querySelectorAll("
                                   "'li.doc')].filter(d => d.getBoundingClientRect().height > 0).length")
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()

    api = httpx.post(f"{compact_url}/search", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"question": QUESTION, "return_trace": True}).json()
    assert api["cached"] and api["policy_model"].startswith("compact-gbr@") and len(api["documents"]) == 3
    assert [d["id"] for d in final] == [d["id"] for d in api["documents"]]
    assert all(0 <= d["top"] and d["bottom"] <= viewport for d in final), (final, viewport)  # no scrolling
    blocks = api["trace"]["blocks"]
    assert len(cards) == len(blocks) and len(blocks[0]["document_ids"]) == 30
    for card, block in zip(cards, blocks, strict=True):
        selected = block["selected"] or []
        assert [d["rank"] for d in card["kept"]] == sorted(selected) and all(d["shown"] for d in card["kept"])
        assert card["rest"] == len(block["document_ids"]) - len(selected) and not card["rest_open"]
        assert card["rest_label"] == f"{card['rest']} more documents retrieved, not selected (show)"
    assert opened == cards[0]["rest"]
    assert height < 3 * viewport, height  # a few lines per turn, not every pool document (was ~8,000 px)


FOCUS_RING = """() => { const s = getComputedStyle(document.activeElement);
  return {style: s.outlineStyle, width: s.outlineWidth, visible: document.activeElement.matches(':focus-visible')}; }"""


def test_playground_marks_what_helped_with_the_keyboard(searcher_url: str, chromium: str, var_dir: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    question = "what is the call of the wild about"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(f"{searcher_url}/ui")
            expect(page.locator("#question")).to_be_focused()
            page.keyboard.type(question)
            tab_to(page, "api-key")
            page.keyboard.type(KEY)
            page.keyboard.press("Enter")
            expect(page.locator("#results")).to_have_attribute("data-state", "done", timeout=30_000)
            expect(page.locator("#mark-help")).to_be_visible()
            shown = page.evaluate("() => [...document.querySelectorAll('#final-docs li.doc')].map(d => d.dataset.docId)")
            assert len(shown) >= 2
            helped = page.locator("#final-docs button.mark.helped")
            not_helped = page.locator("#final-docs button.mark.not-helped")
            expect(helped).to_have_count(len(shown))
            expect(not_helped).to_have_count(len(shown))

            # the first document helped: Tab to its button, Space presses it
            tab_to_selector(page, "#final-docs button.mark.helped")
            ring = page.evaluate(FOCUS_RING)
            assert ring["visible"] and ring["style"] != "none" and ring["width"] != "0px", ring
            page.keyboard.press("Space")
            expect(helped.nth(0)).to_have_attribute("aria-pressed", "true")
            expect(page.locator("#mark-status")).to_have_text("Mark saved: 1 document helped, 0 documents did not.")
            # the second did not: Tab on to its "Did not help", Enter presses it
            tab_to_selector(page, f"#final-docs button.mark.not-helped[data-doc-id='{shown[1]}']")
            page.keyboard.press("Enter")
            expect(not_helped.nth(1)).to_have_attribute("aria-pressed", "true")
            expect(page.locator("#mark-status")).to_have_text(
                "Mark saved (it replaces your earlier one): 1 document helped, 1 document did not.")
            # the first after all did not: pressing its other button moves the mark, one state per document
            page.get_by_role("button", name="Did not help").first.focus()
            page.keyboard.press("Enter")
            expect(helped.nth(0)).to_have_attribute("aria-pressed", "false")
            expect(not_helped.nth(0)).to_have_attribute("aria-pressed", "true")
            expect(page.locator("#mark-status")).to_have_text(
                "Mark saved (it replaces your earlier one): 0 documents helped, 2 documents did not.")
            # and the second helped after all
            helped.nth(1).focus()
            page.keyboard.press("Space")
            expect(page.locator("#mark-status")).to_have_text(
                "Mark saved (it replaces your earlier one): 1 document helped, 1 document did not.")
            assert page.get_by_role("button", name="Helped", pressed=True).count() == 1
            page.screenshot(path=str(var_dir / "test-output" / "playground-marks.png"), full_page=True)
        finally:
            browser.close()

    page_of_marks = httpx.get(f"{searcher_url}/feedback", headers={"Authorization": f"Bearer {KEY}"}, timeout=30,
                              params={"limit": 500}).json()
    mine = [m for m in page_of_marks["marks"] if m["question"] == question]
    assert len(mine) == 1, mine
    assert mine[0]["helpful"] == [shown[1]] and mine[0]["not_helpful"] == [shown[0]]
    assert [d["id"] for d in mine[0]["documents"]][:len(shown)] == shown
