"""``ragspec bench --serve``: the HTTP service, as users meet it, against llama-server and
against its own engine in process.

Two comparisons, one run, the servers never up at the same time:

1. **ragspec serve against llama-server** (llama.cpp's server on the same GGUF and threads;
   optional: skipped, and the report says why, when no binary or no GGUF is found). Each
   phase starts a fresh server process, sends one short warm-up request, then times:

   - ``solo``: the prompts one after another (one client);
   - ``clients``: N clients in a closed loop (each sends its next prompt when its answer
     has arrived); every prompt is sent once, so with as many prompts as clients (the
     default: 4 rag + 4 summarization prompts, 8 clients) all requests go at once;
   - ``mixed``: the same N clients' long prompts, with short questions (qa prompts, at most
     :attr:`MixedLoad.max_tokens` tokens each) arriving among them at set times
     (:class:`~ragspec.bench.serve_client.MixedLoad`), each short question also sent alone
     after the load: how long a short question waits behind long ones.

   The phases alternate between the servers: ragspec solo, llama-server solo, ragspec N
   clients, llama-server N clients, ragspec mixed, llama-server mixed. Requests are OpenAI ``/v1/chat/completions`` with the
   prompt as one user message (each server applies the model's chat template), greedy
   (``temperature`` 0), ``max_tokens`` (natural stops), streamed with
   ``stream_options.include_usage``.

2. **server against engine**: the model loaded in this process (main thread) with the
   settings the server runs with (:meth:`ragspec.integrations.settings.ServerSettings.serving_config`,
   :func:`ragspec.serving.load_serving_engine`: the same prefix-cache and prefill-chunk
   settings), against a fresh ``ragspec serve`` with the response cache off (the engine has
   none), prompt by prompt, alternating which goes first; each prompt is new to both (no
   prefix-cache or response-cache hit). The engine is loaded before that server starts and
   runs only while the server is idle: torch's OpenMP pool belongs to the calling thread,
   and two processes computing at once on the same cores slow each other down.

Reported per phase (:class:`PhaseResult`):
    tok_s               completion tokens (the servers' ``usage``) / wall time of the phase
    latency_p50_s, latency_p95_s   per request, sent to the stream's end (``[DONE]``)
    ttft_p50_s, ttft_p95_s         per request, sent to the first chunk with content
    mean_tokens         mean completion tokens per request
    identical           clients and mixed phases: answers whose text equals the same
                        server's solo answer to the same prompt (the servers return text,
                        not token ids)
    short_*             mixed phase: the short questions among the long ones (their
                        latency P50 / P95 and TTFT P50, and alone: ``short_alone_p50_s``);
                        the fields above are the long prompts' (``tok_s``: all tokens)

and per prompt of the engine comparison (:class:`EngineVsServer`): the engine's seconds
(``engine.generate``), the server's (client-measured, HTTP and tokenization included),
their ratio and whether the texts are equal.

Pure parts (SSE parsing, aggregates, identity, command lines) are functions of their
inputs; the processes and sockets live in :class:`ServerProcess` and :func:`run_serve_bench`,
the client in :mod:`ragspec.bench.serve_client`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..errors import BenchServerError, ConfigError
from .concurrency import _quantile
from .serve_client import ChatReply, MixedLoad, RequestRecord, httpx_module, parse_sse, request_all, request_mixed

if TYPE_CHECKING:
    from ..engine import Engine
    from ..integrations.settings import ServerSettings

logger = logging.getLogger(__name__)

__all__ = [
    "SERVE_PHASES",
    "ChatReply",
    "RequestRecord",
    "MixedLoad",
    "PhaseResult",
    "EngineVsServer",
    "ServeBenchConfig",
    "ServeBenchReport",
    "ServerProcess",
    "parse_sse",
    "summarize_phase",
    "count_identical",
    "find_llama_server",
    "llama_server_command",
    "ragspec_serve_command",
    "free_port",
    "run_serve_bench",
    "format_report",
]

SERVE_PHASES = ("solo", "clients", "mixed", "engine")
"""What ``--serve-phases`` may name: the three server phases and the engine comparison."""

LLAMA_SERVER_CONTEXT = 16384
"""llama-server's ``-c`` (all slots together), as in the recorded baseline."""

