"""`python -m services.judge` / `plugsearch-judge`: settings from env (JUDGE_*), then serve."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app import serve
from services.common.logging import configure_logging
from services.judge.api import create_app
from services.judge.settings import JudgeSettings


def worker_app() -> FastAPI:
    """One worker's app when JUDGE_WORKERS > 1 (settings from the same environment)."""
    settings = JudgeSettings()
    configure_logging(settings.log_level, service="judge")
    return create_app(settings)


def main() -> None:
    settings = JudgeSettings()
    configure_logging(settings.log_level, service="judge")
    serve(create_app(settings), settings, worker_factory="services.judge.__main__:worker_app")


if __name__ == "__main__":
    main()
