"""One worker thread owns the model and interleaves the active requests step by step.

Glossary:
    ticket: a place in the system, reserved (:meth:`Scheduler.reserve`) once a request's
        body is read and parsed, so that requests being prepared count against the bound too
        (requests still being read have places of their own: the server's admission).
    job: one request's generation: its engine and :class:`~ragspec.engine.Request`, its
        asyncio queue, its cancel flag.
    incoming: submitted jobs not yet seen by the worker.
    waiting: jobs whose request is made (prompt checked) but not started.
    active: jobs being generated; each round is one ``engine.step`` over all of them (per
        target model: engines for other datastores share it), that is one verification
        forward for the whole batch (prefills run in the same step, one by one).

The model is shared, per-request state (KV cache, draft session, generator) lives in each
job's request, so a job's output is what the same request gives alone. Chunks go to the
event loop with ``loop.call_soon_threadsafe``. Admission is bounded: at most
``max_active + max_queue`` tickets and jobs are in the system; one more raises
:class:`CapacityError` (the server answers 429). A cancelled job (client gone) is dropped
before its next step, wherever it is (incoming, waiting or active).

Admission to the active set is by count (``max_active``) and by a token budget per step
(``max_step_tokens``): a waiting job starts only while the active jobs' next-step tokens
(``Engine.step_tokens``: a prefill chunk, or root + most draft rows) plus its first prefill
chunk fit the budget (one job always runs). Prompts are prefilled in chunks
(``PolicyConfig.prefill_chunk_tokens``) inside the same steps as the others' decoding, and
every active job advances at every step.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from ragspec.engine import Engine, Request, StepReport
from ragspec.errors import CapacityError
from ragspec.types import StreamChunk

logger = logging.getLogger(__name__)

__all__ = ["Job", "Scheduler", "Ticket"]

READY = "ready"
CHUNK = "chunk"
ERROR = "error"
GONE = "gone"
"""Put on a job's queue by the event loop when its client disconnected."""


class Ticket:
    """A place reserved in a :class:`Scheduler` (see :meth:`Scheduler.reserve`): used by
    :meth:`Scheduler.submit`, or given back with :meth:`release`."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self._scheduler = scheduler
        self.spent = False

    def release(self) -> None:
        """Give the place back (no-op once spent or released)."""
        if not self.spent:
            self.spent = True
            self._scheduler._unreserve()


@dataclass(eq=False)
class Job:
    """One request's generation, shared by the event loop (reader) and the worker (writer).

    Items arrive on ``queue`` as ``(kind, value)``: ``("ready", None)`` once the prompt is
    accepted, then ``("chunk", StreamChunk)`` until one has a ``finish_reason``; or
    ``("error", exception)`` instead of ``ready`` when the request is invalid (or the
    engine fails).
    """

    make_request: Callable[[], tuple[Engine, Request]]
    """Run in the worker: ``(engine, engine.request(...))`` (no forward)."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    id: int = 0
    submitted_s: float = field(default_factory=time.perf_counter)
    activated_s: float = 0.0
    """``time.perf_counter()`` when it joined the active set (0 before)."""
    cancelled: threading.Event = field(default_factory=threading.Event)
    engine: Optional[Engine] = None
    """The engine stepping this job (set by the worker; None once released)."""
    request: Optional[Request] = None
    """Its request: KV state, draft session, generator (set by the worker; None once released)."""

    def stepped(self) -> tuple[Engine, Request]:
        """Its engine and request (a waiting or active job has both)."""
        assert self.engine is not None and self.request is not None, f"job {self.id} has no request"
        return self.engine, self.request

    def cancel(self) -> None:
        """Ask the worker to drop this job (within one step)."""
        self.cancelled.set()

    async def next_item(self) -> tuple[str, Any]:
        return await self.queue.get()


