"""One error envelope and one exception hierarchy for every service.

Domain code raises a `ServiceError` subclass; `install_error_handlers` maps it to its status and the
envelope `{"error": {"type", "message", "param", "request_id"}}`. Anything else is a bug: the caller
gets a generic 500 and the log gets the trace.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.logging import get_request_id

logger = logging.getLogger(__name__)


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
    BadRequest, Unauthorized, NotFound, PayloadTooLarge, UnsupportedMediaType, ValidationFailed, Overloaded,
    UpstreamError, NotReady, UpstreamTimeout)


def error_responses(descriptions: Mapping[int, str]) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` of a route (or a router): each status answered in the error envelope, and when.
    The one way errors are documented (`services.common.app.service_router` adds the guard's)."""
    return {status: {"model": ErrorEnvelope, "description": text} for status, text in descriptions.items()}


def error_response(status: int, type_: str, message: str, *, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorEnvelope(error=ErrorDetail(type=type_, message=message, param=param,
                                           request_id=get_request_id()))
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


def _retry_headers(retry_after: float | None) -> dict[str, str] | None:
    if retry_after is None or not math.isfinite(retry_after):
        return None
    return {"Retry-After": str(min(3600, max(1, int(round(retry_after)))))}


MAX_PARAM_CHARS = 200
MAX_MESSAGE_CHARS = 1000
"""Error texts echo field names from the request: cap them so a giant key cannot inflate the answer."""


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    parts = [_clip(str(p), 64) for p in loc if p not in ("body", "query", "path")]
    return _clip(".".join(parts), MAX_PARAM_CHARS) or None


async def _service_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    if exc.status >= 500:
        logger.warning("request failed: %s %s", exc.type, exc.message)
    return error_response(exc.status, exc.type, exc.message, param=exc.param,
                          headers=_retry_headers(exc.retry_after))


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(400, "invalid_json", "request body is not valid JSON")
    msg = "; ".join(
        f"{_loc_to_param(e.get('loc', ())) or 'body'}: {e.get('msg', 'invalid')}" for e in errors[:5]
    )
    return error_response(422, "validation_error", _clip(msg, MAX_MESSAGE_CHARS),
                          param=_loc_to_param(first.get("loc", ())))


_FASTAPI_BODY_ERROR = "There was an error parsing the body"


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and exc.detail == _FASTAPI_BODY_ERROR:
        # FastAPI's answer when the body is not decodable at all (bad UTF-8, integers over Python's
        # digit limit, nesting deeper than the recursion limit): the same 400 as any invalid JSON.
        return error_response(400, "invalid_json", "request body is not valid JSON")
    type_ = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large",
             415: "unsupported_media_type"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, type_, str(exc.detail), headers=getattr(exc, "headers", None))


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
