"""The served datastores: ``GET /v1/datastores`` (the datastores requests may name, with
their sizes for the keys that may write) and ``POST /v1/datastores/{name}/documents``
(documents added at run time).

An addition goes through the datastore's :class:`~ragspec.datastore.live.DatastoreWriter`
(made at its first addition, closed at shutdown): all or nothing (a failure leaves the
documents neither on disk nor served), with the same hygiene as ``ragspec datastore add``
(an empty, binary or invalid text refuses the call with a 400 and nothing is written), an
``Idempotency-Key`` header making a retry a no-op that answers the same (header
``Idempotent-Replayed: true``; the same key with other documents: 422), and the shards
merged in the background. Each new copy of the datastore is served through
:func:`_serve_copy`, the one place a datastore replaces the one served (swapped in the one
served engine: :meth:`ragspec.Engine.swap_datastore`): requests that start after the call
returns draft from the new documents, requests in flight keep the copy they started with. A datastore with too many shards waiting to be merged answers 503
with ``Retry-After``.

Who may write: with API keys, only the keys given with ``--admin-key`` (403 for the
others); a server without keys lets every client write. ``GET /v1/datastores`` shows the
other keys the names and the default only: the sizes would tell them what others added.
A body is at most ``--max-add-bytes`` (413 beyond; 0 turns additions off, 403).

Module-level handlers on :data:`router` (mounted under ``/v1`` by :func:`.app.create_app`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from typing import Annotated, Optional

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ragspec import serving
from ragspec.backend.threads import release_openmp_pool
from ragspec.datastore import Datastore, DatastoreInfo
from ragspec.datastore.live import Addition, DatastoreWriter
from ragspec.errors import (
    DatastoreBusyError,
    DatastoreError,
    DatastoreInputError,
    EmptyCorpusError,
    IdempotencyKeyError,
)

from ..schemas import AddDocumentsRequest
from .admission import bearer_token, tenant_salt
from .errors import APIError
from .middleware import read_body
from .state import ServerState, server_state
from .validation import validate_body

logger = logging.getLogger(__name__)

__all__ = ["router", "list_datastores", "add_documents", "DEFAULT_SOURCE", "MAX_IDEMPOTENCY_KEY"]

DEFAULT_SOURCE = "api"
"""The source recorded for documents added without a ``source``."""
MAX_IDEMPOTENCY_KEY = 255
"""Most characters of an ``Idempotency-Key`` header (printable ASCII)."""

router = APIRouter()
"""The datastore endpoints, without the ``/v1`` prefix (the app adds it)."""

State = Annotated[ServerState, Depends(server_state)]


def _sizes(info: DatastoreInfo) -> dict:
    return {
        "num_documents": info.num_documents,
        "num_tokens": info.num_tokens,
        "num_bytes": info.bytes_on_disk,
        "num_shards": info.num_shards,
        "updated": info.updated,
    }


def _entry(name: str, ds: Datastore, default: bool, sizes: bool) -> dict:
    """One datastore of ``GET /v1/datastores``: its name, whether requests naming none use
    it, and (``sizes``) the sizes of the copy served."""
    out = {"id": name, "object": "datastore", "default": default}
    if sizes:
        out.update(_sizes(ds.info()))
    return out


def may_write(request: Request, state: ServerState) -> bool:
    """Whether the request's key may write to the datastores: any request on a server
    without keys, else a key of ``--admin-key`` (compared in constant time, every key)."""
    settings = state.settings
    if not settings.api_keys:
        return True
    token = bearer_token(request.scope) or b""
    return sum(hmac.compare_digest(token, k.encode()) for k in settings.admin_keys) > 0


@router.get("/datastores")
async def list_datastores(request: Request, state: State) -> dict:
    """The datastores requests may name (`datastore`); the first is the default of
    requests that name none. For keys that may write (all, without keys): the size of
    each as served, `num_documents`, `num_tokens`, `num_bytes` (on disk), `num_shards`,
    `updated`."""
    served = list(state.engine.datastores.items())
    default = state.engine.default_datastore
    sizes = may_write(request, state)
    data = await asyncio.to_thread(lambda: [_entry(n, ds, n == default, sizes) for n, ds in served])
    return {"object": "list", "data": data}


def _serve_copy(state: ServerState, name: str, ds: Datastore) -> None:
    """Serve the copy ``ds`` of the datastore ``name`` from now on: the one place an added
    to (or merged) datastore replaces the served one. Requests in flight keep theirs."""
    serving.serve_datastore(state.engine, name, ds)


def _writer(state: ServerState, name: str) -> DatastoreWriter:
    """The writer of the served datastore ``name``, made at its first addition."""
    with state.datastore_lock:
        writer = state.datastore_writers.get(name)
        if writer is None:
            engine = state.engine
            writer = DatastoreWriter(engine.datastores[name], engine.tokenizer, lambda ds: _serve_copy(state, name, ds))
            state.datastore_writers[name] = writer
        return writer


def _idempotency_key(request: Request) -> Optional[str]:
    """The ``Idempotency-Key`` header (None: none), scoped to the request's tenant.

    Raises:
        APIError: 400 for an empty key, one over :data:`MAX_IDEMPOTENCY_KEY` characters or
            not printable ASCII.
    """
    key = request.headers.get("idempotency-key")
    if key is None:
        return None
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not all(32 < ord(c) < 127 for c in key):
        raise APIError(
            400,
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters without spaces",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return f"{tenant_salt(request.scope, True)}/{key}"


@router.post("/datastores/{name}/documents")
async def add_documents(name: str, request: Request, state: State) -> JSONResponse:
    """Add `documents` (texts, one document each) to the served datastore `name`, all or
    nothing: written to its folder and drafted from by the requests that start after this
    call returns. With keys, only `--admin-key` keys may. An `Idempotency-Key` header makes
    a retry answer the same without adding again. Answers the documents and tokens added
    and the datastore's new size."""
    limit = state.settings.max_add_bytes
    if limit == 0:
        raise APIError(
            403,
            "adding documents at run time is off on this server (--max-add-bytes 0)",
            type="permission_error",
            code="datastore_additions_off",
        )
    if not may_write(request, state):
        raise APIError(
            403,
            "this key may not add documents: the server takes additions only from its --admin-key keys",
            type="permission_error",
            code="write_key_required",
        )
    if name not in state.engine.datastores:
        names = sorted(state.engine.datastores)
        raise APIError(
            404,
            f"unknown datastore {name!r}: this server has {names if names else 'none'}",
            type="not_found_error",
            param="name",
            code="datastore_not_found",
        )
    key = _idempotency_key(request)
    raw = await read_body(request, limit, lambda: None, option="--max-add-bytes")
    body = await asyncio.to_thread(validate_body, AddDocumentsRequest, raw, state.limits.json_values)
    texts, source = body.documents, body.source or DEFAULT_SOURCE

    def add() -> Addition:
        try:
            return _writer(state, name).add(texts, source=source, idempotency_key=key)
        finally:
            release_openmp_pool()  # only the worker keeps a pool (ragspec.backend.threads)

    try:
        added = await asyncio.to_thread(add)
    except (EmptyCorpusError, DatastoreInputError) as e:
        raise APIError(400, str(e), param="documents", code="invalid_document") from None
    except IdempotencyKeyError as e:
        raise APIError(422, str(e), param="Idempotency-Key", code="idempotency_key_reused") from None
    except DatastoreBusyError as e:
        retry = str(state.settings.retry_after_s)
        raise APIError(
            503, str(e), type="server_error", code="datastore_busy", headers={"Retry-After": retry}
        ) from None
    except DatastoreError as e:
        logger.error("cannot add documents to datastore %r: %s", name, e)
        message = f"cannot add documents to datastore {name!r}: {e} (nothing was added)"
        raise APIError(500, message, type="server_error") from None
    content = {
        "object": "datastore.documents",
        "id": name,
        "added": {"num_documents": added.num_documents, "num_tokens": added.num_tokens},
        "datastore": {"id": name, "object": "datastore", **_sizes(added.info)},
    }
    return JSONResponse(content, headers={"Idempotent-Replayed": "true"} if added.replayed else None)
