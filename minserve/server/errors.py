"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with a status.

Every refusal the server makes goes through `APIError`, so a client always gets a JSON body
it can read and the server goes on serving.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

# status -> OpenAI error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Allow on a 405, WWW-Authenticate on a 401

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_validation(error: ValidationError) -> APIError:
    """A pydantic error as a 400 naming the first bad field ("messages.0.role: ...")."""
    return _first_problem(error.errors())


def _first_problem(errors: list) -> APIError:
    first = errors[0]
    param = ".".join(str(part) for part in first["loc"] if _is_field(part)) or None
    message = first["msg"] if param is None else f"{param}: {first['msg']}"
    count = len(errors)
    if count > 1:
        message += f" (and {count - 1} more problem{'s' * (count > 2)})"
    return APIError(400, message, param=param, code=first["type"])


def _is_field(part: str | int) -> bool:
    """A field name or list index; not a union member's tag ("str", "list[int]", "TextPart")."""
    if isinstance(part, int):
        return True
    return part.isidentifier() and part.islower() and part not in _TYPE_TAGS


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def check_api_key(request: Request, api_key: str | None) -> None:
    """`Authorization: Bearer KEY`, compared in constant time (no timing side channel)."""
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})  # fmt: skip


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI-style body (unknown paths and methods too)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, error: HTTPException) -> JSONResponse:
        return APIError(error.status_code, str(error.detail), headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(_: Request, error: RequestValidationError) -> JSONResponse:
        return _first_problem(list(error.errors())).response()  # a 400, as for bodies

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, error: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(error).__name__}: {error}").response()
