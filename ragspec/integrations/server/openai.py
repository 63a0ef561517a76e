"""OpenAI's API: ``GET /v1/models``, ``POST /v1/completions`` and ``POST
/v1/chat/completions`` (``stream`` as server-sent events, ``[DONE]`` last).

Each handler is a module-level function on :data:`router` (mounted under ``/v1`` by
:func:`.app.create_app`): it admits and reads the request (:class:`.generation.Generation`),
checks the model and the datastore it names, builds its
:class:`~ragspec.params.RequestParams` (:func:`.prepare.request_params`), prepares its token
ids off the event loop (:mod:`.prepare`), and answers from the chunks the worker's
``Engine.step`` produces: ``n`` choices (``choices[i]``, streamed as they come), each with
its ``logprobs`` where asked (:mod:`.logprobs`), the ``usage`` of all of them (the prompt
once), and the request's drafting statistics under ``metrics.speculative_decoding``
(vLLM's per-request names). With ``smooth_streaming`` (or the server's
``--smooth-streaming``) a step's run of accepted tokens is sent one token per event.
Structured outputs (``response_format``, ``structured_outputs``, ``tools``) are read by
:mod:`.structured`; a chat's tool calls come back as OpenAI's ``tool_calls``.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Callable, Optional, Union

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from ragspec.params import RequestParams
from ragspec.types import GenerationStats, StreamChunk

from ..logprobs import TokenTexts, chat_logprobs, completion_logprobs, shown_entries
from ..schemas import ChatCompletionRequest, CompletionRequest
from .errors import APIError
from .generation import Generation
from .prepare import prepare_chat, prepare_completion, request_params
from .responses import (
    collect_choices_and_close,
    finish_reason,
    merge_stats,
    metrics,
    per_token,
    stats_dict,
    stream_choice_events,
    usage,
)
from .state import ServerState, check_datastore, check_model, server_state
from .structured import ChatTools, chat_messages, output_constraint

__all__ = ["router", "models", "completions", "chat_completions", "COMPLETIONS_DEFAULT_MAX_TOKENS"]

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

router = APIRouter()
"""The OpenAI endpoints, without the ``/v1`` prefix (the app adds it)."""

State = Annotated[ServerState, Depends(server_state)]


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


class _Answer:
    """What one response needs to turn a request's chunks into OpenAI's choices: its
    parameters, the token texts of its logprobs, each choice's running state (stats, text
    length so far) while streaming."""

    def __init__(
        self, state: ServerState, params: RequestParams, body: Union[CompletionRequest, ChatCompletionRequest]
    ):
        self.params = params
        self.eos = state.engine.eos_token_ids
        # token texts of the log-probabilities (the tokenizer only touched where asked)
        self.texts = TokenTexts(state.engine.tokenizer) if params.logprobs else None
        self.smooth = state.settings.smooth_streaming if body.smooth_streaming is None else body.smooth_streaming
        self.with_usage = bool(body.stream_options and body.stream_options.include_usage)
        policy = state.engine.policy.max_draft_tokens
        cap = params.max_draft_tokens
        self.draft_tokens = (policy if cap is None else min(policy, cap)) if params.drafts else 0
        self.stats: list[Optional[GenerationStats]] = [None] * params.n
        self.offsets = [0] * params.n  # completions: characters of each choice's text sent so far

    def parts(self, chunk: StreamChunk) -> list[StreamChunk]:
        """The chunk as its events' chunks (one per token with smooth streaming)."""
        return per_token(chunk) if self.smooth else [chunk]

    def finished(self, index: int, chunk: StreamChunk) -> bool:
        """Record a choice's final chunk; True once every choice has finished."""
        self.stats[index] = chunk.stats
        return chunk.finish_reason is not None and all(s is not None for s in self.stats)

    def merged(self) -> Optional[GenerationStats]:
        return merge_stats(self.stats)

    def chat_logprobs(self, chunks: list[StreamChunk]) -> Optional[dict]:
        if self.texts is None:
            return None
        return chat_logprobs([e for c in chunks for e in shown_entries(c, self.eos)], self.texts)

    def completion_logprobs(self, index: int, chunks: list[StreamChunk]) -> Optional[dict]:
        if self.texts is None:
            return None
        entries = [e for c in chunks for e in shown_entries(c, self.eos)]
        out = completion_logprobs(entries, self.texts, [t for c in chunks for t in c.token_texts], self.offsets[index])
        self.offsets[index] += sum(len(c.text) for c in chunks)
        return out

    def whole(self, envelope: Callable[..., dict], choices: list[dict], chunks: list[list[StreamChunk]]) -> dict:
        """The non-streamed response: ``choices`` with the usage, stats and metrics of all."""
        for i, cs in enumerate(chunks):
            self.stats[i] = cs[-1].stats if cs else None
        stats = self.merged()
        out = envelope(choices, usage(stats))
        out["stats"] = stats_dict(stats)
        out["metrics"] = metrics(stats, self.draft_tokens)
        return out

    def closing(self, envelope: Callable[..., dict], last: dict) -> list[dict]:
        """The events after every choice finished: ``metrics`` on the usage chunk (when
        asked for), else on ``last``, the final choice's last event."""
        stats = self.merged()
        if not self.with_usage:
            last["metrics"] = metrics(stats, self.draft_tokens)
            return []
        tail = envelope([], usage(stats))
        tail["metrics"] = metrics(stats, self.draft_tokens)
        return [tail]


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
    """OpenAI's completions: one prompt (text or token ids), its `n` continuations whole,
    or `text_completion` server-sent events with `stream` (`[DONE]` last)."""
    gen = Generation(request, state, "/v1/completions")
    with gen.closing_on_error():
        body = await gen.read(CompletionRequest)
        check_model(state, body.model)
        fmt, _ = output_constraint(body, state.engine)
        params = request_params(
            body, COMPLETIONS_DEFAULT_MAX_TOKENS, state.settings, gen.cache_salt(body.cache_salt), fmt
        )
        check_datastore(state, body.datastore)
        prompt = _completion_prompt(body.prompt)
        engine, limits = state.engine, gen.limits
        await gen.start(lambda cancel: prepare_completion(engine, prompt, params, limits, cancel), params)
    rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    answer = _Answer(state, params, body)

    def envelope(choices: list[dict], usage_: Optional[dict] = None) -> dict[str, Any]:
        out = {"id": rid, "object": "text_completion", "created": created, "model": name, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    def choice(index: int, chunks: list[StreamChunk], reason: Optional[str]) -> dict:
        return {
            "index": index,
            "text": "".join(c.text for c in chunks),
            "logprobs": answer.completion_logprobs(index, chunks),
            "finish_reason": finish_reason(reason),
        }

    if not body.stream:
        chunks = await collect_choices_and_close(gen)
        choices = [choice(i, cs, cs[-1].finish_reason if cs else "stop") for i, cs in enumerate(chunks)]
        return answer.whole(envelope, choices, chunks)

    def events(index: int, chunk: StreamChunk) -> list[dict]:
        out = [envelope([choice(index, [part], part.finish_reason)]) for part in answer.parts(chunk)]
        if chunk.finish_reason is not None and answer.finished(index, chunk):
            out += answer.closing(envelope, out[-1])
        return out

    return stream_choice_events(gen, events)


# ---------------------------------------------------------------------- /v1/chat/completions
@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request, state: State) -> Union[dict, StreamingResponse]:
    """OpenAI's chat completions through the model's chat template: the `n` replies whole,
    or `chat.completion.chunk` server-sent events with `stream` (`[DONE]` last)."""
    gen = Generation(request, state, "/v1/chat/completions")
    with gen.closing_on_error():
        body = await gen.read(ChatCompletionRequest)
        check_model(state, body.model)
        fmt, plan = output_constraint(body, state.engine)
        params = request_params(
            body, state.settings.default_max_tokens, state.settings, gen.cache_salt(body.cache_salt), fmt
        )
        check_datastore(state, body.datastore)
        try:
            messages = chat_messages(body.messages, show_tools=plan is not None and plan.show_tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        engine, limits = state.engine, gen.limits
        await gen.start(lambda cancel: prepare_chat(engine, messages, params, limits, cancel, plan), params)
    rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.model_name
    answer = _Answer(state, params, body)
    tools = ChatTools(plan, params.n) if plan is not None else None

    def envelope(choices: list[dict], usage_: Optional[dict] = None, obj: str = "chat.completion.chunk") -> dict:
        out = {"id": rid, "object": obj, "created": created, "model": name, "choices": choices}
        if usage_ is not None:
            out["usage"] = usage_
        return out

    if not body.stream:
        chunks = await collect_choices_and_close(gen)
        choices = []
        for i, cs in enumerate(chunks):
            text, reason = "".join(c.text for c in cs), cs[-1].finish_reason if cs else "stop"
            message: dict[str, Any] = {"role": "assistant", "content": text}
            shown = finish_reason(reason)
            if tools is not None:
                message, shown = tools.message(text, reason)
            choices.append(
                {"index": i, "message": message, "logprobs": answer.chat_logprobs(cs), "finish_reason": shown}
            )
        return answer.whole(lambda c, u: envelope(c, u, "chat.completion"), choices, chunks)
    first = [
        envelope([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
        for i in range(params.n)
    ]
    held: list[list[StreamChunk]] = [[] for _ in range(params.n)]  # pieces sent no event yet (tools)

    def events(index: int, chunk: StreamChunk) -> list[dict]:
        out = []
        for part in answer.parts(chunk):
            if tools is not None:
                held[index].append(part)

                def emit(delta: dict, reason: Optional[str], first: bool, waiting: list = held[index]) -> dict:
                    # the first event after pieces that sent none carries their log-probabilities
                    logprobs = answer.chat_logprobs(waiting) if first else None
                    if first:
                        waiting.clear()
                    return envelope([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}])

                out += tools.events(index, part.text, part.finish_reason, emit)
                continue
            delta = {"content": part.text} if part.text or part.finish_reason is None else {}
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": answer.chat_logprobs([part]),
                "finish_reason": finish_reason(part.finish_reason),
            }
            out.append(envelope([choice]))
        if chunk.finish_reason is not None and answer.finished(index, chunk):
            out += answer.closing(envelope, out[-1])
        return out

    return stream_choice_events(gen, events, first=first)