WARMUP_PROMPT = "Say hello."
"""The short request each fresh server answers before it is timed (shorter than a prefill
chunk: no prefix-cache entry a timed prompt could hit)."""

STOP_WAIT_S = 15.0
"""How long a stopped server may take to exit before it is killed."""


# ---------------------------------------------------------------------------- pure parts
@dataclass
class PhaseResult:
    """One phase on one server (see the module docstring). Seconds and tokens/s."""

    server: str
    """``"ragspec"`` or ``"llama-server"``."""
    phase: str
    """``"solo"``, ``"clients"`` or ``"mixed"``."""
    clients: int
    requests: int
    wall_s: float
    completion_tokens: int
    tok_s: float
    latency_p50_s: float
    latency_p95_s: float
    ttft_p50_s: float
    mean_tokens: float
    identical: Optional[int] = None
    """Clients phase: answers equal to this server's solo answer (None: not compared)."""
    same_as_ragspec: Optional[int] = None
    """llama-server: answers equal to ragspec serve's solo answer to the same prompt (None:
    not compared; other numerics, so they need not agree)."""
    ready_s: float = 0.0
    """Process start to ready (model load, calibration)."""
    command: list[str] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    ttft_p95_s: float = 0.0
    short_requests: int = 0
    """Mixed phase: short questions sent among the long prompts (0: not a mixed phase)."""
    short_latency_p50_s: float = 0.0
    short_latency_p95_s: float = 0.0
    short_ttft_p50_s: float = 0.0
    short_alone_p50_s: float = 0.0
    """The same short questions sent alone before the load."""
    short_identical: Optional[int] = None
    """Short answers among the long ones equal to their answers alone."""


def count_identical(texts: Sequence[str], reference: Sequence[str]) -> int:
    """How many of ``texts`` equal the reference text at the same index (``texts[i]`` vs
    ``reference[i]``; indices past either list do not count)."""
    return sum(a == b for a, b in zip(texts, reference))


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    """Each request's TTFT, its whole latency when it had no content."""
    return [r.latency_s if r.ttft_s is None else r.ttft_s for r in records]


def summarize_phase(
    server: str,
    phase: str,
    clients: int,
    records: Sequence[RequestRecord],
    wall_s: float,
    *,
    reference: Optional[Sequence[str]] = None,
    ready_s: float = 0.0,
    command: Sequence[str] = (),
) -> PhaseResult:
    """A phase's aggregates from its requests (``records``, any order) and its wall time.

    ``reference``: the solo texts by prompt index, for ``identical`` (None: not counted).
    A request without content counts its whole latency as its TTFT. A mixed phase's
    records (:attr:`RequestRecord.kind`): the long prompts give the latency, TTFT, mean
    tokens and identity; the short questions the ``short_*`` fields (their answers
    compared with their answers alone); ``tok_s`` counts the tokens of both over
    ``wall_s``.
    """
    ordered = sorted((r for r in records if r.kind == "long"), key=lambda r: r.prompt)
    short = sorted((r for r in records if r.kind == "short"), key=lambda r: r.prompt)
    alone = {r.prompt: r for r in records if r.kind == "alone"}
    tokens = sum(r.completion_tokens for r in ordered)
    latencies = [r.latency_s for r in ordered]
    identical = None
    if reference is not None:
        identical = sum(r.prompt < len(reference) and r.text == reference[r.prompt] for r in ordered)
    loaded = tokens + sum(r.completion_tokens for r in short)
    return PhaseResult(
        server=server,
        phase=phase,
        clients=clients,
        requests=len(ordered),
        wall_s=wall_s,
        completion_tokens=loaded,
        tok_s=loaded / wall_s if wall_s > 0 else 0.0,
        latency_p50_s=_quantile(latencies, 0.5),
        latency_p95_s=_quantile(latencies, 0.95),
        ttft_p50_s=_quantile(_ttfts(ordered), 0.5),
        mean_tokens=tokens / len(ordered) if ordered else 0.0,
        identical=identical,
        ready_s=ready_s,
        command=list(command),
        records=sorted(records, key=lambda r: (r.kind != "long", r.kind, r.prompt)),
        ttft_p95_s=_quantile(_ttfts(ordered), 0.95),
        short_requests=len(short),
        short_latency_p50_s=_quantile([r.latency_s for r in short], 0.5),
        short_latency_p95_s=_quantile([r.latency_s for r in short], 0.95),
        short_ttft_p50_s=_quantile(_ttfts(short), 0.5),
        short_alone_p50_s=_quantile([r.latency_s for r in alone.values()], 0.5),
        short_identical=sum(r.prompt in alone and r.text == alone[r.prompt].text for r in short) if short else None,
    )


