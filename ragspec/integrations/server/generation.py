"""One generation as a handler sees it, from admission to the last chunk.

What a request costs before any work is bounded, and none of it runs on the event loop or
the worker:

1. the body is read up to ``RequestLimits.body_bytes`` (:func:`.middleware.read_body`)
   by its deadline, in one of the reading places (:mod:`.admission`, which also bounds
   each client's requests), then parsed and validated (:func:`.validation.validate_body`)
   in the prepare pool;
2. admission: only then is a place reserved in the scheduler (429 when
   ``max_active + max_queue`` requests are in the system): a client slow to send its body
   holds no place in the queue;
3. the prompt is prepared in the same pool (:mod:`.prepare`: sizes checked, then
   tokenized);
4. the job goes to the worker (:class:`..stepper.Stepper`) with token ids and its
   :class:`~ragspec.params.RequestParams` only: ``engine.start(prepared, params)``.

A client that disconnects cancels its request at any stage: the disconnect watcher
(:func:`.middleware.watch_disconnect`) sees ``http.disconnect`` as it happens; a request
being read, validated or prepared is dropped, a queued or active job is dropped by the
worker before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional, TypeVar

from fastapi import Request
from pydantic import BaseModel

from ragspec.engine import Request as EngineRequest
from ragspec.errors import CapacityError
from ragspec.params import RequestParams
from ragspec.prompts import PreparedPrompt
from ragspec.types import StreamChunk

from ..stepper import CHUNK, ERROR, GONE, AsyncOutbox, Job, Ticket
from .admission import cache_salt
from .errors import ClientGone, api_error
from .middleware import read_body, watch_disconnect
from .state import ServerState
from .validation import validate_body

__all__ = ["Generation"]

Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")


class Generation:
    """One generation: ``Generation(request, state, endpoint)``; :meth:`read` reads the
    body (bounded) and validates it off the event loop, then reserves a place in the
    scheduler (429 when full);
    :meth:`start` prepares the token ids off the event loop, submits the job and waits
    until the worker accepted it; :meth:`chunks` / :meth:`collect` read the generation.
    From :meth:`read` on, a watcher task listens for the client's ``http.disconnect`` and
    cancels at once whatever stage the request is in. :meth:`close` (always called) stops
    the watcher and frees the place.

    Raises:
        APIError: 429 when the scheduler is full.
    """

    def __init__(self, request: Request, state: ServerState, endpoint: str) -> None:
        self.request = request
        self.endpoint = endpoint
        self.settings = state.settings
        self.metrics = state.metrics
        self.limits = state.limits
        self.engine = state.engine
        self._pool = state.prepare_pool
        self._scheduler = state.scheduler
        self.t0 = time.perf_counter()
        self.first_token_s: Optional[float] = None
        self.job: Optional[Job] = None
        self.gone = asyncio.Event()
        self._cancel = threading.Event()  # seen by the preparation thread
        self._watcher: Optional[asyncio.Task] = None
        self._done = False
        self._closed = False
        self._ticket: Optional[Ticket] = None

    # ------------------------------------------------------------------ stages
    async def read(self, model: type[Body]) -> Body:
        """The body, read up to the limit, parsed and validated in the prepare pool; then a
        place reserved in the scheduler.

        Raises:
            APIError: 415 (not JSON), 413 (too large), 408 (not read by its deadline), 400
                (empty, malformed), 429 (the scheduler is full).
            RequestValidationError: invalid body.
            ClientGone: the client left.
        """
        raw = await read_body(self.request, self.limits.body_bytes, self.gone.set)
        self._watcher = watch_disconnect(self.request, self._client_left)
        body = await self._off_loop(validate_body, model, raw, self.limits.json_values)
        try:
            self._ticket = self._scheduler.reserve()
        except CapacityError as e:
            self.metrics.rejected.inc()
            raise api_error(e, self.settings.retry_after_s) from None
        return body

    def cache_salt(self, asked: Optional[str]) -> str:
        """The request's cache salt: the one its body ``asked`` for, within its API key's
        partition when the server has keys (:func:`.admission.cache_salt`)."""
        return cache_salt(self.request.scope, bool(self.settings.api_keys), asked)

    async def start(self, prepare: Callable[[threading.Event], PreparedPrompt], params: RequestParams) -> None:
        """Prepare the token ids off the event loop (``prepare(cancel)``), submit the job
        (``engine.start(prepared, params)`` in the worker), wait until the worker accepted
        it; raise the request's error if it did not.

        Raises:
            APIError: the request is invalid (400), the queue is full (429).
            ClientGone: the client left.
        """
        prepared: PreparedPrompt = await self._off_loop(prepare, self._cancel)
        engine = self.engine

        def make_request() -> EngineRequest:
            return engine.start(prepared, params)

        self.job = self._scheduler.submit(make_request, AsyncOutbox(), ticket=self._ticket)
        kind, value = await self._next()
        if kind == ERROR:
            self._done = True
            raise api_error(value, self.settings.retry_after_s)

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The chunks up to the final one.

        Raises:
            APIError: the generation failed.
            ClientGone: the client left.
        """
        while True:
            kind, value = await self._next()
            if kind == ERROR:
                self._done = True
                raise api_error(value, self.settings.retry_after_s)
            if kind != CHUNK:
                continue
            chunk: StreamChunk = value
            if self.first_token_s is None and (chunk.text or chunk.token_ids):
                self.first_token_s = time.perf_counter() - self.t0
                self.metrics.ttft.labels(endpoint=self.endpoint).observe(self.first_token_s)
            if chunk.finish_reason is not None:
                self._done = True
            yield chunk
            if chunk.finish_reason is not None:
                return

    def finished(self) -> None:
        """Record the request's latency (after its last chunk)."""
        self.metrics.latency.labels(endpoint=self.endpoint).observe(time.perf_counter() - self.t0)

    async def collect(self) -> tuple[str, Optional[StreamChunk]]:
        """The whole text and the final chunk (None if there was none)."""
        parts: list[str] = []
        last = None
        async for chunk in self.chunks():
            parts.append(chunk.text)
            last = chunk
        self.finished()
        return "".join(parts), last

    def close(self) -> None:
        """Stop watching, free the reserved place, cancel an unfinished job (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._ticket is not None:
            self._ticket.release()  # no-op once the job took it
        if self.job is not None:
            if not self._done:
                self.job.cancel()
        elif self.gone.is_set():
            self.metrics.cancelled.inc()  # left before its job existed

    @contextlib.contextmanager
    def closing_on_error(self) -> Iterator["Generation"]:
        """Close on any exception (the normal path closes after the last chunk)."""
        try:
            yield self
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ internals
    def _client_left(self) -> None:
        self.gone.set()
        self._cancel.set()
        if self.job is not None and not self._done:
            self.job.cancel()  # the worker drops it before its next step
            self.job.outbox.queue.put_nowait((GONE, None))  # wakes the handler now

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the prepare pool; raise :class:`ClientGone` as soon as the
        client leaves (a task not started yet never runs; one running finishes in its
        thread, bounded by the limits, and its result is dropped)."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        if not self.gone.is_set():
            gone = asyncio.ensure_future(self.gone.wait())
            waiters: set[asyncio.Future[Any]] = {fut, gone}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
        if self.gone.is_set():
            fut.cancel()
            raise ClientGone()
        return fut.result()

    async def _next(self) -> tuple[str, Any]:
        assert self.job is not None, "no job submitted yet"
        kind, value = await self.job.next_item()
        if kind == GONE:
            raise ClientGone()
        return kind, value
