"""The search playground (opt-in, `SEARCHER_UI=true`): a static page at `GET /ui` (files in
`plugsearch/searcher/static/`, no build step, no third-party code) that runs a search over the streamed events
of `POST /search` beside naive top-k. Served without auth (it holds no data): the page asks for the API key
and keeps it in its memory only; a Content-Security-Policy keeps it to this origin.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Response

PATH = "/ui"
ASSETS = {"playground.js": "text/javascript", "playground.css": "text/css"}
OPEN_PATHS = frozenset({PATH, *(f"{PATH}/{name}" for name in ASSETS)})
"""Served without auth, like the health endpoints."""

HEADERS = {
    "Content-Security-Policy": ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                                "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _endpoint(name: str, media_type: str) -> Callable[[], Awaitable[Response]]:
    body = resources.files("plugsearch.searcher.static").joinpath(name).read_bytes()  # once, at build time

    async def serve_file() -> Response:
        return Response(body, media_type=f"{media_type}; charset=utf-8", headers=HEADERS)

    return serve_file


def add_ui_routes(app: FastAPI) -> None:
    """`GET /ui` (the page) and its two assets."""
    app.add_api_route(PATH, _endpoint("playground.html", "text/html"), methods=["GET"], include_in_schema=False)
    for name, media_type in ASSETS.items():
        app.add_api_route(f"{PATH}/{name}", _endpoint(name, media_type), methods=["GET"], include_in_schema=False)
