"""`plugsearch-retriever` / `python -m plugsearch.retriever`: serve the retriever configured by RETRIEVER_* env.

Refuses to start (exit status 2, one clear line on stderr) when an index is missing or was built from a
different corpus or configuration.
"""

from __future__ import annotations

import logging
import os
import sys

from fastapi import FastAPI
from pydantic import ValidationError

from plugsearch.common import tracing
from plugsearch.common.logging import configure_logging
from plugsearch.common.process import serve
from plugsearch.retriever.store.corpus import CorpusError
from plugsearch.retriever.store.manifest import IndexMismatch, IndexMissing

logger = logging.getLogger("plugsearch.retriever")


def main() -> None:
    from plugsearch.retriever.settings import RetrieverSettings

    try:
        settings = RetrieverSettings()  # type: ignore[call-arg]
    except ValidationError as exc:
        sys.stderr.write(f"retriever: invalid configuration: {exc}\n")
        sys.exit(2)
    try:
        app = worker_app()
    except (IndexMismatch, IndexMissing, CorpusError) as exc:
        logger.error("refusing to start: %s", exc)
        sys.exit(2)
    serve(app, settings, worker_factory="plugsearch.retriever.__main__:worker_app")


def worker_app() -> FastAPI:
    """Settings, logging, the index check, the app (RETRIEVER_WORKERS > 1: each worker loads its own indexes)."""
    from plugsearch.retriever.api import create_app
    from plugsearch.retriever.serving import check_indexes
    from plugsearch.retriever.settings import RetrieverSettings

    settings = RetrieverSettings()  # type: ignore[call-arg]
    configure_logging(settings.log_level, service="retriever")
    os.umask(0o077)  # the change log, its generations and any index this process writes are the owner's alone
    tracing.setup_tracing("retriever")  # off unless OTEL_* variables switch it on
    return create_app(settings, check=check_indexes(settings))


if __name__ == "__main__":
    main()
