"""Errors as JSON: every failure answers `{"error": {"message", "type"}}` with its status.

`ApiError` is what routes raise for HTTP-level problems (401, 404, 409, ...); the
engine's own errors (`kvscope.errors`) map to statuses in `STATUS_OF`, and an
`InvalidRequest`'s field to the 400's `param` (`from_engine`: as the body names it,
where a route's body names it otherwise). `register(app)`
installs the handlers, so no route formats an error itself and no bad input turns into
a 500: only a bug does, and it is logged with its traceback. Routes under `/v1/`, and
vLLM's token routes beside them (`OPENAI_SHAPED`), answer in OpenAI's error shape (the
same object plus `param` and `code`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from quart import (
    Quart,
    Response,
    has_request_context,
    has_websocket_context,
    jsonify,
    request,
    websocket,
)
from werkzeug.exceptions import HTTPException

from kvscope import errors as engine_errors

log = logging.getLogger("kvscope.web")


#: Routes outside `/v1/` whose errors take OpenAI's shape (vLLM's token and scoring
#: routes, and SageMaker's invocations).
OPENAI_SHAPED = ("/tokenize", "/detokenize", "/score", "/rerank", "/v2/rerank", "/invocations")


class ApiError(Exception):
    """An HTTP error with a message for the client."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        *,
        headers: dict[str, str] | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.headers = headers or {}
        self.param = param
        self.code = code


#: kvscope error -> (status, type).
STATUS_OF: dict[type[Exception], tuple[int, str]] = {
    engine_errors.InvalidRequest: (400, "invalid_request_error"),
    engine_errors.UnknownRequest: (404, "not_found_error"),
    engine_errors.RequestConflict: (409, "conflict_error"),
    engine_errors.EngineOverloaded: (429, "overloaded_error"),
    engine_errors.EngineClosed: (503, "unavailable_error"),
}

_TYPE_OF_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "overloaded_error",
    503: "unavailable_error",
}


def from_engine(
    exc: engine_errors.KvscopeError,
    *,
    retry_after: int = 1,
    names: Mapping[str, str] = {},
    message: str | None = None,
) -> ApiError:
    """The `ApiError` for an engine error (with `message` in the place of its own, if
    given). An `InvalidRequest`'s field is its `param`, renamed by `names` (the engine's
    name -> the body's) where the body names it otherwise."""
    field = exc.field if isinstance(exc, engine_errors.InvalidRequest) else None
    param = names.get(field, field) if field is not None else None
    for cls, (status, type_) in STATUS_OF.items():
        if isinstance(exc, cls):
            headers = {"Retry-After": str(retry_after)} if status == 429 else None
            return ApiError(status, message or str(exc), type_, headers=headers, param=param)
    return ApiError(500, str(exc), "internal_error")


def error_body(
    message: str,
    type_: str,
    *,
    param: str | None = None,
    code: str | None = None,
    openai: bool = False,
) -> dict[str, Any]:
    error: dict[str, Any] = {"message": message, "type": type_}
    if openai:
        error.update(param=param, code=code)
    return {"error": error}


def _where() -> tuple[str, str]:
    """The method and path being answered: an HTTP request, a WebSocket handshake (its
    refusal is an HTTP response too), or neither (then no route's shape applies)."""
    if has_request_context():
        return request.method, request.path
    if has_websocket_context():
        return "WEBSOCKET", websocket.path
    return "-", ""


def error_response(error: ApiError) -> Response:
    path = _where()[1]
    openai = path.startswith("/v1/") or path in OPENAI_SHAPED
    response = jsonify(
        error_body(error.message, error.type, param=error.param, code=error.code, openai=openai)
    )
    response.status_code = error.status
    for name, value in error.headers.items():
        response.headers[name] = value
    if error.status == 413:  # the rest of the body is still on the wire: start afresh
        response.headers["Connection"] = "close"
    return response


def register(app: Quart, *, retry_after: int = 1) -> None:
    """Install the JSON error handlers on `app`."""

    @app.errorhandler(ApiError)
    async def _api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(engine_errors.KvscopeError)
    async def _engine_error(error: engine_errors.KvscopeError) -> Response:
        return error_response(from_engine(error, retry_after=retry_after))

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        message = error.description or error.name
        return error_response(ApiError(status, message, _TYPE_OF_STATUS.get(status, "http_error")))

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("unhandled error on %s %s", *_where())
        return error_response(ApiError(500, "internal server error", "internal_error"))
