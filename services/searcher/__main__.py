"""`plugsearch-searcher` / `python -m services.searcher`: the public search service (port 8000)."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app import configured_app, serve_main
from services.searcher.api import create_app
from services.searcher.settings import SearcherSettings


def worker_app() -> FastAPI:
    """One worker's app when SEARCHER_WORKERS > 1 (settings from the same environment)."""
    return configured_app(SearcherSettings, create_app, "searcher")[0]


def main() -> None:
    serve_main(SearcherSettings, create_app, "searcher")


if __name__ == "__main__":
    main()
