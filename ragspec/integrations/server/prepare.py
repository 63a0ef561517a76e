"""A request's parameters and token ids, prepared before the worker sees it.

:func:`request_params` is the server's builder of a request's
:class:`~ragspec.params.RequestParams` from its body (the settings' defaults where it gives
none). The ``prepare_*`` functions run in the prepare pool (never on the event loop, never
on the worker); the size checks come first, so no request costs more than its limits allow:
characters are counted against the limits (400 without tokenizing), then the texts are
tokenized (:meth:`ragspec.Engine.prepare`: the request's documents laid in for the model)
and the prompt checked against the context length. Each takes ``cancel`` (set when the
client leaves) and stops before tokenizing once it is set.
"""

from __future__ import annotations

import re
import threading
from typing import Any, Mapping, Optional, Sequence, Union

from ragspec.engine import Engine
from ragspec.errors import ConfigError, PromptTooLongError
from ragspec.params import RequestParams
from ragspec.prompts import PreparedPrompt, grounded_text
from ragspec.structured import ResponseFormat

from ..schemas import ChatCompletionRequest, CompletionRequest, SummarizeRequest, unsupported
from ..settings import RequestLimits, ServerSettings
from ..tools import ToolPlan
from .errors import APIError
from .structured import check_tools

__all__ = [
    "SUMMARY_INSTRUCTION",
    "Prepared",
    "Cancelled",
    "build_summary_prompt",
    "request_params",
    "prepare_completion",
    "prepare_chat",
    "prepare_summary",
]

SUMMARY_INSTRUCTION = "Summarize the documents above in a few sentences."
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")

AnyBody = Union[CompletionRequest, ChatCompletionRequest, SummarizeRequest]


Prepared = PreparedPrompt
"""A request's token ids, ready for the worker (:class:`ragspec.prompts.PreparedPrompt`)."""


class Cancelled(Exception):
    """The client left while its request was being prepared."""


def build_summary_prompt(documents: Sequence[str], instruction: Optional[str] = None) -> str:
    """The summary prompt (as ``ragspec summarize``): the documents in ragspec's default
    layout (:func:`ragspec.prompts.grounded_text`: numbered), then the instruction."""
    return grounded_text(documents, instruction or SUMMARY_INSTRUCTION)


def _logit_bias(value: Optional[Mapping[str, float]]) -> Optional[dict[int, float]]:
    """OpenAI's ``logit_bias`` (token id as a string -> bias) with integer ids. A key is a
    token id written as JSON writes an integer (``"5"``; not ``" 5"``, ``"+5"`` or ``"05"``),
    so two keys never name one token.

    Raises:
        APIError: 400 (``invalid_logit_bias``) for a key that is not a token id so written.
    """
    if not value:
        return None
    for k in value:
        if not _TOKEN_ID.fullmatch(k):
            raise APIError(
                400,
                f'logit_bias keys must be token ids written as integers ("5", not " 5", "+5" or "05"), got {k[:40]!r}',
                param="logit_bias",
                code="invalid_logit_bias",
            )
    return {int(k): float(v) for k, v in value.items()}


def _logprobs(body: AnyBody) -> tuple[bool, int]:
    """``(logprobs, top_logprobs)`` of a body: chat's boolean and ``top_logprobs``, or
    completions' count of top log-probabilities (0: the chosen token's only)."""
    value = getattr(body, "logprobs", None)
    top = getattr(body, "top_logprobs", None) or 0
    if isinstance(value, bool) or value is None:
        return bool(value), top
    return True, value


def _check_choices(n: int, max_tokens: int, settings: ServerSettings) -> None:
    """``n`` within the server's limits (``max_n``, ``max_choice_tokens``).

    Raises:
        APIError: 400 naming ``n``.
    """
    if n > settings.max_n:
        raise APIError(400, f"n={n} is over this server's limit of {settings.max_n} (--max-n)", param="n")
    if n > 1 and n * max_tokens > settings.max_choice_tokens:  # one choice: the context bounds it
        raise APIError(
            400,
            f"n={n} choices of max_tokens={max_tokens} ask for {n * max_tokens} tokens, over this server's limit of "
            f"{settings.max_choice_tokens} (--max-choice-tokens)",
            param="n",
        )


def request_params(
    body: AnyBody,
    default_max_tokens: int,
    settings: ServerSettings,
    cache_salt: str = "",
    response_format: Optional[ResponseFormat] = None,
) -> RequestParams:
    """The :class:`~ragspec.params.RequestParams` a body asks for, the settings' defaults
    where it gives none; ``cache_salt``: the request's partition
    (:func:`.admission.cache_salt`); ``response_format``: the constraint its structured-output
    fields ask for (:func:`.structured.output_constraint`). A summary's documents are its
    prompt's input (:func:`prepare_summary`), not grounding of another prompt.

    Raises:
        APIError: 400 for an OpenAI parameter ragspec does not support, or ``n`` over the
            server's limits.
        ConfigError: a value out of range (InvalidParameterError: 400 with its ``param``);
            UnsupportedParameterError (400 with its ``param``): a field the engine does not
            implement yet.
    """
    bad = unsupported(body)
    if bad is not None:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max_tokens
    logprobs, top_logprobs = _logprobs(body)
    n = getattr(body, "n", None) or 1
    _check_choices(n, max_tokens, settings)
    return RequestParams(
        max_new_tokens=max_tokens,
        stop=body.stop or (),
        documents=() if isinstance(body, SummarizeRequest) else (body.documents or ()),
        speculative=settings.speculative if body.speculative is None else body.speculative,
        max_draft_tokens=body.max_draft_tokens,
        temperature=settings.default_temperature if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        datastore=body.datastore,
        cache_salt=cache_salt,
        response_format=response_format,
        **_sampling_fields(body, n, logprobs, top_logprobs),
    )


