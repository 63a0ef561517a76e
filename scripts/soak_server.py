"""A bounded soak of ``ragspec serve`` with slow-body sockets, then a warm restart.

Starts ``python -m ragspec serve`` on a free loopback port (``--pythonpath`` picks which
checkout serves; its log goes to ``--server-log``) and runs two phases of ``--minutes`` each:

A. ``--clients`` client threads (8) sending mixed requests back to back, with ``max_tokens``
   drawn from ``--max-tokens`` (16-48): non-streaming completions (rag and qa prompts),
   streaming chats (rag, qa and summarization turns) and ``/v1/summarize`` (summarization
   articles), prompts from the Spec-Bench dev data truncated to ``--prompt-chars`` (~400
   tokens). ``--disconnect`` (15%) of the streams close their socket at a random event;
B. the same, plus ``--slow-sockets`` (20) raw sockets throughout, each sending complete headers
   with a ``Content-Length`` of ``--slow-body-bytes`` (300), then one body byte every
   ``--slow-interval`` (1 s), and opening again when the server cuts it (408 or a close).

Per phase: requests, status counts (a 5xx or a transport error on a normal client is a
failure), the P50/P95 latency of the normal clients' completed requests (disconnected streams
left out), how the slow sockets were cut and after how long, and the server's RSS sampled
every second from /proc: start, at the first minute (half the phase when shorter), end, max;
"flat" = the end within 15% + 50 MiB of the first-minute value. Then the restart: SIGTERM,
start again with the same cache folder (a warm calibration cache), and the seconds from the
spawn to ``/health`` 200 and to ``/ready`` 200.

With ``--keys N`` the server has N tenant API keys (client i sends key i mod N)
and one ``--admin-key``, serves a datastore (``--datastore DIR``, else one built at start from
``--seed-docs`` summarization articles of the dev data, in a temporary folder) that requests
draft from by default, and an adder thread, the admin tenant, adds 1-3 documents (chunks of
the dev data's rag passages and articles) every ``--add-interval`` seconds throughout both
phases, each with an ``Idempotency-Key`` and retried with it (up to 3 times) after a transport
error or a 500. Every addition is either visible or refused: the documents the server lists
(``GET /v1/datastores``) and those on disk after the stop equal the start's plus those of the
additions answered 200 (a replayed answer counted once); 503 ``datastore_busy`` and other
4xx are refusals. The server's open files (``/proc/PID/fd``) are sampled with its RSS:
"flat" = the end within 10% + 16 of the first-minute value.

The server runs with ``--no-response-cache`` unless ``--response-cache`` is given: the soak
repeats 200 prompts, and answers from the response cache would measure nothing. Every loop is
bounded in time; Ctrl-C stops every thread, closes every socket and stops the server. Only
loopback addresses. Usage::

    python scripts/soak_server.py --minutes 10 --json soak.json
    python scripts/soak_server.py --minutes 10 --keys 4 --json soak-keys.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Optional

import httpx

DEV_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "specbench-dev.jsonl"
HOST = "127.0.0.1"
MIB = 1 << 20
# request kinds and their shares of a client's requests
KINDS = (("completion", 0.4), ("chat_stream", 0.4), ("summary", 0.2))
ADMIN_KEY = "soak-admin"
ADD_CHUNK_CHARS = 600  # the documents an adder sends: chunks of the dev data's texts
REQUEST_TIMEOUT_S = 120.0  # one normal request, at most
START_TIMEOUT_S = 900.0  # a server start, at most (a loaded machine calibrates for minutes)


# ---------------------------------------------------------------------------- prompts


def _truncate(text: str, max_chars: int) -> str:
    """``text`` cut to at most ``max_chars`` characters, at a word boundary."""
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    return cut[: cut.rfind(" ")] if " " in cut else cut


def load_prompts(path: Path, max_chars: int) -> dict[str, list[str]]:
    """Spec-Bench dev turns by use: ``completion`` (rag and qa prompts), ``chat`` (rag, qa and
    summarization turns), ``summary`` (summarization articles). A rag turn keeps its question
    (the last line) and loses the end of its passages."""
    out: dict[str, list[str]] = {"completion": [], "chat": [], "summary": []}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            turn = row["turns"][0]
            if row["category"] == "rag":
                passages, _, question = turn.rstrip().rpartition("\n")
                text = _truncate(passages, max(0, max_chars - len(question) - 1)) + "\n" + question
                out["completion"].append(text + "\nAnswer:")
                out["chat"].append(text)
            elif row["category"] == "qa":
                out["completion"].append(f"Question: {turn}\nAnswer:")
                out["chat"].append(turn)
            elif row["category"] == "summarization":
                article = turn.removeprefix("Summarize:").strip()
                out["summary"].append(_truncate(article, max_chars))
                out["chat"].append("Summarize: " + _truncate(article, max_chars))
    for use, texts in out.items():
        if not texts:
            raise SystemExit(f"{path}: no {use} prompts (rag, qa and summarization rows expected)")
    return out


def load_add_texts(path: Path, chunk_chars: int = ADD_CHUNK_CHARS) -> list[str]:
    """Documents to add: the dev data's rag passages and summarization articles, in chunks
    of about ``chunk_chars`` characters cut at word boundaries."""
    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["category"] not in ("rag", "summarization"):
                continue
            text = row["turns"][0].removeprefix("Summarize:").strip()
            while text:
                piece = _truncate(text, chunk_chars)
                if not piece.strip():
                    break
                out.append(piece)
                text = text[len(piece) :].strip()
    return out


def seed_articles(path: Path, n: int) -> list[str]:
    """The first ``n`` summarization articles of the dev data (the datastore built at start)."""
    out: list[str] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["category"] == "summarization" and len(out) < n:
                out.append(row["turns"][0].removeprefix("Summarize:").strip())
    return out


# ---------------------------------------------------------------------------- the server


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def open_files(pid: int) -> Optional[int]:
    """How many files a process holds open (None once it is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def rss_bytes(pid: int) -> Optional[int]:
    """VmRSS of a process, in bytes (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class Server:
    """``python -m ragspec serve`` on a free loopback port, its output appended to ``log``."""

    def __init__(self, args: argparse.Namespace, log: Path) -> None:
        self.args = args
        self.log = log
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.proc: Optional[subprocess.Popen] = None

    def command(self) -> list[str]:
        a = self.args
        cmd = [sys.executable, "-m", "ragspec", "-v"]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        cmd += ["serve", "--host", HOST, "--port", str(self.port), "--max-active", "8", "--max-queue", "32"]
        if a.model:
            cmd += ["--model", a.model]
        if not a.response_cache:
            cmd.append("--no-response-cache")
        if a.keys:
            cmd += ["--api-key", ",".join(tenant_keys(a.keys)), "--admin-key", ADMIN_KEY]
            cmd += ["--datastore", f"kb={a.datastore}"]
        return cmd + shlex.split(a.server_args)

    def start(self) -> dict:
        """Spawns the server and waits for ``/ready``: seconds from the spawn to ``/health`` 200
        and to ``/ready`` 200, and whether the latency table came from the cache."""
        env = dict(os.environ)
        if self.args.pythonpath:
            env["PYTHONPATH"] = self.args.pythonpath
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as out:
            t0 = time.monotonic()
            self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT)
        health_s = None
        with httpx.Client(timeout=2) as c:
            while True:
                now = time.monotonic()
                if self.proc.poll() is not None:
                    raise SystemExit(f"ragspec serve exited with {self.proc.returncode}: see {self.log}")
                if now - t0 > START_TIMEOUT_S:
                    raise SystemExit(f"ragspec serve not ready in {START_TIMEOUT_S:.0f} s: see {self.log}")
                path = "/health" if health_s is None else "/ready"
                with contextlib.suppress(httpx.HTTPError):
                    if c.get(self.url + path).status_code == 200:
                        if health_s is None:
                            health_s = time.monotonic() - t0
                            continue  # /ready at once: it may be 200 already
                        ready_s = time.monotonic() - t0
                        break
                time.sleep(0.05)
        with open(self.log, "rb") as f:
            f.seek(offset)
            cached = b"latency table from" in f.read()
        return {"health_s": health_s, "ready_s": ready_s, "calibration_cached": cached}

    def stop(self, timeout: float = 60.0) -> dict:
        """SIGTERM, then SIGKILL after ``timeout`` s: the seconds it took and the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return {"stop_s": 0.0, "returncode": None if self.proc is None else self.proc.returncode}
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        stop_s = time.monotonic() - t0
        # uvicorn re-raises the signal after a graceful shutdown: exit -15 with this line logged
        graceful = f"Finished server process [{self.proc.pid}]".encode() in self.log.read_bytes()
        return {"stop_s": stop_s, "returncode": self.proc.returncode, "graceful": graceful}


def tenant_keys(n: int) -> list[str]:
    return [f"soak-tenant-{i}" for i in range(n)]


def build_seed_datastore(args: argparse.Namespace, folder: Path) -> Path:
    """A datastore of ``--seed-docs`` dev articles, built with the served model's tokenizer."""
    corpus = folder / "seed.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in seed_articles(args.data, args.seed_docs)))
    out = folder / "kb"
    cmd = [sys.executable, "-m", "ragspec", "-q", "datastore", "build", str(corpus), "-o", str(out)]
    if args.model:
        cmd += ["--model", args.model]
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return out


def documents_on_disk(datastore: Path) -> int:
    """The documents a datastore's manifest lists."""
    return int(json.loads((datastore / "manifest.json").read_text())["num_documents"])


class RssSampler:
    """The server's RSS and open files every ``interval`` s, as ``(monotonic time, bytes)``
    and ``(monotonic time, files)``."""

    def __init__(self, pid: int, interval: float = 1.0) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.files: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, files = rss_bytes(self.pid), open_files(self.pid)
            if rss is not None:
                self.samples.append((time.monotonic(), rss))
            if files is not None:
                self.files.append((time.monotonic(), files))
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def summary(self, t0: float, t1: float) -> dict:
        """RSS over ``[t0, t1]``: start, at the first minute (half the span when shorter),
        end, max, and whether it stayed flat."""
        span = [(t, r) for t, r in self.samples if t0 <= t <= t1]
        if not span:
            return {}
        base_at = min(60.0, (t1 - t0) / 2)
        base = next((r for t, r in span if t >= t0 + base_at), span[-1][1])
        end = span[-1][1]
        return {
            "samples": len(span),
            "start_bytes": span[0][1],
            "baseline_at_s": base_at,
            "baseline_bytes": base,
            "end_bytes": end,
            "max_bytes": max(r for _, r in span),
            "flat": abs(end - base) <= 0.15 * base + 50 * MIB,
        }

    def files_summary(self, t0: float, t1: float) -> dict:
        """Open files over ``[t0, t1]``, as :meth:`summary`; flat = the end within 10% + 16
        of the first-minute value."""
        span = [(t, n) for t, n in self.files if t0 <= t <= t1]
        if not span:
            return {}
        base_at = min(60.0, (t1 - t0) / 2)
        base = next((n for t, n in span if t >= t0 + base_at), span[-1][1])
        end = span[-1][1]
        return {
            "start": span[0][1],
            "baseline": base,
            "end": end,
            "max": max(n for _, n in span),
            "flat": end - base <= 0.1 * base + 16,
        }


# ---------------------------------------------------------------------------- clients


class Clients:
    """``n`` threads sending mixed requests back to back until ``until`` (monotonic) or
    :meth:`stop`; each result is a dict in :attr:`results`."""

    def __init__(self, url: str, prompts: dict[str, list[str]], args: argparse.Namespace, until: float, seed: int):
        self.url = url
        self.keys = tenant_keys(args.keys) if args.keys else []
        self.prompts = prompts
        self.args = args
        self.until = until
        self.results: list[dict] = []
        self._stop = threading.Event()
        self.threads = [
            threading.Thread(
                target=self._run, args=(random.Random(seed * 1000 + i), i), name=f"client-{i}", daemon=True
            )
            for i in range(args.clients)
        ]
        for t in self.threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _run(self, rng: random.Random, i: int) -> None:
        kinds, weights = zip(*KINDS)
        lo, hi = self.args.max_tokens
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
        headers = {"Authorization": f"Bearer {self.keys[i % len(self.keys)]}"} if self.keys else None
        with httpx.Client(base_url=self.url, timeout=timeout, headers=headers) as client:
            while not self._stop.is_set() and time.monotonic() < self.until:
                kind = rng.choices(kinds, weights)[0]
                max_tokens = rng.randint(lo, hi)
                t0 = time.monotonic()
                try:
                    if kind == "chat_stream":
                        res = self._stream(client, rng, max_tokens, timeout)
                    elif kind == "completion":
                        body = {"prompt": rng.choice(self.prompts["completion"]), "max_tokens": max_tokens}
                        res = {"status": client.post("/v1/completions", json=body).status_code}
                    else:
                        body = {"documents": [rng.choice(self.prompts["summary"])], "max_tokens": max_tokens}
                        res = {"status": client.post("/v1/summarize", json=body).status_code}
                except httpx.HTTPError as e:
                    res = {"status": type(e).__name__}
                res.update(kind=kind, latency_s=time.monotonic() - t0, end=time.monotonic())
                self.results.append(res)

    def _stream(self, client: httpx.Client, rng: random.Random, max_tokens: int, timeout: httpx.Timeout) -> dict:
        """A streaming chat; a disconnecting one closes its own connection after a random
        number of events (its own client, so that the socket really closes)."""
        body = {
            "messages": [{"role": "user", "content": rng.choice(self.prompts["chat"])}],
            "max_tokens": max_tokens,
            "stream": True,
        }
        cut_at = rng.randint(1, max(1, max_tokens // 2)) if rng.random() < self.args.disconnect else None
        with contextlib.ExitStack() as stack:
            if cut_at is not None:
                client = stack.enter_context(httpx.Client(base_url=self.url, timeout=timeout, headers=client.headers))
            r = stack.enter_context(client.stream("POST", "/v1/chat/completions", json=body))
            if r.status_code != 200:
                r.read()
                return {"status": r.status_code}
            events, done = 0, False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                events += 1
                if cut_at is not None and events >= cut_at:
                    return {"status": 200, "disconnected": True, "events": events}
            return {"status": 200 if done else "incomplete_stream", "events": events}


class SlowSockets:
    """``n`` raw sockets, each sending complete headers with a ``Content-Length`` of
    ``body_bytes``, then one body byte every ``interval`` s, and opening again once the
    server answers or closes; each end is a dict in :attr:`cuts`."""

    def __init__(self, port: int, n: int, body_bytes: int, interval: float, key: Optional[str] = None) -> None:
        self.port = port
        self.interval = interval
        # a valid request, should one ever arrive whole (with a tenant's key: the server reads it)
        prefix = b'{"prompt": "hi", "max_tokens": 1}'
        self.body = prefix + b" " * max(0, body_bytes - len(prefix))
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {len(self.body)}\r\n\r\n"
        ).encode()
        self.cuts: list[dict] = []
        self.open_at_end = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(i, n), name=f"slow-{i}", daemon=True) for i in range(n)
        ]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self._stop.set()
        for t in self.threads:
            t.join(10)

    def _run(self, i: int, n: int) -> None:
        self._stop.wait(self.interval * i / n)  # staggered
        while not self._stop.is_set():
            try:
                sock = socket.create_connection((HOST, self.port), timeout=10)
            except OSError as e:
                with self._lock:
                    self.cuts.append({"outcome": f"connect:{type(e).__name__}", "after_s": 0.0, "bytes_sent": 0})
                self._stop.wait(1.0)
                continue
            with contextlib.closing(sock):
                end = self._trickle(sock)
            with self._lock:
                if end is None:
                    self.open_at_end += 1
                else:
                    self.cuts.append(end)

    def _trickle(self, sock: socket.socket) -> Optional[dict]:
        """Headers, then a byte every interval until the server speaks or closes (its end as a
        dict) or the soak stops (None)."""
        t0 = time.monotonic()
        sent = 0
        try:
            sock.sendall(self.head)
            next_byte = t0 + self.interval
            while not self._stop.is_set():
                readable, _, _ = select.select([sock], [], [], min(0.25, max(0.0, next_byte - time.monotonic())))
                if readable:
                    data = sock.recv(4096)
                    outcome = "closed"
                    if data.startswith(b"HTTP/"):
                        outcome = data.split(b" ", 2)[1].decode("ascii", "replace")
                    return {"outcome": outcome, "after_s": time.monotonic() - t0, "bytes_sent": sent}
                if time.monotonic() >= next_byte and sent < len(self.body):
                    sock.sendall(self.body[sent : sent + 1])
                    sent += 1
                    next_byte += self.interval
                elif time.monotonic() - t0 > REQUEST_TIMEOUT_S + len(self.body) * self.interval:
                    return {"outcome": "no_answer", "after_s": time.monotonic() - t0, "bytes_sent": sent}
        except OSError as e:
            return {"outcome": f"closed:{type(e).__name__}", "after_s": time.monotonic() - t0, "bytes_sent": sent}
        return None


