"""One thread computes: torch's OpenMP thread pool belongs to the thread that uses it.

torch's CPU kernels (and ragspec's compiled ones, through ``at::parallel_for``) run their
parallel loops on an OpenMP thread pool. GNU OpenMP (libgomp, which torch's Linux wheels
ship) keeps one pool *per thread that starts a parallel loop*, for the life of that
thread. Once a process holds more pool threads than CPUs, libgomp stops spinning between
loops (its "throttled" spin count is 100 iterations instead of 300,000) and every loop of
every pool wakes its threads through the kernel. A decoding step is hundreds of short
loops, so a model loaded (or warmed up) in one thread and stepped in another runs every
step slower: on the 2-core CPU, 128 tokens of the default model took 2.2 s stepped in the
thread that loaded it and 3.2 s in a second thread (2.2 s again once the loading thread's
pool was released).

Hence the front ends compute in one thread per process (the server's worker, the
LangChain classes' compute thread) and release the pool of a thread that only loaded the
model (:func:`release_openmp_pool`). Source: libgomp's ``env.c`` (``GOMP_SPINCOUNT``,
``gomp_throttled_spin_count_var``) and ``team.c`` (``gomp_pause_host``).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

__all__ = ["openmp_library", "release_openmp_pool"]

logger = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # OpenMP 5.0 omp_pause_resource_t: stop the threads, free the pool


def openmp_library(maps: str = "/proc/self/maps") -> Optional[str]:
    """The path of the GNU OpenMP runtime this process has loaded (torch's own copy where
    its wheel ships one), or None: not loaded, another runtime, or no ``/proc`` (not Linux)."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libgomp") and ".so" in name:
                    return path
    except OSError:
        return None
    return None


def release_openmp_pool() -> bool:
    """Stop and free the OpenMP thread pool of the *calling* thread (``omp_pause_resource_all
    (omp_pause_hard)``), so that the pools of the threads that compute are the only ones
    left. Harmless where the thread has none; a later parallel loop in this thread makes a
    new pool (a few milliseconds). Call it from a thread that loaded or warmed up a model
    which another thread will step, outside any parallel region.

    Returns:
        True where the runtime released the pool; False where the process has no GNU
        OpenMP runtime loaded (other platforms, another runtime) or it refused.
    """
    path = openmp_library()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same library, one more reference
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError) as e:  # a runtime older than OpenMP 5.0
        logger.debug("cannot release the OpenMP pool (%s): %s", path, e)
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(_OMP_PAUSE_HARD) == 0
