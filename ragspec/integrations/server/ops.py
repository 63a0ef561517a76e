"""Operations: ``GET /health`` (liveness, always open) and ``GET /metrics`` (Prometheus
text format, see :mod:`..metrics`; always open). Module-level handlers on :data:`router`,
mounted at the root by :func:`.app.create_app`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ..metrics import CONTENT_TYPE_LATEST, ServerMetrics

__all__ = ["router", "health", "prometheus_metrics"]

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> dict:
    """Liveness: `{"status": "ok", "model": <served model name>}`. Always open."""
    return {"status": "ok", "model": getattr(request.app.state, "model_name", None)}


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    """The server's metrics in Prometheus' text format. Always open."""
    metrics: ServerMetrics = request.app.state.metrics
    return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