class Adder:
    """The admin tenant: adds 1-3 documents every ``interval`` s until :meth:`stop`, each
    addition with an ``Idempotency-Key`` and retried with it (up to 3 tries) after a
    transport error or a 500; checks after each one answered 200 that the server lists at
    least the documents added so far."""

    def __init__(self, url: str, texts: list[str], interval: float, seed: int) -> None:
        self.url = url
        self.texts = texts
        self.interval = interval
        self.rng = random.Random(seed)
        self.results: list[dict] = []
        self.added = 0
        """Documents of the additions answered 200 (each key once)."""
        self.not_visible = 0
        """Additions answered 200 whose documents the listing right after did not count."""
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="adder", daemon=True)

    def start(self, base: int) -> None:
        self.base = base
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(REQUEST_TIMEOUT_S * 3 + 30)

    def listed(self, client: httpx.Client) -> int:
        return int(client.get("/v1/datastores").json()["data"][0]["num_documents"])

    def _run(self) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
        with httpx.Client(base_url=self.url, timeout=timeout, headers=headers) as client:
            while not self._stop.wait(self.interval):
                docs = self.rng.sample(self.texts, self.rng.randint(1, 3))
                self.results.append(self._add(client, docs))

    def _add(self, client: httpx.Client, docs: list[str]) -> dict:
        key = uuid.uuid4().hex
        out: dict = {"documents": len(docs), "tries": 0, "statuses": []}
        t0 = time.monotonic()
        for _ in range(3):
            out["tries"] += 1
            try:
                r = client.post(
                    "/v1/datastores/kb/documents", json={"documents": docs}, headers={"Idempotency-Key": key}
                )
            except httpx.HTTPError as e:
                out["statuses"].append(type(e).__name__)
                continue
            out["statuses"].append(r.status_code)
            if r.status_code == 200:
                out["replayed"] = r.headers.get("idempotent-replayed") == "true"
                self.added += len(docs)
                try:
                    if self.listed(client) < self.base + self.added:
                        self.not_visible += 1
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                break
            if r.status_code != 500:  # refused (4xx, 503 datastore_busy): not retried
                with contextlib.suppress(ValueError, KeyError):
                    out["code"] = r.json()["error"]["code"]
                break
        out["status"] = out["statuses"][-1]
        out["latency_s"] = time.monotonic() - t0
        return out

    def summary(self) -> dict:
        status: dict[str, int] = {}
        for r in self.results:
            status[str(r["status"])] = status.get(str(r["status"]), 0) + 1
        ok = [r["latency_s"] for r in self.results if r["status"] == 200]
        return {
            "additions": len(self.results),
            "status": status,
            "retried": sum(1 for r in self.results if r["tries"] > 1),
            "replayed": sum(1 for r in self.results if r.get("replayed")),
            "documents_added": self.added,
            "not_visible_at_once": self.not_visible,
            "failures": sum(1 for r in self.results if not str(r["status"]).isdigit() or r["status"] == 500),
            "p50_s": _quantile(ok, 0.5),
            "p95_s": _quantile(ok, 0.95),
        }


