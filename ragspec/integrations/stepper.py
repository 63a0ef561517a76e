"""One thread steps one engine's requests, for the server and the LangChain classes alike.

Glossary:
    ticket: a place in the system, reserved (:meth:`Stepper.reserve`) once a request's body
        is read and parsed, so that requests being prepared count against the bound too
        (requests still being read have places of their own: the server's admission).
    job: one request's generation: how to make its :class:`~ragspec.engine.Request`, the
        outbox its reader takes items from, its cancel flag.
    incoming: submitted jobs not yet seen by the worker.
    waiting: jobs whose request is made (prompt checked) but not started.
    active (in flight): jobs being generated. Each round is one ``engine.step`` over the
        jobs the composer chose, that is one verification forward for all the decoding ones
        (prefill chunks run in the same step), whatever datastore each drafts from (a
        request's datastore is its drafting input).

The engine is shared; per-request state (KV cache, draft session, generator) lives in each
job's request, so a job's output is what the same request gives alone. Items reach their
reader through its job's outbox: :class:`AsyncOutbox` for a reader on an asyncio event loop
(the server's handlers, LangChain's async methods: ``loop.call_soon_threadsafe``, the loop is
never blocked), :class:`ThreadOutbox` for a reader thread (LangChain's sync methods).

Every step runs in the stepper's one thread (``ragspec-worker`` for the server,
``ragspec-compute`` for the LangChain classes), started by :meth:`Stepper.start` or the first
submission: torch's OpenMP pool belongs to the thread that computes, and steps computed in
several threads are each ~30-50% slower (:mod:`ragspec.backend.threads`: a thread that only
loaded the model gives its pool back with ``release_openmp_pool``).

Admission is bounded (when bounds are set): at most ``max_active + max_queue`` tickets and
jobs are in the system; one more raises :class:`~ragspec.errors.CapacityError` (the server
answers 429). What each round runs is chosen by a :class:`~ragspec.scheduling.StepComposer`
over every prepared job, with the engine's measured cost model: which requests prefill a
chunk and which decode (:mod:`ragspec.scheduling`: decodes are never starved, the request
with the least work left goes first, a request joins the running ones where the cost model
says running together is nearly free, at most ``max_active`` in flight). Tenants (a job's
``tenant``: an API key's digest, a client address) are served in turn: a tenant with fewer
requests in flight goes first and one with none in flight starts at once, so one tenant's
backlog delays another's request by about the steps it shares with the requests in
flight, not by the backlog. A cancelled job (its client gone, its reader closed) is dropped
before its next step, wherever it is (incoming, waiting or in flight), without a forward.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from ragspec.engine import Engine, Request, StepReport
from ragspec.errors import CapacityError
from ragspec.params import RequestParams
from ragspec.prompts import PreparedPrompt
from ragspec.scheduling import ComposerConfig, StepComposer
from ragspec.types import StreamChunk

logger = logging.getLogger(__name__)

__all__ = [
    "Stepper",
    "Job",
    "Ticket",
    "Outbox",
    "AsyncOutbox",
    "ThreadOutbox",
    "READY",
    "CHUNK",
    "ERROR",
    "GONE",
    "choice_makers",
]

READY = "ready"
"""Put on a job's outbox once its request is made (its prompt accepted)."""
CHUNK = "chunk"
"""A :class:`~ragspec.types.StreamChunk` of the job's generation (the last has a finish reason)."""
ERROR = "error"
"""The job failed: its request is invalid, or a step failed; the value is the exception."""
GONE = "gone"
"""Put on a job's async outbox by its event loop when its client disconnected."""

Item = tuple[str, Any]


class Outbox(Protocol):
    """Where the worker puts a job's items ``(kind, value)``; ``put`` is called in the
    worker and never blocks (a ``RuntimeError`` means nobody listens any more)."""

    def put(self, item: Item) -> None: ...


