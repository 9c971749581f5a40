"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`.

Handlers map what can go wrong to a status: bad input (a ValueError from SamplingParams or
input processing, a request that fails validation, malformed JSON) is 400, a wrong API key
401, an unknown model 404, a body over the size limit 413, a body that is not JSON 415, a full
queue 429 (with Retry-After), a request the engine failed 500, a dead engine 503. Bad input
never yields a 500, and messages speak of the request, not of the server's internals.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagellm.engine.core_client import EngineDeadError
from pagellm.entrypoints.openai.response_models import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}
_FIELD = re.compile(r"SamplingParams\.(\w+)")
_RETRY_AFTER_S = "1"
# parts of a pydantic error location that name a union member, not a field ("list[int]")
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class APIError(Exception):
    """An error with the HTTP status, OpenAI error fields and headers it is reported with."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = _printable(message)
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = None if param is None else _printable(param)
        self.headers = headers

    def to_response(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, "InternalServerError")
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status)
        )


def _printable(text: str) -> str:
    """Text that UTF-8 can carry: a lone surrogate a client sent becomes its escape."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def unavailable(message: str) -> APIError:
    """503: the engine is dead or restarting; a client may retry."""
    return APIError(message, 503, headers={"Retry-After": _RETRY_AFTER_S})


def too_busy(message: str) -> APIError:
    """429: the server holds as much work as it queues; a client may retry."""
    return APIError(message, 429, headers={"Retry-After": _RETRY_AFTER_S})


def from_exception(e: BaseException) -> APIError:
    """The APIError to report for an exception raised while serving a request."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return unavailable(f"the engine is dead: {e}")
    if isinstance(e, ValueError):
        match = _FIELD.search(str(e))
        return APIError(str(e), 400, match.group(1) if match else None)
    if isinstance(e, TypeError):  # Python's words about our code, not the request's: not echoed
        logger.info("a request's value of an unexpected type: %s", e)
        return APIError("the request holds a value of a type that does not fit here", 400)
    logger.exception("unexpected error while serving a request", exc_info=e)
    return APIError(f"internal error: {type(e).__name__}", 500)


def error_json(error: APIError) -> JSONResponse:
    return JSONResponse(
        error.to_response().model_dump(), status_code=error.status, headers=error.headers
    )


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    errors = e.errors()
    if not errors:
        return "invalid request", None
    # a value out of range says more than "not a string" from another member of a union
    first = next((err for err in errors if not err.get("type", "").endswith("_type")), errors[0])
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error')}", None
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(p for p in loc if not _is_union_tag(p)) or None
    if first.get("type") == "model_attributes_type" and param is None:
        return "the request body must be a JSON object", None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "literal_error":  # Literal[-1] | a range: each member's words
        same = [err["msg"] for err in errors if _param(err) == param]
        message = " or ".join(dict.fromkeys(m.removeprefix("Input should be ") for m in same))
        message = f"Input should be {message}"
    return (f"{param}: {message}" if param else message), param


def _param(err: dict) -> str | None:
    loc = [str(part) for part in err.get("loc", ()) if part != "body"]
    return ".".join(p for p in loc if not _is_union_tag(p)) or None


def _is_union_tag(part: str) -> bool:
    return part in _UNION_TAGS or "[" in part or part[:1].isupper()


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return error_json(e)

    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return error_json(APIError(message, 400, param))

    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_json(APIError(str(e.detail), e.status_code, headers=e.headers))

    async def on_other_error(request: Request, e: Exception) -> JSONResponse:
        return error_json(from_exception(e))

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    for exc in (ValueError, TypeError, EngineDeadError):
        app.add_exception_handler(exc, on_other_error)