@dataclass
class EngineVsServer:
    """One prompt through ``engine.generate`` in process and through one solo server
    request. Seconds."""

    prompt: int
    question_id: Any
    category: str
    prompt_tokens: int
    engine_s: float
    server_s: float
    engine_tokens: int
    server_tokens: int
    identical: bool
    """The server's text equals the engine's."""
    server_first: bool
    """Which went first for this prompt (they alternate)."""
    engine_cached_tokens: int = 0
    server_cached_tokens: Optional[int] = None
    """Prompt tokens each side's prefix cache served: 0 when the prompt was new to it."""

    @property
    def ratio(self) -> float:
        """Server seconds over engine seconds (> 1: the server is slower)."""
        return self.server_s / self.engine_s if self.engine_s > 0 else 0.0


def find_llama_server(path: Optional[str] = None) -> Optional[str]:
    """The llama-server binary: ``path`` when given, else ``llama-server`` on ``PATH``
    (None: not found there).

    Raises:
        ConfigError: ``path`` is given but is not an executable file.
    """
    if path:
        p = Path(path).expanduser()
        if not p.is_file() or not os.access(p, os.X_OK):
            raise ConfigError(f"--llama-server {path}: not an executable file")
        return str(p)
    return shutil.which("llama-server")


def llama_server_command(
    binary: str, gguf: str, *, port: int, threads: int, slots: int, context: int = LLAMA_SERVER_CONTEXT
) -> list[str]:
    """llama-server serving ``gguf`` on 127.0.0.1:``port``, CPU only, with ``threads``
    threads for decoding and for prompt batches and ``slots`` parallel slots over one
    context of ``context`` tokens (each slot ``context // slots``).

    Raises:
        ConfigError: ``threads`` or ``slots`` below 1.
    """
    if threads < 1 or slots < 1:
        raise ConfigError(f"llama-server needs threads and slots >= 1, got {threads} and {slots}")
    flags = f"-c {context} -np {slots} -t {threads} -tb {threads} -ngl 0 --host 127.0.0.1 --port {port} --no-webui"
    return [binary, "-m", str(gguf), *flags.split()]


