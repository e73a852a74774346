"""schemathesis against each service's own OpenAPI document, in-process: at least `MIN_CASES` generated
requests per service (valid ones and deliberately invalid ones), zero 5xx, every response conforming to
the documented schema of its status (bodies, envelope, content type, headers).

The app runs with its lifespan inside one event loop thread (anyio's blocking portal); hypothesis drives
generation from the test thread and each case is sent there through httpx's ASGI transport. Backends
are the deterministic ones of `test_bad_input_services.py` (tiny real bm25s index, scripted fake LLM).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.api.test_bad_input_services import SERVICES, prepare_tiny_index, service_client

MIN_CASES = 500
EXAMPLES = {"post": 130, "get": 20}
"""Examples per operation and generation mode; GET operations without parameters exhaust quickly."""

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


def _send_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """requests-style kwargs from schemathesis -> httpx.AsyncClient.request kwargs."""
    out = {key: kwargs[key] for key in ("method", "url", "headers", "params") if key in kwargs}
    if "json" in kwargs:
        out["json"] = kwargs["json"]
    elif kwargs.get("data") is not None:
        data = kwargs["data"]
        out["content"] = data.encode() if isinstance(data, str) else data
    if kwargs.get("cookies"):
        out["cookies"] = kwargs["cookies"]
    return out


@pytest.fixture(scope="session")
def fuzz_index(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return prepare_tiny_index(data_dir, tmp_path_factory)


@pytest.mark.parametrize("service", SERVICES)
def test_schemathesis_finds_no_5xx_and_no_schema_violation(service: str, fuzz_index: tuple[Path, Path]) -> None:
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(
            service_client(service, fuzz_index)) as client:
        app_schema = portal.call(client.get, "/openapi.json").json()
        schema = schemathesis.openapi.from_dict(app_schema)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations if op.method == "post"}, "no POST operation documented"

        def send(kwargs: dict[str, Any]) -> httpx.Response:
            async def call() -> httpx.Response:
                return await client.request(**_send_kwargs(kwargs))
            return portal.call(call)

        def runner(operation: Any, mode: GenerationMode) -> Callable[[], None]:
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES.get(operation.method, 20), deadline=None, database=None,
                      derandomize=True, suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
                response = send(kwargs)
                statuses[response.status_code] += 1
                try:
                    case.validate_response(response, checks=CHECKS, transport_kwargs=kwargs)
                except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a group
                    failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): "
                                    f"{response.status_code} {type(exc).__name__}: {str(exc)[:300]}")

            return run  # type: ignore[no-any-return]

        for operation in operations:
            # Operations without parameters or body (health, version) have no invalid form to generate.
            modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method == "post" else [])
            for mode in modes:
                runner(operation, mode)()
    total = sum(statuses.values())
    print(f"{service}: {total} cases, statuses {dict(sorted(statuses.items()))}")
    assert total >= MIN_CASES, f"only {total} cases generated: {dict(statuses)}"
    assert not [s for s in statuses if s >= 500], f"5xx answers: {dict(statuses)}"
    assert not failures, f"{len(failures)} violations in {total} cases:\n" + "\n".join(failures[:20])
    # Both valid and invalid requests were exercised (not just one kind of answer).
    assert statuses[200] > 0 and any(400 <= s < 500 for s in statuses), dict(statuses)


def test_retriever_documents_its_errors() -> None:
    """The 400 for an unserved method (and the other refusals) are in the retriever's OpenAPI document."""
    from plugsearch.retriever.api import create_app
    from plugsearch.retriever.settings import RetrieverSettings

    paths = create_app(RetrieverSettings()).openapi()["paths"]
    assert {"400", "429", "503"} <= set(paths["/retrieve"]["post"]["responses"])
    assert "method" in paths["/retrieve"]["post"]["responses"]["400"]["description"]
    assert {"400", "429", "503"} <= set(paths["/searchr1/retrieve"]["post"]["responses"])
