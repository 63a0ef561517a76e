"""Progress lines of the slow start-up steps: loading and de-quantizing the model, compiling
the CPU kernels, calibrating the latency model.

They go to the ``ragspec.progress`` logger (:data:`PROGRESS_LOGGER`) at INFO, never to
stdout: a library user sees them only when that logger (or its parents) logs INFO; the
``ragspec`` command line prints them to stderr unless ``-q``
(:func:`ragspec.cli.common.show_progress`).

Example, a first ``ragspec generate`` on a fresh machine (stderr)::

    ragspec: loading smollm2-135m-instruct (GGUF)...
    ragspec: de-quantizing SmolLM2-135M-Instruct-Q8_0.gguf (first load only, ~15 s)...
    ragspec: de-quantizing SmolLM2-135M-Instruct-Q8_0.gguf: done in 14.8 s
    ragspec: compiling the CPU decoding kernels (first use only, ~45 s)...
    ragspec: compiling the CPU decoding kernels: done in 44.0 s
    ragspec: loading smollm2-135m-instruct (GGUF): done in 60.1 s
    ragspec: calibrating the latency model (~10 s, at each start)...
    ragspec: calibrating the latency model: done in 9.6 s
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Iterator

__all__ = ["PROGRESS_LOGGER", "step"]

PROGRESS_LOGGER = "ragspec.progress"
"""The logger of the progress lines (INFO)."""

logger = logging.getLogger(PROGRESS_LOGGER)


@contextmanager
def step(what: str, note: str = "") -> Iterator[None]:
    """Log ``"<what> (<note>)..."`` on entry and ``"<what>: done in <s> s"`` on a normal
    exit (``"<what>: failed after <s> s"`` when the block raises; the error itself is
    the caller's to report).

    Args:
        what: the step, in the user's words ("compiling the CPU decoding kernels").
        note: how long it takes and how often ("first use only, ~45 s"); empty: none.
    """
    logger.info("%s%s...", what, f" ({note})" if note else "")
    t0 = time.perf_counter()
    try:
        yield
    except BaseException:
        logger.info("%s: failed after %.1f s", what, time.perf_counter() - t0)
        raise
    logger.info("%s: done in %.1f s", what, time.perf_counter() - t0)
