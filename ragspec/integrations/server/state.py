"""What the handlers serve from: a typed view of ``app.state`` (filled by the lifespan,
:mod:`.app`), given to each handler by the FastAPI dependency :func:`server_state`, and the
checks every generation endpoint makes on it (the model a request names, the datastore it
picks)."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request

from ragspec.deprecation import warn_deprecated
from ragspec.engine import Engine

from ..metrics import ServerMetrics
from ..settings import RequestLimits, ServerSettings
from ..stepper import Stepper
from .errors import APIError

__all__ = ["ServerState", "server_state", "not_ready", "check_model", "check_datastore", "pick_engine"]


@dataclass(frozen=True)
class ServerState:
    """The app's serving state, as the lifespan set it on ``app.state``."""

    settings: ServerSettings
    metrics: ServerMetrics
    engine: Engine
    """The served engine: every named datastore (``engine.datastores``; a request names
    its own), the response cache when there is one."""
    scheduler: Stepper
    """The worker that steps every generation."""
    prepare_pool: concurrent.futures.Executor
    """Threads that parse, validate and tokenize requests."""
    limits: RequestLimits
    model_name: str
    """The served model's name (``/v1/models``, responses)."""
    started: int
    """Unix time the app started (``/v1/models``' ``created``)."""
    datastore_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while a served datastore's writer is made (:mod:`.datastores`)."""
    datastore_writers: dict = field(default_factory=dict)
    """The writers of the served datastores that took additions, by name
    (:class:`ragspec.datastore.live.DatastoreWriter`; closed at shutdown)."""

    @classmethod
    def of(cls, app: FastAPI) -> "ServerState":
        """The state of a started ``app`` (raises AttributeError before its lifespan ran)."""
        s = app.state
        return cls(
            settings=s.settings,
            metrics=s.metrics,
            engine=s.engine,
            scheduler=s.scheduler,
            prepare_pool=s.prepare_pool,
            limits=s.limits,
            model_name=s.model_name,
            started=s.started,
            datastore_lock=s.datastore_lock,
            datastore_writers=s.datastore_writers,
        )


def not_ready(app: FastAPI) -> APIError:
    """The 503 of a request that came before the engine was loaded (or after its load
    failed), with ``Retry-After``."""
    error = getattr(app.state, "load_error", None)
    settings = getattr(app.state, "settings", None)
    retry = str(getattr(settings, "retry_after_s", 1))
    if error is not None:
        message = f"the model did not load: {str(error).splitlines()[0] if str(error) else type(error).__name__}"
    else:
        message = "the model is loading; retry shortly (GET /ready says when it is loaded)"
    return APIError(503, message, type="server_error", code="not_ready", headers={"Retry-After": retry})


async def server_state(request: Request) -> ServerState:
    """FastAPI dependency: the serving state of the request's app (async: runs on the
    event loop, no thread hop).

    Raises:
        APIError: 503 ``not_ready`` (with ``Retry-After``) until the engine is loaded.
    """
    if getattr(request.app.state, "ready", True) is False:
        raise not_ready(request.app)
    return ServerState.of(request.app)


def check_model(state: ServerState, model: Optional[str]) -> None:
    """Accept a request's ``model``: none, the served name, the engine's model name or
    ``"ragspec"``.

    Raises:
        APIError: 404 ``model_not_found`` for any other name.
    """
    if model is None or model in (state.model_name, state.engine.model_name, "ragspec"):
        return
    raise APIError(
        404, f"The model `{model}` does not exist.", type="not_found_error", param="model", code="model_not_found"
    )


def check_datastore(state: ServerState, datastore: Optional[str]) -> None:
    """Accept a request's ``datastore``: none (the default), or a name the server was started
    with.

    Raises:
        APIError: 400 ``datastore_not_found`` for any other name (datastores are named, never
            paths).
    """
    names = state.engine.datastores
    if datastore is None or datastore in names:
        return
    raise APIError(
        400,
        f"unknown datastore {datastore!r}: this server has {sorted(names) if names else 'none'} "
        "(datastores are named, never paths)",
        param="datastore",
        code="datastore_not_found",
    )


def pick_engine(state: ServerState, datastore: Optional[str]) -> Engine:
    """Deprecated: one engine serves every datastore (:func:`check_datastore`, then
    ``RequestParams.datastore``). Checks ``datastore`` and returns the served engine.

    Raises:
        APIError: 400 ``datastore_not_found``, as :func:`check_datastore`.
    """
    warn_deprecated("pick_engine", "check_datastore and RequestParams.datastore (one engine serves every datastore)")
    check_datastore(state, datastore)
    return state.engine
