"""Where the milliseconds of one solo ``ragspec serve`` request go.

Starts ``ragspec serve`` (the arguments after ``--`` are passed on; the response cache is off
so no answer is replayed), warms it with one request, then sends each Spec-Bench dev prompt
once, streamed through ``/v1/chat/completions``, one at a time. For each request it reads the
server's Prometheus counters before and after and splits the client's wall time into:

    transport+http   client wall time - the server's own latency (arrival to last byte)
    queue            admitted -> first step (``ragspec_queue_time_seconds``)
    prefill          prefill forwards (``ragspec_prefill_seconds``)
    draft            drafting (``ragspec_draft_seconds``)
    verify           verification forwards and KV commits (``ragspec_verify_seconds``)
    rest             the server's latency minus all of the above: parsing, tokenization,
                     the scheduler's rounds, detokenization, SSE framing

    python scripts/profile_server_request.py --prompts 3 -- --threads 2

Compare with ``ragspec bench --serve --serve-phases engine`` (the same prompts through
``engine.generate``). Timings are only comparable within one run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ragspec.specbench import DEFAULT_DATA, load_prompts  # noqa: E402

COUNTERS = {
    "latency": r'ragspec_request_latency_seconds_sum\{endpoint="/v1/chat/completions"\} ([0-9.e+-]+)',
    "queue": r"ragspec_queue_time_seconds_sum ([0-9.e+-]+)",
    "prefill": r"ragspec_prefill_seconds_total ([0-9.e+-]+)",
    "draft": r"ragspec_draft_seconds_total ([0-9.e+-]+)",
    "verify": r"ragspec_verify_seconds_total ([0-9.e+-]+)",
    "steps": r"ragspec_steps_total ([0-9.e+-]+)",
}


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    text = client.get(url + "/metrics").text
    out = {}
    for name, pattern in COUNTERS.items():
        m = re.search(pattern, text)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def one_request(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    """(wall s, time to first content s, completion tokens) of one streamed chat request."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft, tokens = 0.0, 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not ttft and chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return time.perf_counter() - t0, ttft, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=DEFAULT_DATA)
    ap.add_argument("--categories", default="rag")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per category")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("serve_args", nargs="*", help="after --: more ragspec serve options")
    args = ap.parse_args()
    rows = load_prompts(args.data, args.categories.split(","), args.prompts + 1, required=True)
    warm, rows = rows[0], rows[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ragspec", "serve", "--port", str(port), "--no-response-cache", "-q", *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=600) as client:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                try:
                    if client.get(url + "/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None:
                    raise SystemExit(f"ragspec serve exited with {proc.returncode}")
                time.sleep(0.5)
            one_request(client, url, warm["turns"][0], args.max_tokens)
            time.sleep(0.3)  # the worker records a request's seconds after its last byte
            print("wall_s  ttft_s  tokens  transport+http  queue  prefill  draft  verify  rest  steps")
            for row in rows:
                before = scrape(client, url)
                wall, ttft, tokens = one_request(client, url, row["turns"][0], args.max_tokens)
                time.sleep(0.3)  # the worker records a request's seconds after its last byte
                after = scrape(client, url)
                d = {k: after[k] - before[k] for k in COUNTERS}
                rest = d["latency"] - d["queue"] - d["prefill"] - d["draft"] - d["verify"]
                print(
                    f"{wall:6.3f}  {ttft:6.3f}  {tokens:6d}  {wall - d['latency']:14.3f}  {d['queue']:5.3f}  "
                    f"{d['prefill']:7.3f}  {d['draft']:5.3f}  {d['verify']:6.3f}  {rest:5.3f}  {int(d['steps'])}"
                )
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
