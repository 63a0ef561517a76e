"""Operations: ``GET /health`` (liveness: answers at once, from the first moment),
``GET /ready`` (readiness: 200 once the engine is loaded, 503 with ``Retry-After`` before)
and ``GET /metrics`` (Prometheus text format, see :mod:`..metrics`; behind the API key
unless ``--public-metrics``). Module-level handlers on :data:`router`, mounted at the root
by :func:`.app.create_app`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .state import not_ready

__all__ = ["router", "health", "ready", "prometheus_metrics"]

router = APIRouter()


@router.get("/health", response_model=None)
async def health(request: Request) -> dict | JSONResponse:
    """Liveness: `{"status": "ok", "model": <served model name>}` (`model` null while it
    loads). Always open; 503 only when the model failed to load."""
    state = request.app.state
    if getattr(state, "load_error", None) is not None:
        return not_ready(request.app).response()
    return {"status": "ok", "model": getattr(state, "model_name", None)}


@router.get("/ready", response_model=None)
async def ready(request: Request) -> dict | JSONResponse:
    """Readiness: `{"status": "ready", "model": ...}` once the engine is loaded; 503
    (`not_ready`, with `Retry-After`) before. Always open."""
    state = request.app.state
    if getattr(state, "ready", True) is False:
        return not_ready(request.app).response()
    return {"status": "ready", "model": getattr(state, "model_name", None)}


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    """The server's metrics in Prometheus' text format (behind the API key unless
    `--public-metrics`: they count every tenant's traffic)."""
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
