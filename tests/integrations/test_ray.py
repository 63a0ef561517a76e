"""ragspec on Ray Serve: a local Ray cluster started here (2 CPUs, no dashboard, loopback
only, its own temp folder), a tiny random Llama saved to a folder, a small datastore built
in tmp_path, the OpenAI-compatible endpoint of Ray Serve's proxy on a free loopback port.

One cluster serves the whole module (starting Ray and two replicas costs tens of seconds on
two cores); the tests run in file order: the command line first (its own applications,
removed after each), then the two-replica deployment, the replica kill, then the shutdown,
which must leave no Ray process behind, and last the checks of the deployment files, which
need no cluster. Every request loop is bounded in count and time."""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import httpx
import pytest
import yaml
from _integ_helpers import CHAT_TEMPLATE, LiveServer, free_port, make_char_tokenizer, make_tiny_llama

from ragspec.errors import ConfigError
from ragspec.integrations.ray import PROXY_CALLBACK, REPLICA_HEADER, RayOptions, parse_autoscale
from ragspec.integrations.settings import ServerSettings

# Ray is not imported at the top: connect() sets Ray's environment before its first import
_RAY = importlib.util.find_spec("ray")  # (find_spec("ray.serve") would import ray)
HAVE_RAY = _RAY is not None and (Path(_RAY.origin).parent / "serve").is_dir()

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = httpx.Timeout(90.0)
MAIN_APP = "ragspec"
CORPUS = "the cat sat on the mat. the dog sat on the log. a bird sang in the tree. " * 12


# ---------------------------------------------------------------------- processes and sockets
def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _decode(hexaddr: str) -> str:
    """``ip:port`` of a /proc/net/tcp{,6} address."""
    hexip, hexport = hexaddr.split(":")
    raw = bytes.fromhex(hexip)
    if len(raw) == 4:
        ip = ".".join(str(b) for b in raw[::-1])
    else:  # four little-endian 32-bit words
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        ip = ":".join(raw[i : i + 2].hex() for i in range(0, 16, 2))
    return f"{ip}:{int(hexport, 16)}"


