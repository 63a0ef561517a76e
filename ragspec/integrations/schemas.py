"""Request bodies of the REST service (pydantic, unknown fields refused).

The OpenAI-compatible bodies accept the fields OpenAI's clients commonly send; fields that
ask for something ragspec does not do are accepted only at their neutral value and
otherwise answered with a 400 naming the field: ``echo``, ``suffix``, ``best_of``, vLLM's
``prompt_logprobs`` here (:func:`unsupported`). Anything else unknown is a 400 too.
Structured outputs: OpenAI's ``response_format`` (chat, completions, summaries), ``tools``
with ``tool_choice`` and ``parallel_tool_calls`` (chat), and vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``; chat and completions),
read by :mod:`ragspec.integrations.server.structured`.
Sampling: OpenAI's ``n``, ``logprobs``/``top_logprobs``, penalties and ``logit_bias``, and
vLLM's ``repetition_penalty``, ``min_tokens``, ``min_p``, ``logprobs_mode``.
ragspec extensions: ``top_k``, ``documents`` (texts the model reads as grounding and the
drafter copies from), ``datastore`` (by name), ``speculative`` and ``max_draft_tokens``
(this request's draft budget per step, under the server's; 0 = plain decoding),
``smooth_streaming`` (one token per event).

Types are strict: no booleans as numbers (``max_tokens: true``, ``prompt: [true]``), no
strings as booleans (``stream: "yes"``), no floats as integers. Shapes are bounded here
(:data:`MAX_DOCUMENTS`, :data:`MAX_MESSAGES`, :data:`MAX_STOP`, :data:`MAX_STOP_CHARS`,
:data:`MAX_LOGIT_BIAS`); sizes (body bytes, prompt and document characters) by the server's
:class:`~ragspec.integrations.settings.RequestLimits`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationInfo, field_validator

__all__ = [
    "StreamOptions",
    "CompletionRequest",
    "ChatMessage",
    "ChatCompletionRequest",
    "SummarizeRequest",
    "AddDocumentsRequest",
    "TokenizeRequest",
    "DetokenizeRequest",
    "unsupported",
    "MAX_DOCUMENTS",
    "MAX_MESSAGES",
    "MAX_STOP",
    "MAX_STOP_CHARS",
    "MAX_LOGIT_BIAS",
    "MAX_CONTENT_PARTS",
    "MAX_PROMPT_IDS",
    "first_unknown_field",
]

MAX_TOKENS_LIMIT = 1_000_000
"""Largest ``max_tokens`` accepted at all (the context length checks the rest)."""
MAX_DOCUMENTS = 256
"""Most ``documents`` of one request."""
MAX_MESSAGES = 256
"""Most chat ``messages`` of one request."""
MAX_STOP = 16
"""Most stop strings."""
MAX_STOP_CHARS = 1000
"""Longest stop string (characters): every committed token is matched against them."""
MAX_LOGIT_BIAS = 300
"""Most ``logit_bias`` entries (OpenAI's limit)."""
MAX_CONTENT_PARTS = 256
"""Most content parts of one chat message."""
MAX_PROMPT_IDS = 1 << 17
"""Most token ids in a prompt given as ids (the context length checks the rest)."""
MAX_TOOLS = 128
MAX_N = 128
"""Largest ``n`` the schema accepts (the server's ``--max-n`` bounds it further)."""
MAX_TOP_LOGPROBS = 20
"""Most top log-probabilities per token (OpenAI's limit)."""
MAX_ADD_DOCUMENTS = 10_000
"""Most documents one ``POST /v1/datastores/{name}/documents`` adds (its body size is
bounded by ``--max-add-bytes``)."""
MAX_DRAFT_TOKENS = 4096
"""Largest ``max_draft_tokens`` accepted (the server's own budget caps it anyway)."""
MAX_CACHE_SALT = 256
"""Most characters of a ``cache_salt``."""


def _at_most(max_length: int) -> Any:
    """The constraint of a list field (``Annotated[list[item], _at_most(n)]``): at most
    ``max_length`` items, validation stopping at the first invalid item (no error per item: a
    list of a million wrong values costs one error, not a million)."""
    return Field(max_length=max_length, fail_fast=True)


class _Body(BaseModel):
    # no NaN or Infinity (Python's json reads them; JSON has no such numbers)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _check_documents(v: Optional[list[str]]) -> Optional[list[str]]:
    """Every document non-empty (not only whitespace), as ``/v1/summarize`` and the
    datastore additions require."""
    for i, d in enumerate(v or ()):
        if not d.strip():
            raise ValueError(f"documents[{i}] is empty")
    return v


class StreamOptions(_Body):
    include_usage: Optional[bool] = None
    """Send a last chunk with ``usage`` (and ``choices: []``) before ``[DONE]``."""
    continuous_usage_stats: Optional[bool] = None
    """Accepted for vLLM clients; ignored."""


def _check_stop(v):
    if v is None:
        return v
    stops = [v] if isinstance(v, str) else list(v)
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop strings")
    if any(s == "" for s in stops):
        raise ValueError("stop strings must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
    return v


class _Sampling(_Body):
    """Fields common to the generation bodies."""

    model: Optional[str] = None
    """Served model name (None: the one model served)."""
    max_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    """Most tokens generated (None: the server's default)."""
    temperature: Optional[float] = Field(default=None, ge=0.0, le=100.0)
    """0 = greedy (None: the server's default, greedy)."""
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    """Seed of this request's own random generator (sampling only)."""
    stop: Optional[Union[StrictStr, Annotated[list[StrictStr], _at_most(MAX_STOP)]]] = None
    """Stop string(s): the text from the first match on is dropped."""
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    datastore: Optional[StrictStr] = None
    """Name of a datastore the server was started with (never a path)."""
    speculative: Optional[bool] = None
    """False: plain decoding, no drafts (None: the server's default)."""
    max_draft_tokens: Optional[int] = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    """This request's draft budget per step, under the server's (0: plain decoding)."""
    cache_salt: Optional[StrictStr] = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    """vLLM's: requests share prefix-cache and response-cache hits only with the same salt
    (and, with API keys, the same key)."""
    documents: Optional[Annotated[list[StrictStr], _at_most(MAX_DOCUMENTS)]] = None
    """Texts the model reads as grounding (the chat template's documents where it takes
    them, else before the prompt: ``Document 1:`` ...) and the drafter copies from."""
    user: Optional[str] = None
    """Accepted, ignored."""

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, v):
        return _check_stop(v)

    @field_validator("documents")
    @classmethod
    def _documents_not_empty(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        return _check_documents(v)


class _OpenAIExtras(_Body):
    """OpenAI's sampling parameters and vLLM's extensions of them (the engine's
    :class:`~ragspec.params.RequestParams` checks their values and names the field)."""

    n: Optional[int] = Field(default=None, ge=1, le=MAX_N)
    """Choices to generate (each its own sample; at most the server's ``--max-n``)."""
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: Optional[dict[str, float]] = Field(default=None, max_length=MAX_LOGIT_BIAS)
    """Token id (as a string) -> bias in [-100, 100] added to its logit."""
    # vLLM's extensions
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=100.0)
    min_tokens: Optional[int] = Field(default=None, ge=0, le=MAX_TOKENS_LIMIT)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    logprobs_mode: Optional[Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]] = None
    """What ``logprobs`` return (vLLM's names; default ``raw_logprobs``, the model's own)."""
    prompt_logprobs: Optional[int] = None
    """vLLM's: refused (see :func:`unsupported`)."""
    # ragspec's
    smooth_streaming: Optional[bool] = None
    """Stream one token per event instead of one event per step (None: the server's
    ``--smooth-streaming``)."""


