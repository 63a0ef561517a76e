"""The served datastores: ``GET /v1/datastores`` (the datastores requests may name, with
their sizes) and ``POST /v1/datastores/{name}/documents`` (documents added at run time).

An addition is written to the datastore's folder as ``ragspec datastore add`` writes it
(:func:`ragspec.serving.add_documents`: a new shard, then the manifest replaced atomically,
so a crash leaves the datastore as it was and a restart sees every finished addition),
with the same hygiene (an empty, binary or invalid text refuses the call with a 400 and
nothing is written). The datastore is then reopened and its engine replaced in the state:
later requests draft from the new documents, requests in flight keep the engine they
started with. One addition runs at a time (:attr:`.state.ServerState.datastore_lock`), off
the event loop; its body is at most ``--max-add-bytes`` (413 beyond; 0 turns additions off,
403). Both endpoints are behind the API key, as every ``/v1`` path.

Module-level handlers on :data:`router` (mounted under ``/v1`` by :func:`.app.create_app`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ragspec import serving
from ragspec.backend.threads import release_openmp_pool
from ragspec.datastore import DatastoreInfo
from ragspec.engine import Engine
from ragspec.errors import DatastoreError, DatastoreInputError, EmptyCorpusError

from ..schemas import AddDocumentsRequest
from .errors import APIError
from .middleware import read_body
from .state import ServerState, server_state
from .validation import validate_body

logger = logging.getLogger(__name__)

__all__ = ["router", "list_datastores", "add_documents", "DEFAULT_SOURCE"]

DEFAULT_SOURCE = "api"
"""The source recorded for documents added without a ``source``."""

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


def _entry(name: str, engine: Engine, default: bool) -> dict:
    """One datastore of ``GET /v1/datastores``: its name, whether requests naming none use
    it, and the sizes of the copy its engine serves."""
    ds = engine.datastore
    sizes = _sizes(ds.info()) if ds is not None else {}
    return {"id": name, "object": "datastore", "default": default, **sizes}


@router.get("/datastores")
async def list_datastores(state: State) -> dict:
    """The datastores requests may name (`datastore`), each with its size as served:
    `num_documents`, `num_tokens`, `num_bytes` (on disk), `num_shards`; the first is the
    default of requests that name none."""
    engines = list(state.engines.items())
    data = await asyncio.to_thread(lambda: [_entry(n, e, i == 0) for i, (n, e) in enumerate(engines)])
    return {"object": "list", "data": data}


@router.post("/datastores/{name}/documents")
async def add_documents(name: str, request: Request, state: State) -> dict:
    """Add `documents` (texts, one document each) to the served datastore `name`: written
    atomically to its folder, drafted from by the requests that start after this call
    returns. Answers the documents and tokens added and the datastore's new size."""
    limit = state.settings.max_add_bytes
    if limit == 0:
        raise APIError(
            403,
            "adding documents at run time is off on this server (--max-add-bytes 0)",
            type="permission_error",
            code="datastore_additions_off",
        )
    if name not in state.engines:
        names = sorted(state.engines)
        raise APIError(
            404,
            f"unknown datastore {name!r}: this server has {names if names else 'none'}",
            type="not_found_error",
            param="name",
            code="datastore_not_found",
        )
    raw = await read_body(request, limit, lambda: None, option="--max-add-bytes")
    body = await asyncio.to_thread(validate_body, AddDocumentsRequest, raw, state.limits.json_values)
    texts, source = body.documents, body.source or DEFAULT_SOURCE

    def add() -> tuple[DatastoreInfo, int]:
        try:
            with state.datastore_lock:
                engine = state.engines[name]  # the latest: an earlier addition may have replaced it
                before = engine.datastore.num_tokens if engine.datastore is not None else 0
                new, info = serving.add_documents(engine, texts, source=source)
                state.engines[name] = new  # the same key: the dict's order (the default) is kept
                return info, before
        finally:
            release_openmp_pool()  # only the worker keeps a pool (ragspec.backend.threads)

    try:
        info, before = await asyncio.to_thread(add)
    except (EmptyCorpusError, DatastoreInputError) as e:
        raise APIError(400, str(e), param="documents", code="invalid_document") from None
    except DatastoreError as e:
        logger.error("cannot add documents to datastore %r: %s", name, e)
        raise APIError(500, f"cannot add documents to datastore {name!r}: {e}", type="server_error") from None
    return {
        "object": "datastore.documents",
        "id": name,
        "added": {"num_documents": len(texts), "num_tokens": info.num_tokens - before},
        "datastore": {"id": name, "object": "datastore", **_sizes(info)},
    }
