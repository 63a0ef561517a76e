"""One request's parameters: :class:`RequestParams`, a frozen value validated once.

Everything a request can ask is here (vLLM's ``SamplingParams`` and llama.cpp's slot
parameters are the models): how tokens are chosen (``temperature``, ``top_k``, ``top_p``,
``min_p``, ``seed``, the penalties, ``logit_bias``, ``min_tokens``: the processing of
:mod:`ragspec.logit_processors`), what comes back (``n`` choices, ``logprobs`` /
``top_logprobs`` in ``logprobs_mode``), what the output must be (``response_format``: a
JSON schema, a regex, a choice, a grammar; :mod:`ragspec.structured`), when generation
ends (``max_new_tokens``, ``stop``), how it drafts (``speculative``, ``max_draft_tokens``,
``datastore``, ``draft_documents``), what the model reads besides the prompt
(``documents``), the tenant partition of the shared caches (``cache_salt``). A value out
of range raises :class:`~ragspec.errors.InvalidParameterError` naming its field; a field
the engine does not do yet, if any (:data:`UNSUPPORTED_FIELDS`), set to anything but its
neutral value, :class:`~ragspec.errors.UnsupportedParameterError`, never silently ignored.

Each front end builds one from its own input (the CLI's arguments, an OpenAI or summary
body, a LangChain call's keywords) and hands it to :meth:`ragspec.Engine.start`;
:meth:`ragspec.Engine.generate` and :meth:`~ragspec.Engine.stream` take one, or keywords
that build one here (:func:`request_params`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

from .config import DecodeConfig, SamplingParams
from .deprecation import warn_deprecated
from .errors import ConfigError, InvalidParameterError, UnsupportedParameterError
from .logprobs import LOGPROBS_MODES, MAX_TOP_LOGPROBS
from .structured import ResponseFormat
from .structured import response_format as _response_format

__all__ = ["RequestParams", "request_params", "params_from_old_start", "UNSUPPORTED_FIELDS"]

UNSUPPORTED_FIELDS: tuple[str, ...] = ()
"""Fields of :class:`RequestParams` the engine does not implement yet: accepted only at
their neutral value (the defaults), refused otherwise."""


def _number(value: Any) -> bool:
    """A real number (int or float, not a bool), not NaN."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and not math.isnan(value)


def _texts(value: Union[None, str, Sequence[str]], name: str) -> tuple[str, ...]:
    """``value`` as a tuple of strings (a single string is a tuple of one).

    Raises:
        ConfigError: an item is not a string.
    """
    if value is None:
        return ()
    items = (value,) if isinstance(value, str) else tuple(value)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ConfigError(f"{name}[{i}] must be a string, got {type(item).__name__}")
    return items


