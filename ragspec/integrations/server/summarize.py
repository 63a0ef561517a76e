"""``POST /v1/summarize``: a summary of the request's documents, whole or as server-sent
events (``summary.chunk``, ``[DONE]`` last).

The handler is a module-level function on :data:`router` (mounted under ``/v1`` by
:func:`.app.create_app`). The documents go into the prompt (:func:`.prepare.build_summary_prompt`,
chat-templated), where prompt lookup copies from them; the same layout puts a chat's or a
completion's ``documents`` before its prompt where the chat template takes none
(:mod:`ragspec.prompts`). A ``response_format`` shapes the summary (e.g. a JSON list of
findings, each with the index of the document it comes from).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ragspec.types import StreamChunk

from ..schemas import SummarizeRequest
from .generation import Generation
from .prepare import prepare_summary, request_params
from .responses import collect_and_close, finish_reason, stats_dict, stream_events, usage
from .state import ServerState, check_datastore, check_model, server_state
from .structured import output_constraint

__all__ = ["router", "summarize"]

router = APIRouter()
"""The summary endpoint, without the ``/v1`` prefix (the app adds it)."""


@router.post("/summarize", response_model=None)
async def summarize(
    request: Request, state: Annotated[ServerState, Depends(server_state)]
) -> Union[dict, StreamingResponse]:
    """A summary of `documents` (as `instruction` asks, if given): whole, or `summary.chunk`
    server-sent events with `stream` (`[DONE]` last)."""
    gen = Generation(request, state, "/v1/summarize")
    with gen.closing_on_error():
        body = await gen.read(SummarizeRequest)
        check_model(state, body.model)
        # the documents are the prompt's input: prompt lookup copies from them already
        fmt, _ = output_constraint(body, state.engine)
        params = request_params(
            body, state.settings.default_max_tokens, state.settings, gen.cache_salt(body.cache_salt), fmt
        )
        check_datastore(state, body.datastore)
        engine, limits = state.engine, gen.limits
        docs, instruction = body.documents, body.instruction
        await gen.start(lambda cancel: prepare_summary(engine, docs, instruction, params, limits, cancel), params)
    rid, created, name = f"sum-{uuid.uuid4().hex}", int(time.time()), state.model_name
    if not body.stream:
        text, last = await collect_and_close(gen)
        stats = last.stats if last else None
        return {
            "id": rid,
            "object": "summary",
            "created": created,
            "model": name,
            "summary": text,
            "finish_reason": finish_reason(last.finish_reason if last else "stop"),
            "usage": usage(stats),
            "stats": stats_dict(stats),
        }

    def events(chunk: StreamChunk) -> list[dict]:
        out = {"id": rid, "object": "summary.chunk", "created": created, "model": name, "summary": chunk.text}
        if chunk.finish_reason is not None:
            out["finish_reason"] = finish_reason(chunk.finish_reason)
            out["usage"] = usage(chunk.stats)
            out["stats"] = stats_dict(chunk.stats)
        return [out]

    return stream_events(gen, events)
