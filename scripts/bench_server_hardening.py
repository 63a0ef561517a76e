"""The server under hostile requests, on the real default model over loopback.

Starts ``python -m ragspec serve`` on a free loopback port (``--pythonpath`` picks which
checkout serves) and measures:

1. cancellation latency: 8 concurrent streaming completions; one client closes its socket
   (nothing else signals it); time until the server counts the generation cancelled
   (``ragspec_cancelled_requests_total``, polled every 2 ms), against the time between two
   events of a stream that goes on (one round of the worker over the 8 requests); then the
   same with 4 streams while 4 other clients keep sending long prompts (~3000 tokens,
   ``max_tokens`` 2), so that the worker's rounds hold long prefills;
2. small requests beside oversized ones: the p50 latency of small completions
   (``max_tokens`` 8) alone, and while a separate process sends a 50 MB JSON prompt (with a
   Content-Length), the same 50 MB chunked (no length) and 1 MB of ``documents``, rounds
   alternating so the machine's load hits both alike; the server's resident memory before,
   its peak during (sampled every 5 ms from /proc) and its high-water mark (VmHWM).

Every loop is bounded. Usage::

    python scripts/bench_server_hardening.py --json hardening.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from typing import Optional

import httpx

SMALL = {"prompt": "Question: what is the capital of France? Answer:", "max_tokens": 8}

_SENDER = textwrap.dedent(
    """
    import json, sys, time, httpx
    url = sys.argv[1]
    big = json.dumps({"prompt": "a" * 50_000_000, "max_tokens": 4}).encode()
    docs = json.dumps({"prompt": "x", "documents": ["the cat sat on the mat. " * 2000] * 20}).encode()
    def chunked():
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]
    print("ready", flush=True)
    with httpx.Client(timeout=600) as c:
        for _ in sys.stdin:
            out = []
            for name, body in (("50MB", big), ("50MB-chunked", chunked()), ("1MB-documents", docs)):
                t = time.perf_counter()
                try:
                    r = c.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
                    out.append([name, r.status_code, time.perf_counter() - t])
                except httpx.HTTPError as e:
                    out.append([name, type(e).__name__, time.perf_counter() - t])
            print(json.dumps(out), flush=True)
    """
)


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(pythonpath: Optional[str], threads: Optional[int]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "ragspec"]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += ["serve", "--host", "127.0.0.1", "--port", str(port), "--max-active", "8", "--max-queue", "32"]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"ragspec serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("ragspec serve did not come up in 10 minutes")
        time.sleep(0.5)


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(line.split()[1]) * 1024
    return out


class Stream:
    """A raw streaming completion: closing its socket is the client's only signal."""

    def __init__(self, port: int, i: int, max_tokens: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        # a count the model goes on with: no end of text before max_tokens
        prompt = ", ".join(str(n) for n in range(i, i + 12)) + ","
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + body)
        self.events: list[float] = []
        self.done = False
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while not self._stop:
                data = self.sock.recv(65536)
                if not data:
                    return
                now = time.perf_counter()
                self.events.extend([now] * data.count(b"data: "))
                self.done = self.done or b"[DONE]" in data

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class PrefillLoad:
    """``n`` clients sending long prompts back to back (each a long prefill, 2 tokens)."""

    def __init__(self, url: str, n: int) -> None:
        self.stop = threading.Event()
        text = "The committee reviewed the annual report and discussed the budget in detail. " * 200
        self.threads = [threading.Thread(target=self._run, args=(url, text + str(i)), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, url: str, text: str) -> None:
        with httpx.Client(timeout=600) as c:
            while not self.stop.is_set():
                c.post(url + "/v1/completions", json={"prompt": text, "max_tokens": 2})

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(600)


def cancellation(url: str, port: int, trials: int, num_streams: int = 8, prefill_clients: int = 0) -> dict:
    out = []
    for trial in range(trials):
        load = PrefillLoad(url, prefill_clients) if prefill_clients else None
        streams = [Stream(port, 8 * trial + i, 400) for i in range(num_streams)]
        deadline = time.monotonic() + 300
        while any(len(s.events) < 3 for s in streams) and time.monotonic() < deadline:
            time.sleep(0.05)  # every stream generates (prefills done)
        before = metric(url, "ragspec_cancelled_requests_total")
        assert not streams[0].done, "the victim finished before it left: use a longer max_tokens"
        t0 = time.perf_counter()
        streams[0].close()
        while metric(url, "ragspec_cancelled_requests_total") <= before and time.perf_counter() - t0 < 60:
            time.sleep(0.002)
        latency = time.perf_counter() - t0
        ev = streams[1].events
        gaps = [b - a for a, b in zip(ev, ev[1:]) if a > t0 - 3]
        out.append({"cancel_latency_s": latency, "round_s": statistics.median(gaps) if gaps else None})
        for s in streams[1:]:
            s.close()
        if load is not None:
            load.close()
        while metric(url, "ragspec_active_requests") > 0 and time.perf_counter() - t0 < 300:
            time.sleep(0.05)
    lat = [r["cancel_latency_s"] for r in out]
    rounds = [r["round_s"] for r in out if r["round_s"]]
    return {
        "trials": out,
        "cancel_latency_median_s": statistics.median(lat),
        "cancel_latency_max_s": max(lat),
        "round_median_s": statistics.median(rounds) if rounds else None,
    }


def small(c: httpx.Client, url: str) -> float:
    t = time.perf_counter()
    r = c.post(url + "/v1/completions", json=SMALL)
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def oversized(url: str, pid: int, rounds: int) -> dict:
    alone, during, refused = [], [], []
    rss_peak = [0]
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            rss_peak[0] = max(rss_peak[0], proc_status(pid)["VmRSS"])
            time.sleep(0.005)

    sender = subprocess.Popen(
        [sys.executable, "-c", _SENDER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert sender.stdout.readline().strip() == "ready"
        with httpx.Client(timeout=600) as c:
            for _ in range(3):
                small(c, url)
            before = proc_status(pid)
            th = threading.Thread(target=sample, daemon=True)
            th.start()
            for _ in range(rounds):
                alone.extend(small(c, url) for _ in range(3))
                sender.stdin.write("go\n")
                sender.stdin.flush()
                during.extend(small(c, url) for _ in range(3))
                refused.append(json.loads(sender.stdout.readline()))
            sampling.set()
            th.join(5)
            after = proc_status(pid)
    finally:
        sender.kill()
        sender.wait(30)
    p50a, p50d = statistics.median(alone), statistics.median(during)
    return {
        "small_p50_alone_s": p50a,
        "small_p50_during_s": p50d,
        "ratio": p50d / p50a,
        "small_alone_s": alone,
        "small_during_s": during,
        "oversized": refused,
        "rss_before_bytes": before["VmRSS"],
        "rss_peak_during_bytes": rss_peak[0],
        "vmhwm_before_bytes": before["VmHWM"],
        "vmhwm_after_bytes": after["VmHWM"],
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH of the served checkout (default: inherited)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    ap.add_argument("--trials", type=int, default=5, help="cancellation trials")
    ap.add_argument("--rounds", type=int, default=5, help="alone/during rounds of the oversized test")
    ap.add_argument("--skip-oversized", action="store_true", help="cancellation only")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    proc, url = start_server(args.pythonpath, args.threads)
    try:
        port = int(url.rsplit(":", 1)[1])
        res = {
            "cancellation": cancellation(url, port, args.trials),
            "cancellation_with_prefills": cancellation(url, port, args.trials, 4, 4),
        }
        for key, what in (
            ("cancellation", "8 streaming"),
            ("cancellation_with_prefills", "4 streaming + 4 long prefills"),
        ):
            c = res[key]
            gap = f"{c['round_median_s']:.3f} s" if c["round_median_s"] is not None else "n/a"
            print(
                f"cancellation with {what}: median {c['cancel_latency_median_s']:.3f} s, max "
                f"{c['cancel_latency_max_s']:.3f} s; event gap of a stream that goes on {gap}",
                flush=True,
            )
        if not args.skip_oversized:
            o = res["oversized"] = oversized(url, proc.pid, args.rounds)
            print(
                f"small p50 alone {o['small_p50_alone_s']:.3f} s, during oversized {o['small_p50_during_s']:.3f} s "
                f"({o['ratio']:.2f}x); oversized: {o['oversized']}",
                flush=True,
            )
            mib = 1 << 20
            print(
                f"server RSS before {o['rss_before_bytes'] / mib:.0f} MiB, peak during {o['rss_peak_during_bytes'] / mib:.0f}"
                f" MiB; VmHWM before {o['vmhwm_before_bytes'] / mib:.0f} MiB, after {o['vmhwm_after_bytes'] / mib:.0f} MiB"
            )
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        if proc.poll() is None:
            proc.kill()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
