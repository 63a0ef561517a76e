"""The service's errors, OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``.

:class:`APIError` is what a handler raises; :func:`api_error` maps any other failure of a
generation to one (typed ragspec errors to 4xx, anything unexpected to a logged 500);
:func:`install_error_handlers` makes FastAPI answer every error in that shape.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragspec.errors import (
    CapacityError,
    DatastoreNotFoundError,
    InvalidParameterError,
    IsolationError,
    PromptTooLongError,
    RagspecError,
    UnsupportedParameterError,
)

logger = logging.getLogger(__name__)

__all__ = ["APIError", "ClientGone", "api_error", "generation_failed", "install_error_handlers"]

_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "function-after", "constrained-str"})
"""pydantic's union-member tags, dropped from an error's ``param``."""


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client disconnected while its request was read, prepared, waited or generated."""


def api_error(exc: BaseException, retry_after_s: int = 1) -> APIError:
    """The API error a generation failure becomes: 400 for a prompt too long
    (``context_length_exceeded``), a parameter ragspec does not implement
    (``unsupported_parameter``, naming it), an unknown datastore (``datastore_not_found``)
    and for typed ragspec, value and type errors, 429 with ``Retry-After: retry_after_s``
    for a full queue, 500 (logged) for a drafter that does not declare its tenant isolation
    (the server's configuration, not the request) and anything else."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, UnsupportedParameterError):
        return APIError(400, str(exc), param=exc.param, code="unsupported_parameter")
    if isinstance(exc, InvalidParameterError):
        return APIError(400, str(exc), param=exc.param, code="invalid_parameter")
    if isinstance(exc, DatastoreNotFoundError):
        return APIError(400, str(exc), param="datastore", code="datastore_not_found")
    if isinstance(exc, IsolationError):
        logger.error("refused a salted request: %s", exc)
        return APIError(500, f"this server cannot isolate tenants: {exc}", type="server_error")
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded", param="max_tokens")
    if isinstance(exc, CapacityError):
        return APIError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)}
        )
    if isinstance(exc, (RagspecError, ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__)
    logger.error("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def generation_failed() -> APIError:
    """The 500 of a generation the engine ended in error (``finish_reason`` "error": its
    processing left no token to choose, e.g. the grammar engine failed mid-output), as
    vLLM answers a request its engine failed: an error body, or a streamed error event
    after the text already sent. The server's log says what happened."""
    return APIError(
        500,
        "the generation failed: its processing left no token to choose (the grammar engine failed, or the "
        "request's constraints together forbid every token); the output is incomplete, see the server log",
        type="server_error",
        code="generation_failed",
        headers={"x-should-retry": "false"},  # OpenAI's clients retry a 500 unless told not to
    )


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 of a body pydantic refused: its first error, named by its field path."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    # drop "body" and pydantic's union-member tags ("str", "list[str]", ...) from the path
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and str(x) not in _TYPE_TAGS and "[" not in str(x)]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        param = None
    elif kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif kind == "finite_number":  # NaN, Infinity: Python's json reads them, JSON has no such numbers
        message = f"{param}: the JSON number is not finite (NaN and Infinity are not JSON numbers)"
    elif kind == "missing":
        # an empty body reaches here as the whole body missing (no field name)
        message = f"missing required field: {param}" if param else "request body is missing (a JSON object is required)"
    else:
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return APIError(400, message, param=param, code=kind or None)


async def _api(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError), type(exc)
    return exc.response()


async def _validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError), type(exc)
    return validation_error(exc).response()


async def _http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException), type(exc)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None)).response()


async def _ragspec(request: Request, exc: Exception) -> Response:
    # a typed error raised while a request is prepared (an empty prompt, one too long for
    # the context): its 4xx here, where the middleware counts it, not as a 500 with a
    # traceback through the catch-all below
    return api_error(exc).response()


async def _gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it


async def _internal(request: Request, exc: Exception) -> Response:
    return api_error(exc).response()


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape: :class:`APIError` as itself, a refused body
    as 400, Starlette's HTTP errors (404, 405 ...) with their status, typed ragspec errors
    as :func:`api_error` says, :class:`ClientGone` as 499, anything else as a 500."""
    app.add_exception_handler(APIError, _api)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RagspecError, _ragspec)
    app.add_exception_handler(ClientGone, _gone)
    app.add_exception_handler(Exception, _internal)