@dataclass(frozen=True)
class ServeBenchConfig:
    """What ``ragspec bench --serve`` runs. The model options mean what ``ragspec serve``'s
    do; None leaves the server's default."""

    clients: int = 8
    max_tokens: int = 128
    threads: int = 2
    phases: tuple[str, ...] = SERVE_PHASES
    model: Optional[str] = None
    device: Optional[str] = None
    dtype: Optional[str] = None
    eagle: Optional[str] = None
    numerics: Optional[str] = None
    drafting: Optional[str] = None
    max_draft_tokens: Optional[int] = None
    fixed_draft: bool = False
    calibrate: bool = True
    prefix_cache_tokens: Optional[int] = None
    datastore: Optional[str] = None
    """A datastore directory the server drafts from (its default datastore)."""
    llama_server: Optional[str] = None
    """The llama-server binary (None: not run)."""
    gguf: Optional[str] = None
    """The model's GGUF file, for llama-server."""
    timeout_s: float = 600.0
    """Bounds every wait: a server becoming ready, each request."""
    warmup: bool = True
    """One short request on each fresh server (and the in-process engine) before timing."""
    python: str = sys.executable
    server_source: Optional[str] = None
    """A ragspec source tree whose ``ragspec serve`` is timed (its folder holds the
    ``ragspec`` package; the server processes run there with it first on ``PYTHONPATH``),
    e.g. another checkout to compare with; None: the ragspec of this process. The engine
    comparison's in-process engine is always this process's."""
    mixed: MixedLoad = MixedLoad()
    """When the mixed phase's short questions arrive and how long they are."""

    def __post_init__(self) -> None:
        if self.clients < 1:
            raise ConfigError(f"--serve-clients must be >= 1, got {self.clients}")
        if self.max_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_tokens}")
        if self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")
        if not self.timeout_s > 0:
            raise ConfigError(f"--serve-timeout must be > 0 s, got {self.timeout_s}")
        if self.server_source is not None and not (Path(self.server_source) / "ragspec" / "__init__.py").is_file():
            raise ConfigError(f"--serve-source {self.server_source}: no ragspec package there (ragspec/__init__.py)")
        bad = [p for p in self.phases if p not in SERVE_PHASES]
        if bad or not self.phases:
            raise ConfigError(f"--serve-phases takes some of {', '.join(SERVE_PHASES)}, got {','.join(self.phases)}")

    def server_settings(self, *, response_cache: bool = True) -> "ServerSettings":
        """The settings ``ragspec serve`` runs with under :func:`ragspec_serve_command`'s
        options (the ``RAGSPEC_*`` variables of this process included, as the child
        inherits them): that command line without its address, parsed by the ``serve``
        command's own parser."""
        from ..integrations.cli import add_serve_command, settings_from_args

        parser = argparse.ArgumentParser()
        add_serve_command(parser.add_subparsers())
        cmd = ragspec_serve_command(self, 0, response_cache=response_cache)
        serve = cmd[cmd.index("serve") :]
        for flag in ("--host", "--port"):  # the address: the environment's or the default, as before
            i = serve.index(flag)
            del serve[i : i + 2]
        return settings_from_args(parser.parse_args(serve))


