"""The REST service: OpenAI-compatible completions and chat, document summaries, metrics.

Endpoints:
    POST /v1/summarize          {"documents": [...], "instruction"?, "max_tokens"?, ...}
                                -> {"summary", "usage", "stats", ...} or server-sent events
    POST /v1/completions        OpenAI's completions API (``stream`` as SSE, ``[DONE]`` last)
    POST /v1/chat/completions   OpenAI's chat completions API (chat template of the model)
    GET  /v1/models             the served model and its datastores
    GET  /metrics               Prometheus text format (see :mod:`.metrics`)
    GET  /health                liveness, always open

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status for bad input (400), a missing or wrong API key (401), an unknown model (404), a body
over the size limit (413), a body that is not JSON (415) and a full queue (429, with
``Retry-After``).

The engine loads in the app's lifespan into ``app.state.engine`` (tests pass a ready one to
:func:`create_app`). One worker thread (:class:`.scheduler.Scheduler`) owns the model and
interleaves the requests step by step; each request's output is what it gives alone.

What a request costs before any work is bounded, and none of it runs on the event loop or
the worker (:class:`_Gen`):

1. admission: a place is reserved (429 when ``max_active + max_queue`` requests are in the
   system), before the body is read;
2. the body is read up to ``RequestLimits.body_bytes`` (413 by its ``Content-Length``, or as
   soon as more arrived), then parsed and validated (strict types, bounded counts) in a
   small thread pool;
3. the prompt's and documents' sizes are checked against the limits (400 without
   tokenizing), then they are tokenized in the same pool and the prompt checked against the
   context length;
4. the job goes to the worker with token ids only.

A client that disconnects cancels its request at any stage: an ASGI receive watcher sees
``http.disconnect`` as it happens (not at the next write): a request being read, validated or
tokenized is dropped, a queued or active job is dropped by the worker before its next step.

Security: with an API key (``--api-key`` / ``RAGSPEC_API_KEY``) every ``/v1/*`` request,
``/docs``, ``/redoc`` and ``/openapi.json`` need ``Authorization: Bearer <key>``
(``--no-docs`` turns the last three off); ``/health`` and ``/metrics`` stay open (as vLLM's
server does). A request may name only the datastores the server was started with, by name.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragspec.errors import CapacityError, ConfigError, PromptTooLongError, RagspecError
from ragspec.types import GenerationStats, StreamChunk

from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .scheduler import CHUNK, ERROR, GONE, Job, Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, SummarizeRequest, first_unknown_field, unsupported
from .settings import RequestLimits, ServerSettings

logger = logging.getLogger(__name__)

__all__ = ["create_app", "ServerSettings", "APIError", "build_summary_prompt", "SUMMARY_INSTRUCTION", "json_separators"]

SUMMARY_INSTRUCTION = "Summarize the documents above in a few sentences."
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
_BODIES = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/summarize": SummarizeRequest,
}
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none", "function-after", "constrained-str"})
_ENDPOINTS = ("/v1/summarize", "/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics", "/health")


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _api_error(exc: BaseException, retry_after_s: int = 1) -> APIError:
    """The API error a generation failure becomes."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded", param="max_tokens")
    if isinstance(exc, CapacityError):
        return APIError(
            429, str(exc), type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)}
        )
    if isinstance(exc, (RagspecError, ValueError, TypeError)):
        return APIError(400, str(exc) or type(exc).__name__)
    logger.error("internal error", exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


def build_summary_prompt(documents: list[str], instruction: Optional[str] = None) -> str:
    """The summary prompt (as ``ragspec summarize``): numbered documents, then the
    instruction."""
    body = "\n\n".join(f"Document {i + 1}:\n{d.strip()}" for i, d in enumerate(documents))
    return body + "\n\n" + (instruction or SUMMARY_INSTRUCTION)


def _usage(stats: Optional[GenerationStats]) -> dict:
    p = stats.num_prompt_tokens if stats else 0
    c = stats.num_generated_tokens if stats else 0
    cached = stats.num_cached_prompt_tokens if stats else 0
    return {
        "prompt_tokens": p,
        "completion_tokens": c,
        "total_tokens": p + c,
        "prompt_tokens_details": {"cached_tokens": cached},  # OpenAI's field: served by the prefix cache
    }


def _finish(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else ("length" if reason == "length" else "stop")


def _sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


# ---------------------------------------------------------------------- engines
def _load_engine(settings: ServerSettings):
    from ragspec.config import PolicyConfig
    from ragspec.loading import load_engine

    return load_engine(
        settings.model,
        settings.device,
        settings.dtype,
        eagle=settings.eagle,
        policy=PolicyConfig(
            max_draft_tokens=settings.max_draft_tokens,
            adaptive=settings.adaptive,
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            prefix_cache_tokens=settings.prefix_cache_tokens,
        ),
        calibrate=settings.calibrate,
        numerics=settings.numerics,
        drafting=settings.drafting,
    )


def _response_cache(engine, settings: ServerSettings):
    """The server's cache of its own responses (None when ``response_cache_tokens`` is 0),
    with the responses of ``settings.response_log`` when that file exists; new responses are
    appended to that log as they finish (``ResponseCache.open_journal``: bad lines skipped
    with a warning, the log compacted; ``_close_response_log`` at shutdown).

    Raises:
        ResponseLogError: the log path is unusable, or the log holds another model's responses.
    """
    if settings.response_cache_tokens <= 0:
        return None
    from ragspec.drafters.response_cache import ResponseCache

    cache = ResponseCache(settings.response_cache_tokens, model=engine.model_name or "")
    log = settings.response_log
    if log:
        n = cache.open_journal(log, vocab_size=getattr(engine.target, "vocab_size", None))
        logger.info("response cache: %d responses (%d tokens) from %s", n, cache.num_tokens, log)
    return cache


def _close_response_log(cache, path: str) -> int:
    """At shutdown: the response log's journal closed (its last answers written, the log
    compacted), or a cache given without one saved to ``path``. Returns the responses written."""
    return cache.close_journal() if cache.journal is not None else cache.save(path)


def _datastore_engines(engine, settings: ServerSettings) -> dict[str, Any]:
    """One engine per named datastore: the same model, backend and latency model, the
    drafter composed as ``ragspec.loading`` composes it, with that datastore."""
    if not settings.datastores:
        return {}
    from ragspec.datastore import Datastore
    from ragspec.loading import with_datastore

    out = {}
    for name, directory in settings.datastores:
        ds = Datastore.open(directory, tokenizer=engine.tokenizer)
        out[name] = with_datastore(engine, ds)
        logger.info("datastore %r: %s", name, directory)
    return out


# ---------------------------------------------------------------------- app
class _CountRequests:
    """ASGI middleware counting finished requests by endpoint and status (passes
    ``receive`` through untouched, so disconnects still reach the handlers)."""

    def __init__(self, app, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in _ENDPOINTS else "other"
            self.metrics.requests.labels(endpoint=endpoint, status=str(status[0])).inc()


class _RequireApiKey:
    """ASGI middleware: ``/v1/*`` requests and the API docs (``/docs``, ``/redoc``,
    ``/openapi.json``) need ``Authorization: Bearer <key>``, checked before anything else
    (body reading included), as vLLM does; ``/health`` and ``/metrics`` stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if scope["type"] == "http" and ((path + "/").startswith("/v1/") or path.rstrip("/") in _DOC_PATHS):
            auth = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                error = APIError(
                    401,
                    "missing or invalid API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


_UNSET: Any = object()


def create_app(
    engine=None,
    settings: Optional[ServerSettings] = None,
    *,
    datastore_engines: Optional[dict] = None,
    response_cache: Any = _UNSET,
) -> FastAPI:
    """The FastAPI app. ``engine``: a ready :class:`ragspec.Engine` (None: the lifespan loads
    ``settings.model``). ``settings``: None reads ``RAGSPEC_*`` environment variables.
    ``datastore_engines``: the named datastores' engines, already built by
    ``_datastore_engines`` (None: the lifespan builds them). ``response_cache``: the cache
    of the server's own responses, already built by ``_response_cache`` (None: none;
    unset: the lifespan builds it from the settings when it loads the engine itself, and
    a ready ``engine`` is served as given)."""
    settings = settings if settings is not None else ServerSettings.from_env()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        eng = engine
        if eng is None:
            logger.info("loading model %s", settings.model or "(default)")
            eng = await asyncio.to_thread(_load_engine, settings)
        variants = datastore_engines
        if variants is None:
            variants = await asyncio.to_thread(_datastore_engines, eng, settings)
        cache = response_cache
        if cache is _UNSET:
            cache = await asyncio.to_thread(_response_cache, eng, settings) if engine is None else None
        if cache is not None:
            from ragspec.loading import with_response_cache

            eng = with_response_cache(eng, cache)
            variants = {name: with_response_cache(e, cache) for name, e in variants.items()}
        app.state.response_cache = cache
        scheduler = Scheduler(
            max_active=settings.max_active,
            max_queue=settings.max_queue,
            on_finish=_on_finish,
            on_cancel=lambda job: metrics.cancelled.inc(),
            max_step_tokens=settings.max_step_tokens,
            on_step=metrics.observe_step,
            on_activate=lambda job: metrics.queue_time.observe(job.activated_s - job.submitted_s),
        )
        scheduler.start()
        pool = concurrent.futures.ThreadPoolExecutor(settings.prepare_threads, thread_name_prefix="ragspec-prepare")
        app.state.engine = eng
        app.state.engines = variants
        app.state.scheduler = scheduler
        app.state.prepare_pool = pool
        app.state.limits = settings.limits(getattr(eng.target, "max_length", None))
        app.state.model_name = settings.served_model_name or eng.model_name or "ragspec"
        app.state.started = int(time.time())
        logger.info("request limits: %s", app.state.limits)
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)
            pool.shutdown(wait=False, cancel_futures=True)
            if cache is not None and settings.response_log:
                try:
                    n = await asyncio.to_thread(_close_response_log, cache, settings.response_log)
                    logger.info("saved %d cached responses to %s", n, settings.response_log)
                except OSError as e:
                    logger.error("cannot save the response cache to %s: %s", settings.response_log, e)

    def _on_finish(job: Job, chunk: StreamChunk) -> None:
        if chunk.finish_reason == "cancelled":
            metrics.cancelled.inc()
        if chunk.stats is not None:
            metrics.observe_generation(chunk.stats)

    docs = {} if settings.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="ragspec", version="0.1.0", lifespan=lifespan, **docs)
    app.state.settings = settings

    def _queue_depth() -> float:
        s = getattr(app.state, "scheduler", None)
        return float(max(0, s.num_jobs - s.num_active)) if s is not None else 0.0

    def _active() -> float:
        s = getattr(app.state, "scheduler", None)
        return float(s.num_active) if s is not None else 0.0

    metrics = ServerMetrics(queue_depth=_queue_depth, active=_active)
    app.state.metrics = metrics
    if settings.api_key is not None:
        app.add_middleware(_RequireApiKey, api_key=settings.api_key)
    app.add_middleware(_CountRequests, metrics=metrics)
    _install_error_handlers(app)

    v1 = APIRouter(prefix="/v1")
    _add_v1_routes(v1, settings, metrics)
    app.include_router(v1)
    if settings.docs:
        _document_bodies(app)

    @app.get("/health")
    async def health(request: Request) -> dict:
        return {"status": "ok", "model": getattr(request.app.state, "model_name", None)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        # drop "body" and pydantic's union-member tags ("str", "list[str]", ...) from the path
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and str(x) not in _TYPE_TAGS and "[" not in str(x)]
        param = ".".join(loc) or None
        kind = first.get("type", "")
        if kind == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            param = None
        elif kind == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif kind == "missing":
            # an empty body reaches here as the whole body missing (no field name)
            message = (
                f"missing required field: {param}" if param else "request body is missing (a JSON object is required)"
            )
        else:
            message = (
                f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
            )
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        return APIError(400, message, param=param, code=kind or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(RagspecError)
    async def _ragspec(request: Request, exc: RagspecError) -> JSONResponse:
        # a typed error raised while a request is prepared (an empty prompt, one too long
        # for the context): its 4xx here, where the middleware counts it, not as a 500
        # with a traceback through the catch-all below
        return _api_error(exc).response()

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _api_error(exc).response()


def _document_bodies(app: FastAPI) -> None:
    """Put the request bodies into ``/openapi.json``: the handlers read and validate their
    bodies themselves (bounded, off the event loop), so FastAPI does not see them."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in _BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                op = schema.get("paths", {}).get(path, {}).get("post")
                if op is not None:
                    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ---------------------------------------------------------------------- request preparation
# Everything here runs in the prepare pool (never on the event loop, never on the worker);
# the size checks come first, so no request costs more than its limits allow.
def _is_json(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


def json_separators(raw: bytes, stop_above: int) -> int:
    """Commas and colons of a JSON text outside its strings (one per value after the first
    of each array and object: about the values ``json.loads`` would build), or an upper
    bound of it that is at most ``stop_above``.

    Plain counting first (C speed, strings included): when that is at most ``stop_above``
    it is the answer. Otherwise the strings are skipped, walking their boundaries in a
    Python loop over the quotes (and the backslashes just before them): linear, and other
    threads run meanwhile; counting stops once above ``stop_above``.

    Example: ``{"a": [1, 2, 3], "b": "x,y"}``: 6 with ``stop_above=10`` (the plain count),
    5 with ``stop_above=3`` (the comma inside "x,y" skipped).
    """
    cheap = raw.count(b",") + raw.count(b":")
    if cheap <= stop_above:
        return cheap
    count, i, n = 0, 0, len(raw)
    while i < n and count <= stop_above:
        q = raw.find(b'"', i)
        end = n if q < 0 else q
        count += raw.count(b",", i, end) + raw.count(b":", i, end)
        if q < 0:
            break
        j = q + 1  # find the closing quote: one not preceded by an odd run of backslashes
        while True:
            k = raw.find(b'"', j)
            if k < 0:
                return count  # unterminated string: json.loads refuses it anyway
            b = k - 1
            while b > q and raw[b] == 0x5C:  # backslash
                b -= 1
            if (k - 1 - b) % 2 == 0:
                break
            j = k + 1
        i = k + 1
    return count


def _validate(model: type[BaseModel], raw: bytes, max_values: int) -> BaseModel:
    """Parse and validate a request body (strict types; see :mod:`.schemas`).

    What runs here in one piece holding the GIL (``json.loads``, pydantic) stays short: the
    values outside strings are counted first (at most ``max_values``, see
    :func:`json_separators`), then ``json.loads`` (C), the unknown-field check, and pydantic,
    whose lists stop at their first bad item (never one error per item).

    Raises:
        APIError: empty body, too many values, malformed JSON, not an object.
        RequestValidationError: anything pydantic refuses (the first unknown field alone).
    """
    if not raw.strip():
        raise APIError(400, "request body is missing (a JSON object is required)")
    if json_separators(raw, max_values) > max_values:
        raise APIError(
            400,
            f"request body holds more than {max_values:,} JSON values (numbers, strings, lists, objects); "
            "send texts as strings",
            code="too_many_values",
        )
    try:
        data = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise APIError(400, f"malformed JSON body: {e}", code="json_invalid") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", code="json_invalid") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="model_type")
    unknown = first_unknown_field(model, data)
    if unknown is not None:
        raise RequestValidationError(
            [{"type": "extra_forbidden", "loc": ("body", *unknown), "msg": "Extra inputs are not permitted"}]
        )
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise RequestValidationError(errors) from None


@dataclass(frozen=True)
class _Prepared:
    """A request's token ids, ready for the worker."""

    prompt_ids: list[int]
    document_ids: list[list[int]]


class _Cancelled(Exception):
    """The client left while its request was being prepared."""


def _context_of(engine) -> Optional[int]:
    return getattr(engine.target, "max_length", None)


def _check_chars(n: int, limit: int, what: str, param: str, engine) -> None:
    if n > limit:
        ctx = _context_of(engine)
        why = f"cannot fit the context of {ctx} tokens: " if ctx else ""
        raise APIError(
            400,
            f"{what} of {n:,} characters {why}at most {limit:,} characters are accepted (--max-prompt-chars)",
            param=param,
            code="context_length_exceeded",
        )


def _check_documents(documents: Optional[Sequence[str]], limits: RequestLimits) -> None:
    total = sum(len(d) for d in documents or ())
    if total > limits.document_chars:
        raise APIError(
            400,
            f"documents of {total:,} characters in all are over the limit of {limits.document_chars:,} "
            "(--max-document-chars)",
            param="documents",
            code="documents_too_long",
        )


def _encode_documents(engine, documents: Optional[Sequence[str]], cancel: threading.Event) -> list[list[int]]:
    if not documents:
        return []
    if cancel.is_set():
        raise _Cancelled()
    return [list(ids) for ids in engine.tokenizer(list(documents), add_special_tokens=False)["input_ids"]]


def _check_fits(engine, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    limit = _context_of(engine)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the context length of "
            f"{limit} tokens"
        )


def _prepare_completion(engine, prompt, kwargs: dict, limits: RequestLimits, cancel: threading.Event) -> _Prepared:
    """Token ids of a completion's prompt (text, or ids checked against the vocabulary)."""
    documents = kwargs.get("documents")
    if isinstance(prompt, str):
        _check_chars(len(prompt), limits.prompt_chars, "prompt", "prompt", engine)
    else:
        _check_fits(engine, prompt, kwargs["max_new_tokens"])  # before looking at every id
        vocab = engine.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    _check_documents(documents, limits)
    if cancel.is_set():
        raise _Cancelled()
    ids = engine.encode_prompt(prompt, chat=False)
    _check_fits(engine, ids, kwargs["max_new_tokens"])
    return _Prepared(ids, _encode_documents(engine, documents, cancel))


def _prepare_chat(
    engine, messages: list[dict], kwargs: dict, limits: RequestLimits, cancel: threading.Event
) -> _Prepared:
    """Token ids of a chat through the model's chat template."""
    _check_chars(sum(len(m["content"]) for m in messages), limits.prompt_chars, "messages", "messages", engine)
    documents = kwargs.get("documents")
    _check_documents(documents, limits)
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template: use /v1/completions")
    if cancel.is_set():
        raise _Cancelled()
    ids = engine.encode_messages(messages)
    _check_fits(engine, ids, kwargs["max_new_tokens"])
    return _Prepared(ids, _encode_documents(engine, documents, cancel))


def _prepare_summary(
    engine,
    documents: list[str],
    instruction: Optional[str],
    kwargs: dict,
    limits: RequestLimits,
    cancel: threading.Event,
) -> _Prepared:
    """Token ids of the summary prompt (the documents are in it, chat-templated)."""
    total = sum(len(d) for d in documents) + len(instruction or "")
    _check_chars(total, limits.prompt_chars, "documents and instruction", "documents", engine)
    if cancel.is_set():
        raise _Cancelled()
    ids = engine.encode_prompt(build_summary_prompt(documents, instruction), chat=True)
    _check_fits(engine, ids, kwargs["max_new_tokens"])
    return _Prepared(ids, [])


# ---------------------------------------------------------------------- generation plumbing
class _Gen:
    """One generation as the handlers see it, from admission to the last chunk.

    ``_Gen(request, endpoint)`` reserves a place (429 when full); :meth:`read` reads the
    body (bounded) and validates it off the event loop; :meth:`start` prepares the token ids
    off the event loop, submits the job and waits until the worker accepted it;
    :meth:`chunks` / :meth:`collect` read the generation. From :meth:`read` on, a watcher
    task listens for the client's ``http.disconnect`` and cancels at once whatever stage the
    request is in. :meth:`close` (always called) stops the watcher and frees the place.
    """

    def __init__(self, request: Request, endpoint: str) -> None:
        app = request.app
        self.request = request
        self.endpoint = endpoint
        self.settings: ServerSettings = app.state.settings
        self.metrics: ServerMetrics = app.state.metrics
        self.limits: RequestLimits = app.state.limits
        self._pool: concurrent.futures.Executor = app.state.prepare_pool
        self._scheduler: Scheduler = app.state.scheduler
        self.t0 = time.perf_counter()
        self.first_token_s: Optional[float] = None
        self.job: Optional[Job] = None
        self.gone = asyncio.Event()
        self._cancel = threading.Event()  # seen by the preparation thread
        self._watcher: Optional[asyncio.Task] = None
        self._done = False
        self._closed = False
        try:
            self._ticket = self._scheduler.reserve()
        except CapacityError as e:
            self.metrics.rejected.inc()
            raise _api_error(e, self.settings.retry_after_s) from None

    # ------------------------------------------------------------------ stages
    async def read(self, model: type[BaseModel]) -> Any:
        """The body, read up to the limit, parsed and validated in the prepare pool.

        Raises:
            APIError: 415 (not JSON), 413 (too large), 400 (empty).
            RequestValidationError: invalid body.
            _ClientGone: the client left.
        """
        headers = self.request.headers
        ctype = headers.get("content-type")
        if ctype is not None and not _is_json(ctype):
            raise APIError(
                415,
                f"the request body must be JSON: send 'Content-Type: application/json' (got {ctype!r})",
                code="unsupported_media_type",
            )
        limit = self.limits.body_bytes
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise self._too_large(f" of {int(declared):,} bytes")
        receive = self.request.receive
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                raise _ClientGone()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_large("")
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        self._watch()
        return await self._off_loop(_validate, model, b"".join(parts), self.limits.json_values)

    def _too_large(self, size: str) -> APIError:
        limit = self.limits.body_bytes
        return APIError(
            413,
            f"request body{size} is over the limit of {limit:,} bytes (--max-body-bytes)",
            code="request_too_large",
            headers={"Connection": "close"},
        )

    async def start(self, engine, prepare: Callable[[threading.Event], _Prepared], kwargs: dict) -> None:
        """Prepare the token ids off the event loop, submit the job, wait until the worker
        accepted it; raise the request's error if it did not."""
        prepared: _Prepared = await self._off_loop(prepare, self._cancel)
        kw = {k: v for k, v in kwargs.items() if k != "documents"}

        def make_request():
            return engine, engine.request(prepared.prompt_ids, chat=False, document_ids=prepared.document_ids, **kw)

        self.job = self._scheduler.submit(make_request, ticket=self._ticket)
        kind, value = await self._next()
        if kind == ERROR:
            self._done = True
            raise _api_error(value, self.settings.retry_after_s)

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The chunks up to the final one."""
        while True:
            kind, value = await self._next()
            if kind == ERROR:
                self._done = True
                raise _api_error(value, self.settings.retry_after_s)
            if kind != CHUNK:
                continue
            chunk: StreamChunk = value
            if self.first_token_s is None and (chunk.text or chunk.token_ids):
                self.first_token_s = time.perf_counter() - self.t0
                self.metrics.ttft.labels(endpoint=self.endpoint).observe(self.first_token_s)
            if chunk.finish_reason is not None:
                self._done = True
            yield chunk
            if chunk.finish_reason is not None:
                return

    def finished(self) -> None:
        self.metrics.latency.labels(endpoint=self.endpoint).observe(time.perf_counter() - self.t0)

    async def collect(self) -> tuple[str, Optional[StreamChunk]]:
        parts: list[str] = []
        last = None
        async for chunk in self.chunks():
            parts.append(chunk.text)
            last = chunk
        self.finished()
        return "".join(parts), last

    def close(self) -> None:
        """Stop watching, free the reserved place, cancel an unfinished job (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:
            self._watcher.cancel()
        self._ticket.release()  # no-op once the job took it
        if self.job is not None:
            if not self._done:
                self.job.cancel()
        elif self.gone.is_set():
            self.metrics.cancelled.inc()  # left before its job existed

    @contextlib.contextmanager
    def closing_on_error(self):
        """Close on any exception (the normal path closes after the last chunk)."""
        try:
            yield self
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ internals
    def _watch(self) -> None:
        """Listen for the client's disconnect from now on (the body has been read: the
        only message left to receive is ``http.disconnect``)."""
        receive = self.request.receive

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self._client_left()
                    return

        self._watcher = asyncio.ensure_future(watch())

    def _client_left(self) -> None:
        self.gone.set()
        self._cancel.set()
        if self.job is not None and not self._done:
            self.job.cancel()  # the worker drops it before its next step
            self.job.queue.put_nowait((GONE, None))  # wakes the handler now

    async def _off_loop(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` in the prepare pool; raise :class:`_ClientGone` as soon as the
        client leaves (a task not started yet never runs; one running finishes in its
        thread, bounded by the limits, and its result is dropped)."""
        fut = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        if not self.gone.is_set():
            gone = asyncio.ensure_future(self.gone.wait())
            try:
                await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
        if self.gone.is_set():
            fut.cancel()
            raise _ClientGone()
        return fut.result()

    async def _next(self) -> tuple[str, Any]:
        kind, value = await self.job.next_item()
        if kind == GONE:
            raise _ClientGone()
        return kind, value


class _ClientGone(Exception):
    """The client disconnected while its request was read, prepared, waited or generated."""


def _streaming(gen_events: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(
        gen_events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


def _add_v1_routes(router: APIRouter, settings: ServerSettings, metrics: ServerMetrics) -> None:
    def served_name(request: Request) -> str:
        return request.app.state.model_name

    def check_model(request: Request, model: Optional[str]) -> None:
        engine = request.app.state.engine
        if model is None or model in (served_name(request), engine.model_name, "ragspec"):
            return
        raise APIError(
            404, f"The model `{model}` does not exist.", type="not_found_error", param="model", code="model_not_found"
        )

    def pick_engine(request: Request, datastore: Optional[str]):
        state = request.app.state
        if datastore is None:
            return next(iter(state.engines.values())) if state.engines else state.engine
        if datastore in state.engines:
            return state.engines[datastore]
        names = sorted(state.engines)
        raise APIError(
            400,
            f"unknown datastore {datastore!r}: this server has {names if names else 'none'} (datastores are named, never paths)",
            param="datastore",
            code="datastore_not_found",
        )

    def engine_kwargs(body, default_max_tokens: int) -> dict:
        bad = unsupported(body)
        if bad is not None:
            raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max_tokens
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        return dict(
            max_new_tokens=max_tokens,
            stop=stop or None,
            documents=getattr(body, "documents", None) or None,
            speculative=settings.speculative if body.speculative is None else body.speculative,
            temperature=settings.default_temperature if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
        )

    def include_usage(body) -> bool:
        return bool(body.stream_options and body.stream_options.include_usage)

    # ------------------------------------------------------------------ /v1/models
    @router.get("/models")
    async def models(request: Request) -> dict:
        name = served_name(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": request.app.state.started,
                    "owned_by": "ragspec",
                    "datastores": sorted(request.app.state.engines),
                    # the default for requests that do not set "speculative"
                    "drafting": request.app.state.engine.drafting if request.app.state.settings.speculative else "off",
                }
            ],
        }

    # ------------------------------------------------------------------ /v1/completions
    @router.post("/completions")
    async def completions(request: Request):
        gen = _Gen(request, "/v1/completions")
        with gen.closing_on_error():
            body: CompletionRequest = await gen.read(CompletionRequest)
            check_model(request, body.model)
            kwargs = engine_kwargs(body, COMPLETIONS_DEFAULT_MAX_TOKENS)
            engine = pick_engine(request, body.datastore)
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                if len(prompt) != 1:
                    raise APIError(400, "only one prompt per request is supported", param="prompt")
                prompt = prompt[0]
            if isinstance(prompt, list) and not prompt:
                raise APIError(400, "prompt is empty", param="prompt")
            limits = gen.limits
            await gen.start(engine, lambda cancel: _prepare_completion(engine, prompt, kwargs, limits, cancel), kwargs)
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), served_name(request)

        def envelope(choices, usage=None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if not body.stream:
            try:
                text, last = await gen.collect()
            finally:
                gen.close()
            stats = last.stats if last else None
            out = envelope(
                [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": _finish(last.finish_reason if last else "stop"),
                    }
                ],
                _usage(stats),
            )
            out["stats"] = stats.to_dict() if stats else None
            return out
        with_usage = include_usage(body)

        async def events() -> AsyncIterator[bytes]:
            try:
                try:
                    async for chunk in gen.chunks():
                        choice = {
                            "index": 0,
                            "text": chunk.text,
                            "logprobs": None,
                            "finish_reason": _finish(chunk.finish_reason),
                        }
                        yield _sse(envelope([choice], None))
                        if chunk.finish_reason is not None and with_usage:
                            yield _sse(envelope([], _usage(chunk.stats)))
                except APIError as e:
                    yield _sse(e.body())
                gen.finished()
                yield _sse("[DONE]")
            except _ClientGone:
                return
            finally:
                gen.close()

        return _streaming(events())

    # ------------------------------------------------------------------ /v1/chat/completions
    @router.post("/chat/completions")
    async def chat_completions(request: Request):
        gen = _Gen(request, "/v1/chat/completions")
        with gen.closing_on_error():
            body: ChatCompletionRequest = await gen.read(ChatCompletionRequest)
            check_model(request, body.model)
            kwargs = engine_kwargs(body, settings.default_max_tokens)
            engine = pick_engine(request, body.datastore)
            try:
                messages = [
                    {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
                ]
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            limits = gen.limits
            await gen.start(engine, lambda cancel: _prepare_chat(engine, messages, kwargs, limits, cancel), kwargs)
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served_name(request)

        def envelope(obj: str, choices, usage=None) -> dict:
            out = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if not body.stream:
            try:
                text, last = await gen.collect()
            finally:
                gen.close()
            stats = last.stats if last else None
            out = envelope(
                "chat.completion",
                [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": _finish(last.finish_reason if last else "stop"),
                    }
                ],
                _usage(stats),
            )
            out["stats"] = stats.to_dict() if stats else None
            return out
        with_usage = include_usage(body)

        async def events() -> AsyncIterator[bytes]:
            try:
                first = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse(envelope("chat.completion.chunk", [first]))
                try:
                    async for chunk in gen.chunks():
                        delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
                        choice = {
                            "index": 0,
                            "delta": delta,
                            "logprobs": None,
                            "finish_reason": _finish(chunk.finish_reason),
                        }
                        yield _sse(envelope("chat.completion.chunk", [choice]))
                        if chunk.finish_reason is not None and with_usage:
                            yield _sse(envelope("chat.completion.chunk", [], _usage(chunk.stats)))
                except APIError as e:
                    yield _sse(e.body())
                gen.finished()
                yield _sse("[DONE]")
            except _ClientGone:
                return
            finally:
                gen.close()

        return _streaming(events())

    # ------------------------------------------------------------------ /v1/summarize
    @router.post("/summarize")
    async def summarize(request: Request):
        gen = _Gen(request, "/v1/summarize")
        with gen.closing_on_error():
            body: SummarizeRequest = await gen.read(SummarizeRequest)
            check_model(request, body.model)
            kwargs = engine_kwargs(body, settings.default_max_tokens)
            # the documents are in the prompt: prompt lookup copies from them already
            kwargs["documents"] = None
            engine = pick_engine(request, body.datastore)
            limits = gen.limits
            docs, instruction = body.documents, body.instruction
            await gen.start(
                engine, lambda cancel: _prepare_summary(engine, docs, instruction, kwargs, limits, cancel), kwargs
            )
        rid, created, name = f"sum-{uuid.uuid4().hex}", int(time.time()), served_name(request)
        if not body.stream:
            try:
                text, last = await gen.collect()
            finally:
                gen.close()
            stats = last.stats if last else None
            return {
                "id": rid,
                "object": "summary",
                "created": created,
                "model": name,
                "summary": text,
                "finish_reason": _finish(last.finish_reason if last else "stop"),
                "usage": _usage(stats),
                "stats": stats.to_dict() if stats else None,
            }

        async def events() -> AsyncIterator[bytes]:
            try:
                try:
                    async for chunk in gen.chunks():
                        out = {
                            "id": rid,
                            "object": "summary.chunk",
                            "created": created,
                            "model": name,
                            "summary": chunk.text,
                        }
                        if chunk.finish_reason is not None:
                            out["finish_reason"] = _finish(chunk.finish_reason)
                            out["usage"] = _usage(chunk.stats)
                            out["stats"] = chunk.stats.to_dict() if chunk.stats else None
                        yield _sse(out)
                except APIError as e:
                    yield _sse(e.body())
                gen.finished()
                yield _sse("[DONE]")
            except _ClientGone:
                return
            finally:
                gen.close()

        return _streaming(events())