# ---------------------------------------------------------------------------- phases


def _quantile(xs: list[float], q: float) -> Optional[float]:
    if not xs:
        return None
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def run_phase(
    name: str, server: Server, rss: RssSampler, prompts: dict, args: argparse.Namespace, slow: int, seed: int
) -> dict:
    print(f"phase {name}: {args.clients} clients, {slow} slow sockets, {args.minutes:g} min", flush=True)
    key = tenant_keys(args.keys)[-1] if args.keys else None
    sockets = SlowSockets(server.port, slow, args.slow_body_bytes, args.slow_interval, key) if slow else None
    clients = None
    try:
        if sockets is not None:
            time.sleep(args.slow_interval * 2)  # every slow socket open before the clients start
        t0 = time.monotonic()
        clients = Clients(server.url, prompts, args, t0 + args.minutes * 60, seed)
        clients.join(args.minutes * 60 + REQUEST_TIMEOUT_S + 30)
        t1 = time.monotonic()
    finally:
        if clients is not None:
            clients.stop()
        if sockets is not None:
            sockets.close()
    results = clients.results
    status: dict[str, int] = {}
    for r in results:
        status[str(r["status"])] = status.get(str(r["status"]), 0) + 1
    normal = [r for r in results if r["status"] == 200 and not r.get("disconnected")]
    lat = sorted(r["latency_s"] for r in normal)
    by_kind = {}
    for kind, _ in KINDS:
        k = [r["latency_s"] for r in normal if r["kind"] == kind]
        by_kind[kind] = {"n": len(k), "p50_s": _quantile(k, 0.5), "p95_s": _quantile(k, 0.95)}
    errors = sum(n for s, n in status.items() if not s.isdigit() or s.startswith("5"))
    out = {
        "seconds": t1 - t0,
        "clients": args.clients,
        "slow_sockets": slow,
        "requests": len(results),
        "status": status,
        "disconnected": sum(1 for r in results if r.get("disconnected")),
        "failures": errors,
        "completed": len(normal),
        "p50_s": _quantile(lat, 0.5),
        "p95_s": _quantile(lat, 0.95),
        "by_kind": by_kind,
        "rss": rss.summary(t0, t1),
        "open_files": rss.files_summary(t0, t1),
    }
    if sockets is not None:
        cuts: dict[str, list[float]] = {}
        for c in sockets.cuts:
            cuts.setdefault(c["outcome"], []).append(c["after_s"])
        out["slow"] = {
            outcome: {"n": len(ts), "median_after_s": statistics.median(ts), "max_after_s": max(ts)}
            for outcome, ts in sorted(cuts.items())
        }
        out["slow_open_at_end"] = sockets.open_at_end
    return out


