"""`python -m services.generator` / `plugsearch-generator`: settings from env (GENERATOR_*), then serve."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app import configured_app, serve_main
from services.generator.api import create_app
from services.generator.settings import GeneratorSettings


def worker_app() -> FastAPI:
    """One worker's app when GENERATOR_WORKERS > 1 (settings from the same environment)."""
    return configured_app(GeneratorSettings, create_app, "generator")[0]


def main() -> None:
    serve_main(GeneratorSettings, create_app, "generator")


if __name__ == "__main__":
    main()
