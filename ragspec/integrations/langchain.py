"""LangChain wrappers of the ragspec engine: :class:`RagspecLLM` and :class:`ChatRagspec`.

Swap them in for any LangChain LLM / chat model: a RAG chain (retriever -> prompt -> llm)
gets its speedup with no other change, since the retrieved passages are in the prompt and
prompt lookup copies from them. Passages the model should read without a prompt template
pasting them go in ``documents`` (``llm.invoke(prompt, documents=docs)``,
``llm.with_documents(docs)``): the model reads them as grounding (the chat template's
documents where it takes them, else ``Document 1:`` ... before the prompt) and the drafter
copies from them. Passages the prompt already holds in some form (trimmed, reformatted)
go in ``draft_documents``: only the drafter reads those, as :func:`with_documents` in a
chain does, so the model never reads the passages twice.

Stop strings: the ``stop`` field (set on the model) and the per-call ``stop`` argument are
combined as their **union**; generation stops at the first occurrence of any of them and
the text from that occurrence on is dropped (stop strings may span several tokens and may
complete in the middle of a draft).

Per-call keyword arguments (``invoke(..., **kwargs)``, ``bind(...)``): ``max_new_tokens``
(alias ``max_tokens``), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``,
``speculative``, ``max_draft_tokens`` (the call's draft budget per step, under the
engine's; 0: plain decoding), ``documents``, ``draft_documents``, ``datastore`` (the name
of one of the engine's datastores to draft from), and OpenAI's ``n``, ``logprobs``,
``top_logprobs``, ``presence_penalty``, ``frequency_penalty``, ``logit_bias``, vLLM's
``repetition_penalty`` and ``min_tokens`` (each also a field of the model). Anything else
raises ``TypeError``. They and the fields become one :class:`~ragspec.params.RequestParams`
per call (:meth:`_RagspecBase.request_params`).

Structured outputs: a call's ``response_format`` (OpenAI's mapping, a JSON schema, a
Pydantic model or a TypedDict) constrains its output (:mod:`ragspec.structured`; exact
under speculation, the grammar's forced tokens drafted); ``ChatRagspec.bind_tools`` and
``ChatRagspec.with_structured_output`` (``method="json_schema"``, ``"function_calling"``,
``"json_mode"``; ``include_raw``) work as ``ChatOpenAI``'s, tool calls in
``AIMessage.tool_calls`` (:mod:`ragspec.integrations.langchain_structured`).

Log-probabilities (``logprobs=True``, ``top_logprobs=k``) come as ``ChatOpenAI`` and
LangChain's ``OpenAI`` give them: ``ChatRagspec`` replies in
``response_metadata["logprobs"]`` (``{"content": [{"token", "logprob", "bytes",
"top_logprobs"}]}``, per chunk when streaming), ``RagspecLLM`` generations in
``generation_info["logprobs"]`` (the legacy ``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``). ``n`` choices: ``generate`` returns all of them (one
prefill shared), ``invoke`` the first; a stream is one choice.

Each generation's drafting statistics (vLLM's per-request names, as the server's
``usage.speculative_decoding``) are in its metadata under ``"speculative_decoding"``
(:func:`stats_metadata`).

Batches, threads and async: every generation open on a wrapper is stepped together with
the others by its :class:`~ragspec.integrations.stepper.Stepper` (the server's stepper, in
its own ``ragspec-compute`` thread): one ``engine.step``, one verification forward, per
round for all of them, prompts prefilled in chunks inside the same rounds.
``RagspecLLM.batch`` / ``abatch`` submit all their prompts at once; ``ChatRagspec.batch`` /
``abatch`` (LangChain runs its inputs concurrently) and any concurrent calls join the
running rounds. Each output is what the same call gives alone. The async methods read
their chunks on the event loop and never block it; closing a stream, or cancelling an
async consumer, ends its generation at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator, NoReturn, Optional, Sequence, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LLM, BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import (
    ChatGeneration,
    ChatGenerationChunk,
    ChatResult,
    Generation,
    GenerationChunk,
    LLMResult,
)
from langchain_core.runnables import Runnable, RunnableLambda
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from ragspec.backend.threads import release_openmp_pool
from ragspec.engine import Engine
from ragspec.errors import ConfigError, GenerationError, UnsupportedError
from ragspec.params import RequestParams
from ragspec.prompts import Messages, PreparedPrompt, Prompt
from ragspec.types import GenerationStats, StreamChunk, TokenLogprob

from .langchain_structured import (
    STRUCTURED_KWARGS,
    ToolChunks,
    call_constraint,
    openai_tools,
    structured_output,
    tool_choice_of,
    tool_message,
)
from .logprobs import TokenTexts, chat_logprobs, completion_logprobs, shown_entries
from .stepper import AsyncOutbox, Job, Stepper, ThreadOutbox, choice_makers
from .tools import ToolPlan

logger = logging.getLogger(__name__)

__all__ = [
    "RagspecLLM",
    "ChatRagspec",
    "with_documents",
    "format_documents",
    "document_texts",
    "merge_stop",
    "stats_metadata",
]

_SAMPLING_KWARGS = (
    "n",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "min_p",
)
"""The sampling parameters a call may set, each also a field of the wrappers."""
_CALL_KWARGS = (
    "max_new_tokens",
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "speculative",
    "max_draft_tokens",
    "documents",
    "draft_documents",
    "datastore",
    *_SAMPLING_KWARGS,
    *STRUCTURED_KWARGS,
)

Wrapper = TypeVar("Wrapper", bound="_RagspecBase")


def document_texts(documents) -> list[str]:
    """Texts of ``documents``: strings as they are, LangChain ``Document`` s by their
    ``page_content``; a single string or Document counts as a list of one.

    Raises:
        TypeError: an item is neither.
    """
    if documents is None:
        return []
    if isinstance(documents, str) or hasattr(documents, "page_content"):
        documents = [documents]
    out = []
    for d in documents:
        if isinstance(d, str):
            out.append(d)
        elif isinstance(getattr(d, "page_content", None), str):
            out.append(d.page_content)
        else:
            raise TypeError(f"documents must be strings or Documents, got {type(d).__name__}")
    return out


def merge_stop(*lists: Optional[Sequence[str]]) -> list[str]:
    """Union of stop-string lists, first occurrence order kept, empty strings dropped.

    A single string counts as a list of one."""
    out: list[str] = []
    for stops in lists:
        if stops is None:
            continue
        if isinstance(stops, str):
            stops = [stops]
        for s in stops:
            if s and s not in out:
                out.append(s)
    return out


def stats_metadata(stats: Optional[GenerationStats], model_name: str = "") -> dict:
    """The metadata a wrapper reports for one generation: the headline numbers flat
    (``accepted_tokens``, ``mean_accepted_tokens``, ``tokens_per_s`` ...), the drafting
    statistics under vLLM's per-request names under ``"speculative_decoding"``
    (:meth:`GenerationStats.spec_decode_metrics`) and the whole
    :meth:`GenerationStats.to_dict` under ``"stats"``."""
    if stats is None:
        return {"model_name": model_name}
    return {
        "model_name": model_name,
        "finish_reason": stats.finish_reason,
        "prompt_tokens": stats.num_prompt_tokens,
        "generated_tokens": stats.num_generated_tokens,
        "drafted_tokens": stats.num_drafted_tokens,
        "accepted_tokens": stats.num_accepted_tokens,
        "mean_accepted_tokens": stats.mean_accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "tokens_per_s": stats.tokens_per_s,
        "speculative_decoding": stats.spec_decode_metrics(),
        "stats": stats.to_dict(),
    }


def _usage(stats: Optional[GenerationStats]) -> UsageMetadata:
    inp = stats.num_prompt_tokens if stats else 0
    out = stats.num_generated_tokens if stats else 0
    return UsageMetadata(input_tokens=inp, output_tokens=out, total_tokens=inp + out)


class _RagspecBase(BaseModel):
    """What the LLM and the chat model share: the fields, the constructor and factory, the
    request parameters of a call, and the generations on the wrapper's stepper. A subclass
    says what its input is (:meth:`_input`: a text prompt, or a chat) and how a chunk is
    wrapped for LangChain (:meth:`_wrap`)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model_name: str = ""
    """Name reported in metadata (default: the engine's model name)."""
    max_new_tokens: int = Field(default=256, ge=0)
    """Most tokens generated per call."""
    temperature: float = Field(default=0.0, ge=0.0)
    """Sampling temperature; 0 is greedy decoding (deterministic, equal to plain greedy)."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens when sampling (0 = off)."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0 = off)."""
    seed: Optional[int] = None
    """Seed of each call's own random generator when sampling (None: a fresh seed)."""
    stop: Optional[list[str]] = None
    """Stop strings of every call; combined with a call's own ``stop`` as their union."""
    speculative: bool = True
    """Draft and verify (False: plain one-token-per-step decoding, for comparisons)."""
    max_draft_tokens: Optional[int] = Field(default=None, ge=0)
    """Draft budget per step of every call, under the engine's own (None: the engine's;
    0: plain decoding, as ``speculative=False``)."""
    documents: Optional[list[str]] = None
    """Texts the model reads as grounding, and the drafter copies from, on every call
    (before any per-call ``documents``)."""
    draft_documents: Optional[list[str]] = None
    """Texts only the drafter copies from, on every call (besides the prompt and any
    per-call ``draft_documents``)."""
    datastore: Optional[str] = None
    """The name of the engine's datastore every call drafts from (None: its default)."""
    n: int = Field(default=1, ge=1)
    """Choices per call: ``generate`` returns them all (one prefill shared), ``invoke``
    the first; each sampled with its own generator (``seed + i``)."""
    logprobs: bool = False
    """Return each token's log-probability (see the module docstring for where)."""
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    """With ``logprobs``: also the k likeliest tokens of each position."""
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """OpenAI's presence penalty (0: off)."""
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    """OpenAI's frequency penalty (0: off)."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """vLLM's repetition penalty over the prompt's and the output's tokens (1: off)."""
    logit_bias: Optional[dict[int, float]] = None
    """Token id -> bias in [-100, 100] added to its logit."""
    min_tokens: int = Field(default=0, ge=0)
    """Tokens generated before an EOS token or a stop string may end a call."""
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    """Sampling keeps the tokens of at least ``min_p`` times the likeliest one's probability."""

    _engine: Optional[Engine] = PrivateAttr(default=None)
    _stepper: Optional[Stepper] = PrivateAttr(default=None)
    _stepper_lock: Any = PrivateAttr(default_factory=threading.Lock)

    def __init__(self, *, engine: Optional[Engine] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def from_model_id(
        cls: type[Wrapper],
        model: Optional[str] = None,
        *,
        datastore: Optional[str] = None,
        eagle: Optional[str] = "auto",
        device: Optional[str] = None,
        dtype: Optional[str] = None,
        calibrate: bool = True,
        **fields: Any,
    ) -> Wrapper:
        """Load a model (registry name, GGUF or HF folder; None = the default model) with an
        optional datastore and EAGLE head (:func:`ragspec.loading.load_engine`), and wrap
        it. ``fields`` are this class's fields (``temperature``, ``max_new_tokens``,
        ``stop`` ...)."""
        from ragspec.loading import load_engine

        engine = load_engine(model, device, dtype, datastore=datastore, eagle=eagle, calibrate=calibrate)
        release_openmp_pool()  # steps run in the stepper's compute thread, not this one
        return cls(engine=engine, **fields)

    # ------------------------------------------------------------------ plumbing
    @property
    def engine(self) -> Engine:
        """The wrapped :class:`ragspec.Engine` (not serialized).

        Raises:
            ConfigError: built without one.
        """
        if self._engine is None:
            raise ConfigError(f"{type(self).__name__} has no engine: pass engine=... or use from_model_id()")
        return self._engine

    def _display_name(self) -> str:
        return self.model_name or (self._engine.model_name if self._engine is not None else "") or "ragspec"

    def with_documents(self, documents) -> Runnable:
        """This model grounded in ``documents`` (strings or ``Document`` s) on every call:
        the model reads them and the drafter copies from them (``self.bind(documents=...)``).
        For passages a prompt template already pastes, bind ``draft_documents`` instead."""
        return self.bind(documents=document_texts(documents))  # type: ignore[attr-defined]  # a Runnable

    def request_params(self, stop: Optional[Sequence[str]], kwargs: dict[str, Any]) -> RequestParams:
        """The LangChain builder of a call's :class:`~ragspec.params.RequestParams`: this
        wrapper's fields, a call's keyword arguments over them (``stop`` and the documents
        added to the fields', the rest replacing them).

        Raises:
            TypeError: an unknown keyword argument.
            ConfigError: a value out of range.
        """
        unknown = sorted(set(kwargs) - set(_CALL_KWARGS))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; accepted: {list(_CALL_KWARGS)}")
        fmt, _ = call_constraint(kwargs, self.engine.tokenizer)
        max_new = kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))
        sampling = {name: kwargs.get(name, getattr(self, name)) for name in _SAMPLING_KWARGS}
        sampling["top_logprobs"] = sampling["top_logprobs"] or 0
        return RequestParams(
            **sampling,
            max_new_tokens=int(max_new),
            stop=merge_stop(self.stop, stop),
            documents=list(self.documents or []) + document_texts(kwargs.get("documents")),
            draft_documents=list(self.draft_documents or []) + document_texts(kwargs.get("draft_documents")),
            datastore=kwargs.get("datastore", self.datastore),
            speculative=bool(kwargs.get("speculative", self.speculative)),
            max_draft_tokens=kwargs.get("max_draft_tokens", self.max_draft_tokens),
            temperature=float(kwargs.get("temperature", self.temperature)),
            top_k=int(kwargs.get("top_k", self.top_k)),
            top_p=float(kwargs.get("top_p", self.top_p)),
            seed=kwargs.get("seed", self.seed),
            response_format=fmt,
        )

    @property
    def stepper(self) -> Stepper:
        """The stepper of this wrapper's generations (made on first use; its thread
        ``ragspec-compute`` starts at the first generation)."""
        with self._stepper_lock:
            if self._stepper is None or self._stepper.engine is not self.engine or self._stepper.stopped:
                if self._stepper is not None:
                    self._stepper.stop()
                self._stepper = Stepper(self.engine, thread_name="ragspec-compute")
            return self._stepper

    def _input(self, value: Any) -> tuple[Any, bool]:
        """What :meth:`Engine.prepare` reads for one LangChain input: (prompt, chat)."""
        raise NotImplementedError

    def _prepare(self, value: Any, params: RequestParams, plan: Optional[ToolPlan] = None) -> PreparedPrompt:
        prompt, chat = self._input(value)
        tools = plan.definitions() if plan is not None and plan.show_tools else ()
        return self.engine.prepare(prompt, params, chat=chat, tools=tools)

    def _submit(
        self, values: Sequence[Any], stop: Optional[Sequence[str]], kwargs: dict, outbox, stream: bool = False
    ) -> tuple[list[Job], int]:
        """Prepare every input (token ids, here) and submit them together, ``n`` jobs each
        (their choices): they share their first step. Returns the jobs (input by input,
        choice by choice) and ``n``.

        Raises:
            ConfigError: ``stream`` with ``n`` > 1 (a stream is one choice).
        """
        params = self.request_params(stop, kwargs)
        if stream and params.n > 1:
            raise ConfigError(f"n={params.n}: a stream is one choice (use generate() for several)")
        engine = self.engine
        _, plan = call_constraint(kwargs, engine.tokenizer)
        if plan is not None:
            plan.check(engine.grammars.compile)  # an error names the tool
        prepared = [self._prepare(v, params, plan) for v in values]
        makes = [make for p in prepared for make in choice_makers(engine, p, params)]
        return self.stepper.submit_many(makes, outbox), params.n

    # ------------------------------------------------------------------ sync
    def _iter(self, value: Any, stop: Optional[Sequence[str]], kwargs: dict[str, Any]) -> Iterator[StreamChunk]:
        """The chunks of one generation, read in this thread."""
        (job,), _ = self._submit([value], stop, kwargs, ThreadOutbox, stream=True)
        try:
            while (chunk := job.next_chunk()) is not None:
                yield from _pieces(chunk)
        finally:
            job.cancel()  # no-op once finished; else it ends at the next step

    def _run_many(
        self, values: Sequence[Any], stop: Optional[Sequence[str]], kwargs: dict[str, Any]
    ) -> list[list["_Output"]]:
        """All ``values`` submitted together, then each choice of each read whole."""
        jobs, n = self._submit(values, stop, kwargs, ThreadOutbox)
        try:
            outs = [_collect(iter(job.next_chunk, None)) for job in jobs]
            return [outs[i : i + n] for i in range(0, len(outs), n)]
        finally:
            for job in jobs:
                job.cancel()

    # ------------------------------------------------------------------ async
    async def _aiter(
        self, value: Any, stop: Optional[Sequence[str]], kwargs: dict[str, Any]
    ) -> AsyncIterator[StreamChunk]:
        """The chunks of one generation, read on the event loop (tokenized in a worker thread)."""
        loop = asyncio.get_running_loop()
        (job,), _ = await asyncio.to_thread(self._submit, [value], stop, kwargs, lambda: AsyncOutbox(loop), True)
        try:
            while (chunk := await job.anext_chunk()) is not None:
                for piece in _pieces(chunk):
                    yield piece
        finally:
            job.cancel()

    async def _arun_many(
        self, values: Sequence[Any], stop: Optional[Sequence[str]], kwargs: dict[str, Any]
    ) -> list[list["_Output"]]:
        """All ``values`` submitted together (tokenized in a worker thread), then read on the loop."""
        loop = asyncio.get_running_loop()
        jobs, n = await asyncio.to_thread(self._submit, values, stop, kwargs, lambda: AsyncOutbox(loop))

        async def drain(job: Job) -> _Output:
            out = _Output()
            while (chunk := await job.anext_chunk()) is not None:
                out.add(chunk)
            return out

        try:
            outs = list(await asyncio.gather(*(drain(j) for j in jobs)))
            return [outs[i : i + n] for i in range(0, len(outs), n)]
        finally:
            for job in jobs:
                job.cancel()

    def _shown(self, chunk: StreamChunk) -> tuple[TokenLogprob, ...]:
        """The chunk's log-probability entries a client sees (no end-of-sequence token)."""
        return shown_entries(chunk, self.engine.eos_token_ids)

    # ------------------------------------------------------------------ streams
    def _wrap(self, chunk: StreamChunk) -> Any:
        """A chunk as this LangChain class streams it."""
        raise NotImplementedError

    def _stream_wrapped(self, value: Any, stop: Optional[list[str]], run_manager: Any, kwargs: dict) -> Iterator[Any]:
        """``_stream`` of both classes: each chunk wrapped, reported to the callbacks, then yielded."""
        for chunk in self._iter(value, stop, kwargs):
            wrapped = self._wrap(chunk)
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=wrapped)
            yield wrapped

    async def _astream_wrapped(
        self, value: Any, stop: Optional[list[str]], run_manager: Any, kwargs: dict
    ) -> AsyncIterator[Any]:
        """``_astream`` of both classes (see :meth:`_stream_wrapped`)."""
        async for chunk in self._aiter(value, stop, kwargs):
            wrapped = self._wrap(chunk)
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=wrapped)
            yield wrapped

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self._display_name(),
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "speculative": self.speculative,
            "max_draft_tokens": self.max_draft_tokens,
            **{name: getattr(self, name) for name in _SAMPLING_KWARGS},
        }


