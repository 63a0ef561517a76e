"""ragspec's REST service on Ray Serve: data-parallel replicas behind one endpoint.

Each replica is the FastAPI app of :mod:`.server`, built inside the replica by
:meth:`RagspecReplica.__serve_build_asgi_app__` (only the small, frozen
:class:`.settings.ServerSettings` travel to it; the model, the datastores and the worker
thread are made there). Ray Serve gives the rest: one HTTP proxy per node in front of all
replicas, health checks and restarts, autoscaling, placement on CPUs or (fractional) GPUs,
its own metrics.

Usage::

    ragspec serve --ray --replicas 2 --cpus-per-replica 1          # a local Ray, one machine
    ragspec serve --ray --address ray://head:10001 --autoscale 1:8 # a running cluster

or, composing your own Ray Serve application::

    from ray import serve
    from ragspec.integrations.ray import RayOptions, build_app
    serve.run(build_app(ServerSettings(model="smollm2-135m-instruct"), RayOptions(replicas=2)))

Datastores: every replica opens the same directories (read-only memory maps, so replicas on
one node share the pages). A replica whose model or datastore does not load (missing
directory, built with another tokenizer, ...) fails its health check with that one-line
error, so Ray Serve never routes to it and the deployment fails instead of serving drafts
from the wrong data.

Replica loss: the HTTP proxy's middleware (:func:`proxy_middlewares`, installed through
``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``) turns a request whose replica died into a
clean, retryable error: ``503`` with OpenAI's error body and ``Retry-After`` when nothing
was answered yet, or a last SSE error event and ``[DONE]`` for a stream cut in the middle.

Importing this module is cheap (Ray, torch and FastAPI load when used).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from ragspec.errors import ConfigError, RagspecError
from ragspec.progress import step

from .settings import ServerSettings

if TYPE_CHECKING:
    from ragspec.drafters.response_cache import ResponseCache
    from ragspec.engine import Engine

logger = logging.getLogger(__name__)

__all__ = [
    "RayOptions",
    "RagspecReplica",
    "ReplicaStartError",
    "build_app",
    "connect",
    "parse_autoscale",
    "proxy_middlewares",
    "run",
    "shutdown",
    "PROXY_CALLBACK",
    "REPLICA_HEADER",
]

PROXY_CALLBACK = "ragspec.integrations.ray.proxy_middlewares"
"""Import path for ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` (set on every node)."""
REPLICA_HEADER = "x-ragspec-replica"
"""Response header naming the replica that answered (Ray Serve's replica id)."""
_INSTALL_HINT = "Ray Serve is not installed: pip install 'ragspec[ray]'"
_START_ERROR = re.compile(r"ReplicaStartError: (.+)")


def _load_serving_released(config: Any) -> Any:
    """:func:`ragspec.serving.load_serving` in a worker thread that computes nothing later:
    its OpenMP pool is released (the replica's scheduler thread steps; see
    :mod:`ragspec.backend.threads`)."""
    from ragspec.backend.threads import release_openmp_pool
    from ragspec.serving import load_serving

    try:
        return load_serving(config)
    finally:
        release_openmp_pool()


class ReplicaStartError(RagspecError):
    """A replica's model or datastore did not load; the message is the one-line cause."""


def parse_autoscale(spec: str) -> tuple[int, int]:
    """``MIN:MAX`` replicas as a pair, ``0 <= MIN <= MAX``, ``MAX >= 1``.

    Raises:
        ConfigError: not two integers separated by ``:``, or out of order.
    """
    lo, sep, hi = spec.partition(":")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        pair = None
    if not sep or pair is None:
        raise ConfigError(f"--autoscale wants MIN:MAX (two integers), got {spec!r}")
    if not 0 <= pair[0] <= pair[1] or pair[1] < 1:
        raise ConfigError(f"--autoscale wants 0 <= MIN <= MAX and MAX >= 1, got {spec!r}")
    return pair


@dataclass(frozen=True)
class RayOptions:
    """How the service is spread over Ray Serve replicas. Times in seconds."""

    replicas: int = 1
    """Fixed number of replicas (ignored with ``autoscale``)."""
    autoscale: Optional[tuple[int, int]] = None
    """(min, max) replicas: Ray Serve scales between them, aiming at ``max_active`` (the
    engine's batch) ongoing requests per replica."""
    cpus_per_replica: float = 1.0
    """CPUs Ray reserves for each replica (fractional allowed)."""
    gpus_per_replica: float = 0.0
    """GPUs Ray reserves for each replica (fractional allowed: 0.5 puts two on a GPU)."""
    threads_per_replica: Optional[int] = None
    """Torch threads in each replica (None: ``cpus_per_replica`` rounded down, at least 1),
    so replicas on one node do not oversubscribe its cores."""
    address: Optional[str] = None
    """Ray cluster to join (``ray://host:10001``, ``host:6379`` or ``auto``); None: the
    ``RAY_ADDRESS`` variable, else a local Ray started for this process."""
    name: str = "ragspec"
    """Ray Serve application (and deployment) name."""
    health_check_period_s: float = 10.0
    """How often Ray Serve calls each replica's health check."""
    health_check_timeout_s: float = 30.0
    """A health check slower than this fails."""
    start_retries: int = 3
    """Replica starts that may fail before the deployment is marked failed."""
    metrics_interval_s: float = 5.0
    """How often each replica copies its ``ragspec_*`` metrics into Ray's (0: never)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.autoscale is not None:
            parse_autoscale(f"{self.autoscale[0]}:{self.autoscale[1]}")
        if not (self.cpus_per_replica >= 0 and math.isfinite(self.cpus_per_replica)):
            raise ConfigError(f"cpus_per_replica must be >= 0, got {self.cpus_per_replica}")
        if not (self.gpus_per_replica >= 0 and math.isfinite(self.gpus_per_replica)):
            raise ConfigError(f"gpus_per_replica must be >= 0, got {self.gpus_per_replica}")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ConfigError(f"threads_per_replica must be >= 1, got {self.threads_per_replica}")
        if not (self.metrics_interval_s >= 0 and math.isfinite(self.metrics_interval_s)):
            raise ConfigError(f"metrics_interval_s must be >= 0, got {self.metrics_interval_s}")
        if self.start_retries < 1:
            raise ConfigError(f"start_retries must be >= 1, got {self.start_retries}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", self.name):
            raise ConfigError(f"name must be letters, digits, '_' or '-', got {self.name!r}")

    @property
    def threads(self) -> int:
        """Torch threads per replica."""
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, int(self.cpus_per_replica))


def _import_serve():
    try:
        from ray import serve
    except ImportError as e:
        raise ConfigError(_INSTALL_HINT) from e
    return serve


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _absolute(settings: ServerSettings) -> ServerSettings:
    """Paths made absolute on the driver (a replica's working directory is Ray's, not
    the caller's); registry names and "auto"/"none" are left alone."""

    def fix(value: Optional[str]) -> Optional[str]:
        if value is None or value in ("auto", "none") or not os.path.exists(value):
            return value
        return str(Path(value).resolve())

    return settings.replace(
        model=fix(settings.model),
        eagle=fix(settings.eagle),
        datastores=tuple((name, str(Path(d).resolve())) for name, d in settings.datastores),
    )


# ---------------------------------------------------------------------- the replica
class _ReplicaHeader:
    """ASGI middleware adding :data:`REPLICA_HEADER` to every response of a replica."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, tagged)


class _RayMetricsMirror:
    """Copies a replica's Prometheus registry (:class:`.metrics.ServerMetrics`) into Ray's
    metrics every ``interval_s``, as gauges of the same names and labels, to which Ray
    Serve adds ``deployment``, ``replica`` and ``application``: every replica's series then
    reach Prometheus through each node's Ray metrics port, beside Ray Serve's own (Ray
    exports them with a ``ray_`` prefix). Counters and histogram buckets become gauges of
    their current values, so ``rate()`` and ``histogram_quantile()`` work as before."""

    def __init__(self, registry, interval_s: float) -> None:
        import threading

        self.registry = registry
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self._gauges: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._thread = threading.Thread(target=self._run, name="ragspec-ray-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.stopped.set()

    def copy_once(self) -> int:
        """Copy every sample now; the number copied."""
        from ray.serve.metrics import Gauge

        n = 0
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):  # prometheus_client's creation times
                    continue
                keys = tuple(sorted(sample.labels))
                gauge = self._gauges.get((sample.name, keys))
                if gauge is None:
                    gauge = Gauge(sample.name, description=family.documentation, tag_keys=keys)
                    self._gauges[(sample.name, keys)] = gauge
                gauge.set(float(sample.value), tags=dict(sample.labels) or None)  # type: ignore[arg-type]  # None: no tags
                n += 1
        return n

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.copy_once()
            except (ValueError, TypeError, RuntimeError):  # never let metrics stop a replica
                logger.exception("copying the metrics to Ray failed")


class RagspecReplica:
    """One Ray Serve replica: the engine (every datastore, the response cache) loaded in
    this process, served by :func:`.server.create_app`.

    Use :func:`build_app`, which wraps this class with ``serve.ingress`` and
    ``serve.deployment``; the constructor runs inside the replica.

    Args:
        settings: the service settings (paths absolute).
        threads: torch intra-op threads of this replica.
        metrics_interval_s: how often its metrics are copied into Ray's (0: never).
    """

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async __init__
        self, settings: ServerSettings, threads: int, metrics_interval_s: float = 5.0
    ) -> None:
        import torch

        torch.set_num_threads(threads)
        self.settings = settings
        self.metrics_interval_s = metrics_interval_s
        self.mirror: Optional[_RayMetricsMirror] = None
        self.replica_id = _replica_id()
        self.error: Optional[str] = None
        self.engine: Optional[Engine] = None
        self.response_cache: Optional[ResponseCache] = None
        try:
            # each replica caches its own answers (a shared cache would be a store of our own)
            # replicas share the settings: each journals to a response log of its own
            config = dataclasses.replace(settings.serving_config(), response_log_spread=True)
            served = await asyncio.to_thread(_load_serving_released, config)
            self.engine, self.response_cache = served.engine, served.response_cache
        except (RagspecError, OSError, ValueError) as e:
            # not raised here: the health check reports it (one line) and Ray Serve never
            # routes to this replica
            self.error = _one_line(e)
            self.engine = None  # nothing of it is served: free the model
            logger.error("replica %s cannot serve: %s", self.replica_id, self.error)
        else:
            names = sorted(served.engine.datastores)
            logger.info("replica %s ready (%d threads, datastores %s)", self.replica_id, threads, names)

    def __serve_build_asgi_app__(self):
        from fastapi import FastAPI

        from .server import create_app

        if self.error is not None:
            return FastAPI()  # never served: the first health check fails
        app = create_app(engine=self.engine, settings=self.settings, response_cache=self.response_cache)
        app.add_middleware(_ReplicaHeader, replica=self.replica_id)
        if self.metrics_interval_s > 0:
            self.mirror = _RayMetricsMirror(app.state.metrics.registry, self.metrics_interval_s)
            self.mirror.start()
        return app

    def __del__(self) -> None:
        mirror = getattr(self, "mirror", None)
        if mirror is not None:
            mirror.stop()

    def check_health(self) -> None:
        """Called by Ray Serve when the replica starts and every ``health_check_period_s``.

        Raises:
            ReplicaStartError: the model or a datastore did not load here.
        """
        if self.error is not None:
            raise ReplicaStartError(self.error)


def _replica_id() -> str:
    """Ray Serve's id of this replica ("local" outside a replica)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_tag
    except RayServeException:
        return "local"


def build_app(settings: Optional[ServerSettings] = None, options: Optional[RayOptions] = None):
    """The Ray Serve application of the service (``serve.run(build_app(...))``).

    Args:
        settings: service settings, as for ``ragspec serve`` (None: ``RAGSPEC_*``
            environment variables). ``host`` and ``port`` are the proxy's, set by
            :func:`run` (``serve.start``), not by the application.
        options: replicas, resources, threads (None: one replica, one CPU).

    Returns:
        ``ray.serve.Application``: one deployment, ingress of the application.

    Raises:
        ConfigError: Ray Serve is not installed, or an option is out of range.
    """
    serve = _import_serve()
    settings = _absolute(settings if settings is not None else ServerSettings.from_env())
    options = options if options is not None else RayOptions()
    actor: dict[str, Any] = {"num_cpus": options.cpus_per_replica}
    if options.gpus_per_replica:
        actor["num_gpus"] = options.gpus_per_replica
    deployment_options: dict[str, Any] = dict(
        name=options.name,
        ray_actor_options=actor,
        # each replica admits what one `ragspec serve` admits; Ray Serve holds the rest in
        # its router (up to max_queue more per proxy, then 503)
        max_ongoing_requests=settings.max_active + settings.max_queue,
        max_queued_requests=max(1, settings.max_queue),
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=options.health_check_timeout_s,
        max_constructor_retry_count=options.start_retries,
    )
    if options.autoscale is not None:
        lo, hi = options.autoscale
        deployment_options["autoscaling_config"] = {
            "min_replicas": lo,
            "initial_replicas": max(lo, 1),
            "max_replicas": hi,
            "target_ongoing_requests": settings.max_active,
        }
    else:
        deployment_options["num_replicas"] = options.replicas
    wrapped = serve.ingress()(RagspecReplica)
    deployment = serve.deployment(wrapped).options(**deployment_options)
    return deployment.bind(settings, options.threads, options.metrics_interval_s)


# ---------------------------------------------------------------------- the proxy side
def _error_body(message: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_unavailable"}},
        separators=(",", ":"),
    ).encode()


class ReplicaLossMiddleware:
    """ASGI middleware for Ray Serve's HTTP proxy: a request whose replica died answers a
    clean, retryable error instead of an empty 500 or a stream cut mid-event.

    - nothing answered yet: ``503``, OpenAI's error body (``code: replica_unavailable``),
      ``Retry-After: 1``;
    - an SSE stream already under way: a last ``data: {"error": ...}`` event, then
      ``data: [DONE]`` (as the server ends a stream whose generation failed);
    - another response cut in the middle: left cut (the client sees the broken body).
    """

    MESSAGE = "the replica serving this request stopped before answering; retry the request"

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, done, sse = False, False, False

        async def watch(message) -> None:
            nonlocal started, done, sse
            if message["type"] == "http.response.start":
                started = True
                content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
                sse = content_type.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        await self.app(scope, receive, watch)
        if done:
            return
        if not started:
            body = _error_body(self.MESSAGE)
            headers = [
                (b"content-type", b"application/json"),
                (b"retry-after", b"1"),
                (b"content-length", str(len(body)).encode()),
            ]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        elif sse:
            tail = b"data: " + _error_body(self.MESSAGE) + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": tail, "more_body": False})


def proxy_middlewares() -> list:
    """The HTTP proxy's middlewares (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` =
    :data:`PROXY_CALLBACK`)."""
    from starlette.middleware import Middleware

    return [Middleware(ReplicaLossMiddleware)]


# ---------------------------------------------------------------------- driver side
def connect(
    address: Optional[str] = None,
    *,
    num_cpus: Optional[float] = None,
    num_gpus: Optional[float] = None,
    object_store_memory: Optional[int] = None,
    temp_dir: Optional[str] = None,
    metrics_export_port: Optional[int] = None,
    log_to_driver: bool = True,
    _system_config: Optional[dict] = None,
) -> bool:
    """Join a Ray cluster, or start a local one for this process.

    A local Ray (``address`` None and no ``RAY_ADDRESS``) listens on loopback only, has no
    dashboard and no usage reporting (unless ``RAY_USAGE_STATS_ENABLED`` says otherwise),
    and its HTTP proxies get :func:`proxy_middlewares`. On a cluster, set
    ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=ragspec.integrations.ray.proxy_middlewares``
    on every node where ``ray start`` runs (see docker-compose.ray.yml).

    Returns:
        True when a local Ray was started here (the caller shuts it down).

    Raises:
        ConfigError: Ray is not installed.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        # before Ray is imported (it reads them then, and its processes inherit them):
        # Ray's single-machine mode binds every process to 127.0.0.1 (otherwise it
        # resolves "127.0.0.1" to the machine's address, reachable from outside)
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", PROXY_CALLBACK)
        # Serve's controller kills a proxy not ready within 5 s (health check: 10 s); on a
        # busy small machine its start alone takes longer
        os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60")
        os.environ.setdefault("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "30")
        if "ray" in sys.modules and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
            # Ray was imported before this call: its copy of that switch is already read
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = False
    _import_serve()
    import ray

    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, log_to_driver=log_to_driver)
        return False
    # Ray's raylet gives its agents 30 s to start and its workers 60 s to register, then
    # dies: a busy small machine (importing Ray and torch on 2 shared cores) needs longer
    system_config = {"agent_register_timeout_ms": 180_000, "worker_register_timeout_seconds": 180}
    system_config.update(_system_config or {})
    ray.init(
        num_cpus=num_cpus,  # type: ignore[arg-type]  # Ray takes fractional CPUs
        num_gpus=num_gpus,  # type: ignore[arg-type]
        object_store_memory=object_store_memory,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        _metrics_export_port=metrics_export_port,
        _system_config=system_config,
        log_to_driver=log_to_driver,
    )
    return True