def _sockets(pids: set[int], state: str) -> list[tuple[int, str, str]]:
    """(pid, local ``ip:port``, remote ``ip:port``) of the TCP sockets that ``pids`` hold
    in ``state`` ("0A" listening, "01" established)."""
    owner = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    owner[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == state and cols[9] in owner:
                    out.append((owner[cols[9]], _decode(cols[1]), _decode(cols[2])))
    return out


_V6_LOOPBACK = ("0000:0000:0000:0000:0000:0000:0000:0001", "0000:0000:0000:0000:0000:ffff:7f00:0001")
_V6_ANY = "0000:0000:0000:0000:0000:0000:0000:0000"


def _is_loopback(addr: str) -> bool:
    host = addr.rsplit(":", 1)[0]
    return host.startswith("127.") or host in _V6_LOOPBACK


class Cluster:
    """The module's Ray: started by :func:`ragspec.integrations.ray.connect` as
    ``ragspec serve --ray`` starts one, with 2 CPUs and its own temp folder."""

    def __init__(self) -> None:
        # short: Ray's unix sockets live under it (108-byte path limit)
        self.temp_dir = tempfile.mkdtemp(prefix="rsray", dir="/tmp")
        self.port = free_port()
        self.metrics_port = free_port()
        self.seen: set[int] = set()
        for attempt in (1, 2):
            try:
                started = self._start()
                break
            except Exception as e:  # Ray's own start-up deadlines (30 s, not settable) on a busy machine
                if attempt == 2 or "timed out during startup" not in str(e):
                    raise
        assert started, "a Ray was already running in the test process"
        self.record()
        self.closed = False

    def _start(self) -> bool:
        from ragspec.integrations.ray import connect

        os.makedirs(self.temp_dir, exist_ok=True)
        try:
            return connect(
                num_cpus=2,
                object_store_memory=96 * 2**20,
                temp_dir=self.temp_dir,
                metrics_export_port=self.metrics_port,
                log_to_driver=False,
                _system_config={"metrics_report_interval_ms": 1000},  # (default 10 s)
            )
        except BaseException:
            # a Ray that failed to start leaves what it had started: end those processes
            # (ours: their command lines name our temp folder), then report the failure
            for pid in sorted(_children(os.getpid())):
                if self.temp_dir in _cmdline(pid):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            raise

    def record(self) -> set[int]:
        """The Ray processes now (descendants of this process), remembered for the
        shutdown check."""
        now = _children(os.getpid())
        self.seen |= now
        return now

    def shutdown(self) -> list[str]:
        """Stop Serve and Ray as ``ragspec serve --ray`` does (:func:`ragspec.integrations.ray.shutdown`:
        Serve, Ray, then what Ray left); the Ray processes still alive 20 s later (as command lines)."""
        from ragspec.integrations.ray import shutdown

        self.record()
        self.closed = True
        shutdown(local=True)
        deadline = time.monotonic() + 20
        left: set[int] = set()
        while time.monotonic() < deadline:
            by_dir = {int(p) for p in os.listdir("/proc") if p.isdigit() and self.temp_dir in _cmdline(int(p))}
            left = {p for p in self.seen | by_dir if _alive(p)}
            if not left:
                break
            time.sleep(0.25)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return [f"{p}: {_cmdline(p)[:120]}" for p in sorted(left)]


@pytest.fixture(scope="module")
def cluster():
    if not HAVE_RAY:
        pytest.skip("needs the ray extra: pip install 'ragspec[ray]' (make test installs it)")
    c = Cluster()
    yield c
    if not c.closed:
        left = c.shutdown()
        assert not left, f"Ray processes left behind: {left}"


# ---------------------------------------------------------------------- model, datastore, reference
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama (no EOS: generations run to max_tokens) with the character
    tokenizer and a chat template, saved as an HF folder, and a datastore built on it."""
    from ragspec.datastore import build_datastore

    root = tmp_path_factory.mktemp("ray")
    tok = make_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None)
    model.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    (root / "corpus").mkdir()
    (root / "corpus" / "notes.txt").write_text(CORPUS)
    build_datastore([str(root / "corpus")], root / "ds", tok, progress=False)
    return root


def service_settings(model_dir: Path, port: int, **kw) -> ServerSettings:
    """The settings of every deployment here: the saved model, the datastore "notes", no
    timing-dependent draft sizing (so seeded samples are the same wherever they run)."""
    base = dict(
        host="127.0.0.1",
        port=port,
        model=str(model_dir / "tiny"),
        device="cpu",
        eagle="none",
        datastores=(("notes", str(model_dir / "ds")),),
        calibrate=False,
        adaptive=False,
        max_active=4,
        max_queue=16,
    )
    base.update(kw)
    return ServerSettings(**base)


@pytest.fixture(scope="module")
def reference(model_dir):
    """The same settings served by one ``ragspec serve``-style app in this process: the
    answers Ray Serve must reproduce."""
    from ragspec.integrations.server import create_app
    from ragspec.serving import load_serving_engine

    settings = service_settings(model_dir, free_port())
    engine = load_serving_engine(settings.serving_config())  # every datastore of the settings
    app = create_app(engine=engine, settings=settings)
    with LiveServer(app) as srv:
        srv.engine = engine
        yield srv


@pytest.fixture(scope="module")
def deployed(cluster, model_dir):
    """Two replicas of the service behind Ray Serve's proxy; the endpoint URL."""
    from ragspec.integrations.ray import deploy

    settings = service_settings(model_dir, cluster.port)
    options = RayOptions(
        replicas=2,
        cpus_per_replica=0.5,
        threads_per_replica=1,
        health_check_period_s=1.0,
        metrics_interval_s=0.5,
        name=MAIN_APP,
    )
    url = deploy(settings, options)
    assert url == f"http://127.0.0.1:{cluster.port}"
    cluster.record()
    return url


def replica_states(app: str = MAIN_APP) -> dict:
    from ray import serve

    return dict(serve.status().applications[app].deployments[app].replica_states)


def replica_actors(app: str = MAIN_APP) -> dict[str, str]:
    """Replica id -> actor name of the application's live replicas."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{app}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n[len(prefix) :]: n for n in names if n.startswith(prefix)}


def sse_events(text: str) -> list:
    """JSON payloads of an SSE body; checks the framing and the final [DONE]."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert blocks and blocks[-1] == "data: [DONE]", text[-300:]
    out = []
    for b in blocks[:-1]:
        assert b.startswith("data: "), b
        out.append(json.loads(b[len("data: ") :]))
    return out


def _usage(usage: Optional[dict]) -> Optional[dict]:
    """A usage without the prompt tokens a server's prefix cache served and without the
    request's drafting statistics: both depend on what that server (replica) answered
    before (its prefix cache, its response cache) and on its load (seconds), not on the
    answer."""
    kept = {k: v for k, v in (usage or {}).items() if k not in ("prompt_tokens_details", "speculative_decoding")}
    return kept or None


def answer(body: dict) -> dict:
    """The parts of an answer that must not depend on which server gave it."""
    out = {"usage": _usage(body.get("usage")), "choices": []}
    for c in body["choices"]:
        out["choices"].append({"text": c.get("text"), "message": c.get("message"), "finish_reason": c["finish_reason"]})
    return out


def streamed_text(events: list) -> str:
    parts = []
    for e in events:
        for c in e.get("choices", []):
            parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


# ---------------------------------------------------------------------- the command line (first)
def test_ray_options_from_the_command_line():
    from ragspec.cli import build_parser
    from ragspec.integrations.cli import ray_options_from_args

    parser = build_parser()
    o = ray_options_from_args(parser.parse_args(["serve", "--ray"]))
    assert (o.replicas, o.autoscale, o.cpus_per_replica, o.gpus_per_replica, o.threads) == (1, None, 1.0, 0.0, 1)
    o = ray_options_from_args(
        parser.parse_args(
            [
                "serve",
                "--ray",
                "--autoscale",
                "1:4",
                "--cpus-per-replica",
                "2.5",
                "--gpus-per-replica",
                "0.25",
                "--address",
                "ray://head:10001",
            ]
        )
    )
    # threads default to the whole CPUs a replica holds, so replicas never oversubscribe a node
    assert (o.autoscale, o.cpus_per_replica, o.gpus_per_replica, o.threads, o.address) == (
        (1, 4),
        2.5,
        0.25,
        2,
        "ray://head:10001",
    )
    o = ray_options_from_args(
        parser.parse_args(
            ["serve", "--ray", "--replicas", "3", "--cpus-per-replica", "0.5", "--threads-per-replica", "2"]
        )
    )
    assert (o.replicas, o.threads) == (3, 2)
    assert parse_autoscale("0:2") == (0, 2)
    for bad in ("2", "a:b", "3:1", "0:0", "-1:2"):
        with pytest.raises(ConfigError):
            parse_autoscale(bad)
    for bad in (["--replicas", "0"], ["--cpus-per-replica", "-1"], ["--threads-per-replica", "0"]):
        with pytest.raises(ConfigError):
            ray_options_from_args(parser.parse_args(["serve", "--ray", *bad]))
    # Ray flags without --ray are a mistake, not silently ignored
    with pytest.raises(ConfigError, match="--ray"):
        ray_options_from_args(parser.parse_args(["serve", "--replicas", "2"]))
    with pytest.raises(ConfigError, match="not both"):
        ray_options_from_args(parser.parse_args(["serve", "--ray", "--replicas", "2", "--autoscale", "1:3"]))


@pytest.mark.slow
def test_ragspec_serve_ray_command_serves(cluster, model_dir, monkeypatch):
    # the real command on this cluster (already joined, as with --address): parse, deploy one
    # replica, answer through the proxy, then remove the application on the way out
    import ragspec.integrations.ray as rray
    from ragspec.cli import main

    url = f"http://127.0.0.1:{cluster.port}"
    seen = {}

    def wait() -> None:  # instead of sleeping until Ctrl-C
        seen["health"] = httpx.get(url + "/health", timeout=TIMEOUT).json()
        r = httpx.post(
            url + "/v1/completions", json={"prompt": "the cat", "max_tokens": 6, "datastore": "notes"}, timeout=TIMEOUT
        )
        seen["status"], seen["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
        seen["text"] = r.json()["choices"][0]["text"]
        seen["states"] = replica_states("cli")
        cluster.record()

    monkeypatch.setattr(rray, "_wait_forever", wait)
    args = [
        "serve",
        "--ray",
        "--app-name",
        "cli",
        "--replicas",
        "1",
        "--cpus-per-replica",
        "0.5",
        "--threads-per-replica",
        "1",
    ]
    args += ["--host", "127.0.0.1", "--port", str(cluster.port), "--model", str(model_dir / "tiny"), "--eagle", "none"]
    args += ["--datastore", f"notes={model_dir / 'ds'}", "--no-calibrate"]
    assert main(args) == 0
    assert seen["health"] == {"status": "ok", "model": "tiny"}
    assert seen["status"] == 200 and seen["replica"] and len(seen["text"]) == 6
    assert seen["states"] == {"RUNNING": 1}
    from ray import serve

    assert "cli" not in serve.status().applications  # removed when the command ended


@pytest.mark.slow
def test_replica_with_a_missing_datastore_fails_its_health_check(cluster, model_dir, tmp_path, capsys):
    # the replica cannot open the datastore on its node: its health check fails with the
    # one-line cause, Ray Serve gives up after --start-retries, the command says it in one line
    from ray import serve

    from ragspec.cli import main

    missing = tmp_path / "gone"
    args = ["serve", "--ray", "--app-name", "bad", "--replicas", "1", "--cpus-per-replica", "0", "--start-retries", "1"]
    args += ["--host", "127.0.0.1", "--port", str(cluster.port), "--model", str(model_dir / "tiny"), "--eagle", "none"]
    args += ["--datastore", f"notes={missing}", "--no-calibrate", "-q"]  # -q: no progress lines, the error alone
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err
    cluster.record()
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ragspec: error:") and str(missing) in lines[0], err
    assert "Traceback" not in err
    assert "bad" not in serve.status().applications


@pytest.mark.slow
def test_replica_with_a_mismatched_datastore_reports_it_in_its_health_check(cluster, model_dir, tmp_path):
    # a datastore built with another tokenizer: the replica (made here as Ray Serve makes it,
    # outside a cluster's scheduling) loads nothing to serve, and its health check raises the
    # one-line mismatch, so it is never routed to; a good one passes
    import asyncio

    from ragspec.datastore import build_datastore
    from ragspec.integrations.ray import RagspecReplica, ReplicaStartError

    other = make_char_tokenizer()
    other.add_tokens(["<doc>"])  # one more token: another vocabulary fingerprint
    build_datastore([str(model_dir / "corpus")], tmp_path / "other", other, progress=False)
    replicas = {}
    for name, ds in (("bad", tmp_path / "other"), ("good", model_dir / "ds")):
        replica = RagspecReplica.__new__(RagspecReplica)
        asyncio.run(replica.__init__(service_settings(model_dir, 1, datastores=(("notes", str(ds)),)), 1, 0.0))
        replicas[name] = replica
    with pytest.raises(ReplicaStartError) as e:
        replicas["bad"].check_health()
    message = str(e.value)
    assert "\n" not in message and "tokenizer" in message.lower() and str(tmp_path / "other") in message, message
    assert replicas["bad"].engine is None
    replicas["good"].check_health()
    assert list(replicas["good"].engine.datastores) == ["notes"] and replicas["good"].replica_id == "local"


# ---------------------------------------------------------------------- two replicas
@pytest.mark.slow
def test_outputs_equal_one_engine(deployed, reference):
    chat = [{"role": "user", "content": "tell me about the cat"}]
    cases = [
        # greedy completion, prompt lookup only
        ("/v1/completions", {"prompt": "the cat sat on the mat. the cat", "max_tokens": 24}),
        # greedy, drafting from the datastore every replica opened
        ("/v1/completions", {"prompt": "the dog sat on the", "max_tokens": 24, "datastore": "notes"}),
        # greedy chat through the model's chat template
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 20}),
        # seeded sampling: its own generator, the same sample on any replica
        ("/v1/completions", {"prompt": "a bird sang", "max_tokens": 30, "temperature": 0.9, "top_p": 0.95, "seed": 11}),
        (
            "/v1/chat/completions",
            {"messages": chat, "max_tokens": 20, "temperature": 0.7, "seed": 3, "datastore": "notes"},
        ),
    ]
    for path, body in cases:
        want = httpx.post(reference.url + path, json=body, timeout=TIMEOUT)
        got = httpx.post(deployed + path, json=body, timeout=TIMEOUT)
        assert want.status_code == got.status_code == 200, (path, body, got.text)
        assert answer(got.json()) == answer(want.json()), (path, body)
        assert got.headers.get(REPLICA_HEADER), "every answer names its replica"
    # and the greedy answer is the engine's own
    direct = reference.engine.generate("the cat sat on the mat. the cat", max_new_tokens=24, chat=False)
    assert (
        httpx.post(deployed + "/v1/completions", json=cases[0][1], timeout=TIMEOUT).json()["choices"][0]["text"]
        == direct.text
    )
    # streaming (chat and completions, usage included): the same text and usage, SSE framing kept
    for path, body in (cases[2], cases[3]):
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        want = sse_events(httpx.post(reference.url + path, json=body, timeout=TIMEOUT).text)
        r = httpx.post(deployed + path, json=body, timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = sse_events(r.text)
        assert streamed_text(got) == streamed_text(want) and len(streamed_text(got)) > 0
        assert _usage(got[-1]["usage"]) == _usage(want[-1]["usage"])


@pytest.mark.slow
def test_unknown_datastore_is_still_a_400(deployed):
    r = httpx.post(deployed + "/v1/completions", json={"prompt": "x", "datastore": "nope"}, timeout=TIMEOUT)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "datastore_not_found" and err["param"] == "datastore" and "notes" in err["message"]
    r = httpx.post(deployed + "/v1/completions", json={"prompt": "x", "datastore": "/etc/passwd"}, timeout=TIMEOUT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "datastore"
    assert httpx.get(deployed + "/v1/models", timeout=TIMEOUT).json()["data"][0]["datastores"] == ["notes"]


@pytest.mark.slow
def test_two_replicas_serve_concurrent_load(deployed, reference, cluster):
    prompts = [f"the {w} sat on the" for w in ("cat", "dog", "bird", "mat", "log", "tree")] * 3  # 18 requests
    want = {}
    for p in set(prompts):
        want[p] = httpx.post(
            reference.url + "/v1/completions", json={"prompt": p, "max_tokens": 32}, timeout=TIMEOUT
        ).json()

    def one(p: str):
        r = httpx.post(
            deployed + "/v1/completions", json={"prompt": p, "max_tokens": 32, "datastore": None}, timeout=TIMEOUT
        )
        return p, r.status_code, r.headers.get(REPLICA_HEADER), r.json()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, prompts, timeout=120))
    assert all(status == 200 for _, status, _, _ in results), [b for _, s, _, b in results if s != 200][:2]
    for p, _, _, body in results:
        assert answer(body) == answer(want[p]), p
    replicas = {rid for _, _, rid, _ in results}
    assert len(replicas) == 2 and replicas == set(replica_actors()), "both replicas served requests"
    # each replica's /metrics (reached through the same endpoint; the header says whose)
    # counts what that replica generated
    tokens: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while set(tokens) != replicas and time.monotonic() < deadline:
        r = httpx.get(deployed + "/metrics", timeout=TIMEOUT)
        assert r.status_code == 200
        for line in r.text.splitlines():
            if line.startswith("ragspec_generated_tokens_total "):
                tokens[r.headers[REPLICA_HEADER]] = float(line.split()[1])
    assert set(tokens) == replicas and all(v >= 32 for v in tokens.values()), tokens
    assert sum(tokens.values()) >= 32 * len(prompts)
    # and every replica's series reach Ray's metrics port, labelled with the replica, with
    # the same values (copied every 0.5 s, exported every 1 s)
    mirrored: dict[str, float] = {}
    deadline = time.monotonic() + 30
    while mirrored != tokens and time.monotonic() < deadline:
        time.sleep(0.5)
        text = httpx.get(f"http://127.0.0.1:{cluster.metrics_port}/metrics", timeout=TIMEOUT).text
        for line in text.splitlines():
            if line.startswith("ray_ragspec_generated_tokens_total{"):
                labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
                mirrored[labels["replica"].strip('"')] = float(line.rsplit(" ", 1)[1])
    assert mirrored == tokens
    assert "ray_serve_num_http_requests_total" in text  # beside Ray Serve's own
    # loopback only: every connection of every Ray process stays on 127.0.0.1, and all
    # they listen on is loopback, except the one port Ray Serve 2.60 binds to all interfaces
    # in each replica (its inter-deployment gRPC server, hard-coded "[::]:0"; see README)
    pids = cluster.record()
    connections = _sockets(pids, "01")
    assert connections and all(_is_loopback(remote) for _, _, remote in connections), connections
    listening = [(pid, local) for pid, local, _ in _sockets(pids, "0A")]
    wildcard = [(pid, local) for pid, local in listening if local.startswith(_V6_ANY + ":")]
    replica_pids = {pid for pid in pids if _cmdline(pid).startswith("ray::ServeReplica")}
    assert len(replica_pids) == 2
    assert sorted(pid for pid, _ in wildcard) == sorted(replica_pids), wildcard
    outside = [
        (pid, _cmdline(pid)[:60], local)
        for pid, local in listening
        if not _is_loopback(local) and (pid, local) not in wildcard
    ]
    assert not outside, outside
    listening = [local for _, local in listening]
    assert f"127.0.0.1:{cluster.port}" in listening


