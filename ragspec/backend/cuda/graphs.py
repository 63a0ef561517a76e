"""The engine step captured as CUDA graphs over row-count buckets.

A step over R rows (:class:`~ragspec.backend.cuda.batch.FlatBatch`) runs in the smallest
bucket of at least R rows: the batch is packed straight into the bucket's pinned staging
buffer with padding rows (they write to the KV pool's scratch slot and attend only to it,
see :func:`~ragspec.backend.cuda.batch.pack_rows`), copied to the device in one transfer,
and the bucket's graph is replayed. :meth:`GraphRunner.capture_all` captures every bucket
up front (the target's factory calls it at load), each with
``capture_error_mode="thread_local"`` so that another thread's CUDA calls cannot
invalidate a capture; a bucket first used before that is captured then. Batches larger
than the largest bucket, with a longer draft-tree path than the static buffers hold, or
whose capture failed (logged) run eagerly; :attr:`GraphRunner.graph_steps` and
:attr:`GraphRunner.eager_steps` count both.

The runner does not know what a step computes: ``step(batch) -> Tensor | tuple[Tensor,
...]`` with R rows each, reading only the batch's tensors (no host synchronisation, no new
host->device copies: what a CUDA graph can replay). Capturing is a function too
(:data:`Capture`): torch's CUDA graphs on a GPU (:func:`cuda_graph_capture`); a test passes
one that replays eagerly, so the CPU checks that bucketing and padding never change a
row's values.

Buffers are made outside inference mode (whatever mode the first call runs in): a bucket
allocated under ``torch.inference_mode()`` (calibration) stays usable outside it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ...errors import ConfigError
from .batch import FlatBatch, RequestRows, batch_views, buffer_size, pack_rows, widen

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKETS", "Capture", "EagerRunner", "GraphRunner", "cuda_graph_capture"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Row counts a step is padded to (a verification step: 1 row per plain request, 1 + N per
drafted one; a prefill chunk: up to 256 rows, the engine's default chunk)."""

Outputs = Union[torch.Tensor, tuple[torch.Tensor, ...]]
Step = Callable[[FlatBatch], Outputs]
Capture = Callable[[Callable[[], Outputs]], Callable[[], Outputs]]
"""``capture(run) -> replay``: ``run()`` computes the step's output from the static buffers;
``replay()`` redoes that computation on the buffers' current values and returns the output."""


def cuda_graph_capture(
    run: Callable[[], Outputs], warmup: int = 2, pool: Optional[Any] = None
) -> Callable[[], Outputs]:
    """Capture ``run`` as a CUDA graph (after ``warmup`` eager runs on a side stream, as
    torch's docs ask) -> a replay function returning the graph's static output. ``pool``: a
    memory pool shared with other graphs that are never replayed at the same time (the
    runner's buckets). The capture is ``thread_local``: CUDA calls of other threads (a
    server's) neither fail nor invalidate it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = run()

    def replay() -> Outputs:
        graph.replay()
        return out

    return replay


def _cut(out: Outputs, rows: int) -> Outputs:
    """The first ``rows`` rows of each output (views)."""
    if isinstance(out, torch.Tensor):
        return out[:rows]
    return tuple(t[:rows] for t in out)


class EagerRunner:
    """Runs every step eagerly (CPU, or graphs off), the batch moved to ``device``.

    Attributes:
        eager_steps: steps run; graph_steps: 0.
    """

    def __init__(self, step: Step, device: torch.device | str = "cpu", path_width: int = 0) -> None:
        self.step = step
        self.device = torch.device(device)
        self.path_width = int(path_width)
        self.eager_steps = 0
        self.graph_steps = 0

    def __call__(self, batch: FlatBatch) -> Outputs:
        """The step's output over ``batch``'s real rows."""
        self.eager_steps += 1
        return _cut(self.step(batch.to(self.device)), batch.real_rows)

    def run(self, requests: Sequence[RequestRows]) -> tuple[Outputs, tuple[int, ...]]:
        """The step over ``requests``' rows -> (outputs of their rows, row offsets)."""
        batch = pack_rows(requests, path_width=self.path_width)
        return self(batch), batch.cu_rows


