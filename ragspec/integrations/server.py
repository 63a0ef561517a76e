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
status for bad input (400), a missing or wrong API key (401), an unknown model (404) and a
full queue (429, with ``Retry-After``).

The engine loads in the app's lifespan into ``app.state.engine`` (tests pass a ready one to
:func:`create_app`). One worker thread (:class:`.scheduler.Scheduler`) owns the model and
interleaves the requests step by step; each request's output is what it gives alone. A
client that disconnects cancels its generation within one step.

Security: with an API key (``--api-key`` / ``RAGSPEC_API_KEY``) every ``/v1/*`` request
needs ``Authorization: Bearer <key>``; ``/health`` and ``/metrics`` stay open (as vLLM's
server does). A request may name only the datastores the server was started with, by name.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ragspec.errors import CapacityError, ConfigError, PromptTooLongError, RagspecError
from ragspec.types import GenerationStats, StreamChunk

from .metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .scheduler import CHUNK, ERROR, Job, Scheduler
from .schemas import ChatCompletionRequest, CompletionRequest, SummarizeRequest, unsupported
from .settings import ServerSettings

logger = logging.getLogger(__name__)

__all__ = ["create_app", "ServerSettings", "APIError", "build_summary_prompt", "SUMMARY_INSTRUCTION"]

SUMMARY_INSTRUCTION = "Summarize the documents above in a few sentences."
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_DISCONNECT_POLL_S = 0.5
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
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


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
        policy=PolicyConfig(max_draft_tokens=settings.max_draft_tokens, adaptive=settings.adaptive),
        calibrate=settings.calibrate,
    )


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
    """ASGI middleware: ``/v1/*`` requests need ``Authorization: Bearer <key>``, checked
    before anything else (body parsing included), as vLLM does; other paths stay open."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (scope.get("path", "") + "/").startswith("/v1/"):
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


def create_app(
    engine=None, settings: Optional[ServerSettings] = None, *, datastore_engines: Optional[dict] = None
) -> FastAPI:
    """The FastAPI app. ``engine``: a ready :class:`ragspec.Engine` (None: the lifespan loads
    ``settings.model``). ``settings``: None reads ``RAGSPEC_*`` environment variables.
    ``datastore_engines``: the named datastores' engines, already built by
    ``_datastore_engines`` (None: the lifespan builds them)."""
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
        scheduler = Scheduler(
            max_active=settings.max_active,
            max_queue=settings.max_queue,
            on_finish=_on_finish,
            on_cancel=lambda job: metrics.cancelled.inc(),
        )
        scheduler.start()
        app.state.engine = eng
        app.state.engines = variants
        app.state.scheduler = scheduler
        app.state.model_name = settings.served_model_name or eng.model_name or "ragspec"
        app.state.started = int(time.time())
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    def _on_finish(job: Job, chunk: StreamChunk) -> None:
        if chunk.finish_reason == "cancelled":
            metrics.cancelled.inc()
        if chunk.stats is not None:
            metrics.observe_generation(chunk.stats)

    app = FastAPI(title="ragspec", version="0.1.0", lifespan=lifespan)
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
            message = f"missing required field: {param}" if param else "request body is missing (a JSON object is required)"
        else:
            message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
        return APIError(400, message, param=param, code=kind or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone) -> Response:
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        return _api_error(exc).response()


# ---------------------------------------------------------------------- generation plumbing
class _Gen:
    """One generation as the handlers see it: submit, wait until the prompt is accepted,
    read chunks, cancel when the client leaves."""

    def __init__(self, request: Request, endpoint: str, make_stream: Callable[[], Any]) -> None:
        self.request = request
        self.endpoint = endpoint
        app = request.app
        self.settings: ServerSettings = app.state.settings
        self.metrics: ServerMetrics = app.state.metrics
        self.t0 = time.perf_counter()
        self._last_poll = self.t0
        self.first_token_s: Optional[float] = None
        try:
            self.job = app.state.scheduler.submit(make_stream)
        except CapacityError as e:
            self.metrics.rejected.inc()
            raise _api_error(e, self.settings.retry_after_s) from None

    async def _get(self, poll_disconnect: bool):
        """The job's next item; with ``poll_disconnect``, also look at least every
        ``_DISCONNECT_POLL_S`` whether the client is still there (a plain response writes
        nothing until the end, so nothing else would notice)."""
        if not poll_disconnect:
            return await self.job.next_item()
        while True:
            now = time.perf_counter()
            if now - self._last_poll >= _DISCONNECT_POLL_S:
                self._last_poll = now
                if await self.request.is_disconnected():
                    raise _ClientGone()
            try:
                return await asyncio.wait_for(self.job.next_item(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    async def started(self) -> None:
        """Wait until the worker accepted the prompt; raise the request's error if not."""
        try:
            kind, value = await self._get(poll_disconnect=True)
        except BaseException:
            self.job.cancel()
            raise
        if kind == ERROR:
            raise _api_error(value, self.settings.retry_after_s)

    async def chunks(self, poll_disconnect: bool) -> AsyncIterator[StreamChunk]:
        """The chunks up to the final one; the job is cancelled if the reader stops early."""
        done = False
        try:
            while True:
                kind, value = await self._get(poll_disconnect)
                if kind == ERROR:
                    done = True
                    raise _api_error(value, self.settings.retry_after_s)
                if kind != CHUNK:
                    continue
                chunk: StreamChunk = value
                if self.first_token_s is None and (chunk.text or chunk.token_ids):
                    self.first_token_s = time.perf_counter() - self.t0
                    self.metrics.ttft.labels(endpoint=self.endpoint).observe(self.first_token_s)
                yield chunk
                if chunk.finish_reason is not None:
                    done = True
                    return
        finally:
            if not done:
                self.job.cancel()

    def finished(self) -> None:
        self.metrics.latency.labels(endpoint=self.endpoint).observe(time.perf_counter() - self.t0)

    async def collect(self) -> tuple[str, Optional[StreamChunk]]:
        parts: list[str] = []
        last = None
        async for chunk in self.chunks(poll_disconnect=True):
            parts.append(chunk.text)
            last = chunk
        self.finished()
        return "".join(parts), last


class _ClientGone(Exception):
    """The client disconnected while its request waited or generated."""


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
        raise APIError(404, f"The model `{model}` does not exist.", type="not_found_error", param="model", code="model_not_found")

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
                }
            ],
        }

    # ------------------------------------------------------------------ /v1/completions
    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
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
        if isinstance(prompt, list):
            vocab = engine.target.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
        gen = _Gen(request, "/v1/completions", lambda: engine.stream(prompt, chat=False, **kwargs))
        await gen.started()
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), served_name(request)

        def envelope(choices, usage=None) -> dict:
            out = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if not body.stream:
            text, last = await gen.collect()
            stats = last.stats if last else None
            out = envelope(
                [{"index": 0, "text": text, "logprobs": None, "finish_reason": _finish(last.finish_reason if last else "stop")}],
                _usage(stats),
            )
            out["stats"] = stats.to_dict() if stats else None
            return out
        with_usage = include_usage(body)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in gen.chunks(poll_disconnect=False):
                    choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": _finish(chunk.finish_reason)}
                    yield _sse(envelope([choice], None))
                    if chunk.finish_reason is not None and with_usage:
                        yield _sse(envelope([], _usage(chunk.stats)))
            except APIError as e:
                yield _sse(e.body())
            gen.finished()
            yield _sse("[DONE]")

        return _streaming(events())

    # ------------------------------------------------------------------ /v1/chat/completions
    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(request, body.model)
        kwargs = engine_kwargs(body, settings.default_max_tokens)
        engine = pick_engine(request, body.datastore)
        try:
            messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

        def make_stream():
            if not getattr(engine.tokenizer, "chat_template", None):
                raise ConfigError("this model has no chat template: use /v1/completions")
            return engine.stream(engine.encode_messages(messages), **kwargs)

        gen = _Gen(request, "/v1/chat/completions", make_stream)
        await gen.started()
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), served_name(request)

        def envelope(obj: str, choices, usage=None) -> dict:
            out = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices}
            if usage is not None:
                out["usage"] = usage
            return out

        if not body.stream:
            text, last = await gen.collect()
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
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _sse(envelope("chat.completion.chunk", [first]))
            try:
                async for chunk in gen.chunks(poll_disconnect=False):
                    delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
                    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _finish(chunk.finish_reason)}
                    yield _sse(envelope("chat.completion.chunk", [choice]))
                    if chunk.finish_reason is not None and with_usage:
                        yield _sse(envelope("chat.completion.chunk", [], _usage(chunk.stats)))
            except APIError as e:
                yield _sse(e.body())
            gen.finished()
            yield _sse("[DONE]")

        return _streaming(events())

    # ------------------------------------------------------------------ /v1/summarize
    @router.post("/summarize")
    async def summarize(body: SummarizeRequest, request: Request):
        check_model(request, body.model)
        kwargs = engine_kwargs(body, settings.default_max_tokens)
        # the documents are in the prompt: prompt lookup copies from them already
        kwargs["documents"] = None
        engine = pick_engine(request, body.datastore)
        prompt = build_summary_prompt(body.documents, body.instruction)
        gen = _Gen(request, "/v1/summarize", lambda: engine.stream(prompt, chat=True, **kwargs))
        await gen.started()
        rid, created, name = f"sum-{uuid.uuid4().hex}", int(time.time()), served_name(request)
        if not body.stream:
            text, last = await gen.collect()
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
                async for chunk in gen.chunks(poll_disconnect=False):
                    out = {"id": rid, "object": "summary.chunk", "created": created, "model": name, "summary": chunk.text}
                    if chunk.finish_reason is not None:
                        out["finish_reason"] = _finish(chunk.finish_reason)
                        out["usage"] = _usage(chunk.stats)
                        out["stats"] = chunk.stats.to_dict() if chunk.stats else None
                    yield _sse(out)
            except APIError as e:
                yield _sse(e.body())
            gen.finished()
            yield _sse("[DONE]")

        return _streaming(events())
