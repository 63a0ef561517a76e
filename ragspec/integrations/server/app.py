"""The app factory and its lifespan.

:func:`create_app` builds the FastAPI app: the middleware (:mod:`.middleware`), the error
handlers (:mod:`.errors`), the routers of each API surface (:mod:`.openai`,
:mod:`.summarize`, :mod:`.datastores`, :mod:`.ops`, :mod:`.tokens`) and the request bodies in the OpenAPI schema
(:mod:`.openapi`). Its lifespan loads what is served (:mod:`ragspec.serving`: one engine
with every named datastore and the response cache; tests pass a ready engine), starts the
worker (:class:`..stepper.Stepper`) and the prepare pool, and puts them on ``app.state``
(:class:`.state.ServerState`); at shutdown it stops them and saves the response cache to
``response_log``.

Readiness: when the lifespan loads the model itself, it does so in a background task and
the app serves at once: ``/health`` (liveness) answers 200 from the first moment, ``/ready``
and every API request answer 503 with ``Retry-After`` until the engine is loaded
(``app.state.ready``), as container orchestrators and load balancers expect. A load that
fails is kept in ``app.state.load_error`` (``/health`` then answers 503 with it).
``on_loaded(error)`` is called once the background load ends, with None or the exception
(the CLI prints its ready line, or stops the server and prints the error).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from fastapi import APIRouter, FastAPI

from ragspec import serving
from ragspec.backend.threads import release_openmp_pool
from ragspec.deprecation import warn_deprecated
from ragspec.drafters.response_cache import ResponseCache
from ragspec.engine import Engine
from ragspec.loading import open_datastores
from ragspec.types import StreamChunk

from ..metrics import ServerMetrics
from ..settings import ServerSettings
from ..stepper import Job, Stepper
from . import datastores, openai, ops, summarize, tokens
from .admission import Admission
from .errors import install_error_handlers
from .middleware import CountRequests, RequireApiKey
from .openapi import document_bodies

logger = logging.getLogger(__name__)

__all__ = ["create_app"]

_UNSET: Any = object()
T = TypeVar("T")


def _scheduler(engine: Engine, settings: ServerSettings, metrics: ServerMetrics) -> Stepper:
    """The worker stepping ``engine``, its hooks feeding ``metrics``."""

    def on_finish(job: Job, chunk: StreamChunk) -> None:
        if chunk.finish_reason == "cancelled":
            metrics.cancelled.inc()
        if chunk.stats is not None:
            metrics.observe_generation(chunk.stats)

    return Stepper(
        engine,
        max_active=settings.max_active,
        max_queue=settings.max_queue,
        on_finish=on_finish,
        on_cancel=lambda job: metrics.cancelled.inc(),
        max_step_tokens=settings.max_step_tokens,
        throughput_slack=settings.throughput_slack,
        on_step=metrics.observe_step,
        on_activate=lambda job: metrics.queue_time.observe(job.activated_s - job.submitted_s),
        thread_name="ragspec-worker",
    )


def _ready_engine(
    engine: Engine,
    datastores: tuple[tuple[str, str], ...],
    variants: Optional[dict[str, Engine]],
    response_cache: Optional[ResponseCache],
) -> Engine:
    """A ready ``engine`` as served: with the named ``datastores`` opened (none when it has
    its own), the deprecated ``variants``' datastores, and ``response_cache``
    (:func:`ragspec.serving.serve_engine`)."""
    if variants:
        named = {name: e.datastore for name, e in variants.items() if e.datastore is not None}
    elif engine.datastores or not datastores:
        named = dict(engine.datastores)
    else:
        named = open_datastores(datastores, engine.tokenizer)
    return serving.serve_engine(engine, named, response_cache)


def _metrics(app: FastAPI) -> ServerMetrics:
    """The app's metrics, the queue gauges reading its scheduler (none before the lifespan)."""

    def queue_depth() -> float:
        s = getattr(app.state, "scheduler", None)
        return float(max(0, s.num_jobs - s.num_active)) if s is not None else 0.0

    def active() -> float:
        s = getattr(app.state, "scheduler", None)
        return float(s.num_active) if s is not None else 0.0

    return ServerMetrics(queue_depth=queue_depth, active=active)


async def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a daemon thread: a model still loading never holds the process up at
    exit (Ctrl-C while loading ends it at once; ``asyncio.to_thread``'s threads are joined)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            result: Any = (True, fn(*args))
        except BaseException as e:  # handed to the awaiting coroutine
            result = (False, e)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=run, name="ragspec-load", daemon=True).start()
    return await fut


async def _save_response_cache(cache: ResponseCache, path: str) -> None:
    try:
        n = await asyncio.to_thread(serving.close_response_log, cache, path)
        logger.info("saved %d cached responses to %s", n, path)
    except OSError as e:
        logger.error("cannot save the response cache to %s: %s", path, e)


