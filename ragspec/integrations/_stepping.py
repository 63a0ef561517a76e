"""Stepping an engine stream from a thread that is not the one that started it.

:meth:`ragspec.Engine.stream` returns a generator whose body runs inside
``torch.inference_mode()``. That mode is thread-local and its context manager restores the
state it found on entry: when several generators are interleaved on one thread, or one
generator is resumed from different threads (LangChain's ``run_in_executor``, the server's
worker), the first one to exit its ``with`` block turns the mode off under the others, whose
next forward then mixes inference tensors (their KV cache) with autograd and fails. Running
every ``next()`` / ``close()`` inside our own ``inference_mode`` makes each resumption see
the mode on, whatever the other generators did.

:class:`BatchStepper` steps all the requests open on one engine together, whichever
thread asks for a chunk (LangChain's ``batch`` / ``abatch`` and concurrent calls): one
``engine.step`` (one verification forward) per round for all of them, always computed in
the stepper's one compute thread (:mod:`ragspec.backend.threads`: torch's OpenMP pool is
per thread, and steps computed in several threads are each ~30-50% slower).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from typing import Callable, Iterator, Optional, Sequence

import torch

from ragspec.engine import Engine, Request
from ragspec.types import StreamChunk

__all__ = ["step", "close", "document_texts", "merge_stop", "BatchStepper", "Slot"]


class Slot:
    """One request open on a :class:`BatchStepper`: its chunks not read yet."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.chunks: collections.deque[StreamChunk] = collections.deque()
        self.finished = False  # its final chunk is in ``chunks`` (or was read)
        self.closed = False
        self.error: Optional[BaseException] = None


class BatchStepper:
    """Steps every open request of one engine together, whoever asks.

    A caller opens its request (:meth:`open`) and reads chunks (:meth:`next`); a reader
    with no chunk waiting either runs the next ``engine.step`` over *all* open requests
    (when no step is running: it becomes that round's leader) or waits for the running one.
    Chunks of the others are queued on their slots. Requests opened while a step runs join
    the next one. Each request's output is its solo output (the engine's batched step
    guarantees it). Thread-safe; every step runs in ``torch.inference_mode``, in the
    stepper's compute thread (named ``ragspec-compute_0``, started at the first step, ended
    by :meth:`shutdown` or at exit).

    Args:
        engine: the :class:`ragspec.Engine` whose requests are stepped.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._open: list[Slot] = []
        self._stepping = False
        self.steps = 0
        self.max_batch = 0
        """Most requests stepped together so far (for tests and logs)."""
        self._compute: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def _compute_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._cv:
            if self._compute is None:
                self._compute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ragspec-compute")
            return self._compute

    def shutdown(self) -> None:
        """End the compute thread (a later step starts a new one)."""
        with self._cv:
            compute, self._compute = self._compute, None
        if compute is not None:
            compute.shutdown(wait=True)

    def open(self, make_request: Callable[[], Request]) -> Slot:
        """Make a request (``make_request()``: ``engine.request(...)``, no forward) and open
        it. Raises what ``make_request`` raises."""
        with torch.inference_mode():
            slot = Slot(make_request())
        with self._cv:
            self._open.append(slot)
        return slot

    def next(self, slot: Slot) -> Optional[StreamChunk]:
        """The slot's next chunk (None after its final one), stepping all open requests
        as needed.

        Raises:
            Exception: the engine's step failed (every request of that step gets it).
        """
        while True:
            with self._cv:
                while True:
                    if slot.chunks:
                        return slot.chunks.popleft()
                    if slot.error is not None:
                        raise slot.error
                    if slot.finished or slot.closed:
                        return None
                    if not self._stepping:
                        break
                    self._cv.wait()
                batch = [s for s in self._open if not s.finished]
                self._stepping = True
            self._step(batch)

    def _step(self, batch: list[Slot]) -> None:
        """One engine step over ``batch`` (this thread is the round's leader; the step is
        computed in the compute thread)."""
        error: Optional[BaseException] = None
        chunks: list[StreamChunk] = []
        try:
            requests = [s.request for s in batch]
            chunks = self._compute_thread().submit(self._compute_step, requests).result()
        except BaseException as e:  # delivered to every request of the step
            error = e
            if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: also raised here
                raise
        finally:
            with self._cv:
                self._stepping = False
                self.steps += 1
                self.max_batch = max(self.max_batch, len(batch))
                for i, s in enumerate(batch):
                    if error is not None:
                        s.error, s.finished = error, True
                    else:
                        chunk = chunks[i]
                        if not s.closed and (chunk.text or chunk.token_ids or chunk.finish_reason):
                            s.chunks.append(chunk)
                        s.finished = chunk.finish_reason is not None
                # finished requests and closed ones (cancelled: never stepped again) leave
                self._open = [s for s in self._open if not (s.finished or s.closed)]
                self._cv.notify_all()

    def _compute_step(self, requests: list[Request]) -> list[StreamChunk]:
        with torch.inference_mode():
            return self.engine.step(requests)

    def close(self, slot: Slot) -> None:
        """Stop reading ``slot``: an unfinished request is cancelled (ended at the next
        step, without a forward; dropped now when no step holds it)."""
        with self._cv:
            slot.closed = True
            slot.chunks.clear()
            if slot.finished:
                return
            slot.request.cancel()
            if not self._stepping and slot in self._open:
                self._open.remove(slot)
                slot.finished = True


def step(iterator: Iterator[StreamChunk], lock: Optional[threading.Lock] = None) -> Optional[StreamChunk]:
    """The next chunk of ``iterator`` (None once it is exhausted), computed in inference
    mode and, when ``lock`` is given, while holding it (one engine step at a time)."""
    if lock is None:
        with torch.inference_mode():
            return next(iterator, None)
    with lock, torch.inference_mode():
        return next(iterator, None)


def close(iterator: Iterator[StreamChunk], lock: Optional[threading.Lock] = None) -> None:
    """Close an engine stream (ends its generation, frees its KV cache)."""
    closer = getattr(iterator, "close", None)
    if closer is None:
        return
    if lock is None:
        with torch.inference_mode():
            closer()
        return
    with lock, torch.inference_mode():
        closer()


def document_texts(documents) -> list[str]:
    """Texts of ``documents``: strings as they are, LangChain ``Document`` s by their
    ``page_content``; a single string or Document counts as a list of one.

    Raises:
        TypeError: an item is neither.
    """
    if documents is None:
        return []
    if isinstance(documents, str) or hasattr(documents, "page_content"):
        documents = [documents]
    out = []
    for d in documents:
        if isinstance(d, str):
            out.append(d)
        elif isinstance(getattr(d, "page_content", None), str):
            out.append(d.page_content)
        else:
            raise TypeError(f"documents must be strings or Documents, got {type(d).__name__}")
    return out


def merge_stop(*lists: Optional[Sequence[str]]) -> list[str]:
    """Union of stop-string lists, first occurrence order kept, empty strings dropped.

    A single string counts as a list of one."""
    out: list[str] = []
    for stops in lists:
        if stops is None:
            continue
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if s and s not in out:
                out.append(s)
    return out