def _sampling_fields(body: AnyBody, n: int, logprobs: bool, top_logprobs: int) -> dict[str, Any]:
    """The sampling parameters of an OpenAI body as ``RequestParams`` fields (a summary
    body has none: the defaults)."""
    fields: dict[str, Any] = dict(
        n=n,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=getattr(body, "presence_penalty", None) or 0.0,
        frequency_penalty=getattr(body, "frequency_penalty", None) or 0.0,
        repetition_penalty=getattr(body, "repetition_penalty", None) or 1.0,
        min_tokens=getattr(body, "min_tokens", None) or 0,
        min_p=getattr(body, "min_p", None) or 0.0,
        logit_bias=_logit_bias(getattr(body, "logit_bias", None)),
    )
    mode = getattr(body, "logprobs_mode", None)
    if mode is not None:
        fields["logprobs_mode"] = mode
    return fields


def _check_chars(n: int, limit: int, what: str, param: str, engine: Engine) -> None:
    if n > limit:
        ctx = engine.target.max_length
        why = f"cannot fit the context of {ctx} tokens: " if ctx else ""
        raise APIError(
            400,
            f"{what} of {n:,} characters {why}at most {limit:,} characters are accepted (--max-prompt-chars)",
            param=param,
            code="context_length_exceeded",
        )


def _check_documents(documents: Optional[Sequence[str]], limits: RequestLimits) -> None:
    total = sum(len(d) for d in documents or ())
    if total > limits.document_chars:
        raise APIError(
            400,
            f"documents of {total:,} characters in all are over the limit of {limits.document_chars:,} "
            "(--max-document-chars)",
            param="documents",
            code="documents_too_long",
        )


def _check_fits(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    limit = engine.target.max_length
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens + max_tokens {max_new_tokens} exceeds the context length of "
            f"{limit} tokens"
        )


def prepare_completion(
    engine: Engine,
    prompt: Union[str, list[int]],
    params: RequestParams,
    limits: RequestLimits,
    cancel: threading.Event,
) -> PreparedPrompt:
    """Token ids of a completion's prompt (text, with the request's documents laid before
    it; or ids checked against the vocabulary) and of the drafter's documents.

    Raises:
        APIError: 400 for a prompt or documents over the limits, an id out of the
            vocabulary, or documents with a prompt of token ids (they cannot be laid in).
        PromptTooLongError: the prompt and ``max_new_tokens`` do not fit the context.
        Cancelled: ``cancel`` was set.
    """
    if isinstance(prompt, str):
        _check_chars(len(prompt), limits.prompt_chars, "prompt", "prompt", engine)
    else:
        if params.documents:
            raise APIError(
                400,
                "documents are read by the model, and a prompt of token ids cannot take them: send the prompt as text",
                param="documents",
            )
        _check_fits(engine, prompt, params.max_new_tokens)  # before looking at every id
        vocab = engine.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    _check_documents(params.documents, limits)
    if cancel.is_set():
        raise Cancelled()
    prepared = engine.prepare(prompt, params, chat=False)
    _check_fits(engine, prepared.prompt_ids, params.max_new_tokens)
    return prepared


def prepare_chat(
    engine: Engine,
    messages: list[dict],
    params: RequestParams,
    limits: RequestLimits,
    cancel: threading.Event,
    tools: Optional[ToolPlan] = None,
) -> PreparedPrompt:
    """Token ids of a chat (``messages``: ``{"role", "content"}`` dicts) through the
    model's chat template, the request's documents laid in (the template's documents, or
    before the last user message: :mod:`ragspec.prompts`), its ``tools`` shown where the
    plan says so (their schemas compiled first, one by one), and of the drafter's documents.

    Raises:
        APIError: 400 for messages or documents over the limits.
        StructuredOutputError: a tool's schema or the request's constraint does not compile.
        ConfigError: the model has no chat template.
        PromptTooLongError: the prompt and ``max_new_tokens`` do not fit the context.
        Cancelled: ``cancel`` was set.
    """
    _check_chars(sum(len(m["content"]) for m in messages), limits.prompt_chars, "messages", "messages", engine)
    _check_documents(params.documents, limits)
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template: use /v1/completions")
    if cancel.is_set():
        raise Cancelled()
    check_tools(engine, tools)
    prepared = engine.prepare(messages, params, tools=tools.definitions() if tools and tools.show_tools else ())
    _check_fits(engine, prepared.prompt_ids, params.max_new_tokens)
    return prepared


def prepare_summary(
    engine: Engine,
    documents: list[str],
    instruction: Optional[str],
    params: RequestParams,
    limits: RequestLimits,
    cancel: threading.Event,
) -> PreparedPrompt:
    """Token ids of the summary prompt (the documents are in it, chat-templated; see
    :func:`build_summary_prompt`).

    Raises:
        APIError: 400 for documents and instruction over the prompt limit.
        PromptTooLongError: the prompt and ``max_new_tokens`` do not fit the context.
        Cancelled: ``cancel`` was set.
    """
    total = sum(len(d) for d in documents) + len(instruction or "")
    _check_chars(total, limits.prompt_chars, "documents and instruction", "documents", engine)
    if cancel.is_set():
        raise Cancelled()
    prepared = engine.prepare(build_summary_prompt(documents, instruction), params, chat=True)
    _check_fits(engine, prepared.prompt_ids, params.max_new_tokens)
    return prepared