@dataclass
class _Output:
    """One choice read whole: its text, its last stats, its chunks (for log-probabilities)."""

    text: str = ""
    stats: Optional[GenerationStats] = None
    chunks: list[StreamChunk] = field(default_factory=list)

    def add(self, chunk: StreamChunk) -> None:
        if chunk.finish_reason == "error":
            raise _failed()
        self.text += chunk.text
        self.stats = chunk.stats or self.stats
        self.chunks.append(chunk)


def _pieces(chunk: StreamChunk) -> Iterator[StreamChunk]:
    """``chunk`` as it is; for one the engine ended in error (``finish_reason`` "error"),
    its text as a last piece, then :class:`~ragspec.errors.GenerationError` (as
    ``ChatOpenAI`` raises for a server's 500)."""
    if chunk.finish_reason != "error":
        yield chunk
        return
    if chunk.text or chunk.token_ids:
        yield dataclasses.replace(chunk, finish_reason=None, stats=None)
    raise _failed()


def _failed() -> GenerationError:
    return GenerationError(
        "the generation failed: its processing left no token to choose (the grammar engine failed, or the "
        "request's constraints together forbid every token); the output is incomplete, see the log"
    )


def _collect(chunks) -> _Output:
    """The whole text of ``chunks``, the last stats, the chunks."""
    out = _Output()
    for chunk in chunks:
        out.add(chunk)
    return out


