"""Load test (issue 17): oversized requests among normal ones, on a live uvicorn over the
tiny random Llama (127.0.0.1 only). The oversized ones are refused (413; 400 for documents
over their character limit) while the normal ones keep their usual latency.

Bounded: a fixed number of rounds and requests, every call with a timeout. Rounds alternate
"alone" and "during" so that the load of a shared test machine hits both alike. The same
measurement on the real default model: ``scripts/bench_server_hardening.py`` (docs/server.md)."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import textwrap
import time

import httpx
from _integ_helpers import LiveServer

from ragspec.integrations.server import ServerSettings, create_app

SMALL = {"prompt": "the cat sat on the mat. the cat", "max_tokens": 8}

# its own process, so that building and sending 50 MB costs the server's process nothing:
# on each line read, it sends a 50 MB prompt (with a Content-Length), the same chunked (no
# length: refused once 2 MiB arrived) and 780 kB of documents, then prints their statuses
_SENDER = textwrap.dedent(
    """
    import json, sys, httpx
    url = sys.argv[1]
    big = json.dumps({"prompt": "a" * 50_000_000, "max_tokens": 4}).encode()
    docs = json.dumps({"prompt": "x", "documents": ["the cat sat. " * 5000] * 12}).encode()
    def chunked():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]
    print("ready", flush=True)
    with httpx.Client(timeout=60) as c:
        for _ in sys.stdin:
            out = []
            for body in (big, chunked(), docs):
                r = c.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
                out.append(r.status_code)
            print(json.dumps(out), flush=True)
    """
)


def _small(c: httpx.Client, url: str) -> float:
    t = time.perf_counter()
    r = c.post(url + "/v1/completions", json=SMALL)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def _cpu_s() -> float:
    """CPU seconds of this process (the server runs in it; the sender does not)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def test_oversized_requests_among_normal_ones_leave_their_latency_alone(tiny_engine):
    app = create_app(engine=tiny_engine, settings=ServerSettings(max_body_bytes=2 << 20))
    alone: list[float] = []
    during: list[float] = []
    statuses: list[int] = []
    refuse_cpu: list[float] = []
    with LiveServer(app) as srv, httpx.Client(timeout=60) as c:
        sender = subprocess.Popen(
            [sys.executable, "-c", _SENDER, srv.url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert sender.stdout.readline().strip() == "ready"
            for _ in range(3):
                _small(c, srv.url)  # warm up
            for _ in range(5):
                alone.extend(_small(c, srv.url) for _ in range(3))
                sender.stdin.write("go\n")
                sender.stdin.flush()
                # small requests while the three oversized ones are sent and refused
                during.append(_small(c, srv.url))
                during.append(_small(c, srv.url))
                statuses += json.loads(sender.stdout.readline())
            for _ in range(2):  # what refusing them costs the server, nothing else running
                cpu0 = _cpu_s()
                sender.stdin.write("go\n")
                sender.stdin.flush()
                statuses += json.loads(sender.stdout.readline())
                refuse_cpu.append(_cpu_s() - cpu0)
        finally:
            sender.kill()
            sender.wait(30)
        assert app.state.scheduler.num_jobs == 0
    assert statuses == [413, 413, 400] * 7, statuses
    # the server spends milliseconds on them (measured ~20 ms for the three): the 50 MB one
    # is refused unread, the chunked one after 2 MiB, the documents before tokenizing
    assert statistics.median(refuse_cpu) < 0.3, refuse_cpu
    p50_alone, p50_during = statistics.median(alone), statistics.median(during)
    # the original stall: a 2-token request timed out after 45 s while a 50 MB prompt was
    # tokenized; now the p50 holds. 0.25 s of absolute slack: on a shared 2-core test
    # machine the sender's own copying of 100 MB competes with the server for the CPU
    assert p50_during <= 1.5 * p50_alone + 0.25, (p50_alone, p50_during)
