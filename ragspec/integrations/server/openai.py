"""OpenAI's API: ``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (``stream`` as server-sent events, ``[DONE]`` last).

Each handler is a module-level function on :data:`router` (mounted under ``/v1`` by
:func:`.app.create_app`): it admits and reads the request (:class:`.generation.Generation`),
checks the model and the datastore it names, builds its
:class:`~ragspec.params.RequestParams` (:func:`.prepare.request_params`), prepares its token
ids off the event loop (:mod:`.prepare`), and answers from the chunks the worker's
``Engine.step`` produces.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ragspec.types import StreamChunk

from ..schemas import ChatCompletionRequest, CompletionRequest
from .errors import APIError
from .generation import Generation
from .prepare import prepare_chat, prepare_completion, request_params
from .responses import collect_and_close, finish_reason, stats_dict, stream_events, usage
from .state import ServerState, check_datastore, check_model, server_state

__all__ = ["router", "models", "completions", "chat_completions", "COMPLETIONS_DEFAULT_MAX_TOKENS"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()
"""The OpenAI endpoints, without the ``/v1`` prefix (the app adds it)."""

State = Annotated[ServerState, Depends(server_state)]


def _include_usage(body: Union[CompletionRequest, ChatCompletionRequest]) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


@router.get("/models")
async def models(state: State) -> dict:
    """The served model, with the datastores requests may name and its default drafting."""
    return {
        "object": "list",
        "data": [
            {
                "id": state.model_name,
                "object": "model",
                "created": state.started,
                "owned_by": "ragspec",
                "datastores": sorted(state.engine.datastores),
                # the default for requests that do not set "speculative"
                "drafting": state.engine.drafting if state.settings.speculative else "off",
            }
        ],
    }


# ---------------------------------------------------------------------- /v1/completions
def _completion_prompt(prompt: Union[str, list[str], list[int]]) -> Union[str, list[int]]:
    """One prompt: a text, or token ids.

    Raises:
        APIError: 400 for several prompts, or none.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        return prompt[0]
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return prompt  # type: ignore[return-value]  # str, or a non-empty list of ints


@router.post("/completions", response_model=None)
async def completions(request: Request, state: State) -> Union[dict, StreamingResponse]:
    """OpenAI's completions: one prompt (text or token ids), its continuation whole, or
    `text_completion` server-sent events with `stream` (`[DONE]` last)."""
    gen = Generation(request, state, "/v1/completions")
    with gen.closing_on_error():
        body = await gen.read(CompletionRequest)
        check_model(state, body.model)
        params = request_params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, state.settings, gen.cache_salt(body.cache_salt))
        check_datastore(state, body.datastore)
        prompt = _completion_prompt(body.prompt)
        engine, limits = state.engine, gen.limits
        await gen.start(lambda cancel: prepare_completion(engine, prompt, params, limits, cancel), params)
    rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

    def envelope(choices: list[dict], usage_: Optional[dict] = None) -> dict[str, Any]:
        out = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    if not body.stream:
        text, last = await collect_and_close(gen)
        stats = last.stats if last else None
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason(last.finish_reason if last else "stop"),
        }
        out = envelope([choice], usage(stats))
        out["stats"] = stats_dict(stats)
        return out
    with_usage = _include_usage(body)

    def events(chunk: StreamChunk) -> list[dict]:
        choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": finish_reason(chunk.finish_reason)}
        out = [envelope([choice], None)]
        if chunk.finish_reason is not None and with_usage:
            out.append(envelope([], usage(chunk.stats)))
        return out

    return stream_events(gen, events)


# ---------------------------------------------------------------------- /v1/chat/completions
@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request, state: State) -> Union[dict, StreamingResponse]:
    """OpenAI's chat completions through the model's chat template: the reply whole, or
    `chat.completion.chunk` server-sent events with `stream` (`[DONE]` last)."""
    gen = Generation(request, state, "/v1/chat/completions")
    with gen.closing_on_error():
        body = await gen.read(ChatCompletionRequest)
        check_model(state, body.model)
        params = request_params(
            body, state.settings.default_max_tokens, state.settings, gen.cache_salt(body.cache_salt)
        )
        check_datastore(state, body.datastore)
        try:
            messages = [
                {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages
            ]
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        engine, limits = state.engine, gen.limits
        await gen.start(lambda cancel: prepare_chat(engine, messages, params, limits, cancel), params)
    rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name

    def envelope(obj: str, choices: list[dict], usage_: Optional[dict] = None) -> dict[str, Any]:
        out = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    if not body.stream:
        text, last = await collect_and_close(gen)
        stats = last.stats if last else None
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason(last.finish_reason if last else "stop"),
        }
        out = envelope("chat.completion", [choice], usage(stats))
        out["stats"] = stats_dict(stats)
        return out
    with_usage = _include_usage(body)
    first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def events(chunk: StreamChunk) -> list[dict]:
        delta = {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(chunk.finish_reason)}
        out = [envelope("chat.completion.chunk", [choice])]
        if chunk.finish_reason is not None and with_usage:
            out.append(envelope("chat.completion.chunk", [], usage(chunk.stats)))
        return out

    return stream_events(gen, events, first=[envelope("chat.completion.chunk", [first])])