class AsyncOutbox:
    """The outbox of a reader on an asyncio event loop (``loop``: the running one)."""

    def __init__(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self.queue: asyncio.Queue[Item] = asyncio.Queue()

    def put(self, item: Item) -> None:
        """From any thread: hand ``item`` to the loop (RuntimeError once the loop is closed)."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def get(self) -> Item:
        return await self.queue.get()


class ThreadOutbox:
    """The outbox of a reader thread (it blocks in :meth:`get`)."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def put(self, item: Item) -> None:
        self.queue.put(item)

    def get(self) -> Item:
        return self.queue.get()


class Ticket:
    """A place reserved in a :class:`Stepper` (see :meth:`Stepper.reserve`): used by
    :meth:`Stepper.submit`, or given back with :meth:`release`."""

    def __init__(self, stepper: "Stepper") -> None:
        self._stepper = stepper
        self.spent = False

    def release(self) -> None:
        """Give the place back (no-op once spent or released)."""
        if not self.spent:
            self.spent = True
            self._stepper._unreserve()


@dataclass(eq=False)
class Job:
    """One request's generation, shared by its reader and the worker.

    Items arrive on ``outbox`` as ``(kind, value)``: ``(READY, None)`` once the request is
    made, then ``(CHUNK, StreamChunk)`` until one has a ``finish_reason``; or
    ``(ERROR, exception)`` instead when the request is invalid (or a step fails).
    """

    make_request: Callable[[], Request]
    """Run in the worker: ``engine.start(...)`` (no forward)."""
    outbox: Any
    """Its :class:`Outbox` (:class:`AsyncOutbox` or :class:`ThreadOutbox`)."""
    tenant: str = ""
    """Whose request it is (served in turn with the other tenants; "": one tenant)."""
    id: int = 0
    submitted_s: float = field(default_factory=time.perf_counter)
    activated_s: float = 0.0
    """``time.perf_counter()`` when it first got work in a step (0 before)."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    request: Optional[Request] = None
    """Its request: KV state, draft session, generator (set by the worker; None once released)."""
    finished: bool = False
    """Its reader has taken its final chunk (or its error)."""

    def cancel(self) -> None:
        """Ask the worker to drop this job (within one step; no forward is run for it)."""
        self.cancelled.set()

    async def next_item(self) -> Item:
        """The next item of an :class:`AsyncOutbox` job."""
        return await self.outbox.get()

    def _chunk_of(self, item: Item) -> Optional[StreamChunk]:
        """The chunk ``item`` carries (None: an item without one, e.g. READY); the job's
        error raised."""
        kind, value = item
        if kind == ERROR:
            self.finished = True
            raise value
        if kind != CHUNK:
            return None
        self.finished = value.finish_reason is not None
        return value

    def next_chunk(self) -> Optional[StreamChunk]:
        """For a reader thread (:class:`ThreadOutbox`): the next chunk, blocking; None
        after the final one.

        Raises:
            Exception: the job's error (an invalid request, a failed step).
        """
        while not self.finished:
            if (chunk := self._chunk_of(self.outbox.get())) is not None:
                return chunk
        return None

    async def anext_chunk(self) -> Optional[StreamChunk]:
        """:meth:`next_chunk` for a reader on the event loop (:class:`AsyncOutbox`)."""
        while not self.finished:
            if (chunk := self._chunk_of(await self.outbox.get())) is not None:
                return chunk
        return None


class Stepper:
    """The thread that steps one engine's requests, and its bounded admission.

    Args:
        engine: the engine whose requests are stepped (one ``engine.step`` per round for
            all active jobs).
        max_active: generations in flight at once (None: no bound); a tenant with none in
            flight may start one beyond it.
        max_queue: jobs allowed to wait beyond the active ones (None: no bound).
        max_step_tokens: token budget of one step (prefill chunk tokens + verification
            rows) beyond its first chunk; None: no budget.
        throughput_slack: share of the throughput of starting every waiting request at
            once that the decode groups may give up for latency
            (:attr:`~ragspec.scheduling.ComposerConfig.throughput_slack`).
        on_finish: called in the worker with ``(job, final_chunk)`` when a generation ends
            normally (metrics).
        on_cancel: called in the worker with ``(job)`` when a cancelled job is dropped.
        on_step: called in the worker with ``(report)`` after each engine step
            (:class:`~ragspec.engine.StepReport`; metrics).
        on_activate: called in the worker with ``(job)`` when a job first gets work in a
            step (its queue time is ``job.activated_s - job.submitted_s``).
        thread_name: the worker thread's name.
        composer: chooses each step's work (None: a
            :class:`~ragspec.scheduling.StepComposer` over the engine's latency model with
            ``max_active``, ``max_step_tokens`` and ``throughput_slack``).

    Constructing starts nothing: :meth:`start` (or the first submission) starts the
    worker, :meth:`stop` ends it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_active: Optional[int] = None,
        max_queue: Optional[int] = None,
        max_step_tokens: Optional[int] = None,
        throughput_slack: Optional[float] = ComposerConfig.throughput_slack,
        on_finish: Optional[Callable[[Job, StreamChunk], Any]] = None,
        on_cancel: Optional[Callable[[Job], Any]] = None,
        on_step: Optional[Callable[[StepReport], Any]] = None,
        on_activate: Optional[Callable[[Job], Any]] = None,
        thread_name: str = "ragspec-worker",
        composer: Optional[StepComposer] = None,
    ) -> None:
        self.engine = engine
        self.composer = (
            composer
            if composer is not None
            else StepComposer(
                engine.latency,
                ComposerConfig(
                    max_active=max_active, max_step_tokens=max_step_tokens, throughput_slack=throughput_slack
                ),
            )
        )
        self.max_active = max_active
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.on_finish = on_finish
        self.on_cancel = on_cancel
        self.on_step = on_step
        self.on_activate = on_activate
        self.thread_name = thread_name
        self.steps = 0
        """Engine steps run so far."""
        self.max_batch = 0
        """Most requests working in one step so far (for tests and logs)."""
        self._cv = threading.Condition()
        self._incoming: collections.deque[Job] = collections.deque()
        self._num_jobs = 0
        self._num_active = 0
        self._stopping = False
        self._ids = itertools.count(1)
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ reader side
    @property
    def num_jobs(self) -> int:
        """Requests in the system: reserved (being prepared) + incoming + waiting + active."""
        return self._num_jobs

    @property
    def num_active(self) -> int:
        return self._num_active

    @property
    def stopped(self) -> bool:
        """:meth:`stop` was called: it takes no more jobs."""
        return self._stopping

    def _admit(self) -> None:
        """Count one more request in the system (hold ``_cv``)."""
        if self._stopping:
            raise CapacityError("the server is shutting down")
        bound = None if self.max_active is None or self.max_queue is None else self.max_active + self.max_queue
        if bound is not None and self._num_jobs >= bound:
            raise CapacityError(
                f"the request queue is full ({self._num_jobs} requests in progress or waiting); retry later"
            )
        self._num_jobs += 1

    def reserve(self) -> Ticket:
        """Reserve a place before preparing a request (its body read and parsed), so that
        requests in preparation count against ``max_active + max_queue`` (their memory is
        bounded).

        Raises:
            CapacityError: the system is full, or stopping.
        """
        with self._cv:
            self._admit()
        return Ticket(self)

    def _unreserve(self) -> None:
        with self._cv:
            self._num_jobs -= 1
            self._cv.notify()

    def submit(
        self, make_request: Callable[[], Request], outbox: Outbox, ticket: Optional[Ticket] = None, tenant: str = ""
    ) -> Job:
        """Queue a generation, from any thread. ``make_request()`` runs in the worker and
        returns ``engine.start(...)`` (no forward; an exception there is delivered to the
        reader as the job's error). ``outbox``: where its items go. ``ticket``: the place
        reserved for it (spent here); None takes a new one. ``tenant``: whose it is
        (tenants are served in turn). Starts the worker if needed.

        Raises:
            CapacityError: no ticket and the system is full, or the stepper is stopping.
        """
        return self.submit_many([make_request], lambda: outbox, ticket, tenant)[0]

    def submit_many(
        self,
        make_requests: Sequence[Callable[[], Request]],
        outbox: Callable[[], Outbox],
        ticket: Optional[Ticket] = None,
        tenant: str = "",
    ) -> list[Job]:
        """:meth:`submit` for several generations at once (one outbox each from
        ``outbox()``), all of ``tenant``: the worker sees them together.
        ``ticket`` counts for the first of them.

        Raises:
            CapacityError: the system is full (then none is queued), or stopping.
        """
        jobs = [Job(make_request=m, outbox=outbox(), tenant=tenant) for m in make_requests]
        with self._cv:
            admitted = 0
            try:
                for i in range(len(jobs)):
                    if i == 0 and ticket is not None and not ticket.spent:
                        ticket.spent = True
                        if self._stopping:
                            self._num_jobs -= 1
                            raise CapacityError("the server is shutting down")
                    else:
                        self._admit()
                        admitted += 1
            except CapacityError:
                self._num_jobs -= admitted
                raise
            for job in jobs:
                job.id = next(self._ids)
                self._incoming.append(job)
            self._cv.notify()
            self._start_locked()
        return jobs

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the worker (no-op when it runs)."""
        with self._cv:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: jobs still in the system are closed (their readers get an error)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            self._thread = None

    # ------------------------------------------------------------------ worker side
    def _deliver(self, job: Job, kind: str, value: Any) -> None:
        try:
            job.outbox.put((kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            job.cancel()

    def _prepare(self, job: Job) -> bool:
        """Make the request (its prompt checked against the context length)."""
        try:
            job.request = job.make_request()
        except Exception as e:  # the request is invalid: its reader turns it into a 4xx
            self._deliver(job, ERROR, e)
            return False
        self._deliver(job, READY, None)
        return True

    def _notify(self, callback: Optional[Callable], *args) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # a metrics hook must never stop the worker
            logger.exception("stepper callback failed")

    def _release(self, job: Job) -> None:
        job.request = None  # its KV state is freed with it
        with self._cv:
            self._num_jobs -= 1

    def _sweep(self, jobs) -> None:
        """Drop the cancelled jobs of ``jobs`` (a list or deque), now."""
        for job in [j for j in jobs if j.cancelled.is_set()]:
            jobs.remove(job)
            self._release(job)
            self._notify(self.on_cancel, job)

    def _round(self, jobs: list[Job]) -> None:
        """One round over the prepared jobs: the composer's plan, one ``engine.step``;
        chunks delivered, finished jobs released."""
        if not jobs:
            return
        requests = [j.request for j in jobs]
        try:
            plan = self.composer.plan(self.engine.work(requests, [j.tenant for j in jobs]))  # type: ignore[arg-type]
            for i in plan.indices:
                if not jobs[i].activated_s:
                    jobs[i].activated_s = time.perf_counter()
                    self._notify(self.on_activate, jobs[i])
            self._num_active = sum(1 for j in jobs if j.activated_s)  # in flight, this step's included
            chunks = self.engine.step(requests, plan)  # type: ignore[arg-type]  # prepared jobs hold a request
        except Exception as e:
            logger.exception("step of requests %s failed", [j.id for j in jobs])
            for job in list(jobs):
                self._deliver(job, ERROR, e)
                jobs.remove(job)
                self._release(job)
            return
        self.steps += 1
        self.max_batch = max(self.max_batch, len(plan.indices))
        report = self.engine.last_step
        self.composer.observe(report.prefill_tokens, report.prefill_s, report.verified, report.rows, report.decode_s)
        self._notify(self.on_step, report)
        for job, chunk in zip(list(jobs), chunks):
            if chunk.finish_reason is not None:  # settled before its reader sees the end
                jobs.remove(job)
                self._release(job)
                self._notify(self.on_finish, job, chunk)
            if chunk.text or chunk.token_ids or chunk.finish_reason:
                self._deliver(job, CHUNK, chunk)

    def _in_flight(self, jobs: Sequence[Job]) -> int:
        return sum(1 for j in jobs if j.activated_s)

    def _run(self) -> None:
        jobs: list[Job] = []  # prepared: waiting or in flight, in arrival order
        # every step runs in inference mode, whichever generator exits its own block first
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._incoming or jobs):
                        self._cv.wait()
                    if self._stopping:
                        break
                    incoming = list(self._incoming)
                    self._incoming.clear()
                for job in incoming:
                    if job.cancelled.is_set():
                        self._release(job)
                        self._notify(self.on_cancel, job)
                    elif not self._prepare(job):
                        self._release(job)
                    else:
                        jobs.append(job)
                # a job whose reader left is dropped before the step: cancellation within one step
                self._sweep(jobs)
                self._num_active = self._in_flight(jobs)
                self._round(jobs)
                self._num_active = self._in_flight(jobs)
            # stopping: close what is left
            leftovers = list(jobs)
            with self._cv:
                leftovers += list(self._incoming)
                self._incoming.clear()
            for job in leftovers:
                self._deliver(job, ERROR, CapacityError("the server is shutting down"))
                self._release(job)


def choice_makers(engine: Engine, prepared: PreparedPrompt, params: RequestParams) -> list[Callable[[], Request]]:
    """The ``make_request`` of each of a request's ``params.n`` jobs (submit them together
    with :meth:`Stepper.submit_many`): the first called makes all the choices
    (:meth:`~ragspec.engine.Engine.start_choices`: one prefill shared), each job takes
    its own; one choice: ``engine.start(prepared, params)``."""
    if params.n == 1:
        return [lambda: engine.start(prepared, params)]
    made: list[list[Request]] = []

    def make(i: int) -> Request:
        if not made:
            made.append(engine.start_choices(prepared, params))
        return made[0][i]

    return [lambda i=i: make(i) for i in range(params.n)]  # type: ignore[misc]