def _s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def _rss(r: dict) -> str:
    if not r:
        return "-"
    mib = [r[k] / MIB for k in ("start_bytes", "baseline_bytes", "end_bytes", "max_bytes")]
    return " / ".join(f"{x:.0f}" for x in mib) + (", flat" if r["flat"] else ", NOT flat")


def _files(r: dict) -> str:
    if not r:
        return "-"
    return f"{r['start']} / {r['baseline']} / {r['end']} / {r['max']}" + (", flat" if r["flat"] else ", NOT flat")


def print_table(res: dict) -> None:
    a, b = res["phases"]["A"], res["phases"]["B"]
    rows = [
        ("seconds", f"{a['seconds']:.0f}", f"{b['seconds']:.0f}"),
        ("clients / slow sockets", f"{a['clients']} / 0", f"{b['clients']} / {b['slow_sockets']}"),
        ("requests", a["requests"], b["requests"]),
        ("status", json.dumps(a["status"]), json.dumps(b["status"])),
        ("failures (5xx, transport)", a["failures"], b["failures"]),
        ("disconnected streams", a["disconnected"], b["disconnected"]),
        ("completed (normal)", a["completed"], b["completed"]),
        ("P50 / P95 s", f"{_s(a['p50_s'])} / {_s(a['p95_s'])}", f"{_s(b['p50_s'])} / {_s(b['p95_s'])}"),
    ]
    for kind, _ in KINDS:
        ka, kb = a["by_kind"][kind], b["by_kind"][kind]
        rows.append(
            (
                f"  {kind} n, P50 / P95 s",
                f"{ka['n']}, {_s(ka['p50_s'])} / {_s(ka['p95_s'])}",
                f"{kb['n']}, {_s(kb['p50_s'])} / {_s(kb['p95_s'])}",
            )
        )
    slow = ", ".join(
        f"{o} x{v['n']} after {v['median_after_s']:.1f} s (max {v['max_after_s']:.1f})" for o, v in b["slow"].items()
    )
    rows.append(("slow sockets cut", "-", slow or "none"))
    base_at = a["rss"].get("baseline_at_s", 60) if a["rss"] else 60
    rows.append((f"RSS MiB start/{base_at:.0f}s/end/max", _rss(a["rss"]), _rss(b["rss"])))
    rows.append((f"open files start/{base_at:.0f}s/end/max", _files(a["open_files"]), _files(b["open_files"])))
    w0 = max(len(str(r[0])) for r in rows)
    w1 = max(len(str(r[1])) for r in rows)
    print(f"{'':<{w0}}  {'A: no slow sockets':<{w1}}  B: slow sockets")
    for r in rows:
        print(f"{r[0]:<{w0}}  {str(r[1]):<{w1}}  {r[2]}")
    v = res["verdict"]
    ratio = "-" if v["p95_ratio"] is None else f"{v['p95_ratio']:.2f}x"
    print(
        f"P95 B/A {ratio} (<= 2x: {v['p95_within_2x']}); no 5xx/transport failures: {v['no_failures']}; RSS flat: {v['rss_flat']}"
        f"; open files flat: {v['open_files_flat']}"
    )
    adds = res.get("adds")
    if adds:
        print(
            f"additions (admin key, both phases): {adds['additions']} {json.dumps(adds['status'])}, retried "
            f"{adds['retried']}, replayed {adds['replayed']}, P50 / P95 {_s(adds['p50_s'])} / {_s(adds['p95_s'])} s; "
            f"documents: {adds['base']} at start + {adds['documents_added']} added = {adds['expected']}; listed at the "
            f"end {adds['listed_end']}, on disk {adds['on_disk']}, listed after the restart "
            f"{adds['listed_after_restart']}; not listed right after their 200: {adds['not_visible_at_once']}"
        )
        print(f"every addition visible or refused: {v['adds_visible_or_refused']}")
    for key in ("first_start", "restart"):
        s = res[key]
        print(
            f"{key.replace('_', ' ')}: /health 200 after {s['health_s']:.2f} s, /ready 200 after {s['ready_s']:.2f} s"
            f" (latency table cached: {s['calibration_cached']})"
            + (
                f"; the first stopped by SIGTERM in {s['stop_s']:.2f} s, exit {s['returncode']}, "
                f"graceful: {s['graceful']}"
                if "stop_s" in s
                else ""
            )
        )
    print(f"warm restart healthy (ready) in under 30 s: {v['restart_under_30s']}")


