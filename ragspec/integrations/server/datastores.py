"""The served datastores: ``GET /v1/datastores`` (the datastores requests may name, with
their sizes) and ``POST /v1/datastores/{name}/documents`` (documents added at run time).

An addition is written to the datastore's folder as ``ragspec datastore add`` writes it
(:func:`ragspec.serving.add_to_datastore`: a new shard, then the manifest replaced
atomically, so a crash leaves the datastore as it was and a restart sees every finished
addition), with the same hygiene (an empty, binary or invalid text refuses the call with a
400 and nothing is written). The datastore is then reopened and swapped in the served
engine (:func:`ragspec.serving.reopen_datastore`): later requests draft from the new
documents, requests in flight keep drafting from it as it was. One addition runs at a time (:attr:`.state.ServerState.datastore_lock`), off
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
from ragspec.datastore import Datastore, DatastoreInfo
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


def _entry(name: str, datastore: Datastore, default: bool) -> dict:
    """One datastore of ``GET /v1/datastores``: its name, whether requests naming none use
    it, and the sizes of the copy served."""
    return {"id": name, "object": "datastore", "default": default, **_sizes(datastore.info())}


@router.get("/datastores")
async def list_datastores(state: State) -> dict:
    """The datastores requests may name (`datastore`), each with its size as served:
    `num_documents`, `num_tokens`, `num_bytes` (on disk), `num_shards`; the first is the
    default of requests that name none."""
    engine = state.engine
    served = list(engine.datastores.items())
    default = engine.default_datastore
    data = await asyncio.to_thread(lambda: [_entry(n, ds, n == default) for n, ds in served])
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
    if name not in state.engine.datastores:
        names = sorted(state.engine.datastores)
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
                before = state.engine.datastores[name].num_tokens  # the latest: an earlier addition may have swapped it
                info = serving.add_to_datastore(state.engine, name, texts, source=source)
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