def _cut_by_the_kill(stream_results: list[dict], plain_results: list, victim: str, full: str) -> int:
    """How many requests the kill cut, each checked: in flight on the killed replica, a
    clean, retryable error (a stream's text a true prefix of the answer); elsewhere the
    full answer."""
    cut = 0
    for s in stream_results:
        if s["status"] != 200:  # had not started on the killed replica
            assert s["status"] == 503 and s["retry_after"] == "1" and s["error"]["code"] == "replica_unavailable", s
            cut += 1
        elif s["replica"] == victim:
            assert "error" in s["events"][-1], s["events"][-2:]
            err = s["events"][-1]["error"]
            assert err["code"] == "replica_unavailable" and err["type"] == "server_error"
            assert full.startswith(s["text"]) and len(s["text"]) < len(full)  # a true prefix
            cut += 1
        else:
            assert s["text"] == full
    for r in plain_results:
        if r.status_code == 200:
            assert r.json()["choices"][0]["text"] == full
        elif r.status_code == 408:
            # routed to the victim as it died, then re-routed by Ray Serve's router to another
            # replica without its body (already sent): that replica's read deadline answers
            # a clear, retryable 408 (seen once, under heavy load; docs/ray.md says so)
            assert r.json()["error"]["code"] == "request_timeout", r.text
            cut += 1
        else:
            assert r.status_code == 503 and r.headers.get("retry-after") == "1", (r.status_code, r.text)
            assert r.json()["error"]["code"] == "replica_unavailable"
            cut += 1
    return cut


