"""One error envelope and one exception hierarchy for every service.

Domain code raises a `ServiceError` subclass; `plugsearch.common.error_handlers.install_error_handlers` maps it
to its status and the envelope `{"error": {"type", "message", "param", "request_id"}}`. Anything else is a bug:
the caller gets a generic 500 and the log gets the trace. This module needs pydantic only: the public client
decodes the same envelope into the same exceptions without the server's packages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None = None
    request_id: str | None = None


class ErrorEnvelope(BaseModel):
    error: ErrorDetail


class ServiceError(Exception):
    """Base of every expected failure. `status` and `type` decide the response; a subclass sets them as
    class keywords (`class BadRequest(ServiceError, status=400, error_type="bad_request")`)."""

    status: int = 500
    type: str = "internal_error"
    upstream_status: int | None = None
    """For an upstream's error answer decoded into this exception: the status it answered."""

    def __init_subclass__(cls, *, status: int | None = None, error_type: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if status is not None:
            cls.status = status
        if error_type is not None:
            cls.type = error_type

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after


class BadRequest(ServiceError, status=400, error_type="bad_request"): ...
class Unauthorized(ServiceError, status=401, error_type="unauthorized"): ...
class Forbidden(ServiceError, status=403, error_type="forbidden"): ...
class NotFound(ServiceError, status=404, error_type="not_found"): ...
class Conflict(ServiceError, status=409, error_type="conflict"): ...
class PayloadTooLarge(ServiceError, status=413, error_type="payload_too_large"): ...
class UnsupportedMediaType(ServiceError, status=415, error_type="unsupported_media_type"): ...
class ValidationFailed(ServiceError, status=422, error_type="validation_error"): ...
class Overloaded(ServiceError, status=429, error_type="overloaded"): ...
class NotReady(ServiceError, status=503, error_type="not_ready"): ...
class UpstreamTimeout(ServiceError, status=504, error_type="upstream_timeout"): ...


class CostLimitExceeded(ServiceError, status=422, error_type="cost_limit_exceeded"):
    """The request asks for more work than one request may (mode, k, turns, batch size)."""


class RateLimited(Overloaded, error_type="rate_limited"):
    """The caller spent its budget of cost units; it may retry after Retry-After."""


class UpstreamError(ServiceError, status=502, error_type="upstream_error"):
    """An upstream service or LLM answered with an error, or could not be reached."""


ERROR_CLASSES: tuple[type[ServiceError], ...] = (
    BadRequest, Unauthorized, Forbidden, NotFound, Conflict, PayloadTooLarge, UnsupportedMediaType, ValidationFailed, Overloaded,
    UpstreamError, NotReady, UpstreamTimeout)


def error_responses(descriptions: Mapping[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of a route (or a router): each status answered in the error envelope, and when.
    The one way errors are documented (`plugsearch.common.app.service_router` adds the guard's)."""
    return {status: {"model": ErrorEnvelope, "description": text} for status, text in descriptions.items()}