def ragspec_serve_command(config: ServeBenchConfig, port: int, *, response_cache: bool = True) -> list[str]:
    """``python -m ragspec --threads T serve`` on 127.0.0.1:``port`` with ``config``'s
    model options; ``--max-active`` at least the clients (8 at least, the default),
    ``--max-client-requests 0`` (every client of the bench has the same address) and, with
    ``response_cache`` False, ``--no-response-cache``."""
    cmd = [config.python, "-m", "ragspec", "--threads", str(config.threads), "serve"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    for flag, value in (
        ("--model", config.model),
        ("--device", config.device),
        ("--dtype", config.dtype),
        ("--eagle", config.eagle),
        ("--numerics", config.numerics),
        ("--drafting", config.drafting),
        ("--max-draft-tokens", config.max_draft_tokens),
        ("--prefix-cache-tokens", config.prefix_cache_tokens),
        ("--datastore", config.datastore),
    ):
        if value is not None:
            cmd += [flag, str(value)]
    if config.fixed_draft:
        cmd.append("--fixed-draft")
    if not config.calibrate:
        cmd.append("--no-calibrate")
    cmd += ["--max-active", str(max(config.clients, 8)), "--max-queue", str(max(32, config.clients))]
    cmd += ["--max-client-requests", "0"]
    if not response_cache:
        cmd.append("--no-response-cache")
    return cmd


def free_port() -> int:
    """A TCP port free on 127.0.0.1 at the moment of asking."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- processes
class ServerProcess:
    """A server started as a child process on a loopback port, its output in ``log``;
    stopped (terminate, then kill after :data:`STOP_WAIT_S`) on leaving the ``with``.

    ``ready_path``: the URL path that answers 200 once the model is loaded (``/ready`` for
    ragspec, ``/health`` for llama-server). ``source``: a folder it runs in, first on its
    ``PYTHONPATH`` (a ragspec source tree; None: this process's folder and environment).
    Constructing does nothing; ``start`` (or ``with``) starts it and waits at most
    ``timeout_s`` for it to be ready.
    """

    def __init__(
        self,
        name: str,
        command: Sequence[str],
        port: int,
        ready_path: str,
        log: Path,
        timeout_s: float,
        source: Optional[str] = None,
    ) -> None:
        self.name = name
        self.command = list(command)
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        self.log = log
        self.timeout_s = timeout_s
        self.ready_s = 0.0
        self.source = source
        self._proc: Optional[subprocess.Popen] = None

    def start(self) -> float:
        """Start the process and wait until it is ready; returns the seconds that took.

        Raises:
            BenchServerError: it exited, or was not ready within ``timeout_s`` (stopped;
                the message ends with its last output lines).
        """
        httpx = httpx_module()
        logger.info("starting %s: %s", self.name, " ".join(self.command))
        t0 = time.perf_counter()
        with open(self.log, "ab") as out:
            env, cwd = None, None
            if self.source is not None:
                cwd = str(Path(self.source).resolve())
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (cwd, os.environ.get("PYTHONPATH")) if p)}
            self._proc = subprocess.Popen(
                self.command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env=env
            )
        try:
            self._wait_ready(httpx, t0 + self.timeout_s)
        except BaseException:  # not ready, or interrupted (Ctrl-C): no process left behind
            self.stop()
            raise
        self.ready_s = time.perf_counter() - t0
        logger.info("%s ready in %.1f s", self.name, self.ready_s)
        return self.ready_s

    def _wait_ready(self, httpx: Any, deadline: float) -> None:
        proc = self._proc
        assert proc is not None, "started first"
        with httpx.Client(trust_env=False, timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    raise BenchServerError(
                        f"{self.name} exited with status {proc.returncode} before it was ready: {self._tail()}"
                    )
                try:
                    if client.get(self.url + self.ready_path).status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                if time.perf_counter() > deadline:
                    raise BenchServerError(f"{self.name} was not ready after {self.timeout_s:g} s: {self._tail()}")
                time.sleep(0.2)

    def stop(self) -> None:
        """Terminate the process; kill it when it has not exited after :data:`STOP_WAIT_S`."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not exit %.0f s after SIGTERM: killed", self.name, STOP_WAIT_S)
            proc.kill()
            proc.wait(timeout=STOP_WAIT_S)

    def _tail(self, lines: int = 8) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no output)"
        return " | ".join(text.strip().splitlines()[-lines:]) or "(no output)"

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------- the run
@dataclass
class ServeBenchReport:
    """Everything ``ragspec bench --serve`` measured, and how."""

    settings: dict
    phases: list[PhaseResult] = field(default_factory=list)
    engine: list[EngineVsServer] = field(default_factory=list)
    llama_server: Optional[str] = None
    """Why llama-server was not run (None: it was)."""

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {
            "settings": self.settings,
            "llama_server_skipped": self.llama_server,
            "phases": [asdict(p) for p in self.phases],
            "engine_vs_server": [{**asdict(e), "ratio": e.ratio} for e in self.engine],
        }


def _server_phase(
    name: str,
    phase: str,
    make: Callable[[int], list[str]],
    ready_path: str,
    texts: Sequence[str],
    config: ServeBenchConfig,
    logdir: Path,
    reference: Optional[Sequence[str]],
    short_texts: Sequence[str] = (),
) -> PhaseResult:
    clients = 1 if phase == "solo" else config.clients
    port = free_port()
    command = make(port)
    source = config.server_source if name == "ragspec" else None
    server = ServerProcess(name, command, port, ready_path, logdir / f"{name}-{phase}.log", config.timeout_s, source)
    with server:
        if config.warmup:
            request_all(server.url, [WARMUP_PROMPT], 1, min(8, config.max_tokens), config.timeout_s)
        if phase == "mixed":
            records, wall = request_mixed(
                server.url, texts, short_texts, clients, config.max_tokens, config.mixed, config.timeout_s
            )
        else:
            records, wall = request_all(server.url, texts, clients, config.max_tokens, config.timeout_s)
    return summarize_phase(
        name, phase, clients, records, wall, reference=reference, ready_s=server.ready_s, command=command
    )


