"""Running a service's process: `entrypoint` (what each `plugsearch.<service>.__main__` calls: settings from the
environment, logging, tracing, the app), `serve` (uvicorn, one process or `<SVC>_WORKERS` of them) and
`uvicorn_options` (how every service runs under uvicorn). The app itself: `plugsearch.common.app.build_app`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from pydantic import ValidationError

from plugsearch.common import tracing
from plugsearch.common.logging import configure_logging
from plugsearch.common.metrics import MULTIPROCESS_ENV
from plugsearch.common.settings import ServiceSettings


def uvicorn_options(settings: ServiceSettings) -> dict[str, Any]:
    """How every service runs under uvicorn (with the guarded HTTP protocol, `plugsearch.common.protocol`)."""
    from plugsearch.common.protocol import GuardedHttpToolsProtocol

    return dict(host=settings.host, port=settings.port, log_level=settings.log_level.lower(), access_log=False,
                timeout_graceful_shutdown=10, log_config=None, timeout_keep_alive=int(settings.keep_alive_s),
                http=GuardedHttpToolsProtocol)


def serve(app: FastAPI, settings: ServiceSettings, *, worker_factory: str) -> None:
    """Run one service with uvicorn: `app` alone, or `settings.workers` processes each built by
    `worker_factory` ("module:function", no arguments; its own state: RAM x workers) on their own
    SO_REUSEPORT sockets (`plugsearch.common.workers`; elsewhere than Linux uvicorn's shared socket), their
    metrics summed through prometheus_client's multiprocess mode."""
    import uvicorn

    options = uvicorn_options(settings)
    if settings.workers == 1:
        uvicorn.run(app, **options)
        return
    import shutil
    import tempfile

    from plugsearch.common.workers import Supervisor

    # A fresh directory per run: files left by an earlier run would add their counts to this one's.
    metrics_dir = tempfile.mkdtemp(prefix="plugsearch-metrics-")
    os.environ[MULTIPROCESS_ENV] = metrics_dir
    try:
        if sys.platform == "linux":
            code = Supervisor(worker_factory, options, settings.workers).run()
        else:  # SO_REUSEPORT spreads connections over sockets only on Linux: uvicorn's shared socket
            uvicorn.run(worker_factory, factory=True, workers=settings.workers, **options)
            code = 0
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if code:
        sys.exit(code)


def entrypoint(service: str) -> tuple[Callable[[], FastAPI], Callable[[], None]]:
    """`(worker_app, main)` of `plugsearch.<service>.__main__`: `<Service>Settings` from the environment,
    logging, `create_app` of `plugsearch.<service>.api`; `main` serves it, each worker rebuilds it."""

    def build() -> tuple[FastAPI, ServiceSettings]:
        import importlib

        settings_type = getattr(importlib.import_module(f"plugsearch.{service}.settings"),
                                f"{service.capitalize()}Settings")
        settings = settings_type()
        configure_logging(settings.log_level, service=service)
        tracing.setup_tracing(service)  # off unless OTEL_* variables switch it on
        app = importlib.import_module(f"plugsearch.{service}.api").create_app(settings)
        app.state.tune_gc = True  # this process serves it: its garbage collector is the service's to set
        return app, settings

    def worker_app() -> FastAPI:
        return build()[0]

    def main() -> None:
        try:
            app, settings = build()
        except ValidationError as exc:  # a bad setting (or a policy folder refused): one clear message, exit 2
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}"
                                 for e in exc.errors())
            sys.stderr.write(f"{service}: invalid configuration: {problems}\n")
            sys.exit(2)
        serve(app, settings, worker_factory=f"plugsearch.{service}.__main__:worker_app")

    return worker_app, main
