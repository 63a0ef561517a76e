"""The engine step captured as CUDA graphs over row-count buckets.

A step over R rows (:class:`~ragspec.backend.cuda.batch.FlatBatch`) runs in the smallest
bucket of at least R rows: the batch is padded to the bucket (padding rows write to the KV
pool's scratch slot and attend only to it, see :func:`~ragspec.backend.cuda.batch.pad_batch`),
copied into the bucket's static input buffers, and the bucket's graph is replayed; the
first step of a bucket captures it. Batches larger than the largest bucket, with a longer
draft-tree path than the static buffers hold, or whose capture failed, run eagerly.

The runner does not know what a step computes: ``step(batch) -> Tensor [R, ...]`` reads
only the batch's tensors (no host synchronisation, no new host->device copies: what a
CUDA graph can replay). Capturing is a function too (:data:`Capture`): torch's CUDA graphs
on a GPU (:func:`cuda_graph_capture`); a test passes one that replays eagerly, so the CPU
checks that bucketing and padding never change a row's values.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Any, Callable, Optional, Sequence

import torch

from ...errors import ConfigError
from .batch import FlatBatch, pad_batch

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_BUCKETS", "Capture", "EagerRunner", "GraphRunner", "cuda_graph_capture"]

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
"""Row counts a step is padded to (a verification step: 1 row per plain request, 1 + N per
drafted one)."""

Step = Callable[[FlatBatch], torch.Tensor]
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
"""``capture(run) -> replay``: ``run()`` computes the step's output from the static buffers;
``replay()`` redoes that computation on the buffers' current values and returns the output."""

_BATCH_TENSORS = tuple(f.name for f in fields(FlatBatch) if f.name != "cu_rows")


def cuda_graph_capture(
    run: Callable[[], torch.Tensor], warmup: int = 2, pool: Optional[Any] = None
) -> Callable[[], torch.Tensor]:
    """Capture ``run`` as a CUDA graph (after ``warmup`` eager runs on a side stream, as
    torch's docs ask) -> a replay function returning the graph's static output. ``pool``: a
    memory pool shared with other graphs that are never replayed at the same time (the
    runner's buckets: each output is copied out right after its replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


class EagerRunner:
    """Runs every step eagerly (CPU, or graphs off), the batch moved to ``device``."""

    def __init__(self, step: Step, device: torch.device | str = "cpu") -> None:
        self.step = step
        self.device = torch.device(device)

    def __call__(self, batch: FlatBatch) -> torch.Tensor:
        """The step's output over ``batch``'s rows."""
        return self.step(batch.to(self.device))


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
        captured: the buckets captured so far.
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
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._failed: set[int] = set()
        self.captured: list[int] = []
        self.eager_steps = 0
        self.graph_steps = 0

    def bucket(self, rows: int) -> Optional[int]:
        """The smallest bucket of at least ``rows`` rows, or None."""
        return next((b for b in self.buckets if b >= rows), None)

    def __call__(self, batch: FlatBatch) -> torch.Tensor:
        """The step's output over ``batch``'s rows (padding rows cut off). ``batch`` may be
        on the host: it is padded there and copied into the bucket's buffers."""
        bucket = self.bucket(batch.rows)
        if bucket is None or batch.path_width > self.path_width or bucket in self._failed:
            self.eager_steps += 1
            return self.step(batch.to(self.device))
        padded = _widen(pad_batch(batch, bucket, self.scratch_slot), self.path_width)
        buffers = self._buffers.get(bucket)
        if buffers is None:
            # (cu_rows: the step reads tensors only; the rows of a request are cut out after)
            buffers = self._buffers[bucket] = replace(
                padded,
                cu_rows=(0, bucket),
                **{n: torch.empty_like(getattr(padded, n), device=self.device) for n in _BATCH_TENSORS},
            )
        for name in _BATCH_TENSORS:
            getattr(buffers, name).copy_(getattr(padded, name), non_blocking=True)
        replay = self._replays.get(bucket)
        if replay is None:
            static = buffers
            try:
                if self._capture is None:  # torch's CUDA graphs, one memory pool for all buckets
                    pool = torch.cuda.graph_pool_handle()
                    self._capture = lambda run: cuda_graph_capture(run, pool=pool)
                replay = self._capture(lambda: self.step(static))
            except Exception as e:  # a kernel that cannot be captured: this bucket stays eager
                logger.warning(
                    "CUDA graph capture of the %d-row step failed (%s: %s); eager", bucket, type(e).__name__, e
                )
                self._failed.add(bucket)
                self.eager_steps += 1
                return self.step(batch.to(self.device))
            self._replays[bucket] = replay
            self.captured.append(bucket)
            # capturing ran the step on these buffers already (warm-up), with a side effect
            # on the pool that replaying again repeats identically: the same values land
            # in the same places
        self.graph_steps += 1
        out = replay()
        return out[: batch.rows].clone()


def _widen(batch: FlatBatch, width: int) -> FlatBatch:
    """``batch`` with its path padded with zeros to ``width`` columns."""
    extra = width - batch.path_width
    if extra <= 0:
        return batch
    pad = torch.zeros((batch.rows, extra), dtype=batch.path.dtype, device=batch.path.device)
    return replace(batch, path=torch.cat([batch.path, pad], dim=1))
