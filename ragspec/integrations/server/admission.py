"""Admission that slow or greedy clients cannot exhaust, and who a client is.

A request with a body (POST, PUT, PATCH) passes :class:`Admission` (ASGI middleware, inside
the API key check) before any handler runs:

1. per client: a client (its API key when keys are set, else its address: :func:`client_id`)
   may have at most ``ServerSettings.client_limit`` requests in the server at once, being
   read, queued or generated; one more gets 429 ``client_limit``, so no client takes every
   place;
2. reading: at most ``max_reading`` bodies are read at once, apart from the scheduler's
   queue (a request takes a place there only once its body is read and parsed:
   :class:`.generation.Generation`); one more gets 429 ``read_limit``. Memory stays bounded:
   ``max_reading`` bodies of at most ``max_body_bytes``;
3. a deadline: the body must arrive within ``read_timeout_s`` plus one second per
   ``min_read_rate`` bytes received (Apache's mod_reqtimeout rule: a large body on a slow
   link is fine, a trickle is not); past it the handler's read raises 408
   ``request_timeout`` and the connection is closed.

So a client sending one byte a second holds one reading place for ``read_timeout_s`` and no
place in the queue at all (before this rule, 40 such sockets held every place for 53 s).
Headers are read by uvicorn before the app is called: they hold no place (their size is
bounded by uvicorn).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..metrics import ServerMetrics
from .errors import APIError

__all__ = ["Admission", "client_id", "bearer_token", "tenant_salt", "cache_salt"]

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def bearer_token(scope: Scope) -> Optional[bytes]:
    """The token of the request's ``Authorization: Bearer <token>`` header (None: none)."""
    auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
    scheme, _, token = auth.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" and token.strip() else None


def _digest(token: bytes) -> str:
    return hashlib.sha256(b"ragspec-tenant\0" + token).hexdigest()[:32]


def tenant_salt(scope: Scope, keyed: bool) -> str:
    """The tenant part of a request's cache salt: a digest of its API key when the server
    has keys (``keyed``; the key was checked already), else "" (one tenant)."""
    token = bearer_token(scope) if keyed else None
    return _digest(token) if token is not None else ""


def cache_salt(scope: Scope, keyed: bool, requested: Optional[str]) -> str:
    """The salt partitioning a request's caches (prefix cache, response cache): its tenant
    (:func:`tenant_salt`) and the ``cache_salt`` it asked for, so a request can narrow its
    tenant's partition but never reach another tenant's. "" with neither: the shared
    partition."""
    tenant = tenant_salt(scope, keyed)
    if not tenant:
        return requested or ""
    return f"{tenant}/{requested}" if requested else tenant


def client_id(scope: Scope, keyed: bool) -> str:
    """Who sent a request, for per-client limits: ``key:<digest>`` of its API key when the
    server has keys (``keyed``), else ``addr:<peer address>``."""
    if keyed:
        token = bearer_token(scope)
        if token is not None:
            return f"key:{_digest(token)[:16]}"
    client = scope.get("client")
    return f"addr:{client[0] if client else 'unknown'}"


class Admission:
    """ASGI middleware: per-client and reading limits, and the body's read deadline (see
    the module docstring).

    Args:
        app: the wrapped app.
        read_timeout_s: seconds a body may take before the rate applies.
        min_read_rate: bytes per second a body must average beyond ``read_timeout_s``.
        max_reading: bodies read at once.
        client_limit: requests per client in the server at once (0: no limit).
        keyed: the server has API keys (clients are keys, not addresses).
        metrics: ``rejected`` counts the 429s.
        retry_after_s: the 429s' ``Retry-After``.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        read_timeout_s: float,
        min_read_rate: int,
        max_reading: int,
        client_limit: int,
        keyed: bool,
        metrics: Optional[ServerMetrics] = None,
        retry_after_s: int = 1,
    ) -> None:
        self.app = app
        self.read_timeout_s = float(read_timeout_s)
        self.min_read_rate = float(min_read_rate)
        self.max_reading = int(max_reading)
        self.client_limit = int(client_limit)
        self.keyed = keyed
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.reading = 0
        """Bodies being read now."""
        self.clients: dict[str, int] = {}
        """Requests in the server per client (clients with none are not kept)."""

    def _refuse(self, message: str, code: str) -> APIError:
        if self.metrics is not None:
            self.metrics.rejected.inc()
        return APIError(
            429,
            message,
            type="rate_limit_error",
            code=code,
            headers={"Retry-After": str(self.retry_after_s), "Connection": "close"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        client = client_id(scope, self.keyed)
        held = self.clients.get(client, 0)
        if self.client_limit and held >= self.client_limit:
            who = "API key" if client.startswith("key:") else "address"
            error = self._refuse(
                f"too many requests from this client: {held} in progress from your {who}, at most "
                f"{self.client_limit} at once (--max-client-requests); retry when one has finished",
                "client_limit",
            )
            await error.response()(scope, receive, send)
            return
        if self.reading >= self.max_reading:
            error = self._refuse(
                f"too many requests being received ({self.reading} bodies arriving, at most {self.max_reading}: "
                "--max-reading); retry later",
                "read_limit",
            )
            await error.response()(scope, receive, send)
            return
        self.clients[client] = held + 1
        self.reading += 1
        loop = asyncio.get_running_loop()
        start = loop.time()
        state = {"reading": True, "received": 0}

        def done_reading() -> None:
            if state["reading"]:
                state["reading"] = False
                self.reading -= 1

        async def receive_by_deadline() -> Message:
            if not state["reading"]:
                return await receive()
            left = start + self.read_timeout_s + state["received"] / self.min_read_rate - loop.time()
            try:
                if left <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), left)
            except asyncio.TimeoutError:
                done_reading()
                raise APIError(
                    408,
                    f"the request body did not arrive in time: {state['received']:,} bytes in "
                    f"{loop.time() - start:.1f} s (a body may take {self.read_timeout_s:g} s plus one second per "
                    f"{self.min_read_rate:,.0f} bytes: --read-timeout, --min-read-rate)",
                    code="request_timeout",
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if not message.get("more_body", False):
                    done_reading()
            else:
                done_reading()
            return message

        try:
            await self.app(scope, receive_by_deadline, send)
        finally:
            done_reading()
            left = self.clients.get(client, 1) - 1
            if left > 0:
                self.clients[client] = left
            else:
                self.clients.pop(client, None)