class GraphRunner:
    """Runs a step through per-bucket captured graphs (see the module docstring).

    Args:
        step: the step function.
        scratch_slot: the KV pool slot padding rows use.
        device: where the static buffers live.
        buckets: the row counts, increasing.
        path_width: the static buffers' draft-tree path width (longer paths run eagerly).
        capture: how to capture (default :func:`cuda_graph_capture`).

    Attributes:
        captured: the buckets captured so far; failed: those whose capture failed (eager).
        eager_steps, graph_steps: counters.

    Raises:
        ConfigError: no bucket, or buckets not increasing.
    """

    def __init__(
        self,
        step: Step,
        *,
        scratch_slot: int,
        device: torch.device | str,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        path_width: int = 80,
        capture: Optional[Capture] = None,
    ) -> None:
        buckets = tuple(int(b) for b in buckets)
        if not buckets or any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"graph buckets must be increasing positive row counts, got {buckets}")
        self.step = step
        self.scratch_slot = int(scratch_slot)
        self.device = torch.device(device)
        self.buckets = buckets
        self.path_width = int(path_width)
        self._capture = capture
        self._buffers: dict[int, FlatBatch] = {}
        self._staging: dict[int, torch.Tensor] = {}
        self._copied: dict[int, Any] = {}
        self._replays: dict[int, Callable[[], Outputs]] = {}
        self.failed: list[int] = []
        self.captured: list[int] = []
        self.eager_steps = 0
        self.graph_steps = 0

    @property
    def max_rows(self) -> int:
        """The largest bucket."""
        return self.buckets[-1]

    def bucket(self, rows: int) -> Optional[int]:
        """The smallest bucket of at least ``rows`` rows, or None."""
        return next((b for b in self.buckets if b >= rows), None)

    def staging(self, bucket: int) -> torch.Tensor:
        """The bucket's host staging buffer (pinned on CUDA), free to be written: the
        previous copy out of it has completed."""
        buf = self._staging.get(bucket)
        if buf is None:
            with torch.inference_mode(False):
                pin = self.device.type == "cuda"
                buf = torch.empty(buffer_size(bucket, self.path_width), dtype=torch.int32, pin_memory=pin)
            self._staging[bucket] = buf
        event = self._copied.pop(bucket, None)
        if event is not None:
            event.synchronize()
        return buf

    def run(self, requests: Sequence[RequestRows]) -> tuple[Outputs, tuple[int, ...]]:
        """The step over ``requests``' rows -> (outputs of their rows, row offsets): packed
        into the bucket's staging buffer, one copy, one replay (or eagerly, see the module
        docstring). The outputs are views of the graph's static outputs, valid until the
        next step."""
        rows = sum(len(r.tokens) for r in requests)
        bucket = self.bucket(rows)
        if bucket is None or bucket in self.failed:
            batch = pack_rows(requests, path_width=self.path_width if bucket else 0)
            return self(batch), batch.cu_rows
        try:
            batch = pack_rows(
                requests,
                path_width=self.path_width,
                rows=bucket,
                scratch_slot=self.scratch_slot,
                out=self.staging(bucket),
            )
        except ConfigError:  # a path wider than the static buffers: eager
            batch = pack_rows(requests)
        return self(batch), batch.cu_rows

    def __call__(self, batch: FlatBatch) -> Outputs:
        """The step's output over ``batch``'s real rows (padding rows cut off; views of
        the graph's static outputs, valid until the next step). ``batch`` may be on the
        host: it is padded there and copied into the bucket's buffers."""
        bucket = self.bucket(batch.rows)
        if bucket is None or batch.path_width > self.path_width or bucket in self.failed:
            self.eager_steps += 1
            return _cut(self.step(batch.to(self.device)), batch.real_rows)
        if batch.buffer is None or batch.rows != bucket or batch.path_width != self.path_width:
            batch = widen(batch.to("cpu"), bucket, self.path_width, self.scratch_slot)
        static = self._static(bucket)
        assert static.buffer is not None and batch.buffer is not None  # (both packed flat)
        static.buffer.copy_(batch.buffer, non_blocking=True)
        if self.device.type == "cuda" and batch.buffer.device.type == "cpu":
            event = torch.cuda.Event()
            event.record()
            self._copied[bucket] = event  # the staging buffer is rewritten only after this copy
        replay = self._replays.get(bucket)
        if replay is None:
            replay = self._capture_bucket(bucket)
            if replay is None:
                self.eager_steps += 1
                return _cut(self.step(static), batch.real_rows)
            # capturing ran the step on these buffers already (warm-up), with a side effect
            # on the pool that replaying again repeats identically: the same values land
            # in the same places
        self.graph_steps += 1
        return _cut(replay(), batch.real_rows)

    def capture_all(self) -> list[int]:
        """Capture every bucket not captured yet (on all-padding inputs: nothing but the
        scratch slot is written). Returns the buckets whose capture failed."""
        for bucket in self.buckets:
            if bucket in self._replays or bucket in self.failed:
                continue
            static = self._static(bucket)
            padding = pack_rows([], path_width=self.path_width, rows=bucket, scratch_slot=self.scratch_slot)
            assert static.buffer is not None and padding.buffer is not None  # (packed flat)
            static.buffer.copy_(padding.buffer)
            self._capture_bucket(bucket)
        return list(self.failed)

    def _static(self, bucket: int) -> FlatBatch:
        """The bucket's device buffers (made outside inference mode)."""
        static = self._buffers.get(bucket)
        if static is None:
            with torch.inference_mode(False):
                buf = torch.zeros(buffer_size(bucket, self.path_width), dtype=torch.int32, device=self.device)
            static = self._buffers[bucket] = batch_views(buf, bucket, self.path_width, (0, bucket))
        return static

    def _capture_bucket(self, bucket: int) -> Optional[Callable[[], Outputs]]:
        """Capture the bucket's graph (None, logged, when the capture fails)."""
        static = self._buffers[bucket]
        try:
            if self._capture is None:  # torch's CUDA graphs, one memory pool for all buckets
                pool = torch.cuda.graph_pool_handle()
                self._capture = lambda run: cuda_graph_capture(run, pool=pool)
            with torch.inference_mode(False), torch.no_grad():
                replay = self._capture(lambda: self.step(static))
        except Exception as e:  # a kernel that cannot be captured: this bucket stays eager
            logger.warning(
                "CUDA graph capture of the %d-row step failed (%s: %s); that bucket runs eagerly",
                bucket,
                type(e).__name__,
                e,
            )
            self.failed.append(bucket)
            return None
        self._replays[bucket] = replay
        self.captured.append(bucket)
        return replay
