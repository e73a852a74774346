"""`python -m services.judge` / `plugsearch-judge`: settings from env (JUDGE_*), then serve."""

from __future__ import annotations

from fastapi import FastAPI

from services.common.app import configured_app, serve_main
from services.judge.api import create_app
from services.judge.settings import JudgeSettings


def worker_app() -> FastAPI:
    """One worker's app when JUDGE_WORKERS > 1 (settings from the same environment)."""
    return configured_app(JudgeSettings, create_app, "judge")[0]


def main() -> None:
    serve_main(JudgeSettings, create_app, "judge")


if __name__ == "__main__":
    main()
