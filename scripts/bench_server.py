"""Load test of ``POST /v1/summarize``: requests/s and latency percentiles at 1, 4 and 8
concurrent clients, speculation on vs off (the request field ``speculative``).

The documents are the articles of the Spec-Bench dev data's summarization prompts (the text
after "Summarize:"). By default the script starts ``ragspec serve`` on a free loopback port
(the real default model) and stops it at the end; ``--url`` targets a running server instead.
Requests stream, so the client measures both the time to the first summary text and the
whole latency. Every loop is bounded (``--requests`` per level) and only loopback is used.

    python scripts/bench_server.py --requests 8 --max-tokens 64 --json bench_server.json

With 8 to 16 requests per level, P95 and P99 are interpolated between the slowest few
requests: read them as "the tail", not as precise percentiles.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

DEV_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench-dev.jsonl"


def summarization_articles(path: Path, limit: int) -> list[str]:
    rows = [json.loads(line) for line in path.open(encoding="utf-8") if line.strip()]
    out = []
    for row in rows:
        if row["category"] != "summarization":
            continue
        turn = row["turns"][0].strip()
        out.append(turn.split(":", 1)[1].strip() if turn.lower().startswith("summarize:") else turn)
        if len(out) == limit:
            break
    return out


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = ["ragspec", "serve", "--host", "127.0.0.1", "--port", str(port), "--max-active", "8", "--max-queue", "64"]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    exe = Path(sys.executable).with_name("ragspec")
    if exe.exists():
        cmd[0] = str(exe)
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"ragspec serve exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("ragspec serve did not come up in 10 minutes")
        time.sleep(0.5)


def one_request(client: httpx.Client, url: str, body: dict) -> dict:
    """Streams one summary; returns its latency, time to first text, text and stats."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    final = {}
    with client.stream("POST", url + "/v1/summarize", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("summary"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(ev["summary"])
            if "stats" in ev:
                final = ev
    latency = time.perf_counter() - t0
    return {
        "latency_s": latency,
        "ttft_s": ttft if ttft is not None else latency,
        "text": "".join(parts),
        "stats": final.get("stats") or {},
    }


def run_level(
    url: str, articles: list[str], concurrency: int, num_requests: int, speculative: bool, max_tokens: int
) -> dict:
    bodies = [
        {"documents": [articles[i % len(articles)]], "max_tokens": max_tokens, "speculative": speculative}
        for i in range(num_requests)
    ]
    with httpx.Client(timeout=httpx.Timeout(900.0)) as client:
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda b: one_request(client, url, b), bodies))
        wall = time.perf_counter() - t0
    lat = np.array([r["latency_s"] for r in results])
    ttft = np.array([r["ttft_s"] for r in results])
    tokens = sum(r["stats"].get("num_generated_tokens", 0) for r in results)
    steps = sum(max(0, r["stats"].get("num_forward_passes", 1) - 1) for r in results)
    committed = sum(max(0, r["stats"].get("num_generated_tokens", 0) - 1) for r in results)
    return {
        "speculative": speculative,
        "concurrency": concurrency,
        "requests": num_requests,
        "wall_s": wall,
        "requests_per_s": num_requests / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": float(np.percentile(lat, 50)),
        "latency_p95_s": float(np.percentile(lat, 95)),
        "latency_p99_s": float(np.percentile(lat, 99)),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "mean_accepted_tokens": committed / steps if steps else 0.0,
        "texts": [r["text"] for r in results],
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server (default: start ragspec serve on loopback)")
    ap.add_argument("--data", type=Path, default=DEV_DATA)
    ap.add_argument("--requests", type=int, default=8, help="requests per (mode, concurrency) level")
    ap.add_argument("--levels", default="1,4,8", help="concurrent clients")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the started server (OMP_NUM_THREADS)")
    ap.add_argument("--json", type=Path, default=None, help="write all figures here")
    args = ap.parse_args(argv)

    articles = summarization_articles(args.data, args.requests)
    if not articles:
        raise SystemExit(f"no summarization prompts in {args.data}")
    levels = [int(x) for x in args.levels.split(",")]
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        # warm-up: one request per mode (first forwards are slow)
        for spec in (True, False):
            run_level(url, articles, 1, 1, spec, 8)
        rows = []
        # on and off alternate at each level, so both see the same (noisy) machine
        for c in levels:
            for spec in (True, False):
                row = run_level(url, articles, c, args.requests, spec, args.max_tokens)
                rows.append(row)
                print(
                    f"speculative={'on ' if spec else 'off'} clients={c}: {row['requests_per_s']:.3f} req/s, "
                    f"{row['tokens_per_s']:.1f} tok/s, latency P50/P95/P99 {row['latency_p50_s']:.2f}/"
                    f"{row['latency_p95_s']:.2f}/{row['latency_p99_s']:.2f} s, TTFT P50 {row['ttft_p50_s']:.2f} s, "
                    f"accepted/step {row['mean_accepted_tokens']:.2f}",
                    flush=True,
                )
        metrics = httpx.get(url + "/metrics", timeout=30).text
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    # lossless: the same request gives the same summary with speculation on and off
    on = {r["concurrency"]: r["texts"] for r in rows if r["speculative"]}
    off = {r["concurrency"]: r["texts"] for r in rows if not r["speculative"]}
    same = sum(a == b for c in on for a, b in zip(on[c], off.get(c, [])))
    total = sum(len(v) for v in on.values())
    print(f"\nidentical summaries, speculation on vs off: {same}/{total}")
    print("\n| speculative | clients | req/s | tok/s | P50 s | P95 s | P99 s | TTFT P50 s | accepted/step |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {'on' if r['speculative'] else 'off'} | {r['concurrency']} | {r['requests_per_s']:.3f} | {r['tokens_per_s']:.1f} | "
            f"{r['latency_p50_s']:.2f} | {r['latency_p95_s']:.2f} | {r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} | "
            f"{r['mean_accepted_tokens']:.2f} |"
        )
    speedups = []
    for c in levels:
        a = next(r for r in rows if r["speculative"] and r["concurrency"] == c)
        b = next(r for r in rows if not r["speculative"] and r["concurrency"] == c)
        speedups.append((c, a["requests_per_s"] / b["requests_per_s"]))
    print("\nthroughput speedup (on/off): " + ", ".join(f"{c} clients {s:.2f}x" for c, s in speedups))
    if args.json:
        out = {
            "settings": vars(args) | {"data": str(args.data), "json": str(args.json)},
            "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows],
            "identical": [same, total],
            "median_latency_ratio": statistics.median(
                b["latency_p50_s"] / a["latency_p50_s"]
                for a in rows
                if a["speculative"]
                for b in rows
                if not b["speculative"] and b["concurrency"] == a["concurrency"]
            ),
            "metrics": metrics,
        }
        args.json.write_text(json.dumps(out, indent=1, default=str))
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