def _load_engine(config: ServeBenchConfig) -> tuple["Engine", dict]:
    """The engine the server serves, loaded here with its settings (response cache off),
    and those settings for the report."""
    from ..serving import load_serving_engine

    settings = config.server_settings(response_cache=False)
    engine = load_serving_engine(settings.serving_config())  # its first datastore the default, as served
    return engine, {
        "prefill_chunk_tokens": engine.policy.prefill_chunk_tokens,
        "prefix_cache_tokens": engine.policy.prefix_cache_tokens if engine.prefix_cache is not None else 0,
        "max_draft_tokens": engine.policy.max_draft_tokens,
        "adaptive": engine.policy.adaptive,
        "drafting": engine.drafting,
        "response_cache": False,
        "model": engine.model_name,
    }


def _engine_phase(
    rows: Sequence[dict],
    config: ServeBenchConfig,
    logdir: Path,
    progress: Optional[Callable[[EngineVsServer], None]],
) -> tuple[list[EngineVsServer], dict]:
    engine, used = _load_engine(config)  # before the server starts: never both computing
    texts = [str(r["turns"][0]) for r in rows]
    port = free_port()
    command = ragspec_serve_command(config, port, response_cache=False)
    used["command"] = command
    out: list[EngineVsServer] = []

    def run_engine(text: str, max_tokens: int) -> tuple[float, Any, int]:
        ids = engine.encode_messages([{"role": "user", "content": text}])
        t = time.perf_counter()
        result = engine.generate(ids, max_new_tokens=max_tokens, chat=False, temperature=0.0)
        return time.perf_counter() - t, result, len(ids)

    def run_server(text: str) -> RequestRecord:
        (record,), _ = request_all(server.url, [text], 1, config.max_tokens, config.timeout_s)
        return record

    log = logdir / "ragspec-engine.log"
    with ServerProcess("ragspec", command, port, "/ready", log, config.timeout_s, config.server_source) as server:
        used["ready_s"] = server.ready_s
        if config.warmup:
            run_engine(WARMUP_PROMPT, min(8, config.max_tokens))
            request_all(server.url, [WARMUP_PROMPT], 1, min(8, config.max_tokens), config.timeout_s)
        for k, (row, text) in enumerate(zip(rows, texts)):
            server_first = k % 2 == 1  # they take turns going first
            if server_first:
                rec = run_server(text)
            engine_s, result, prompt_tokens = run_engine(text, config.max_tokens)
            if not server_first:
                rec = run_server(text)
            item = EngineVsServer(
                prompt=k,
                question_id=row.get("question_id"),
                category=str(row.get("category", "")),
                prompt_tokens=prompt_tokens,
                engine_s=engine_s,
                server_s=rec.latency_s,
                engine_tokens=len(result.token_ids),
                server_tokens=rec.completion_tokens,
                identical=rec.text == result.text,
                server_first=server_first,
                engine_cached_tokens=result.stats.num_cached_prompt_tokens,
                server_cached_tokens=rec.cached_tokens,
            )
            out.append(item)
            if progress is not None:
                progress(item)
    return out, used


