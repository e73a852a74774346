"""`python -m services.generator` / `plugsearch-generator`: settings from env (GENERATOR_*), then serve."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app import serve
from services.common.logging import configure_logging
from services.generator.api import create_app
from services.generator.settings import GeneratorSettings


def worker_app() -> FastAPI:
    """One worker's app when GENERATOR_WORKERS > 1 (settings from the same environment)."""
    settings = GeneratorSettings()
    configure_logging(settings.log_level, service="generator")
    return create_app(settings)


def main() -> None:
    settings = GeneratorSettings()
    configure_logging(settings.log_level, service="generator")
    serve(create_app(settings), settings, worker_factory="services.generator.__main__:worker_app")


if __name__ == "__main__":
    main()
