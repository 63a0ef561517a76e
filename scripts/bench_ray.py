"""One ``ragspec serve`` against ``ragspec serve --ray`` with 1 and 2 replicas, side by side:
aggregate tokens/s and latency P50/P95 of streamed ``/v1/summarize`` requests at 8
concurrent clients (speculation on, the server default), on the real default model.

Each configuration is started with the real command on a free loopback port, warmed up with
one request, measured, then stopped with Ctrl-C (SIGINT), as a user would. The requests and
the client are :mod:`bench_server`'s. Every loop is bounded and only loopback is used.

    python scripts/bench_ray.py --requests 16 --max-tokens 64 --json bench_ray.json

On a machine with C cores, compare ``--replicas`` up to C with one thread each against one
server with C threads: replicas add whole engines (data parallelism), threads make one
engine's forwards faster.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_server import DEV_DATA, free_port, run_level, summarization_articles


def start(cmd: list[str], url: str, env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{' '.join(cmd)} exited with {proc.returncode}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("the server did not come up in 15 minutes")
        time.sleep(1.0)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def main(argv: Optional[list[str]] = None) -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEV_DATA)
    ap.add_argument("--requests", type=int, default=16, help="requests per configuration")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--model", default=None)
    ap.add_argument(
        "--cores", type=int, default=os.cpu_count() or 1, help="threads of the single server, most replicas"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    articles = summarization_articles(args.data, args.requests)
    if not articles:
        raise SystemExit(f"no summarization prompts in {args.data}")
    exe = (
        str(Path(sys.executable).with_name("ragspec"))
        if Path(sys.executable).with_name("ragspec").exists()
        else "ragspec"
    )
    common = ["--max-active", "8", "--max-queue", "64"] + (["--model", args.model] if args.model else [])
    configs = [
        (
            f"ragspec serve, {args.cores} threads",
            [exe, "--threads", str(args.cores), "serve"],
            {"OMP_NUM_THREADS": str(args.cores)},
        ),
        ("ragspec serve, 1 thread", [exe, "--threads", "1", "serve"], {"OMP_NUM_THREADS": "1"}),
    ]
    for n in sorted({1, args.cores}):
        ray = ["--ray", "--replicas", str(n), "--cpus-per-replica", "1", "--threads-per-replica", "1"]
        configs.append((f"ragspec serve --ray, {n} replica(s) x 1 thread", [exe, "serve", *ray], {}))
    rows = []
    for name, cmd, extra_env in configs:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, **extra_env)
        t0 = time.perf_counter()
        proc = start(cmd + ["--host", "127.0.0.1", "--port", str(port), *common], url, env)
        up_s = time.perf_counter() - t0
        try:
            run_level(url, articles, 1, 1, True, 8)  # warm-up (first forwards are slow)
            row = run_level(url, articles, args.clients, args.requests, True, args.max_tokens)
        finally:
            stop(proc)
        row.update(config=name, start_s=up_s)
        rows.append(row)
        print(
            f"{name}: {row['tokens_per_s']:.1f} tok/s, latency P50/P95 {row['latency_p50_s']:.2f}/"
            f"{row['latency_p95_s']:.2f} s, TTFT P50 {row['ttft_p50_s']:.2f} s, up in {up_s:.0f} s",
            flush=True,
        )
    base = rows[0]
    same = [sum(a == b for a, b in zip(base["texts"], r["texts"])) for r in rows]
    print(f"\n{args.clients} clients, {args.requests} summaries of {args.max_tokens} tokens, speculation on\n")
    print("| configuration | tok/s | req/s | P50 s | P95 s | TTFT P50 s | accepted/step | same text as row 1 |")
    print("|---|---|---|---|---|---|---|---|")
    for r, s in zip(rows, same):
        print(
            f"| {r['config']} | {r['tokens_per_s']:.1f} | {r['requests_per_s']:.3f} | {r['latency_p50_s']:.2f} | "
            f"{r['latency_p95_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['mean_accepted_tokens']:.2f} | {s}/{len(r['texts'])} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "settings": vars(args) | {"data": str(args.data), "json": str(args.json)},
                    "rows": [{k: v for k, v in r.items() if k != "texts"} for r in rows],
                    "same_text": same,
                },
                indent=1,
                default=str,
            )
        )
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
