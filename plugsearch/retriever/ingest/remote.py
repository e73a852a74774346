"""How `plugsearch-index put`, `upload`, `delete` and `sync` reach a running retriever: its token, its client, and
one call that waits out a restart.

The token is `--token`, else $PLUGSEARCH_INTERNAL_TOKEN, else $RETRIEVER_ADMIN_KEY, else the one the local stack
wrote for its user (`var/stack/internal-token` under the current folder, or under $PLUGSEARCH_VAR_DIR:
`plugsearch-stack --show-token` prints it), so whoever started the stack as the README shows can change documents without
restarting it. Calls go through the project's client (`plugsearch.common.http.ServiceClient`: timeouts, retries,
its breaker); on top of it `call` keeps trying while the retriever cannot answer (not listening, 503 while it
starts, a timeout) for up to `--wait-s` seconds, saying so once on stderr: the changes are idempotent (a document
put twice is the same document), so a retried change is safe. What the retriever refuses is reported with the
status it answered (`Refused.status`: 401, 403, 409, 413, 422, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from plugsearch.common.errors import ServiceError
from plugsearch.common.http import ClientSettings, ServiceClient, UpstreamUnavailable

DEFAULT_URL = "http://127.0.0.1:8001"
TOKEN_FILE = Path("stack") / "internal-token"
"""Under the stack's --var-dir (default `var`): the internal token of the stack running from that folder, written
0600 when it starts and removed when it stops (`plugsearch.stack.cli`)."""
DEFAULT_WAIT_S = 60.0


def token_file(var_dir: Path | None = None) -> Path:
    return (var_dir or Path(os.environ.get("PLUGSEARCH_VAR_DIR") or "var")) / TOKEN_FILE


def token_of(given: str | None) -> str:
    """The token to send (module docstring); SystemExit saying where it was looked for when there is none."""
    token = given or os.environ.get("PLUGSEARCH_INTERNAL_TOKEN") or os.environ.get("RETRIEVER_ADMIN_KEY")
    if token:
        return token
    path = token_file()
    try:
        found = path.read_text().strip()
    except OSError:
        found = ""
    if found:
        return found
    raise SystemExit("error: changing documents needs the internal token or an admin key: --token, "
                     f"$PLUGSEARCH_INTERNAL_TOKEN, $RETRIEVER_ADMIN_KEY, or {path} (written by a running "
                     "plugsearch-stack; `plugsearch-stack --show-token` prints it)")


def add_connection_options(parser: argparse.ArgumentParser, *, timeout_s: float = 300.0) -> None:
    parser.add_argument("--url", default=os.environ.get("PLUGSEARCH_RETRIEVER_URL", DEFAULT_URL),
                        help=f"the retriever (default $PLUGSEARCH_RETRIEVER_URL or {DEFAULT_URL})")
    parser.add_argument("--token", default=None, help="the internal token or an admin key (default: "
                        "$PLUGSEARCH_INTERNAL_TOKEN, else $RETRIEVER_ADMIN_KEY, else the running stack's "
                        "var/stack/internal-token)")
    parser.add_argument("--timeout-s", type=float, default=timeout_s, help="per request (a batch is encoded "
                        f"before it is acknowledged; default {timeout_s:g})")
    parser.add_argument("--wait-s", type=float, default=DEFAULT_WAIT_S, help="how long to keep trying while the "
                        f"retriever does not answer (a restart; default {DEFAULT_WAIT_S:g})")


def client_of(args: argparse.Namespace) -> ServiceClient:
    settings = ClientSettings(url=args.url, token=SecretStr(token_of(args.token)), timeout_s=args.timeout_s,
                              max_retries=2, breaker_failures=1_000_000)
    return ServiceClient(settings, name="retriever")


class Refused(Exception):
    """The retriever answered with an error, or could not be reached within --wait-s; `status` as it answered
    (None: no answer)."""

    def __init__(self, message: str, status: int | None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def _unanswered(exc: ServiceError) -> bool:
    """No answer worth giving up on: not listening, restarting (503), out of time (504, a timeout), busy (429)."""
    return exc.upstream_status in (None, 429, 502, 503, 504) or isinstance(exc, UpstreamUnavailable)


def describe(exc: ServiceError, url: str) -> str:
    message = exc.message.removeprefix("retriever: ")
    if exc.upstream_status is None:
        return f"the retriever at {url} did not answer: {message}"
    return f"the retriever at {url} answered {exc.upstream_status}: {message}"


async def call(client: ServiceClient, method: str, path: str, *, json: Any = None, wait_s: float = DEFAULT_WAIT_S,
               say: Callable[[str], None] | None = None) -> Any:
    """The answer's JSON; Refused with the status the retriever answered, or when it did not answer within
    `wait_s` (each try with the client's own retries)."""
    deadline = time.monotonic() + wait_s
    told = False
    pause = 0.5
    while True:
        try:
            return (await client.request(method, path, json=json)).json()
        except ServiceError as exc:
            url = client.settings.url
            if not _unanswered(exc) or time.monotonic() + pause > deadline:
                raise Refused(describe(exc, url), exc.upstream_status, exc.param) from exc
            if not told:
                (say or _stderr)(f"{describe(exc, url)}; trying again for up to {wait_s:g} s")
                told = True
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 5.0)


def _stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