async def _load(
    app: FastAPI,
    settings: ServerSettings,
    engine: Optional[Engine],
    response_cache: Any,
    datastore_engines: Optional[dict[str, Engine]],
) -> Optional[ResponseCache]:
    """Load what is served (``engine``, else the settings' model) and start the worker;
    ``app.state.ready`` once done. Returns the response cache served (or None)."""
    config = settings.serving_config()
    if engine is None:
        logger.info("loading model %s", settings.model or "(default)")
        eng = await _in_daemon_thread(serving.load_serving_engine, config)
    else:
        cache = engine.parts.response_cache if response_cache is _UNSET else response_cache
        eng = await _in_daemon_thread(_ready_engine, engine, config.datastores, datastore_engines, cache)
    app.state.response_cache = eng.parts.response_cache
    scheduler = _scheduler(eng, settings, app.state.metrics)
    scheduler.start()
    # the worker computes from here on: a pool this thread holds (a model handed over,
    # loaded or warmed up here) would slow its every step (ragspec.backend.threads)
    release_openmp_pool()
    pool = concurrent.futures.ThreadPoolExecutor(settings.prepare_threads, thread_name_prefix="ragspec-prepare")
    app.state.engine = eng
    app.state.scheduler = scheduler
    app.state.prepare_pool = pool
    app.state.limits = settings.limits(eng.target.max_length)
    app.state.model_name = settings.served_model_name or eng.model_name or "ragspec"
    app.state.started = int(time.time())
    logger.info("request limits: %s", app.state.limits)
    logger.info("scheduler: %s", scheduler.composer.config)
    app.state.ready = True
    return app.state.response_cache


async def _stop(app: FastAPI, settings: ServerSettings, loading: Optional[asyncio.Task]) -> None:
    """The lifespan's end: cancel a load still running, stop the worker and the prepare
    pool, close the datastore writers, save the response cache to its log."""
    cache = getattr(app.state, "response_cache", None)
    if loading is not None and not loading.done():
        loading.cancel()  # the load's thread finishes on its own; nothing of it is served
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await loading
    scheduler = getattr(app.state, "scheduler", None)
    if scheduler is not None:
        await asyncio.to_thread(scheduler.stop)
    pool = getattr(app.state, "prepare_pool", None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    for writer in list(app.state.datastore_writers.values()):
        await asyncio.to_thread(writer.close)  # a merge running is abandoned
    if cache is not None and settings.response_log and app.state.ready:
        await _save_response_cache(cache, settings.response_log)


def _add_middleware(app: FastAPI, settings: ServerSettings, metrics: ServerMetrics) -> None:
    """The middleware, the last added running first: count, check the key, then admit
    (limits, read deadline)."""
    app.add_middleware(
        Admission,
        read_timeout_s=settings.read_timeout_s,
        min_read_rate=settings.min_read_rate,
        max_reading=settings.max_reading,
        client_limit=settings.client_limit,
        keyed=bool(settings.api_keys),
        metrics=metrics,
        retry_after_s=settings.retry_after_s,
    )
    if settings.api_keys:
        app.add_middleware(RequireApiKey, api_key=settings.api_keys, public_metrics=settings.public_metrics)
    app.add_middleware(CountRequests, metrics=metrics)


def create_app(
    engine: Optional[Engine] = None,
    settings: Optional[ServerSettings] = None,
    *,
    datastore_engines: Optional[dict[str, Engine]] = None,
    response_cache: Any = _UNSET,
    on_loaded: Optional[Callable[[Optional[BaseException]], Any]] = None,
) -> FastAPI:
    """The FastAPI app. ``engine``: a ready :class:`ragspec.Engine` (None: the lifespan loads
    ``settings.model``). ``settings``: None reads ``RAGSPEC_*`` environment variables.
    A ready ``engine`` is served with its own datastores, or else those the settings name
    (opened by the lifespan). ``datastore_engines`` (deprecated: one engine serves every
    datastore) adds the named datastores of engines built by
    :func:`ragspec.serving.datastore_engines`. ``response_cache``: the cache of the
    server's own responses, already built by :func:`ragspec.serving.open_response_cache`
    (None: none; unset: the lifespan builds it from the settings when it loads the engine
    itself, and a ready ``engine`` is served with its own). Without ``engine`` the model
    loads in the background while the app already
    serves (``/health`` 200, ``/ready`` and the API 503); ``on_loaded(error)`` is called
    when that load ends (``error``: None, or what it raised; logged here only without
    ``on_loaded``)."""
    settings = settings if settings is not None else ServerSettings.from_env()
    if datastore_engines is not None:
        warn_deprecated(
            "create_app(datastore_engines=...)",
            "an engine with its datastores (ragspec.serving.serve_engine), or the datastores in the settings",
        )

    async def load_in_background(app: FastAPI) -> Optional[ResponseCache]:
        try:
            cache = await _load(app, settings, engine, response_cache, datastore_engines)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # kept for /health and the CLI; the server keeps answering 503
            app.state.load_error = e
            if on_loaded is None:
                logger.error("the model did not load: %s", e)
            else:
                on_loaded(e)
            return None
        if on_loaded is not None:
            on_loaded(None)
        return cache

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.ready = False
        app.state.load_error = None
        loading: Optional[asyncio.Task] = None
        if engine is None:
            loading = asyncio.ensure_future(load_in_background(app))
        else:
            await _load(app, settings, engine, response_cache, datastore_engines)  # a ready engine: nothing slow
        try:
            yield
        finally:
            await _stop(app, settings, loading)

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ragspec", version="0.1.0", lifespan=lifespan, **docs)  # type: ignore[arg-type]
    app.state.settings = settings
    app.state.datastore_lock = threading.Lock()
    app.state.datastore_writers = {}
    metrics = _metrics(app)
    app.state.metrics = metrics
    _add_middleware(app, settings, metrics)
    install_error_handlers(app)

    v1 = APIRouter(prefix="/v1")
    v1.include_router(openai.router)
    v1.include_router(summarize.router)
    v1.include_router(datastores.router)
    app.include_router(v1)
    if settings.docs:
        document_bodies(app)
    app.include_router(ops.router)
    app.include_router(tokens.router)
    return app
