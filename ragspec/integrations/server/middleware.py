"""What stands between a connection and a handler: the API key check and the request
counter (ASGI middleware), the bounded body read, and the watch for the client's
disconnect.

The body is read by the handler (:func:`read_body`, called by
:meth:`.generation.Generation.read`), not by FastAPI: a body over the limit is refused by
its ``Content-Length`` (413) or as soon as more than the limit arrived, before any of it is
parsed. From then on :func:`watch_disconnect` listens for ``http.disconnect`` so a client
that leaves cancels its request at once, at whatever stage it is.
"""

from __future__ import annotations

import asyncio
import hmac
import re
from typing import Any, Callable, Sequence, Union

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..metrics import ServerMetrics
from .errors import APIError, ClientGone

__all__ = [
    "CountRequests",
    "RequireApiKey",
    "ENDPOINTS",
    "endpoint_label",
    "DOC_PATHS",
    "TOKEN_PATHS",
    "is_json",
    "read_body",
    "watch_disconnect",
]

DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
"""The API docs' paths: behind the API key when one is set."""
TOKEN_PATHS = frozenset({"/tokenize", "/detokenize"})
"""The tokenizer's endpoints (vLLM's and llama-server's paths, at the root): behind the
API key when one is set."""
ENDPOINTS = (
    "/v1/summarize",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/datastores",
    "/v1/datastores/{name}/documents",
    "/tokenize",
    "/detokenize",
    "/metrics",
    "/health",
    "/ready",
)
"""The endpoints counted by name in ``ragspec_requests_total``, a path with a parameter by
its template (any other path: "other"; see :func:`endpoint_label`)."""
_DATASTORE_DOCUMENTS = re.compile(r"^/v1/datastores/[^/]+/documents$")


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a request to ``path``: the path of a fixed endpoint, the
    template of one with a parameter (``/v1/datastores/{name}/documents``: one label for
    every datastore, so the label's values stay few), else ``"other"``."""
    if path in ENDPOINTS:
        return path
    if _DATASTORE_DOCUMENTS.match(path):
        return "/v1/datastores/{name}/documents"
    return "other"


class CountRequests:
    """ASGI middleware counting finished requests by endpoint and status (passes
    ``receive`` through untouched, so disconnects still reach the handlers)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(endpoint=endpoint_label(path), status=str(status[0])).inc()


class RequireApiKey:
    """ASGI middleware: ``/v1/*`` requests, ``/tokenize`` and ``/detokenize``, the API docs
    (``/docs``, ``/redoc``, ``/openapi.json``) and, unless ``public_metrics``, ``/metrics`` (every tenant's traffic)
    need ``Authorization: Bearer <key>`` with one of the keys (``api_key``: one, or a
    sequence), checked before anything else (body reading included), as vLLM does;
    ``/health`` and ``/ready`` stay open."""

    def __init__(self, app: ASGIApp, api_key: Union[str, Sequence[str]], public_metrics: bool = False) -> None:
        self.app = app
        self.keys = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key)]
        self.public_metrics = public_metrics

    def _guarded(self, path: str) -> bool:
        bare = path.rstrip("/")
        if (path + "/").startswith("/v1/") or bare in DOC_PATHS or bare in TOKEN_PATHS:
            return True
        return bare == "/metrics" and not self.public_metrics

    def _valid(self, token: bytes) -> bool:
        # every key compared (no early exit): the time does not tell which key came close
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope["type"] == "http" and self._guarded(path):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not self._valid(token.strip()):
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def is_json(content_type: str) -> bool:
    """Whether a ``Content-Type`` names JSON (``application/json`` or ``application/*+json``)."""
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def _too_large(size: str, limit: int, option: str = "--max-body-bytes") -> APIError:
    return APIError(
        413,
        f"request body{size} is over the limit of {limit:,} bytes ({option})",
        code="request_too_large",
        headers={"Connection": "close"},
    )


async def read_body(
    request: Request, limit: int, on_disconnect: Callable[[], Any], option: str = "--max-body-bytes"
) -> bytes:
    """The request's body, at most ``limit`` bytes, read from the ASGI ``receive``
    (``option``: the setting a 413 names).

    Raises:
        APIError: 415 (a ``Content-Type`` that is not JSON), 413 (declared or sent over
            ``limit``).
        ClientGone: the client disconnected (``on_disconnect()`` called first).
    """
    headers = request.headers
    ctype = headers.get("content-type")
    if ctype is not None and not is_json(ctype):
        raise APIError(
            415,
            f"the request body must be JSON: send 'Content-Type: application/json' (got {ctype!r})",
            code="unsupported_media_type",
        )
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(f" of {int(declared):,} bytes", limit, option)
    receive = request.receive
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large("", limit, option)
        parts.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(parts)


def watch_disconnect(request: Request, on_disconnect: Callable[[], Any]) -> asyncio.Task:
    """A task calling ``on_disconnect()`` when the client disconnects (start it once the
    body has been read: the only message left to receive is then ``http.disconnect``).
    Cancel it when the request is done."""
    receive = request.receive

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                on_disconnect()
                return

    return asyncio.ensure_future(watch())