class _Structured(_Body):
    """The structured-output fields of the generation bodies (their values are read and
    checked by :mod:`ragspec.integrations.server.structured`)."""

    response_format: Optional[dict[str, Any]] = None
    """OpenAI's: ``{"type": "text" | "json_object" | "json_schema", ...}`` (and ragspec's
    ``regex``, ``choice``, ``grammar`` types)."""
    structured_outputs: Optional[dict[str, Any]] = None
    """vLLM's: one of ``json`` (a schema), ``regex``, ``choice``, ``grammar``,
    ``json_object``."""


class CompletionRequest(_Sampling, _OpenAIExtras, _Structured):
    """``POST /v1/completions``."""

    prompt: Union[
        StrictStr,
        Annotated[list[StrictStr], _at_most(MAX_PROMPT_IDS)],
        Annotated[list[StrictInt], _at_most(MAX_PROMPT_IDS)],
    ]
    """Text, a list of one text, or token ids."""
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """OpenAI's legacy form: return each token's log-probability and the ``logprobs``
    likeliest tokens' (0: the token's own only)."""
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, Annotated[list[dict[str, Any]], _at_most(MAX_CONTENT_PARTS)]]] = Field(
        default=None, validate_default=True
    )
    """Text, or a list of ``{"type": "text", "text": ...}`` parts; null or absent only in
    an assistant's message (one that calls tools), as OpenAI's API."""
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[Annotated[list[dict[str, Any]], _at_most(MAX_TOOLS)]] = None
    refusal: Optional[str] = None

    @field_validator("content")
    @classmethod
    def _content_given(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of text parts), got null")
        return v

    def text(self) -> str:
        """The content as one string (text parts joined).

        Raises:
            ValueError: a part that is not text.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling, _OpenAIExtras, _Structured):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]
    max_completion_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: Optional[bool] = None
    """Return each token's log-probability (``choices[].logprobs.content``)."""
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With ``logprobs``: also the k likeliest tokens of each position (0-20)."""
    tools: Optional[Annotated[list[dict[str, Any]], _at_most(MAX_TOOLS)]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    # accepted, ignored
    metadata: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    service_tier: Optional[str] = None
    modalities: Optional[Annotated[list[StrictStr], _at_most(16)]] = None
    reasoning_effort: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None


class SummarizeRequest(_Body):
    """``POST /v1/summarize``: a summary of the documents (pasted into the prompt, where
    prompt lookup copies from them)."""

    documents: Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_DOCUMENTS, fail_fast=True)]
    """The texts to summarize (each non-empty)."""
    instruction: Optional[StrictStr] = Field(default=None, max_length=4000)
    """What to do with them (default: summarize in a few sentences)."""
    response_format: Optional[dict[str, Any]] = None
    """The summary's structure, as OpenAI's ``response_format`` (e.g. a JSON schema of
    findings, each with the index of the document it comes from)."""
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=0)
    seed: Optional[int] = Field(default=None, ge=0, le=2**63 - 1)
    stop: Optional[Union[StrictStr, Annotated[list[StrictStr], _at_most(MAX_STOP)]]] = None
    stream: Optional[bool] = False
    datastore: Optional[StrictStr] = None
    """Name of a datastore the server was started with (never a path)."""
    speculative: Optional[bool] = None
    """False: plain decoding, no drafts (None: the server's default)."""
    max_draft_tokens: Optional[int] = Field(default=None, ge=0, le=MAX_DRAFT_TOKENS)
    """This request's draft budget per step, under the server's (0: plain decoding)."""
    cache_salt: Optional[StrictStr] = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT)
    """vLLM's: requests share prefix-cache and response-cache hits only with the same salt
    (and, with API keys, the same key)."""

    @field_validator("documents")
    @classmethod
    def _documents_not_empty(cls, v: list[str]) -> list[str]:
        return _check_documents(v)  # type: ignore[return-value]

    @field_validator("stop")
    @classmethod
    def _valid_stop(cls, v):
        return _check_stop(v)