def run_serve_bench(
    config: ServeBenchConfig,
    rows: Sequence[dict],
    *,
    llama_skipped: Optional[str] = None,
    on_phase: Optional[Callable[[PhaseResult], None]] = None,
    on_prompt: Optional[Callable[[EngineVsServer], None]] = None,
    short_rows: Sequence[dict] = (),
) -> ServeBenchReport:
    """Run the phases of ``config`` over the Spec-Bench ``rows`` (their first turns), in
    order: solo on each server, clients on each server, mixed on each server (``short_rows``'
    first turns the short questions), then the engine comparison; one server process at a
    time (see the module docstring).

    ``llama_skipped``: why llama-server is not run (reported), when ``config.llama_server``
    or ``config.gguf`` is None.

    Raises:
        ConfigError: no rows; a mixed phase without ``short_rows``.
        BenchServerError: a server did not start or answered an error.
        what loading the model raises (the engine comparison).
    """
    if not rows:
        raise ConfigError("no prompts")
    if "mixed" in config.phases and not short_rows:
        raise ConfigError("the mixed phase needs short questions (qa prompts)")
    texts = [str(r["turns"][0]) for r in rows]
    short_texts = [str(r["turns"][0]) for r in short_rows]
    servers: list[tuple[str, Callable[[int], list[str]], str]] = [
        ("ragspec", lambda port: ragspec_serve_command(config, port), "/ready")
    ]
    if config.llama_server and config.gguf:
        binary, gguf = config.llama_server, config.gguf
        servers.append(
            (
                "llama-server",
                lambda port: llama_server_command(
                    binary, gguf, port=port, threads=config.threads, slots=config.clients
                ),
                "/health",
            )
        )
    elif llama_skipped is None:
        llama_skipped = "no llama-server binary" if not config.llama_server else "the model has no GGUF file"
    settings = {
        "prompts": len(rows),
        "categories": sorted({str(r.get("category", "")) for r in rows}),
        "clients": config.clients,
        "closed_loop": True,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        "threads": config.threads,
        "phases": list(config.phases),
        "warmup": config.warmup,
        "server_source": config.server_source,
        "llama_server": config.llama_server,
        "gguf": config.gguf,
        "ragspec_server": {
            k: getattr(config.server_settings(), k)
            for k in ("prefill_chunk_tokens", "prefix_cache_tokens", "response_cache_tokens", "max_active")
        },
    }
    report = ServeBenchReport(settings=settings, llama_server=llama_skipped)
    solo: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="ragspec-bench-serve-") as tmp:
        logdir = Path(tmp)
        if "mixed" in config.phases:
            report.settings["mixed"] = {
                "short_questions": len(short_texts),
                "categories": sorted({str(r.get("category", "")) for r in short_rows}),
                "delay_s": config.mixed.delay_s,
                "interval_s": config.mixed.interval_s,
                "max_tokens": config.mixed.max_tokens,
            }
        for phase in ("solo", "clients", "mixed"):
            if phase not in config.phases:
                continue
            for name, make, ready in servers:
                reference = solo.get(name) if phase != "solo" else None
                result = _server_phase(name, phase, make, ready, texts, config, logdir, reference, short_texts)
                if phase == "solo":
                    solo[name] = [r.text for r in result.records]
                if name != "ragspec" and "ragspec" in solo:
                    result.same_as_ragspec = count_identical([r.text for r in result.records], solo["ragspec"])
                report.phases.append(result)
                if on_phase is not None:
                    on_phase(result)
        if "engine" in config.phases:
            report.engine, used = _engine_phase(rows, config, logdir, on_prompt)
            report.settings["engine_comparison"] = used
    return report


# ---------------------------------------------------------------------------- the table
def _mixed_lines(report: ServeBenchReport) -> list[str]:
    """One line per mixed phase: its short questions among the long prompts and alone."""
    load = report.settings.get("mixed", {})
    out = []
    for p in report.phases:
        if p.phase != "mixed":
            continue
        same = (
            ""
            if p.short_identical is None
            else f"; equal to their answers alone {p.short_identical}/{p.short_requests}"
        )
        out.append(
            f"# {p.server} mixed: {p.short_requests} short question{'' if p.short_requests == 1 else 's'} (max_tokens {load.get('max_tokens')}, sent "
            f"{load.get('delay_s')} s after the {p.requests} long prompts, then every {load.get('interval_s')} s): "
            f"P50 {p.short_latency_p50_s:.2f} s, P95 {p.short_latency_p95_s:.2f} s, TTFT P50 "
            f"{p.short_ttft_p50_s:.2f} s; alone P50 {p.short_alone_p50_s:.2f} s" + same
        )
    return out


def _phase_label(p: PhaseResult) -> str:
    if p.phase == "mixed":
        return f"{p.clients}+mixed"
    return "solo" if p.phase == "solo" else f"{p.clients} clients"