@dataclass(frozen=True)
class RequestParams:
    """What one request asks for; frozen, validated at construction (a
    :class:`~ragspec.errors.ConfigError` for a value out of range,
    :class:`~ragspec.errors.UnsupportedParameterError` for a field the engine does not
    implement set to anything but its neutral value).

    Lists given for ``stop``, ``documents`` and ``draft_documents`` are kept as tuples; a
    single string counts as a list of one.
    """

    # ------------------------------------------------------------------ limits
    max_new_tokens: int = 128
    """Most tokens generated (never exceeded, whatever the draft length)."""
    stop: Sequence[str] = ()
    """Stop strings, matched on decoded text; the text from the first match on is dropped."""
    # ------------------------------------------------------------------ sampling
    temperature: float = 0.0
    """Softmax temperature; 0 is greedy decoding (never draws a random number)."""
    top_k: int = 0
    """Sample among the k likeliest tokens only (0: off)."""
    top_p: float = 1.0
    """Sample among the smallest set of tokens whose probability reaches top_p (1.0: off)."""
    seed: Optional[int] = None
    """Seed of the request's own ``torch.Generator`` (sampling only; None: a fresh seed)."""
    # ------------------------------------------------------------------ drafting
    speculative: bool = True
    """Draft and verify; False: plain decoding (one token per target forward)."""
    max_draft_tokens: Optional[int] = None
    """Most draft tokens verified per step, under the engine's own budget
    (``PolicyConfig.max_draft_tokens``); None: the engine's; 0: plain decoding."""
    datastore: Optional[str] = None
    """Name of the datastore this request drafts from (one the engine was built with:
    ``Engine.datastores``); None: the engine's default."""
    draft_documents: Sequence[str] = ()
    """Texts only the drafter reads (the model does not): for passages the prompt already
    holds in some form, so the model never reads them twice."""
    # ------------------------------------------------------------------ grounding
    documents: Sequence[str] = ()
    """Texts the model reads as grounding and the drafter copies from: through the chat
    template's ``documents`` where the template takes them, else laid out before the
    prompt (``Document 1:`` ..., :func:`ragspec.prompts.grounded_text`)."""
    # ------------------------------------------------------------------ isolation
    cache_salt: str = ""
    """The request's partition of what requests share (the prefix cache, the response
    cache: vLLM's ``cache_salt``): it reuses and feeds only its own salt's ("": the shared
    partition). A salted request starts only on drafters that declare how they partition
    (:class:`~ragspec.drafters.base.TenantIsolation`)."""
    # ------------------------------------------------------------------ reporting
    return_steps: bool = False
    """Keep per-step stats in ``GenerationStats.steps``."""
    # ------------------------------------------------------------------ choices and outputs
    n: int = 1
    """Choices (completions) of the request, >= 1: each its own generation, sampled with
    its own generator seeded ``seed + i``, sharing one prefill
    (:meth:`Engine.start_choices <ragspec.engine.Engine.start_choices>`)."""
    logprobs: bool = False
    """Return each generated token's log-probability (``GenerationOutput.logprobs``,
    ``StreamChunk.logprobs``), from the verification row that chose it: equal to plain
    decoding's (:mod:`ragspec.logprobs`)."""
    top_logprobs: int = 0
    """With ``logprobs``: also the k likeliest tokens of each position, 0 .. 20."""
    logprobs_mode: str = "raw_logprobs"
    """What ``logprobs`` returns (vLLM's names): ``raw_logprobs`` (the model's own
    distribution), ``raw_logits``, ``processed_logprobs`` or ``processed_logits`` (after
    penalties, bias, temperature, top-k/top-p/min-p: the distribution the token was chosen
    from)."""
    # ------------------------------------------------------------------ processing
    presence_penalty: float = 0.0
    """OpenAI's presence penalty, in [-2, 2]: subtracted once from the logit of every
    token the output holds (0: off)."""
    frequency_penalty: float = 0.0
    """OpenAI's frequency penalty, in [-2, 2]: subtracted from a token's logit once per
    time the output holds it (0: off)."""
    repetition_penalty: float = 1.0
    """vLLM's and transformers' multiplicative repetition penalty (> 0) over the prompt's
    and the output's tokens: a positive logit is divided by it, a negative one multiplied
    (1: off; above 1 discourages repeats)."""
    logit_bias: Optional[Mapping[int, float]] = None
    """Token id -> value in [-100, 100] added to its logit in every step (OpenAI's
    ``logit_bias``; -100 bans the token in practice, and it is never drafted)."""
    min_tokens: int = 0
    """Tokens generated before an EOS token or a stop string may end the request (EOS
    tokens are masked until then); at most ``max_new_tokens``. It never leaves a step
    without a token: where EOS is the only token the rest of the request allows (a
    ``response_format`` structure that is complete), the output ends there, shorter."""
    min_p: float = 0.0
    """Sampling keeps only tokens of probability at least ``min_p`` times the likeliest
    one's, in [0, 1] (after temperature, top-k and top-p, as transformers applies it;
    0: off; greedy decoding ignores it)."""
    # ------------------------------------------------------------------ the output's structure
    response_format: Union[None, Mapping[str, Any], ResponseFormat] = None
    """What the output must be: a :class:`~ragspec.structured.ResponseFormat`, or its
    OpenAI-shaped mapping (``{"type": "json_schema", "json_schema": {"schema": {...}}}``,
    ``{"type": "json_object"}``, and the ``regex``, ``choice`` and ``grammar`` kinds), kept
    as a ``ResponseFormat``; None (or ``{"type": "text"}``): free text. Every token is
    chosen among those the constraint allows (drafts included), and EOS only where the
    output is complete (:mod:`ragspec.grammar`); the schema compiles when the request is
    prepared (:meth:`Engine.prepare <ragspec.engine.Engine.prepare>`)."""

    _decode: DecodeConfig = field(init=False, repr=False, compare=False, hash=False)
    _sampling: SamplingParams = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise in place, once
        set_(self, "stop", _texts(self.stop, "stop"))
        set_(self, "documents", _texts(self.documents, "documents"))
        set_(self, "draft_documents", _texts(self.draft_documents, "draft_documents"))
        set_(self, "response_format", _response_format(self.response_format))
        for name in ("speculative", "return_steps", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.datastore is not None and (not isinstance(self.datastore, str) or not self.datastore):
            raise ConfigError(f"datastore must be a datastore's name, got {self.datastore!r}")
        if self.cache_salt is None:
            set_(self, "cache_salt", "")
        if not isinstance(self.cache_salt, str):
            raise ConfigError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigError(f"{name} must be a number, got {value!r}")
        for name in ("top_k", "n", "top_logprobs", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
        self._check_processing()
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        # the component settings validate their own ranges (ConfigError)
        set_(
            self,
            "_decode",
            DecodeConfig(
                max_new_tokens=self.max_new_tokens,
                stop=tuple(self.stop),
                speculative=self.speculative,
                return_steps=self.return_steps,
                max_draft_tokens=self.max_draft_tokens,
            ),
        )
        set_(
            self,
            "_sampling",
            SamplingParams(
                temperature=float(self.temperature),
                top_k=self.top_k,
                top_p=float(self.top_p),
                seed=self.seed,
                min_p=float(self.min_p),
            ),
        )
        self._refuse_unimplemented()

    def _check_processing(self) -> None:
        """Range checks of the fields that edit logits (:mod:`ragspec.logit_processors`);
        a ``logit_bias`` is normalised to a dict of ints to floats.

        Raises:
            InvalidParameterError: a value out of range, naming the field.
        """
        for name, low, high in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0), ("min_p", 0.0, 1.0)):
            value = getattr(self, name)
            if not _number(value) or not low <= value <= high:
                raise InvalidParameterError(
                    f"{name} must be a number in [{low:g}, {high:g}], got {value!r}", param=name
                )
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidParameterError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", param="top_logprobs"
            )
        if self.top_logprobs and not self.logprobs:
            raise InvalidParameterError("top_logprobs needs logprobs=True", param="top_logprobs")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidParameterError(
                f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}",
                param="logprobs_mode",
            )
        if self.n < 1:
            raise InvalidParameterError(f"n must be at least 1, got {self.n}", param="n")
        rp = self.repetition_penalty
        if not _number(rp) or not 0 < rp < math.inf:
            raise InvalidParameterError(
                f"repetition_penalty must be a number above 0, got {rp!r}", param="repetition_penalty"
            )
        most = self.max_new_tokens if isinstance(self.max_new_tokens, int) else self.min_tokens
        if self.min_tokens < 0 or self.min_tokens > most:
            raise InvalidParameterError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}] (max_tokens in the OpenAI "
                f"API), got {self.min_tokens}",
                param="min_tokens",
            )
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping):
            raise InvalidParameterError("logit_bias must map token ids to numbers", param="logit_bias")
        bias: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            if isinstance(k, bool) or not isinstance(k, int) or k < 0:
                raise InvalidParameterError(f"logit_bias keys must be token ids, got {k!r}", param="logit_bias")
            if not _number(v) or not -100 <= v <= 100:
                raise InvalidParameterError(
                    f"logit_bias values must be numbers in [-100, 100], got {v!r} for token {k}", param="logit_bias"
                )
            bias[k] = float(v)
        object.__setattr__(self, "logit_bias", bias or None)

    def _refuse_unimplemented(self) -> None:
        """Raise :class:`UnsupportedParameterError` for the first field of
        :data:`UNSUPPORTED_FIELDS` set to anything but its neutral value."""
        checks: tuple[tuple[str, bool, str], ...] = ()
        for name, bad, message in checks:
            if bad:
                raise UnsupportedParameterError(message, param=name)

    # ------------------------------------------------------------------ component views
    @property
    def decode(self) -> DecodeConfig:
        """The limits and drafting switches as the decode loop reads them."""
        return self._decode

    @property
    def sampling(self) -> SamplingParams:
        """How tokens are chosen, as the verifiers read it."""
        return self._sampling

    @property
    def constraint(self) -> Optional[ResponseFormat]:
        """``response_format`` as the :class:`~ragspec.structured.ResponseFormat` it was
        read into (None: free text)."""
        fmt = self.response_format
        return fmt if isinstance(fmt, ResponseFormat) else None

    @property
    def greedy(self) -> bool:
        """Temperature 0: argmax decoding, no random number drawn."""
        return self._sampling.greedy

    @property
    def drafts(self) -> bool:
        """Whether the request drafts at all (``speculative`` and a budget above 0)."""
        return self.speculative and self.max_draft_tokens != 0

    @classmethod
    def from_configs(
        cls, decode: Optional[DecodeConfig] = None, sampling: Optional[SamplingParams] = None, **fields: Any
    ) -> "RequestParams":
        """The parameters of a request given as the component settings (``decode``,
        ``sampling``; None: their defaults) and any other ``fields``."""
        d = decode if decode is not None else DecodeConfig()
        s = sampling if sampling is not None else SamplingParams()
        return request_params(
            max_new_tokens=d.max_new_tokens,
            stop=d.stop,
            speculative=d.speculative,
            return_steps=d.return_steps,
            max_draft_tokens=d.max_draft_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            **fields,
        )

    def replace(self, **changes: Any) -> "RequestParams":
        """A copy with ``changes`` (validated again).

        Raises:
            TypeError: an unknown field. ConfigError, UnsupportedParameterError: as the constructor.
        """
        return dataclasses.replace(self, **changes)


