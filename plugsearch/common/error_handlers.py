"""The error envelope on the wire: every service's FastAPI handlers, one place (`install_error_handlers`).

A `ServiceError` answers its status and type; a request that does not validate 422 (invalid JSON 400); Starlette's
own errors (404, 405, 413, 415) the same envelope; anything else is a bug: a generic 500 out, the trace in the log.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from plugsearch.common.errors import ErrorDetail, ErrorEnvelope, ServiceError
from plugsearch.common.logging import get_request_id

logger = logging.getLogger(__name__)


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