def start_error(exc: Union[BaseException, str]) -> Optional[str]:
    """The one-line :class:`ReplicaStartError` inside Ray Serve's deploy failure, if any."""
    found = _START_ERROR.findall(str(exc))
    return found[-1].strip() if found else None


def deploy(settings: ServerSettings, options: RayOptions, route_prefix: str = "/") -> str:
    """Start Serve's proxies on ``settings.host:settings.port`` and deploy the
    application at ``route_prefix``; wait until its replicas pass their first health check.

    Serve's proxies are started once per cluster: when Serve already runs there, they keep
    the host and port they were started with.

    Returns:
        The endpoint URL.

    Raises:
        ReplicaStartError: a replica's model or datastore did not load (its one line).
    """
    serve = _import_serve()
    serve.start(http_options={"host": settings.host, "port": settings.port})
    try:
        serve.run(build_app(settings, options), name=options.name, route_prefix=route_prefix, blocking=False)
    except RuntimeError as e:
        # the application's message only says which deployment failed; the deployment's
        # message carries the replica's health check error
        messages = [str(e)]
        app = serve.status().applications.get(options.name)
        if app is not None:
            messages += [d.message for d in app.deployments.values()]
        cause = start_error("\n".join(messages))
        if cause is None:
            raise
        raise ReplicaStartError(cause) from None
    return f"http://{settings.host}:{settings.port}" + route_prefix.rstrip("/")


