"""A request's logit processors, built once at :meth:`Engine.start
<ragspec.engine.Engine.start>` from its :class:`~ragspec.params.RequestParams`
(:func:`build_processors`): the one place where a request field becomes a
:class:`~ragspec.processors.LogitsProcessor` (the contract is in :mod:`ragspec.processors`).

Each entry of :data:`PROCESSOR_FACTORIES` looks at the request's parameters and returns
its processor, or None when the request does not ask for it; the chain applies them in
that order (as vLLM's sampler: a structured-output mask, then ``min_tokens`` and
``logit_bias``, then the penalties). A request asking for none of them gets an empty
chain, and the engine then runs exactly its unprocessed path (no copy of any row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .logit_processors import LogitBias, MinTokens, Penalties
from .params import RequestParams
from .processors import LogitsProcessor, ProcessorChain

__all__ = ["ProcessorContext", "ProcessorFactory", "PROCESSOR_FACTORIES", "build_processors"]


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor factory may read besides the request's parameters.

    Attributes:
        prompt_ids: the request's prompt token ids (documents laid in).
        vocab_size: V, the target's output rows.
        eos_token_ids: the ids that end a generation (the engine's).
        tokenizer: the target's tokenizer (a grammar compiles against it).
        grammar: the request's compiled ``response_format``
            (:class:`ragspec.grammar.Grammar`; None: free text).
    """

    prompt_ids: tuple[int, ...]
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: Any = None
    grammar: Any = None


ProcessorFactory = Callable[[RequestParams, ProcessorContext], Optional[LogitsProcessor]]
"""``factory(params, context) -> processor`` (None: the request does not ask for it)."""


def _grammar(params: RequestParams, context: ProcessorContext) -> Optional[LogitsProcessor]:
    if context.grammar is None:
        return None
    return context.grammar.processor()


def _min_tokens(params: RequestParams, context: ProcessorContext) -> Optional[LogitsProcessor]:
    if params.min_tokens <= 0 or not context.eos_token_ids:
        return None
    return MinTokens(params.min_tokens, context.eos_token_ids)


def _logit_bias(params: RequestParams, context: ProcessorContext) -> Optional[LogitsProcessor]:
    if not params.logit_bias:
        return None
    return LogitBias(params.logit_bias, context.vocab_size)


def _penalties(params: RequestParams, context: ProcessorContext) -> Optional[LogitsProcessor]:
    if params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1:
        return None
    return Penalties(
        context.prompt_ids,
        presence=params.presence_penalty,
        frequency=params.frequency_penalty,
        repetition=params.repetition_penalty,
    )


PROCESSOR_FACTORIES: tuple[ProcessorFactory, ...] = (
    # a structured-output constraint (``response_format``) goes first: a mask
    _grammar,
    _min_tokens,
    _logit_bias,
    _penalties,
)
"""The processor factories, in application order."""


def build_processors(
    params: RequestParams, context: ProcessorContext, factories: Sequence[ProcessorFactory] = PROCESSOR_FACTORIES
) -> ProcessorChain:
    """The request's processors (one new object each: never shared between requests), in
    the order of ``factories``; an empty chain when it asks for no processing.

    Raises:
        ConfigError: a value the processor cannot take (e.g. a ``logit_bias`` token id
            outside the vocabulary).
    """
    made = (factory(params, context) for factory in factories)
    return ProcessorChain([p for p in made if p is not None])