class Scheduler:
    """The worker thread and its bounded admission.

    Args:
        max_active: generations interleaved at once.
        max_queue: jobs allowed to wait beyond the active ones.
        on_finish: called in the worker with ``(job, final_chunk)`` when a generation ends
            normally (metrics).
        on_cancel: called in the worker with ``(job)`` when a cancelled job is dropped.
        max_step_tokens: token budget of one step (prefill chunk tokens + verification
            rows of all active jobs) for admitting waiting jobs; None: count only.
        on_step: called in the worker with ``(report)`` after each engine step
            (:class:`~ragspec.engine.StepReport`; metrics).
        on_activate: called in the worker with ``(job)`` when a job joins the active set
            (its queue time is ``job.activated_s - job.submitted_s``).
    """

    def __init__(
        self,
        *,
        max_active: int = 8,
        max_queue: int = 32,
        on_finish: Optional[Callable[[Job, StreamChunk], Any]] = None,
        on_cancel: Optional[Callable[[Job], Any]] = None,
        max_step_tokens: Optional[int] = 512,
        on_step: Optional[Callable[[StepReport], Any]] = None,
        on_activate: Optional[Callable[[Job], Any]] = None,
    ) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self.max_step_tokens = max_step_tokens
        self.on_finish = on_finish
        self.on_cancel = on_cancel
        self.on_step = on_step
        self.on_activate = on_activate
        self._cv = threading.Condition()
        self._incoming: collections.deque[Job] = collections.deque()
        self._num_jobs = 0
        self._num_active = 0
        self._stopping = False
        self._ids = itertools.count(1)
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ event-loop side
    @property
    def num_jobs(self) -> int:
        """Requests in the system: reserved (being prepared) + incoming + waiting + active."""
        return self._num_jobs

    @property
    def num_active(self) -> int:
        return self._num_active

    def _admit(self) -> None:
        """Count one more request in the system (hold ``_cv``)."""
        if self._stopping:
            raise CapacityError("the server is shutting down")
        if self._num_jobs >= self.max_active + self.max_queue:
            raise CapacityError(
                f"the request queue is full ({self._num_jobs} requests in progress or waiting); retry later"
            )
        self._num_jobs += 1

    def reserve(self) -> Ticket:
        """Reserve a place before preparing a request (its body read and parsed), so that
        requests in preparation count against ``max_active + max_queue`` (their memory is
        bounded).

        Raises:
            CapacityError: the system is full.
        """
        with self._cv:
            self._admit()
        return Ticket(self)

    def _unreserve(self) -> None:
        with self._cv:
            self._num_jobs -= 1
            self._cv.notify()

    def submit(self, make_request: Callable[[], tuple[Engine, Request]], ticket: Optional[Ticket] = None) -> Job:
        """Queue a generation; call from the event loop. ``make_request()`` runs in the worker
        and returns ``(engine, engine.request(...))`` (no forward; an exception there is
        delivered to the reader as the request's error). ``ticket``: the place reserved for
        it (spent here); None takes a new one.

        Raises:
            CapacityError: no ticket and ``max_active + max_queue`` jobs are in the system.
        """
        loop = asyncio.get_running_loop()
        job = Job(make_request=make_request, loop=loop, queue=asyncio.Queue())
        with self._cv:
            if ticket is not None and not ticket.spent:
                ticket.spent = True
                if self._stopping:
                    self._num_jobs -= 1
                    raise CapacityError("the server is shutting down")
            else:
                self._admit()
            job.id = next(self._ids)
            self._incoming.append(job)
            self._cv.notify()
        return job

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="ragspec-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: jobs still in the system are closed (their readers get an error)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    # ------------------------------------------------------------------ worker side
    def _deliver(self, job: Job, kind: str, value: Any) -> None:
        try:
            job.loop.call_soon_threadsafe(job.queue.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            job.cancel()

    def _prepare(self, job: Job) -> bool:
        """Make the request (its prompt checked against the context length)."""
        try:
            job.engine, job.request = job.make_request()
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
            logger.exception("scheduler callback failed")

    def _release(self, job: Job) -> None:
        job.engine = job.request = None  # its KV state is freed with it
        with self._cv:
            self._num_jobs -= 1

    def _sweep(self, jobs) -> None:
        """Drop the cancelled jobs of ``jobs`` (a list or deque), now."""
        for job in [j for j in jobs if j.cancelled.is_set()]:
            jobs.remove(job)
            self._release(job)
            self._notify(self.on_cancel, job)

    def _step(self, active: list[Job]) -> None:
        """One round: one ``engine.step`` per target model over its active jobs; chunks
        delivered, finished jobs released."""
        groups: dict[int, list[Job]] = {}
        for job in active:
            groups.setdefault(id(job.stepped()[0].target), []).append(job)
        for jobs in groups.values():
            engine = jobs[0].stepped()[0]
            try:
                chunks = engine.step([j.stepped()[1] for j in jobs])
            except Exception as e:
                logger.exception("step of requests %s failed", [j.id for j in jobs])
                for job in jobs:
                    self._deliver(job, ERROR, e)
                    active.remove(job)
                    self._release(job)
                continue
            self._notify(self.on_step, engine.last_step)
            for job, chunk in zip(jobs, chunks):
                if chunk.text or chunk.token_ids or chunk.finish_reason:
                    self._deliver(job, CHUNK, chunk)
                if chunk.finish_reason is not None:
                    active.remove(job)
                    self._release(job)
                    self._notify(self.on_finish, job, chunk)

    @staticmethod
    def _tokens(job: Job) -> int:
        """Tokens ``job`` puts through the model in its next step."""
        engine, request = job.stepped()
        return int(engine.step_tokens(request))

    def _admit_waiting(self, waiting, active: list[Job]) -> None:
        """Move waiting jobs to the active set, in order, while the count and the step's
        token budget allow (at least one active job)."""
        budget = self.max_step_tokens
        used = sum(self._tokens(j) for j in active) if budget is not None else 0
        while waiting and len(active) < self.max_active:
            need = self._tokens(waiting[0]) if budget is not None else 0
            if budget is not None and active and used + need > budget:
                break
            job = waiting.popleft()
            job.activated_s = time.perf_counter()
            active.append(job)
            used += need
            self._notify(self.on_activate, job)

    def _run(self) -> None:
        waiting: collections.deque[Job] = collections.deque()
        active: list[Job] = []
        # every step runs in inference mode, whichever generator exits its own block first
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not (self._stopping or self._incoming or waiting or active):
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
                        waiting.append(job)
                self._sweep(waiting)
                self._admit_waiting(waiting, active)
                self._num_active = len(active)
                # a job whose client left is dropped before the step: cancellation within one step
                self._sweep(active)
                self._num_active = len(active)
                self._step(active)
                self._num_active = len(active)
            # stopping: close what is left
            leftovers = active + list(waiting)
            with self._cv:
                leftovers += list(self._incoming)
                self._incoming.clear()
            for job in leftovers:
                self._deliver(job, ERROR, CapacityError("the server is shutting down"))
                self._release(job)