def _wait_forever() -> None:
    while True:
        time.sleep(3600)


# ---------------------------------------------------------------------- stopping
def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process, from /proc (empty where
    there is none)."""
    table: dict[int, tuple[int, str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # a zombie has ended already
            table[int(entry)] = (int(fields[1]), cmdline)
    return table


def _local_ray_processes() -> dict[int, str]:
    """pid -> command line of this process's descendants that are Ray's (its GCS, raylet,
    agents, workers, replicas): what a local Ray started here runs as."""
    table = _process_table()
    out: dict[int, str] = {}
    frontier = {os.getpid()}
    while frontier:
        children = {p for p, (parent, _) in table.items() if parent in frontier and p not in out}
        out.update({p: table[p][1] for p in children})
        frontier = children
    return {p: cmd for p, cmd in out.items() if "ray" in cmd}


def _end_leftovers(processes: dict[int, str], grace_s: float) -> list[str]:
    """Wait up to ``grace_s`` for ``processes`` (pid -> command line) to end, then SIGKILL
    those still running the same command line (Ray's dashboard and runtime-env agents
    outlive their raylet and ignore SIGTERM). The killed ones' command lines."""
    deadline = time.monotonic() + grace_s
    while True:
        table = _process_table()
        left = {p: cmd for p, cmd in processes.items() if p in table and table[p][1] == cmd}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    killed = []
    for pid, cmd in sorted(left.items()):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # ended meanwhile, or not ours
            continue
        killed.append(f"{pid}: {cmd[:120]}")
    if killed:
        logger.info("ended %d Ray process(es) left after ray.shutdown(): %s", len(killed), "; ".join(killed))
    return killed


