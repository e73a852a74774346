"""`plugsearch-searcher` / `python -m services.searcher`: the public search service (port 8000)."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app import serve
from services.common.logging import configure_logging
from services.searcher.api import create_app
from services.searcher.settings import SearcherSettings


def worker_app() -> FastAPI:
    """One worker's app when SEARCHER_WORKERS > 1 (settings from the same environment)."""
    settings = SearcherSettings()
    configure_logging(settings.log_level, service="searcher")
    return create_app(settings)


def main() -> None:
    settings = SearcherSettings()
    configure_logging(settings.log_level, service="searcher")
    serve(create_app(settings), settings, worker_factory="services.searcher.__main__:worker_app")


if __name__ == "__main__":
    main()