def format_report(report: ServeBenchReport) -> str:
    """The phases as a table, the ragspec / llama-server ratios per phase and the engine
    comparison per prompt."""
    s = report.settings
    lines = [
        f"# ragspec bench --serve: {s['prompts']} prompts ({', '.join(s['categories'])}), max_tokens "
        f"{s['max_tokens']}, greedy, threads {s['threads']}, clients in a closed loop, a fresh server per phase",
    ]
    if report.phases:
        lines.append(
            f"{'server':<13} {'phase':<10} {'reqs':>4} {'tok/s':>7} {'P50 s':>7} {'P95 s':>7} {'TTFT50 s':>9} "
            f"{'TTFT95 s':>9} {'mean tok':>8} {'identical':>9}"
        )
        for p in report.phases:
            same = "-" if p.identical is None else f"{p.identical}/{p.requests}"
            lines.append(
                f"{p.server:<13} {_phase_label(p):<10} {p.requests:>4} {p.tok_s:>7.1f} {p.latency_p50_s:>7.2f} "
                f"{p.latency_p95_s:>7.2f} {p.ttft_p50_s:>9.2f} {p.ttft_p95_s:>9.2f} {p.mean_tokens:>8.1f} {same:>9}"
            )
        lines += _mixed_lines(report)
        by = {(p.server, p.phase): p for p in report.phases}
        for phase in ("solo", "clients"):
            ours, theirs = by.get(("ragspec", phase)), by.get(("llama-server", phase))
            if ours is not None and theirs is not None and theirs.tok_s > 0 and theirs.latency_p50_s > 0:
                same = (
                    ""
                    if theirs.same_as_ragspec is None
                    else (
                        f"; llama-server's answers equal to ragspec's solo ones {theirs.same_as_ragspec}/{theirs.requests}"
                    )
                )
                lines.append(
                    f"# {_phase_label(ours)}: ragspec / llama-server tok/s x{ours.tok_s / theirs.tok_s:.2f}, "
                    f"P50 latency x{ours.latency_p50_s / theirs.latency_p50_s:.2f} (below 1: ragspec answers sooner)"
                    + same
                )
        ours, theirs = by.get(("ragspec", "mixed")), by.get(("llama-server", "mixed"))
        if ours is not None and theirs is not None and theirs.short_latency_p50_s > 0 and theirs.latency_p50_s > 0:
            lines.append(
                f"# mixed: ragspec / llama-server short questions' P50 x{ours.short_latency_p50_s / theirs.short_latency_p50_s:.2f}, "
                f"long prompts' P50 x{ours.latency_p50_s / theirs.latency_p50_s:.2f}"
            )
    if report.llama_server:
        lines.append(f"# llama-server not run: {report.llama_server}")
    if report.engine:
        used = s.get("engine_comparison", {})
        lines.append(
            f"# server vs engine in process, solo, each prompt new to both: prefill chunk "
            f"{used.get('prefill_chunk_tokens')}, prefix cache {used.get('prefix_cache_tokens')} tokens, "
            f"response cache off, drafting {used.get('drafting')}"
        )
        lines.append(
            f"{'prompt':<22} {'tokens':>6} {'engine s':>9} {'server s':>9} {'ratio':>6} {'out tok':>7} {'same':>5}"
        )
        for e in report.engine:
            label = f"{e.category} #{e.question_id}"[:22]
            lines.append(
                f"{label:<22} {e.prompt_tokens:>6} {e.engine_s:>9.2f} {e.server_s:>9.2f} {e.ratio:>6.2f} "
                f"{e.server_tokens:>7} {'yes' if e.identical else 'NO':>5}"
            )
        engine_s = sum(e.engine_s for e in report.engine)
        server_s = sum(e.server_s for e in report.engine)
        if engine_s > 0:
            lines.append(
                f"# server / engine, all prompts: x{server_s / engine_s:.2f} ({server_s:.2f} s / {engine_s:.2f} s); "
                f"same text {sum(e.identical for e in report.engine)}/{len(report.engine)}"
            )
        hits = [e for e in report.engine if e.engine_cached_tokens or e.server_cached_tokens]
        if hits:
            lines.append(
                f"# note: {len(hits)} prompts began with a prefix cached by an earlier prompt (engine / server "
                f"tokens: {', '.join(f'{e.engine_cached_tokens}/{e.server_cached_tokens}' for e in hits)})"
            )
    return "\n".join(lines)