def shutdown(local: bool, name: str = RayOptions.name, *, grace_s: float = 15.0) -> list[str]:
    """Stop serving: remove the application ``name`` from a cluster this process joined,
    or, for the local Ray :func:`connect` started (``local``), stop Ray Serve (its
    controller shuts its replicas and proxies down), then Ray, then end what is left of
    that Ray's processes after ``grace_s`` seconds (SIGKILL).

    Returns:
        The command lines of the processes that had to be killed (empty: none).
    """
    serve = _import_serve()
    import ray

    started = _local_ray_processes() if local else {}
    try:
        if local:
            serve.shutdown()
        else:
            serve.delete(name)
    finally:
        if local:
            ray.shutdown()
    return _end_leftovers(started, grace_s) if local else []


def _ray_initialized() -> bool:
    import ray

    return ray.is_initialized()


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that :func:`run` stops as on Ctrl-C."""


def _raise_terminated(signum, frame) -> None:
    raise _Terminated()


def run(
    settings: ServerSettings,
    options: RayOptions,
    *,
    wait: Optional[Callable[[], None]] = None,
    ready: Optional[Callable[[str], None]] = None,
) -> int:
    """``ragspec serve --ray``: connect (or start a local Ray), deploy, serve until
    interrupted (Ctrl-C or SIGTERM), then remove the application (or stop Serve and the
    local Ray, leaving none of its processes: :func:`shutdown`).

    Args:
        wait: called once the service is up, returns when it should stop (None: sleep
            until Ctrl-C or SIGTERM).
        ready: called with the one line saying where it serves, once it does (it is
            logged at INFO too).
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    local = connected = False
    try:
        joined = options.address or os.environ.get("RAY_ADDRESS") or ("ray" in sys.modules and _ray_initialized())
        with step("connecting to Ray" if joined else "starting a local Ray"):
            local = connect(options.address)
            connected = True
        if main_thread:
            # Ray's own handler kills the local Ray's processes first, after which Serve
            # cannot shut down gracefully and Ray's agents are left running
            signal.signal(signal.SIGTERM, _raise_terminated)
        scale = (
            f"{options.autoscale[0]}..{options.autoscale[1]} replicas"
            if options.autoscale
            else f"{options.replicas} replica(s)"
        )
        with step(f"deploying {scale} on Ray Serve", "each replica loads the model"):
            url = deploy(settings, options)
        line = (
            f"ragspec on Ray Serve: {url}, {scale} each {options.cpus_per_replica:g} CPU / "
            f"{options.gpus_per_replica:g} GPU, {options.threads} thread(s)"
        )
        logger.info("%s", line)
        if ready is not None:
            ready(line)
        (wait or _wait_forever)()
    except KeyboardInterrupt:
        pass
    finally:
        try:
            if main_thread:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # no second interruption mid-shutdown
            if connected:
                shutdown(local, options.name)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return 0