class RagspecLLM(_RagspecBase, LLM):
    """A LangChain ``LLM`` (text in, text out) decoding with ragspec.

    Build it around a loaded engine, ``RagspecLLM(engine=engine, max_new_tokens=128)``, or
    load one with :meth:`from_model_id`. The constructor does no I/O. A text prompt goes
    through the tokenizer's chat template as one user turn when ``chat`` is True (the
    default, right for instruct models) and the tokenizer has one.

    ``generate()`` results carry the stats in ``generation_info`` (see
    :func:`stats_metadata`) and the token counts in ``llm_output["token_usage"]``.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    chat: bool = True
    """Wrap a text prompt in the chat template (one user turn) when the tokenizer has one."""

    @property
    def _llm_type(self) -> str:
        return "ragspec"

    def _input(self, value: Any) -> tuple[Prompt, bool]:
        return value, self.chat

    def _wrap(self, chunk: StreamChunk) -> GenerationChunk:
        info = stats_metadata(chunk.stats, self._display_name()) if chunk.stats is not None else None
        if chunk.logprobs:
            entries = self._shown(chunk)
            info = dict(info or {})
            info["logprobs"] = completion_logprobs(entries, TokenTexts(self.engine.tokenizer), chunk.token_texts)
        return GenerationChunk(text=chunk.text, generation_info=info)

    def _info(self, out: _Output) -> dict:
        """A generation's ``generation_info``: its stats, its log-probabilities where asked."""
        info = stats_metadata(out.stats, self._display_name())
        if any(c.logprobs for c in out.chunks):
            entries = [e for c in out.chunks for e in self._shown(c)]
            texts = [t for c in out.chunks for t in c.token_texts]
            info["logprobs"] = completion_logprobs(entries, TokenTexts(self.engine.tokenizer), texts)
        return info

    # ------------------------------------------------------------------ LangChain hooks
    def with_structured_output(self, schema: dict[str, Any] | type, **kwargs: Any) -> NoReturn:
        """Not for a text-completion model (as LangChain's own LLMs): raises
        :class:`~ragspec.errors.UnsupportedError` naming what does it instead.

        Raises:
            UnsupportedError: always.
        """
        raise UnsupportedError(
            "RagspecLLM.with_structured_output is not supported: a text-completion LLM returns text. Use "
            "ChatRagspec.with_structured_output(schema), or pass response_format=... to RagspecLLM per call "
            "(ragspec's docs/usage.md, section 'LangChain')."
        )

    def _call(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> str:
        return self._run_many([prompt], stop, kwargs)[0][0].text

    def _result(self, outs: list[list[_Output]]) -> LLMResult:
        name = self._display_name()
        gens = [[Generation(text=o.text, generation_info=self._info(o)) for o in choices] for choices in outs]
        # the prompt counted once per input (its choices share it), as OpenAI's usage does
        prompt_tokens = sum(choices[0].stats.num_prompt_tokens for choices in outs if choices and choices[0].stats)
        completion_tokens = sum(o.stats.num_generated_tokens for choices in outs for o in choices if o.stats)
        return LLMResult(
            generations=gens,
            llm_output={
                "model_name": name,
                "token_usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        )

    def _generate(
        self,
        prompts: list[str],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> LLMResult:
        """``invoke`` / ``batch``'s path: every prompt submitted to the stepper together
        (:meth:`_run_many`) and stepped, one ``Engine.step`` per round for all of them
        (:class:`~ragspec.integrations.stepper.Stepper`)."""
        return self._result(self._run_many(prompts, stop, kwargs))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> LLMResult:
        return self._result(await self._arun_many(prompts, stop, kwargs))

    def _stream(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        return self._stream_wrapped(prompt, stop, run_manager, kwargs)

    def _astream(
        self,
        prompt: str,
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        return self._astream_wrapped(prompt, stop, run_manager, kwargs)


_ROLES = {
    "human": "user",
    "user": "user",
    "ai": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
}


def _chat_messages(messages: Sequence[BaseMessage]) -> list[dict]:
    """LangChain messages as the ``{"role", "content"}`` dicts of a chat template."""
    out = []
    for m in messages:
        role = getattr(m, "role", None) if m.type == "chat" else _ROLES.get(m.type)
        if role is None:
            raise ConfigError(f"unsupported message type {m.type!r}")
        out.append({"role": role, "content": str(m.text)})
    return out


class ChatRagspec(_RagspecBase, BaseChatModel):
    """A LangChain chat model decoding with ragspec; messages go through the tokenizer's
    chat template (:meth:`ragspec.Engine.prepare`).

    Build it around a loaded engine, ``ChatRagspec(engine=engine)``, or load one with
    :meth:`from_model_id`. The constructor does no I/O. Replies carry the stats in
    ``response_metadata`` (see :func:`stats_metadata`) and the token counts in
    ``usage_metadata``; when streaming, both arrive on the last chunk.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "ragspec-chat"

    def _input(self, value: Any) -> tuple[Messages, bool]:
        if not getattr(self.engine.tokenizer, "chat_template", None):
            raise ConfigError("the tokenizer has no chat template: use RagspecLLM for plain text prompts")
        return _chat_messages(value), True

    def _message(self, out: _Output, plan: Optional[ToolPlan] = None) -> AIMessage:
        metadata = stats_metadata(out.stats, self._display_name())
        if any(c.logprobs for c in out.chunks):
            entries = [e for c in out.chunks for e in self._shown(c)]
            metadata["logprobs"] = chat_logprobs(entries, TokenTexts(self.engine.tokenizer))
        if plan is not None:
            return tool_message(plan, out.text, response_metadata=metadata, usage_metadata=_usage(out.stats))
        return AIMessage(content=out.text, response_metadata=metadata, usage_metadata=_usage(out.stats))

    def _result(self, outs: list[_Output], kwargs: Optional[dict] = None) -> ChatResult:
        plan = call_constraint(kwargs, self.engine.tokenizer)[1] if kwargs else None
        return ChatResult(generations=[ChatGeneration(message=self._message(o, plan)) for o in outs])

    # ------------------------------------------------------------------ structured outputs
    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: Any = None,
        strict: Optional[bool] = None,
        parallel_tool_calls: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable:
        """This model with ``tools`` (functions, Pydantic models, TypedDicts, ``BaseTool`` s
        or OpenAI's definitions) on every call. ``tool_choice``: ``"auto"`` (the default:
        the model decides, where its chat template declares tool use), ``"none"``,
        ``"any"``/``"required"``/``True`` (a call is generated, under its function's
        schema), or a tool's name. Replies carry the calls in ``tool_calls``. Arguments
        are generated strictly: an object without ``additionalProperties`` takes only the
        keys it names; the definitions are marked ``"strict": true`` (``strict=True``
        converts them as ``ChatOpenAI`` does, every property required)."""
        defs = openai_tools(tools, strict)
        extra: dict[str, Any] = {"tools": defs, **kwargs}
        if tool_choice is not None:
            extra["tool_choice"] = tool_choice_of(tool_choice, defs)
        if parallel_tool_calls is not None:
            extra["parallel_tool_calls"] = parallel_tool_calls
        return self.bind(**extra)

    def with_structured_output(
        self,
        schema: Any = None,
        *,
        method: str = "json_schema",
        include_raw: bool = False,
        strict: Optional[bool] = None,
        **kwargs: Any,
    ) -> Runnable:
        """A runnable returning ``schema``'s parsed object (a Pydantic model's instance;
        a dict for a TypedDict or JSON schema), generated under it: ``method`` is
        ``"json_schema"`` (the default: the schema as the response format),
        ``"function_calling"`` (the schema as the one tool, called) or ``"json_mode"``
        (any JSON object). ``include_raw``: ``{"raw", "parsed", "parsing_error"}``.
        ``strict`` (None: true for ``json_schema``): an object without
        ``additionalProperties`` takes only the keys it names.

        Raises:
            ConfigError: an unknown method or keyword.
        """
        if kwargs:
            raise ConfigError(f"with_structured_output got unexpected argument(s) {sorted(kwargs)}")
        return structured_output(self, schema, method=method, include_raw=include_raw, strict=strict)

    def _tool_chunk(self, calls: ToolChunks, chunk: StreamChunk) -> ChatGenerationChunk:
        """A streamed reply's chunk under a tool plan, with ``tool_call_chunks``."""
        if chunk.stats is None:
            return ChatGenerationChunk(message=calls.chunk(chunk.text, False))
        msg = calls.chunk(
            chunk.text,
            True,
            response_metadata=stats_metadata(chunk.stats, self._display_name()),
            usage_metadata=_usage(chunk.stats),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": chunk.stats.finish_reason})

    def _tool_chunks(
        self, messages: list[BaseMessage], stop: Any, kwargs: dict, plan: ToolPlan
    ) -> Iterator[ChatGenerationChunk]:
        calls = ToolChunks(plan)
        for chunk in self._iter(messages, stop, kwargs):
            yield self._tool_chunk(calls, chunk)

    async def _atool_chunks(
        self, messages: list[BaseMessage], stop: Any, kwargs: dict, plan: ToolPlan
    ) -> AsyncIterator[ChatGenerationChunk]:
        calls = ToolChunks(plan)
        async for chunk in self._aiter(messages, stop, kwargs):
            yield self._tool_chunk(calls, chunk)

    def _wrap(self, chunk: StreamChunk) -> ChatGenerationChunk:
        logprobs = {}
        if chunk.logprobs:
            logprobs = {"logprobs": chat_logprobs(self._shown(chunk), TokenTexts(self.engine.tokenizer))}
        if chunk.stats is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text, response_metadata=logprobs))
        msg = AIMessageChunk(
            content=chunk.text,
            response_metadata={**stats_metadata(chunk.stats, self._display_name()), **logprobs},
            usage_metadata=_usage(chunk.stats),
            chunk_position="last",
        )
        return ChatGenerationChunk(message=msg, generation_info={"finish_reason": chunk.stats.finish_reason})

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        (outs,) = self._run_many([messages], stop, kwargs)
        return self._result(outs, kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> ChatResult:
        (outs,) = await self._arun_many([messages], stop, kwargs)
        return self._result(outs, kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[CallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        plan = call_constraint(kwargs, self.engine.tokenizer)[1]
        if plan is None:
            return self._stream_wrapped(messages, stop, run_manager, kwargs)
        return self._tool_chunks(messages, stop, kwargs, plan)

    def _astream(
        self,
        messages: list[BaseMessage],
        stop: Optional[list[str]] = None,
        run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        plan = call_constraint(kwargs, self.engine.tokenizer)[1]
        if plan is None:
            return self._astream_wrapped(messages, stop, run_manager, kwargs)
        return self._atool_chunks(messages, stop, kwargs, plan)


# ---------------------------------------------------------------------- chains
def format_documents(documents) -> str:
    """Retrieved documents as prompt text: their contents separated by blank lines."""
    return "\n\n".join(document_texts(documents))


def with_documents(llm, prompt, *, documents_key: str = "context", format=format_documents) -> Runnable:
    """``prompt | llm`` that also gives the retrieved documents to the drafter, per request.

    The input is a dict whose ``documents_key`` holds the retriever's output (``Document`` s
    or strings). The prompt sees that value passed through ``format`` (None: unchanged), so
    the prompt may trim or rephrase the passages; the drafter gets their full
    ``page_content`` either way, as ``draft_documents`` (the model reads the passages once,
    in the prompt). Example::

        chain = {"context": retriever, "question": RunnablePassthrough()} | with_documents(llm, prompt)

    Streams like ``prompt | llm``.
    """

    def route(inputs: dict) -> Runnable:
        if not isinstance(inputs, dict) or documents_key not in inputs:
            raise ConfigError(f"with_documents expects a dict input with the key {documents_key!r}")
        docs = inputs[documents_key]
        values = dict(inputs)
        if format is not None:
            values[documents_key] = format(docs)
        return (
            RunnableLambda(lambda _: values, name="documents_formatted")
            | prompt
            | llm.bind(draft_documents=document_texts(docs))
        )

    return RunnableLambda(route, name="with_documents")