def _restarted_replica(before: dict, victim: str) -> str:
    """The replica Ray Serve starts in place of ``victim`` (waited for, 90 s at most)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        now = replica_actors()
        if len(now) == 2 and victim not in now and replica_states() == {"RUNNING": 2}:
            return (set(now) - set(before)).pop()
        time.sleep(0.5)
    pytest.fail(f"the killed replica was not restarted: {replica_states()}, {sorted(replica_actors())}")


@pytest.mark.slow
def test_killing_a_replica_mid_load(deployed, reference):
    import ray

    before = replica_actors()
    assert len(before) == 2
    prompt, body = "the cat sat on the", {"max_tokens": 400}
    full = httpx.post(reference.url + "/v1/completions", json={"prompt": prompt, **body}, timeout=TIMEOUT).json()[
        "choices"
    ][0]["text"]
    stream_started = threading.Event()
    streams: dict[int, dict] = {}
    lock = threading.Lock()

    def stream(i: int) -> dict:
        out = {"replica": None, "text": "", "events": []}
        with httpx.stream(
            "POST", deployed + "/v1/completions", json={"prompt": prompt, **body, "stream": True}, timeout=TIMEOUT
        ) as r:
            out["status"] = r.status_code
            out["replica"] = r.headers.get(REPLICA_HEADER)
            with lock:
                streams[i] = out
            raw = ""
            for piece in r.iter_text():
                raw += piece
                if '"text"' in raw:
                    stream_started.set()
        if out["status"] == 200:
            out["events"] = sse_events(raw)
            out["text"] = streamed_text(out["events"])
        else:
            out["error"] = json.loads(raw)["error"]
            out["retry_after"] = r.headers.get("retry-after")
        return out

    def plain(_: int) -> httpx.Response:
        return httpx.post(deployed + "/v1/completions", json={"prompt": prompt, **body}, timeout=TIMEOUT)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        stream_futures = [pool.submit(stream, i) for i in range(4)]
        plain_futures = [pool.submit(plain, i) for i in range(4)]
        # kill the replica of a stream that is producing tokens
        assert stream_started.wait(60), "no stream produced tokens"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with lock:
                victims = [s["replica"] for s in streams.values() if s["status"] == 200 and s["replica"]]
            if victims:
                break
            time.sleep(0.05)
        victim = victims[0]
        ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
        killed_s = time.monotonic()
        # requests sent after the kill succeed (on the other replica, or the restarted one)
        after = [plain(0) for _ in range(3)]
        _, pending = concurrent.futures.wait(stream_futures + plain_futures, timeout=120)
    assert not pending, "a request hung after its replica was killed"
    stream_results = [f.result() for f in stream_futures]
    plain_results = [f.result() for f in plain_futures]
    for r in after:
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == full, r.text
        assert r.headers[REPLICA_HEADER] != victim
    assert _cut_by_the_kill(stream_results, plain_results, victim, full) >= 1
    new = _restarted_replica(before, victim)
    short = httpx.post(
        reference.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 8}, timeout=TIMEOUT
    ).json()
    seen = set()
    deadline = time.monotonic() + 30
    while new not in seen and time.monotonic() < deadline:
        r = httpx.post(deployed + "/v1/completions", json={"prompt": prompt, "max_tokens": 8}, timeout=TIMEOUT)
        assert r.status_code == 200 and answer(r.json()) == answer(short)
        seen.add(r.headers[REPLICA_HEADER])
    assert new in seen, "the restarted replica serves"
    assert time.monotonic() - killed_s < 150


# ---------------------------------------------------------------------- last: shutdown
@pytest.mark.slow
def test_shutdown_leaves_no_ray_process(cluster):
    alive_before = cluster.record()
    assert alive_before, "the cluster had processes"
    left = cluster.shutdown()
    assert not left, f"Ray processes left behind: {left}"


@pytest.mark.slow
def test_sigterm_to_ragspec_serve_ray_leaves_no_ray_process(model_dir):
    """Regression (issue 40): after SIGTERM, ``ragspec serve --ray`` left ``ray::DashboardAgent``
    and ``ray::RuntimeEnvAgent`` running (parent PID 1, ignoring SIGTERM) and logged
    ``ServeController.graceful_shutdown failed``: Ray's own SIGTERM handler killed the local
    Ray's processes before Serve could shut down, and the command died with SIGABRT (exit
    -6 here). Its ready line was logged at WARNING.
    Now SIGTERM stops it as Ctrl-C does: Serve, then Ray, then what is left of that Ray."""
    if not HAVE_RAY:
        pytest.skip("needs the ray extra: pip install 'ragspec[ray]' (make test installs it)")
    temp_dir = tempfile.mkdtemp(prefix="rssig", dir="/tmp")  # short: Ray's unix sockets live under it
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray, started by the command
    env.update(RAY_TMPDIR=temp_dir, PYTHONPATH=str(ROOT))
    argv = [sys.executable, "-m", "ragspec", "serve", "--ray", "--replicas", "1", "--cpus-per-replica", "0.5"]
    argv += ["--threads-per-replica", "1", "--host", "127.0.0.1", "--port", str(port), "--no-calibrate"]
    argv += ["--model", str(model_dir / "tiny"), "--eagle", "none", "--app-name", "sigterm"]
    log = Path(temp_dir) / "stderr.txt"
    seen: set[int] = set()
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=temp_dir)
    try:
        deadline = time.monotonic() + 300
        while "ragspec serve: ragspec on Ray Serve" not in log.read_text():
            assert proc.poll() is None, f"ragspec serve --ray ended (rc {proc.returncode}): {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"not ready in 300 s: {log.read_text()[-3000:]}"
            seen |= _children(proc.pid)
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT).status_code == 200
        seen |= _children(proc.pid)
        assert any("ray::" in _cmdline(p) or "raylet" in _cmdline(p) for p in seen), "Ray ran under the command"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=180)
        deadline = time.monotonic() + 20
        while True:
            by_dir = {int(p) for p in os.listdir("/proc") if p.isdigit() and temp_dir in _cmdline(int(p))}
            left = {p for p in seen | by_dir if _alive(p)}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert not left, f"Ray processes left behind: {[f'{p}: {_cmdline(p)[:120]}' for p in sorted(left)]}"
        text = log.read_text()
        assert rc == 0, text[-3000:]
        # (not checked: Ray's raylet may log "Task ServeController.graceful_shutdown failed ... will be
        # retried" on any serve.shutdown(): in Ray 2.60 that task never returns, the controller kills
        # itself; under Ray's own SIGTERM handler it came with the crash checked above)
        assert "Traceback" not in text, text[-3000:]
        assert "ragspec: starting a local Ray..." in text and "ragspec: deploying 1 replica(s) on Ray Serve" in text
        assert "WARNING ragspec.integrations.ray" not in text  # the ready line is INFO, printed by the command
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for pid in seen:  # whatever this test started, never more
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---------------------------------------------------------------------- deployment files (no cluster)
def test_ray_compose_file_follows_the_compose_spec_and_runs_the_tested_command():
    # as test_deploy.py checks docker-compose.yml (no Docker on these machines): the schema,
    # then what the services run, parsed by the real command lines
    import jsonschema

    from ragspec.cli import build_parser
    from ragspec.integrations.cli import ray_options_from_args, settings_from_args

    compose = yaml.safe_load((ROOT / "docker-compose.ray.yml").read_text())
    schema = json.loads((Path(__file__).resolve().parent / "data" / "compose_spec.json").read_text())
    checker = jsonschema.FormatChecker()

    @checker.checks("duration")
    def _duration(value) -> bool:  # compose durations: 1h30m, 15s, 500ms
        return not isinstance(value, str) or re.fullmatch(r"(\d+(\.\d+)?(us|ms|s|m|h))+", value) is not None

    errors = list(jsonschema.Draft7Validator(schema, format_checker=checker).iter_errors(compose))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    services = compose["services"]
    head, worker, fetch = services["ray-head"], services["ray-worker"], services["model-fetch"]
    # one image with the ray extra, built from the Dockerfile's RAGSPEC_EXTRAS argument
    assert fetch["build"]["args"]["RAGSPEC_EXTRAS"] == "[ray]"
    assert 'pip install ".${RAGSPEC_EXTRAS}"' in (ROOT / "Dockerfile").read_text()
    assert head["image"] == worker["image"] == fetch["image"]
    for svc in (head, worker):
        env = svc["environment"]
        assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == PROXY_CALLBACK
        assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN:?")
        assert "./datastores:/data/datastores:ro" in svc["volumes"] and any(
            v.endswith(":" + env["RAGSPEC_CACHE"]) for v in svc["volumes"]
        )

    def shell(svc) -> list[list[str]]:
        """The commands of a ``bash -c`` service, compose's $$ and the defaults expanded."""
        assert svc["command"][:2] == ["bash", "-c"]
        env = {k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in svc["environment"].items()}
        line = re.sub(r'"\$\$(\w+)"', lambda m: env[m.group(1)], svc["command"][2])
        return [shlex.split(part.replace("exec ", "", 1)) for part in line.split("&&")]

    ray_start, serve = shell(head)
    (worker_start,) = shell(worker)
    if HAVE_RAY:  # Ray's own parser accepts both ray start command lines
        from ray.scripts.scripts import start

        for cmd in (ray_start, worker_start):
            assert cmd[:2] == ["ray", "start"]
            start.make_context("start", cmd[2:])
    assert "--head" in ray_start and "--port=6379" in ray_start and "--num-cpus=0" in ray_start
    assert "--address=ray-head:6379" in worker_start
    # the head's serve command parses with the real CLI into the deployment it should be
    assert serve[:2] == ["ragspec", "serve"]
    args = build_parser().parse_args(serve[1:])
    settings, options = settings_from_args(args), ray_options_from_args(args)
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)
    assert (options.address, options.replicas, options.cpus_per_replica, options.threads) == ("auto", 2, 1.0, 1)
    assert head["ports"] == [f"127.0.0.1:{settings.port}:{settings.port}"]
    assert f":{settings.port}/health" in " ".join(head["healthcheck"]["test"])
