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
   :class:`~ragspec.params.RequestParams` only: ``engine.start(prepared, params)``; a
   request of ``n`` choices is ``n`` jobs submitted together, made by one
   ``engine.start_choices(prepared, params)`` (they share one prefill), their items on one
   queue tagged with the choice's index; the jobs carry the request's tenant
   (:func:`.admission.client_id`: its API key, else its address), which the worker serves
   in turn with the other tenants.

A client that disconnects cancels its request at any stage: the disconnect watcher
(:func:`.middleware.watch_disconnect`) sees ``http.disconnect`` as it happens; a request
being read, validated or prepared is dropped, a queued or active job is dropped by the
worker before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional, TypeVar

from fastapi import Request
from pydantic import BaseModel

from ragspec.errors import CapacityError
from ragspec.params import RequestParams
from ragspec.prompts import PreparedPrompt
from ragspec.types import StreamChunk

from ..stepper import CHUNK, ERROR, GONE, READY, Job, Ticket, choice_makers
from .admission import cache_salt, client_id
from .errors import ClientGone, api_error, generation_failed
from .middleware import read_body, watch_disconnect
from .state import ServerState
from .validation import validate_body

__all__ = ["Generation"]

Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")


class _ChoiceOutbox:
    """The outbox of choice ``index`` of a generation: its items go to the generation's
    one queue as ``(index, item)``, from the worker thread through the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: "asyncio.Queue[Any]", index: int) -> None:
        self.loop, self.queue, self.index = loop, queue, index

    def put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (self.index, item))


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
        self.jobs: list[Job] = []
        """One job per choice (``n``), in choice order."""
        self._items: asyncio.Queue[tuple[int, tuple[str, Any]]] = asyncio.Queue()
        self._finished: set[int] = set()  # choices whose final chunk (or error) was read
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
        loop, index = asyncio.get_running_loop(), itertools.count()
        try:
            self.jobs = self._scheduler.submit_many(
                choice_makers(self.engine, prepared, params),
                lambda: _ChoiceOutbox(loop, self._items, next(index)),
                ticket=self._ticket,
                tenant=client_id(self.request.scope, bool(self.settings.api_keys)),  # served in turn
            )
        except CapacityError as e:
            self.metrics.rejected.inc()
            raise api_error(e, self.settings.retry_after_s) from None
        ready = 0
        while ready < len(self.jobs):
            _, (kind, value) = await self._next()
            if kind == ERROR:
                self._done = len(self.jobs) == 1
                raise api_error(value, self.settings.retry_after_s)
            ready += kind == READY

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The chunks up to the final one (of a request of one choice).

        Raises:
            APIError: the generation failed.
            ClientGone: the client left.
        """
        async for _, chunk in self.choice_chunks():
            yield chunk

    async def choice_chunks(self) -> AsyncIterator[tuple[int, StreamChunk]]:
        """``(choice index, chunk)`` as the choices' chunks arrive, up to every choice's
        final one.

        Raises:
            APIError: a choice failed; a 500 (``generation_failed``) for one the engine
                ended in error (``finish_reason`` "error"), after its last piece.
            ClientGone: the client left.
        """
        while len(self._finished) < len(self.jobs):
            index, (kind, value) = await self._next()
            if kind == ERROR:
                self._done = len(self.jobs) == 1  # other choices still running are cancelled by close()
                raise api_error(value, self.settings.retry_after_s)
            if kind != CHUNK:
                continue
            chunk: StreamChunk = value
            if self.first_token_s is None and (chunk.text or chunk.token_ids):
                self.first_token_s = time.perf_counter() - self.t0
                self.metrics.ttft.labels(endpoint=self.endpoint).observe(self.first_token_s)
            if chunk.finish_reason == "error":
                # the engine ended the choice in error (no token left to choose): its last
                # tokens go out as a piece, then the request fails as vLLM fails one
                self._done = len(self.jobs) == 1
                if chunk.text or chunk.token_ids:
                    yield index, dataclasses.replace(chunk, finish_reason=None, stats=None)
                raise generation_failed()
            if chunk.finish_reason is not None:
                self._finished.add(index)
                self._done = len(self._finished) == len(self.jobs)
            yield index, chunk

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

    async def collect_choices(self) -> list[list[StreamChunk]]:
        """Every choice's chunks, in choice order (the last of each is its final one)."""
        out: list[list[StreamChunk]] = [[] for _ in self.jobs]
        async for index, chunk in self.choice_chunks():
            out[index].append(chunk)
        self.finished()
        return out

    def close(self) -> None:
        """Stop watching, free the reserved place, cancel an unfinished job (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self._ticket is not None:
            self._ticket.release()  # no-op once the job took it
        if self.jobs:
            if not self._done:
                for job in self.jobs:
                    job.cancel()
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
        if self.jobs and not self._done:
            for job in self.jobs:
                job.cancel()  # the worker drops it before its next step
            self._items.put_nowait((-1, (GONE, None)))  # wakes the handler now

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

    async def _next(self) -> tuple[int, tuple[str, Any]]:
        assert self.jobs, "no job submitted yet"
        index, (kind, value) = await self._items.get()
        if kind == GONE:
            raise ClientGone()
        return index, (kind, value)
