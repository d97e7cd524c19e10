"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes an `APIError` with its HTTP status; the handlers below
turn those, malformed bodies, unknown routes and unexpected exceptions into that shape, so clients
(the `openai` SDK raises `BadRequestError`, `NotFoundError`, ... from the status) always get JSON.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("kdaserve.server")

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    401: "authentication_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# Seconds a client should wait before retrying a 503 (a full queue or a restarting engine).
RETRY_AFTER_S = 1


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def validation_message(errors) -> tuple[str, str | None]:
    """pydantic's error list -> one readable line and the offending parameter."""
    parts, param = [], None
    for err in errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
        param = param or (loc or None)
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        response = error_response(status, message)
        for name, value in (exc.headers or {}).items():   # 405's Allow, among others
            response.headers[name] = value
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        logger.exception("unexpected error while serving a request")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
