"""One thread computes (:mod:`ragspec.backend.threads`): a thread that only loaded a model
gives its OpenMP pool back, so the pool of the thread that steps is the process's only one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ragspec.backend.threads import openmp_library

_CHECK = """
import json, os, threading, torch
from ragspec.backend.threads import release_openmp_pool

def count():
    return len(os.listdir("/proc/self/task"))

seen = {}

def in_a_fresh_thread():
    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    n0 = count()
    (x @ x).sum()  # a parallel loop: this thread's pool starts one more thread
    seen["with_pool"] = count() - n0
    seen["released"] = release_openmp_pool()
    seen["after"] = count() - n0
    (x @ x).sum()  # a later loop makes a new pool: nothing broke
    seen["again"] = count() - n0
    seen["release_twice"] = release_openmp_pool() and release_openmp_pool()

t = threading.Thread(target=in_a_fresh_thread)
t.start()
t.join(60)
print(json.dumps(seen))
"""


@pytest.mark.skipif(openmp_library() is None, reason="this torch does not run on GNU OpenMP (libgomp)")
def test_release_openmp_pool_stops_the_calling_threads_pool_threads():
    """Issue 41: a model loaded in one thread and stepped in another ran every step ~30-50%
    slower, because the loading thread's pool stayed alive beside the stepping thread's.
    Counted in a fresh interpreter: no other thread of the test process comes or goes."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"with_pool": 1, "released": True, "after": 0, "again": 1, "release_twice": True}


def test_openmp_library_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/libc.so.6\n"
        "7f02-7f03 r-xp 00000000 08:01 43 /venv/torch/lib/libgomp-a34b3233.so.1\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
    )
    assert openmp_library(str(maps)) == "/venv/torch/lib/libgomp-a34b3233.so.1"
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 42 /usr/lib/libc.so.6\n")
    assert openmp_library(str(maps)) is None
    assert openmp_library(str(tmp_path / "missing")) is None
