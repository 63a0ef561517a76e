"""A request's generation arguments and token ids, prepared before the worker sees it.

The ``prepare_*`` functions run in the prepare pool (never on the event loop, never on the
worker); the size checks come first, so no request costs more than its limits allow:
characters are counted against the limits (400 without tokenizing), then the texts are
tokenized and the prompt checked against the context length. Each takes ``cancel`` (set
when the client leaves) and stops before tokenizing once it is set.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from ragspec.engine import Engine
from ragspec.errors import ConfigError, PromptTooLongError

from ..schemas import ChatCompletionRequest, CompletionRequest, SummarizeRequest, unsupported
from ..settings import RequestLimits, ServerSettings
from .errors import APIError

__all__ = [
    "SUMMARY_INSTRUCTION",
    "Prepared",
    "Cancelled",
    "build_summary_prompt",
    "engine_kwargs",
    "prepare_completion",
    "prepare_chat",
    "prepare_summary",
]

SUMMARY_INSTRUCTION = "Summarize the documents above in a few sentences."

AnyBody = Union[CompletionRequest, ChatCompletionRequest, SummarizeRequest]


@dataclass(frozen=True)
class Prepared:
    """A request's token ids, ready for the worker."""

    prompt_ids: list[int]
    document_ids: list[list[int]]


class Cancelled(Exception):
    """The client left while its request was being prepared."""


def build_summary_prompt(documents: list[str], instruction: Optional[str] = None) -> str:
    """The summary prompt (as ``ragspec summarize``): numbered documents, then the
    instruction."""
    body = "\n\n".join(f"Document {i + 1}:\n{d.strip()}" for i, d in enumerate(documents))
    return body + "\n\n" + (instruction or SUMMARY_INSTRUCTION)


def engine_kwargs(body: AnyBody, default_max_tokens: int, settings: ServerSettings) -> dict[str, Any]:
    """The keyword arguments of :meth:`ragspec.Engine.request` a body asks for (plus
    ``documents``: texts, tokenized by the ``prepare_*`` functions), the settings' defaults
    where it gives none.

    Raises:
        APIError: 400 for an OpenAI parameter ragspec does not support.
    """
    bad = unsupported(body)
    if bad is not None:
        raise APIError(400, bad[1], param=bad[0], code="unsupported_parameter")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or default_max_tokens
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return dict(
        max_new_tokens=max_tokens,
        stop=stop or None,
        documents=getattr(body, "documents", None) or None,
        speculative=settings.speculative if body.speculative is None else body.speculative,
        max_draft_tokens=body.max_draft_tokens,
        temperature=settings.default_temperature if body.temperature is None else body.temperature,
        top_k=body.top_k or 0,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        cache_salt=body.cache_salt,
    )


def _context_of(engine: Engine) -> Optional[int]:
    return engine.target.max_length


def _check_chars(n: int, limit: int, what: str, param: str, engine: Engine) -> None:
    if n > limit:
        ctx = _context_of(engine)
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


def _encode_documents(engine: Engine, documents: Optional[Sequence[str]], cancel: threading.Event) -> list[list[int]]:
    if not documents:
        return []
    if cancel.is_set():
        raise Cancelled()
    return [list(ids) for ids in engine.tokenizer(list(documents), add_special_tokens=False)["input_ids"]]


def _check_fits(engine: Engine, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
    limit = _context_of(engine)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise PromptTooLongError(
            f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds the context length of "
            f"{limit} tokens"
        )


def prepare_completion(
    engine: Engine,
    prompt: Union[str, list[int]],
    kwargs: dict[str, Any],
    limits: RequestLimits,
    cancel: threading.Event,
) -> Prepared:
    """Token ids of a completion's prompt (text, or ids checked against the vocabulary).

    Raises:
        APIError: 400 for a prompt or documents over the limits, or an id out of the
            vocabulary.
        PromptTooLongError: the prompt and ``max_new_tokens`` do not fit the context.
        Cancelled: ``cancel`` was set.
    """
    documents = kwargs.get("documents")
    if isinstance(prompt, str):
        _check_chars(len(prompt), limits.prompt_chars, "prompt", "prompt", engine)
    else:
        _check_fits(engine, prompt, kwargs["max_new_tokens"])  # before looking at every id
        vocab = engine.target.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="prompt")
    _check_documents(documents, limits)
    if cancel.is_set():
        raise Cancelled()
    ids = engine.encode_prompt(prompt, chat=False)
    _check_fits(engine, ids, kwargs["max_new_tokens"])
    return Prepared(ids, _encode_documents(engine, documents, cancel))


def prepare_chat(
    engine: Engine, messages: list[dict], kwargs: dict[str, Any], limits: RequestLimits, cancel: threading.Event
) -> Prepared:
    """Token ids of a chat (``messages``: ``{"role", "content"}`` dicts) through the
    model's chat template.

    Raises:
        APIError: 400 for messages or documents over the limits.
        ConfigError: the model has no chat template.
        PromptTooLongError: the prompt and ``max_new_tokens`` do not fit the context.
        Cancelled: ``cancel`` was set.
    """
    _check_chars(sum(len(m["content"]) for m in messages), limits.prompt_chars, "messages", "messages", engine)
    documents = kwargs.get("documents")
    _check_documents(documents, limits)
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template: use /v1/completions")
    if cancel.is_set():
        raise Cancelled()
    ids = engine.encode_messages(messages)
    _check_fits(engine, ids, kwargs["max_new_tokens"])
    return Prepared(ids, _encode_documents(engine, documents, cancel))


def prepare_summary(
    engine: Engine,
    documents: list[str],
    instruction: Optional[str],
    kwargs: dict[str, Any],
    limits: RequestLimits,
    cancel: threading.Event,
) -> Prepared:
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
    ids = engine.encode_prompt(build_summary_prompt(documents, instruction), chat=True)
    _check_fits(engine, ids, kwargs["max_new_tokens"])
    return Prepared(ids, [])