class TokenizeRequest(_Body):
    """``POST /tokenize``: vLLM's body (``prompt`` or ``messages``) or llama-server's
    (``content``); exactly one of the three."""

    model: Optional[str] = None
    prompt: Optional[StrictStr] = None
    """vLLM's: a text."""
    content: Optional[StrictStr] = None
    """llama-server's: a text."""
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES, fail_fast=True)]] = (
        None
    )
    """vLLM's: a chat, through the model's chat template."""
    add_special_tokens: Optional[bool] = None
    """vLLM's: add the tokenizer's special tokens (BOS) to a text (default True; a chat:
    the template's own)."""
    add_special: Optional[bool] = None
    """llama-server's name of the same (default False)."""
    add_generation_prompt: Optional[bool] = None
    """A chat: end with the assistant's turn opening (default True)."""
    with_pieces: Optional[bool] = None
    """llama-server's: also each token's text (``[{"id", "piece"}]``)."""
    return_token_strs: Optional[bool] = None
    """vLLM's: also each token's text (``token_strs``)."""


class DetokenizeRequest(_Body):
    """``POST /detokenize``: vLLM's and llama-server's body."""

    model: Optional[str] = None
    tokens: Annotated[list[StrictInt], _at_most(MAX_PROMPT_IDS)]
    """Token ids."""


class AddDocumentsRequest(_Body):
    """``POST /v1/datastores/{name}/documents``: texts added to a served datastore."""

    documents: Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_ADD_DOCUMENTS, fail_fast=True)]
    """The texts, one document each (non-empty, no NUL characters)."""
    source: Optional[StrictStr] = Field(default=None, max_length=200)
    """What they are, recorded in the new shard's sources (default ``"api"``)."""


def first_unknown_field(model: type[BaseModel], data: Mapping[str, Any]) -> Optional[tuple]:
    """The location of the first field no model of the body knows (top level, ``messages[i]``,
    ``stream_options``), or None. Checked before pydantic, which would report every unknown
    key: a body of 100k of them would cost 100k errors."""
    fields = model.model_fields
    for key in data:
        if key not in fields:
            return (key,)
    opts = data.get("stream_options")
    if isinstance(opts, Mapping):
        for key in opts:
            if key not in StreamOptions.model_fields:
                return ("stream_options", key)
    messages = data.get("messages")
    if "messages" in fields and isinstance(messages, list):
        for i, m in enumerate(messages[:MAX_MESSAGES]):
            if isinstance(m, Mapping):
                for key in m:
                    if key not in ChatMessage.model_fields:
                        return ("messages", i, key)
    return None


def unsupported(req: BaseModel) -> Optional[tuple[str, str]]:
    """The first field of the body's own asking for something ragspec does not do, as
    (field, message); the request parameters the engine does not implement yet are refused
    by :class:`ragspec.params.RequestParams` (:data:`ragspec.params.UNSUPPORTED_FIELDS`)."""
    checks = [
        ("best_of", lambda v: v not in (None, 1), "only best_of=1 is supported"),
        (
            "prompt_logprobs",
            lambda v: bool(v),
            "prompt_logprobs is not supported: the prefill applies the output layer to the prompt's last position "
            "only (log-probabilities of generated tokens: logprobs)",
        ),
        ("echo", lambda v: bool(v), "echo is not supported"),
        ("suffix", lambda v: bool(v), "suffix is not supported"),
    ]
    for name, bad, message in checks:
        if name in type(req).model_fields and bad(getattr(req, name)):
            return name, message
    return None