def request_params(params: Optional[RequestParams] = None, **fields: Any) -> RequestParams:
    """The one place keywords become a :class:`RequestParams`: ``params`` with ``fields``
    replaced, or a new one from ``fields`` (None values of ``stop``, ``documents``,
    ``draft_documents`` and ``cache_salt`` mean their defaults).

    Raises:
        TypeError: an unknown keyword (the message names the accepted ones).
        ConfigError, UnsupportedParameterError: as :class:`RequestParams`.
    """
    known = {f.name for f in dataclasses.fields(RequestParams) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unexpected request parameter(s) {unknown}; accepted: {sorted(known)}")
    for name in ("stop", "documents", "draft_documents", "cache_salt"):
        if name in fields and fields[name] is None:
            del fields[name]
    if params is None:
        return RequestParams(**fields)
    return params.replace(**fields) if fields else params


def params_from_old_start(
    params: Union[RequestParams, DecodeConfig, None], sampling: Optional[SamplingParams], kwargs: dict[str, Any]
) -> tuple[RequestParams, Sequence[Sequence[int]]]:
    """The parameters of :meth:`Engine.start` 's old signature (``start(prompt, decode,
    sampling, *, documents, document_ids, cache_salt)``) as a ``RequestParams`` (its
    ``documents``, the drafter's alone there, as ``draft_documents``) and the drafter-only
    token ids, with a DeprecationWarning.

    Raises:
        TypeError: an unknown keyword.
    """
    unknown = sorted(set(kwargs) - {"decode", "sampling", "documents", "document_ids", "cache_salt"})
    if unknown:
        raise TypeError(f"Engine.start() got unexpected keyword argument(s) {unknown}")
    warn_deprecated(
        "Engine.start(prompt, decode, sampling, documents=, document_ids=, cache_salt=)",
        "Engine.start(prompt, RequestParams(...)) (ragspec.RequestParams: one value for the request)",
        stacklevel=4,
    )
    if isinstance(params, RequestParams):
        raise TypeError("Engine.start(): give a RequestParams alone, not with decode/sampling settings")
    decode = kwargs.pop("decode", params)
    sampling = kwargs.pop("sampling", sampling)
    document_ids = kwargs.pop("document_ids", None) or ()
    # the old signature's documents were the drafter's alone: they keep that meaning here
    fields = {"draft_documents" if k == "documents" else k: v for k, v in kwargs.items() if v is not None}
    return RequestParams.from_configs(decode, sampling, **fields), document_ids