def verdict(res: dict) -> dict:
    """What the soak must show: no failures, phase B's P95 within 2x of A's, flat RSS and open
    files, a warm restart under 30 s, every addition visible or refused."""
    a, b = res["phases"]["A"], res["phases"]["B"]
    ratio = b["p95_s"] / a["p95_s"] if a["p95_s"] and b["p95_s"] is not None else None
    adds = res.get("adds")
    return {
        "no_failures": a["failures"] == 0 and b["failures"] == 0 and (adds is None or adds["failures"] == 0),
        "p95_ratio": ratio,
        "p95_within_2x": ratio is not None and ratio <= 2.0,
        "rss_flat": bool(a["rss"].get("flat")) and bool(b["rss"].get("flat")),
        "open_files_flat": bool(a["open_files"].get("flat")) and bool(b["open_files"].get("flat")),
        "restart_under_30s": res["restart"]["ready_s"] < 30.0,
        "adds_visible_or_refused": adds is None
        or (
            adds["expected"] == adds["listed_end"] == adds["on_disk"] == adds["listed_after_restart"]
            and adds["not_visible_at_once"] == 0
        ),
    }


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pythonpath", default=None, help="PYTHONPATH of the served checkout (default: inherited)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    ap.add_argument("--server-args", default="", help="more `ragspec serve` options, one shell-quoted string")
    ap.add_argument("--model", default=None, help="the served model (and the seed datastore's tokenizer)")
    ap.add_argument("--keys", type=int, default=0, help="tenant API keys (0: none); with keys, an admin tenant adds")
    ap.add_argument("--datastore", type=Path, default=None, help="with --keys: the datastore served and added to")
    ap.add_argument("--seed-docs", type=int, default=20, help="articles of the datastore built when none is given")
    ap.add_argument("--add-interval", type=float, default=2.0, help="seconds between additions (with --keys)")
    ap.add_argument("--response-cache", action="store_true", help="keep the server's response cache on")
    ap.add_argument("--data", type=Path, default=DEV_DATA, help="Spec-Bench dev JSONL (default: %(default)s)")
    ap.add_argument("--prompt-chars", type=int, default=1600, help="prompts cut to this many characters (~400 tokens)")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of each phase")
    ap.add_argument("--clients", type=int, default=8, help="normal client threads")
    ap.add_argument("--max-tokens", type=int, nargs=2, default=[16, 48], metavar=("LO", "HI"))
    ap.add_argument("--disconnect", type=float, default=0.15, help="share of streams closed mid-stream")
    ap.add_argument("--slow-sockets", type=int, default=20, help="slow-body sockets in phase B")
    ap.add_argument("--slow-body-bytes", type=int, default=300, help="their Content-Length")
    ap.add_argument("--slow-interval", type=float, default=1.0, help="seconds between their body bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-log", type=Path, default=None, help="the server's output (default: a temporary file)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not args.data.exists():
        ap.error(f"{args.data} not found: give --data")
    lo, hi = args.max_tokens
    if not 1 <= lo <= hi or args.minutes <= 0 or args.clients < 1 or args.slow_interval <= 0:
        ap.error("need 1 <= LO <= HI, --minutes > 0, --clients >= 1, --slow-interval > 0")
    if args.keys < 0 or args.add_interval <= 0 or (args.datastore is not None and not args.keys):
        ap.error("need --keys >= 0, --add-interval > 0, and --datastore only with --keys")
    prompts = load_prompts(args.data, args.prompt_chars)
    log = args.server_log or Path(tempfile.mkstemp(prefix="ragspec-soak-", suffix=".log")[1])
    print(f"server log: {log}", flush=True)
    built = None
    if args.keys and args.datastore is None:
        built = Path(tempfile.mkdtemp(prefix="ragspec-soak-ds-"))
        args.datastore = build_seed_datastore(args, built)
        print(f"datastore: {args.datastore} ({documents_on_disk(args.datastore)} documents)", flush=True)

    server = Server(args, log)
    rss = adder = None
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    res: dict = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    try:
        res["first_start"] = server.start()
        print(
            f"server ready at {server.url} (pid {server.proc.pid}) in {res['first_start']['ready_s']:.1f} s", flush=True
        )
        rss = RssSampler(server.proc.pid)
        if args.keys:
            adder = Adder(server.url, load_add_texts(args.data), args.add_interval, args.seed)
            with httpx.Client(base_url=server.url, headers=admin, timeout=30) as c:
                adder.start(adder.listed(c))
        res["phases"] = {
            "A": run_phase("A", server, rss, prompts, args, 0, args.seed),
            "B": run_phase("B", server, rss, prompts, args, args.slow_sockets, args.seed + 1),
        }
        if adder is not None:
            adder.stop()
            with httpx.Client(base_url=server.url, headers=admin, timeout=30) as c:
                listed_end = adder.listed(c)
        rss.close()
        stopped = server.stop()
        server.port = free_port()  # the old one may linger in TIME_WAIT
        server.url = f"http://{HOST}:{server.port}"
        res["restart"] = {**stopped, **server.start()}
        if adder is not None:
            with httpx.Client(base_url=server.url, headers=admin, timeout=30) as c:
                after = adder.listed(c)
            res["adds"] = {
                **adder.summary(),
                "base": adder.base,
                "expected": adder.base + adder.added,
                "listed_end": listed_end,
                "on_disk": documents_on_disk(args.datastore),
                "listed_after_restart": after,
            }
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if adder is not None and adder.thread.is_alive():
            adder.stop()
        if rss is not None:
            rss.close()
        server.stop(30)
        if built is not None:
            shutil.rmtree(built, ignore_errors=True)
    res["verdict"] = verdict(res)
    print_table(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
