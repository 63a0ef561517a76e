"""The decode loop: requests started with :meth:`Engine.start`, advanced by
:meth:`Engine.step`, streamed as text chunks.

A request's first steps are its prefill: the prompt enters its KV cache in chunks of at most
``PolicyConfig.prefill_chunk_tokens`` tokens, and a step prefills at most
``PolicyConfig.prefill_step_tokens`` prompt tokens over all requests (default one chunk), the
earliest request first (vLLM's chunked prefill and token budget), so prompts arriving hold
up the other requests' steps by one chunk's forward at most, and the first to arrive gets
its first token after its own prefill, not everyone's; the first generated token comes
from the last chunk's last logits. Every later step is one
target forward for all requests of the step:
  1. draft: each request's draft session proposes a tree; the policy keeps the part worth
     verifying (possibly nothing: plain decoding);
  2. verify: one ``Target.verify`` call over every request's root + tree; the verifier
     picks each request's accepted path and bonus token;
  3. commit: each KV state is rolled back to its accepted path; committed tokens pass one
     by one through the stop conditions (EOS, stop strings, ``max_new_tokens``);
  4. feedback: the drafter and the acceptance model learn what was accepted.

:meth:`Engine.stream` and :meth:`Engine.generate` are thin loops over ``start``/``step``;
servers call ``step`` once per round for the requests they hold.

The step's parts live by role: which requests work (all, or a
:class:`~ragspec.scheduling.StepComposer`'s plan) in :mod:`ragspec.stepping`, the request's
state and lifecycle (commit, chunk, stats) in :mod:`ragspec.request`, the prefill chunks in
:mod:`ragspec.prefill`, the draft choice (stage 1) in :mod:`ragspec.draft_choice`, prompt
encoding in :mod:`ragspec.prompts`.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Optional, Sequence, Union

import torch

from .backend.base import Capability, Target, VerifyItem
from .composition import DrafterParts, DraftSources
from .config import DecodeConfig, PolicyConfig, SamplingParams
from .deprecation import warn_deprecated
from .detok import TextAssembler
from .draft_choice import Pending, draft_for_step, observe_gates, per_request_drafts
from .drafters.base import (
    Drafter,
    DraftSession,
    SessionCapability,
    reproducible_drafter,
    salted_drafter,
    session_capabilities,
)
from .drafters.forced import ForcedTokenSession
from .errors import ConfigError, NoTokenLeftError, PromptTooLongError
from .grammar import Grammar, GrammarCompiler
from .logprobs import step_logprob_rows, step_rows
from .params import RequestParams, params_from_old_start, request_params
from .policy import DEFAULT_LATENCY, AcceptanceModel, DraftTimeGate, LatencyModel
from .prefill import prefill_budget, prefill_chunks
from .prefix_cache import PrefixCache
from .processing import ProcessorContext, build_processors
from .prompts import Messages, PreparedPrompt, Prompt, encode_documents, encode_messages, encode_prompt
from .request import Request, StepReport, commit_tokens, end_in_error, record_step, take_chunk
from .scheduling import StepPlan, Work
from .stepping import select_work
from .types import DraftTree, GenerationOutput, GenerationStats, StreamChunk, TokenLogprob, VerifyResult
from .verify import GreedyVerifier, Verifier, ended_before, verify_greedy

if TYPE_CHECKING:
    from .datastore import Datastore
    from .eagle import EagleHead

logger = logging.getLogger(__name__)

__all__ = ["Engine", "Request", "RequestParams", "PreparedPrompt", "DrafterParts", "StepReport"]


class Engine:
    """Lossless speculative decoding over a :class:`~ragspec.backend.base.Target`.

    Args:
        target: the target model's backend.
        tokenizer: its tokenizer.
        drafter: who proposes drafts (None: plain decoding only).
        policy: draft-size settings.
        latency: forward latency model (None: the reference CPU's table until refined).
        eos_token_ids: ids that end a generation (all EOS ids of the generation config).
        model_name: reported in stats and by the servers.
        parts: what ``drafter`` was composed of (see :class:`DrafterParts`).
        prefix_cache: another engine's prefix cache over the same target, shared where it
            fits this one's policy (None: a new one).
        datastores: name -> datastore a request may name
            (:attr:`RequestParams.datastore <ragspec.params.RequestParams.datastore>`), each
            drafted from by a drafter composed from ``parts``
            (:class:`~ragspec.composition.DraftSources`); ``parts.datastore``, the default,
            is one of them.
        grammars: another engine's grammar compiler over the same tokenizer, its compiled
            grammars shared (None: a new one).

    Constructing does no I/O: build engines with :func:`ragspec.loading.load_engine`.

    Raises:
        ConfigError: named datastores with a drafter not composed from ``parts``.
    """

    from_pretrained: ClassVar[Callable[..., "Engine"]]
    """Deprecated alias of :func:`ragspec.load_engine` (the same arguments), for one release:
    it warns. Set by :mod:`ragspec.loading`, which builds engines."""

    def __init__(
        self,
        target: Target,
        tokenizer: Any,
        *,
        drafter: Optional[Drafter] = None,
        policy: PolicyConfig = PolicyConfig(),
        latency: Optional[LatencyModel] = None,
        eos_token_ids: Sequence[int] = (),
        model_name: str = "",
        parts: DrafterParts = DrafterParts(),
        prefix_cache: Optional[PrefixCache] = None,
        datastores: Optional[Mapping[str, "Datastore"]] = None,
        grammars: Optional[GrammarCompiler] = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self._sources = DraftSources(drafter, parts, datastores)
        self.policy = policy
        self.latency = latency if latency is not None else LatencyModel(dict(DEFAULT_LATENCY))
        self.eos_token_ids = tuple(int(e) for e in eos_token_ids)
        self.model_name = model_name
        self._hidden_states = bool(target.capability(Capability.HIDDEN_STATES))
        self._lazy_rows = bool(target.capability(Capability.LAZY_ROWS))
        self._invalid_draft_sources: set[str] = set()  # sources already warned about (logging only)
        self.prefix_cache: Optional[PrefixCache] = (
            prefix_cache if prefix_cache is not None and self._fits(prefix_cache) else self._new_prefix_cache()
        )
        """The KV entries of prompt chunks kept across this engine's requests
        (:attr:`PolicyConfig.prefix_cache_tokens`), or None: off, unchunked prefill, or a
        target without ``Capability.PREFIX_KV``."""
        self.last_step = StepReport()
        """What the latest :meth:`step` call did."""
        self.grammars = (
            grammars
            if grammars is not None and grammars.tokenizer is tokenizer
            else GrammarCompiler(tokenizer, target.vocab_size, self.eos_token_ids)
        )
        """Compiles and caches the requests' structured-output constraints
        (``RequestParams.response_format``; :mod:`ragspec.grammar`)."""

    @property
    def drafting(self) -> str:
        """The drafting in effect (what ``generate --json``, the bench and ``/v1/models``
        report): ``"off"`` without a drafter; ``"retrieval"`` when retrieval drafts alone
        (``drafting="retrieval"``, or no EAGLE head composed: ``merged`` and ``select`` then
        have nothing to merge or select); else ``DrafterParts.drafting`` (``"merged"`` or
        ``"select"``); ``"custom"`` for a drafter not composed by :mod:`ragspec.loading`."""
        if self.drafter is None:
            return "off"
        parts = self.parts
        if not parts.composed:
            return "custom"
        return "retrieval" if parts.eagle is None else parts.drafting

    # ------------------------------------------------------------------ drafting sources
    @property
    def drafter(self) -> Optional[Drafter]:
        """The drafter of requests naming no datastore (None: plain decoding only)."""
        return self._sources.drafter

    @property
    def parts(self) -> DrafterParts:
        """What :attr:`drafter` was composed of (see :class:`DrafterParts`)."""
        return self._sources.parts

    @property
    def datastores(self) -> Mapping[str, "Datastore"]:
        """The datastores a request may name (``RequestParams.datastore``), name ->
        datastore as served now, in order (read-only)."""
        return self._sources.datastores

    @property
    def default_datastore(self) -> Optional[str]:
        """The name of the datastore requests naming none draft from (None: not a named one)."""
        return self._sources.default_name

    def swap_datastore(self, name: str, datastore: "Datastore") -> None:
        """Serve ``datastore`` (e.g. the same folder reopened after documents were added)
        under ``name`` from now on: requests started later draft from it, requests already
        started keep drafting from the one they started with. One reference swap: safe
        while another thread starts requests.

        Raises:
            DatastoreNotFoundError: this engine has no datastore of that name.
        """
        self._sources = self._sources.replacing(name, datastore)

    # ------------------------------------------------------------------ other engines
    def with_drafter(
        self,
        drafter: Optional[Drafter],
        parts: Optional[DrafterParts] = None,
        *,
        policy: Optional[PolicyConfig] = None,
        datastores: Optional[Mapping[str, "Datastore"]] = None,
    ) -> "Engine":
        """An engine sharing this one's target, tokenizer, latency model and prefix cache,
        drafting with ``drafter`` (``parts``: what it was composed of, default this one's;
        ``policy``: other draft-size settings, default this one's), for comparisons (the
        bench's budgets and drafting modes) and :func:`ragspec.loading.engine_over`. Its
        named datastores: ``datastores``, else this one's when ``parts`` compose (none when
        they compose nothing), drafted from as ``parts`` compose. No I/O."""
        parts = parts if parts is not None else self.parts
        if datastores is None:
            datastores = self.datastores if parts.composed else None
        return Engine(
            self.target,
            self.tokenizer,
            drafter=drafter,
            policy=policy if policy is not None else self.policy,
            latency=self.latency,
            eos_token_ids=self.eos_token_ids,
            model_name=self.model_name,
            parts=parts,
            prefix_cache=self.prefix_cache,  # kept where the new policy's chunks and budget are the same
            datastores=datastores,
            grammars=self.grammars,
        )

    def _new_prefix_cache(self) -> Optional[PrefixCache]:
        tokens, chunk = int(self.policy.prefix_cache_tokens), int(self.policy.prefill_chunk_tokens)
        if tokens <= 0 or not self.target.capability(Capability.PREFIX_KV):
            return None
        if not chunk or tokens < chunk:
            logger.warning(
                "prefix cache off: it keeps whole prefill chunks, and %s",
                "prefill is unchunked (prefill_chunk_tokens 0)"
                if not chunk
                else f"prefix_cache_tokens {tokens} is less than one chunk of {chunk} tokens",
            )
            return None
        return PrefixCache(tokens, chunk)

    def _fits(self, cache: PrefixCache) -> bool:
        """Whether ``cache`` (another engine's, same target) serves this engine's policy."""
        return cache.chunk_tokens == int(self.policy.prefill_chunk_tokens) and cache.max_tokens == int(
            self.policy.prefix_cache_tokens
        )

    @property
    def model(self) -> Any:
        """The backend's underlying model (the transformers model for ``HFTarget`` and ``CPUTarget``)."""
        return self.target.model

    @property
    def datastore(self) -> Optional["Datastore"]:
        """The datastore requests naming none draft from, or None."""
        return self.parts.datastore

    @property
    def eagle(self) -> Optional["EagleHead"]:
        """The EAGLE head this engine drafts with, or None."""
        return self.parts.eagle.head if self.parts.eagle is not None else None

    @property
    def eagle_path(self) -> Optional[str]:
        """Folder of the loaded EAGLE head, or None."""
        return self.parts.eagle_path

    # ------------------------------------------------------------------ prompts
    def encode_prompt(self, prompt: Prompt, chat: bool = True, documents: Sequence[str] = ()) -> list[int]:
        """Token ids of a prompt: text goes through the chat template when ``chat`` (and the
        tokenizer has one); a list of ids is taken as is; ``documents`` laid in for the
        model to read (:func:`ragspec.prompts.encode_prompt`).

        Raises:
            ConfigError: the prompt is empty, or not valid Unicode text (a lone surrogate);
                documents with a prompt of token ids.
        """
        return encode_prompt(self.tokenizer, prompt, chat, documents)

    def encode_messages(
        self, messages: Messages, documents: Sequence[str] = (), tools: Sequence[Mapping[str, Any]] = ()
    ) -> list[int]:
        """Token ids of a chat (list of {"role", "content"}) through the chat template,
        ``documents`` laid in for the model to read, ``tools`` (OpenAI's definitions)
        shown where the template declares tool use (:func:`ragspec.prompts.encode_messages`).

        Raises:
            ConfigError: a message's content is not valid Unicode text (a lone surrogate).
        """
        return encode_messages(self.tokenizer, messages, documents, tools)

    def encode_documents(self, documents: Sequence[str]) -> list[list[int]]:
        """Token ids of each document (no special tokens).

        Raises:
            ConfigError: a document is not a string, or not valid Unicode text.
        """
        return encode_documents(self.tokenizer, documents)

    # ------------------------------------------------------------------ requests
    def prepare(
        self,
        prompt: Union[Prompt, Messages],
        params: Optional[RequestParams] = None,
        *,
        chat: bool = True,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> PreparedPrompt:
        """The token ids a request reads (no forward; a front end may run it on another
        thread than the one that steps): the prompt with ``params.documents`` laid in for
        the model (:mod:`ragspec.prompts`: the chat template's documents where it takes
        them, else the default layout), and, when the request drafts, the token ids of its
        ``documents`` and ``draft_documents`` for the drafter. A ``response_format`` is
        compiled here (into :attr:`grammars`' cache), so a constraint that cannot be served
        is refused before the request is queued.

        Args:
            prompt: text (chat-templated when ``chat``), token ids, or a chat
                (``{"role", "content"}`` messages, always chat-templated).
            params: the request's parameters (None: the defaults).
            chat: apply the chat template to a text prompt.
            tools: OpenAI's tool definitions, shown to a chat template that declares tool
                use (:func:`ragspec.prompts.template_takes_tools`).

        Raises:
            ConfigError: an empty prompt, text that is not valid Unicode, a non-string
                document, documents with a prompt of token ids.
            StructuredOutputError: a ``response_format`` that does not compile (naming its
                field in ``param``).
        """
        params = params if params is not None else RequestParams()
        if params.constraint is not None:
            self.grammars.compile(params.constraint)
        if _is_messages(prompt):
            ids = self.encode_messages(prompt, params.documents, tools)  # type: ignore[arg-type]
        else:
            ids = self.encode_prompt(prompt, chat=chat, documents=params.documents)  # type: ignore[arg-type]
        docs = self.encode_documents([*params.documents, *params.draft_documents]) if params.drafts else []
        return PreparedPrompt(tuple(ids), tuple(tuple(d) for d in docs))

    def start(
        self,
        prompt: Union[Prompt, Messages, PreparedPrompt],
        params: Union[RequestParams, DecodeConfig, None] = None,
        sampling: Optional[SamplingParams] = None,
        *,
        chat: bool = True,
        **deprecated: Any,
    ) -> Request:
        """A new request, ready for :meth:`step` (no forward runs here).

        Args:
            prompt: text (chat-templated when ``chat``), token ids, a chat, or a prompt
                already prepared (:meth:`prepare`).
            params: what the request asks for (:class:`~ragspec.params.RequestParams`; None:
                the defaults). Its ``datastore`` picks the drafter
                (:attr:`datastores`); its ``cache_salt`` is its partition of the prefix
                cache and of drafters that read other requests' tokens (vLLM's
                ``cache_salt``): it reuses only what requests of the same salt stored, so
                tenants of other salts cannot observe its prompts through hits, timing or
                ``num_cached_prompt_tokens`` ("": the shared partition).
            sampling: deprecated (with ``params`` a ``DecodeConfig``, and the keywords
                ``decode``, ``sampling``, ``documents``, ``document_ids``, ``cache_salt``):
                the parameters as the component settings (``documents`` there are the
                drafter's alone, as before); give a ``RequestParams``.
            chat: apply the chat template to a text prompt.

        Raises:
            PromptTooLongError: prompt + max_new_tokens exceed the context length.
            ConfigError: an empty prompt, a non-string document.
            DatastoreNotFoundError: ``params.datastore`` names no datastore of this engine.
            IsolationError: a salted request that drafts, on a drafter that does not declare
                whether it reads other requests' tokens.
            StructuredOutputError: a ``response_format`` that does not compile.
        """
        extra_ids: Sequence[Sequence[int]] = ()
        if sampling is not None or deprecated or isinstance(params, DecodeConfig):
            params, extra_ids = params_from_old_start(params, sampling, deprecated)
        params = params if params is not None else RequestParams()
        if params.n != 1:
            raise ConfigError(f"n={params.n}: a request of several choices starts with Engine.start_choices")
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare(prompt, params, chat=chat)
        prompt_ids = list(prompt.prompt_ids)
        limit = self.target.max_length
        if limit is not None and len(prompt_ids) + params.max_new_tokens > limit:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} exceeds the "
                f"context length of {limit} tokens"
            )
        drafter = self._sources.drafter_for(params.datastore)
        if params.greedy:
            verifier: Verifier = GreedyVerifier()
            generator = None
        else:
            from .sampling import SamplingVerifier

            verifier = SamplingVerifier(params.sampling)
            generator = torch.Generator(device="cpu")
            if params.seed is not None:
                generator.manual_seed(int(params.seed))
            else:
                generator.seed()
        seeded = not params.greedy and params.seed is not None
        doc_ids = [list(d) for d in prompt.document_ids] + [list(d) for d in extra_ids]
        fmt = params.constraint
        grammar = self.grammars.compile(fmt) if fmt is not None else None
        session = self._session(drafter, params, prompt_ids, doc_ids, seeded, grammar)
        processors = build_processors(
            params,
            ProcessorContext(
                tuple(prompt_ids), self.target.vocab_size, self.eos_token_ids, self.tokenizer, grammar=grammar
            ),
        )
        req = Request(
            prompt_ids=prompt_ids,
            params=params,
            processors=processors,
            state=self.target.new_state(),
            verifier=verifier,
            session=session,
            generator=generator,
            acceptance=AcceptanceModel(),
            # each request refines its own copy of the latency model; a seeded sampled
            # request uses the fixed reference table instead, so its drafts (and thus its
            # samples) depend neither on timing noise, other requests, nor on the latency
            # measured at this process's start: same seed, same output, in any process
            latency=LatencyModel(dict(DEFAULT_LATENCY), ema=0.0) if seeded else self.latency.fork(),
            assembler=TextAssembler(self.tokenizer, params.stop, prompt_ids[-4:]),
            want_hidden=(
                session is not None
                and self._hidden_states
                and SessionCapability.HIDDEN_STATES in session_capabilities(session)
            ),
            prefill_chunk=int(self.policy.prefill_chunk_tokens),
            batch_independent=seeded,
        )
        req.stats.num_prompt_tokens = len(prompt_ids)
        if params.max_new_tokens == 0:
            req.finish_reason = "length"
        return req

    def start_choices(
        self, prompt: Union[Prompt, Messages, PreparedPrompt], params: RequestParams, *, chat: bool = True
    ) -> list[Request]:
        """The ``params.n`` choices of one request, each a :class:`Request` of ``n=1``,
        ready to be stepped together (no forward runs here). Choice i samples with its own
        generator, seeded ``params.seed + i`` (vLLM's rule; unseeded: fresh seeds); they
        share one prefill: choice 0 runs it, and where the target copies KV entries
        (``Capability.PREFIX_KV``) the others copy its prompt's entries once it ran and
        choose their first token from its last logits (otherwise each prefills itself).
        Greedy choices are all the same output.

        Raises:
            as :meth:`start`.
        """
        if not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare(prompt, params, chat=chat)
        one = params.replace(n=1)
        choices = [
            self.start(prompt, one if params.seed is None else one.replace(seed=params.seed + i))
            for i in range(params.n)
        ]
        if len(choices) > 1 and self.target.capability(Capability.PREFIX_KV):
            choices[0].shares_prefill = True
            for req in choices[1:]:
                req.fork_of = choices[0]
        return choices

    def generate_choices(
        self,
        prompt: Union[Prompt, Messages],
        params: Optional[RequestParams] = None,
        *,
        chat: bool = True,
        **fields: Any,
    ) -> list[GenerationOutput]:
        """:meth:`generate` for a request of ``n`` choices (:meth:`start_choices`, stepped
        together): one :class:`~ragspec.types.GenerationOutput` per choice, in order.

        Raises:
            TypeError: an unknown keyword. Others: as :meth:`start`.
        """
        choices = self.start_choices(prompt, request_params(params, **fields), chat=chat)
        outs = [GenerationOutput("", [], GenerationStats()) for _ in choices]
        running = list(range(len(choices)))
        while running:
            for i, chunk in zip(running, self.step([choices[i] for i in running])):
                out = outs[i]
                out.text += chunk.text
                out.token_ids.extend(chunk.token_ids)
                out.logprobs.extend(chunk.logprobs)
                if chunk.stats is not None:
                    out.stats = chunk.stats
            running = [i for i in running if not choices[i].done]
        return outs

    def _session(
        self,
        drafter: Optional[Drafter],
        params: RequestParams,
        prompt_ids: Sequence[int],
        doc_ids: Sequence[Sequence[int]],
        seeded: bool,
        grammar: Optional[Grammar] = None,
    ) -> Optional[DraftSession]:
        """The request's draft session (None: it does not draft): a seeded sampled request
        drafts only from its own tokens (same seed, same output); a salted one from its
        salt's partition (:func:`~ragspec.drafters.base.salted_drafter`, which refuses a
        drafter that does not declare its isolation). A request under a ``grammar`` drafts
        the tokens it forces first (:class:`~ragspec.drafters.forced.ForcedTokenSession`),
        also on an engine without a drafter."""
        if not params.drafts:
            return None
        session: Optional[DraftSession] = None
        chosen = reproducible_drafter(drafter) if seeded else drafter
        chosen = salted_drafter(chosen, params.cache_salt)
        if chosen is not None:
            session = chosen.start_request(prompt_ids, doc_ids, eos_token_ids=self.eos_token_ids)
        if grammar is not None:
            session = ForcedTokenSession(session, grammar.follower())
        return session

    def step_tokens(self, req: Request) -> int:
        """Most tokens ``req`` puts through the model in its next step: its next prefill
        chunk, or its verification rows (root + at most ``max_draft_tokens``); 0 when it
        finishes without a forward (finished, cancelled). For schedulers' token budgets."""
        if req.done or req.finish_reason or req.cancel_requested:
            return 0
        if req.prefilling:
            return req.next_prefill_tokens()
        return 1 + (req.draft_budget(self.policy.max_draft_tokens) if req.session is not None else 0)

    def work(self, requests: Sequence[Request], tenants: Optional[Sequence[str]] = None) -> list[Work]:
        """What a :class:`~ragspec.scheduling.StepComposer` needs of each request
        (:meth:`Request.work <ragspec.request.Request.work>`, ``index`` its position in
        ``requests``); ``tenants[i]``: whose request i is (None: one tenant)."""
        return [req.work(i, tenants[i] if tenants is not None else "") for i, req in enumerate(requests)]

    def step(self, requests: Sequence[Request], plan: Optional[StepPlan] = None) -> list[StreamChunk]:
        """Advance each request by one step: one chunk of its prefill, or one
        draft-verify-commit round in one ``Target.verify`` call for all of them.

        Which requests work (``plan``): None: every decoding request decodes and prefilling
        requests run a chunk each, the earliest first, within ``PolicyConfig.prefill_step_tokens``
        (:func:`~ragspec.prefill.prefill_budget`). A :class:`~ragspec.scheduling.StepPlan`
        (from a :class:`~ragspec.scheduling.StepComposer` over :meth:`work`) names them by
        their index in ``requests``: ``plan.prefill`` run one chunk each, in that order,
        ``plan.decode`` are verified; the others do nothing in this step (finished or
        cancelled ones still end in it). Each request's own steps are the same whichever
        plan: outputs do not depend on the schedule.

        Drafts (batch-aware, time-gated): :meth:`_decode`.

        Returns:
            one :class:`~ragspec.types.StreamChunk` per request, in order: the text and
            tokens committed by this step (possibly empty), and for a request that finished
            in it ``finish_reason`` and ``stats`` (its last chunk).

        Raises:
            ConfigError: a request was already finished; a plan naming a request that is
                not prefilling (in ``plan.prefill``) or not decoding (in ``plan.decode``).
        """
        for req in requests:
            if req.done:
                raise ConfigError("request already finished: its final chunk was returned")
        t_step = time.perf_counter()
        counts = self.target.capability(Capability.STEP_COUNTS)
        with torch.inference_mode():
            prefilling, decoding = select_work(requests, plan)
            prefill_tokens, chunks, prefill_s = prefill_chunks(
                self.target,
                prefilling,
                self.prefix_cache,
                budget=prefill_budget(self.policy) if plan is None else None,  # a plan is run as it is
                hidden_states=self._hidden_states,
                eos_token_ids=self.eos_token_ids,
            )
            pending, decode_s = self._decode(decoding)
        after = self.target.capability(Capability.STEP_COUNTS)
        self.last_step = StepReport(
            requests=len(requests) if plan is None else len(plan.indices),
            verified=len(pending),
            rows=sum(1 + p.tree.num_nodes for p in pending),
            prefill_tokens=prefill_tokens,
            prefill_chunks=chunks,
            seconds=time.perf_counter() - t_step,
            prefill_s=prefill_s,
            decode_s=decode_s,
            graph_steps=after.graph_steps - counts.graph_steps if after else 0,
            eager_steps=after.eager_steps - counts.eager_steps if after else 0,
        )
        return [take_chunk(req) for req in requests]

    def _decode(self, decoding: Sequence[tuple[int, Request]]) -> tuple[list[Pending], float]:
        """The step's decoding part for ``decoding`` (``(index, request)``): each request's
        draft, one ``Target.verify`` over all of them, each verified and committed. Returns
        what was verified and the part's seconds (0 with nobody decoding).

        Drafts in a batch (``PolicyConfig.batch_aware`` with ``adaptive``): the verification
        forward costs about ``latency(total rows)``, so each request's draft is chosen for
        the committed tokens per second of the whole step: request j weighs its expected
        committed tokens plus the others' against ``latency(rows of the others + its own)``
        (:func:`~ragspec.policy.choose_draft`'s ``other_rows`` / ``other_committed``; the
        requests before it with their chosen drafts, the ones after it at one row and one
        token each), and no request gets more than ``max_step_rows // requests - 1`` draft
        nodes. A row's share of a step's cost falls as the batch grows, and so does its
        share of the step's gain: drafts shrink with the batch. Greedy outputs do not depend
        on drafts; seeded sampled requests keep their solo choice.

        Drafting time (``PolicyConfig.draft_time_gate`` with ``adaptive``): the cost model
        prices a draft's rows, not the seconds its drafter spends proposing it, so a request
        alone (its ``solo_draft_gate``) or in a batched step (its ``draft_gate``) drafts only
        while its drafting has been adding more tokens than its drafting seconds and draft
        rows cost (:class:`~ragspec.policy.DraftTimeGate`); otherwise its steps are plain
        ones, with a retry every few steps. Seeded sampled requests are never gated.
        """
        pending: list[Pending] = []
        batch = len(decoding) > 1 and self.policy.adaptive and self.policy.batch_aware
        cap = per_request_drafts(self.policy, self.latency, len(decoding)) if batch else None
        # a request drafts while its drafting pays for its own seconds (DraftTimeGate),
        # alone and in a batched step; seeded sampled requests' drafts must not depend
        # on timing: never gated
        solo = len(decoding) == 1
        gate = self.policy.draft_time_gate and self.policy.adaptive and (batch or solo)
        gates: list[Optional[DraftTimeGate]] = []  # fed after the step (None: not gated)
        t_decode = time.perf_counter()
        other_rows, other_committed = 0, 0.0
        for j, (i, req) in enumerate(decoding):
            later = len(decoding) - 1 - j  # not drafted yet: one row, one token each
            g = None
            if gate and req.session is not None and not req.batch_independent:
                g = req.solo_draft_gate if solo else req.draft_gate
            skip = g is not None and not g.should_draft()
            if batch and not req.batch_independent:
                p = self._draft(i, req, other_rows + later, other_committed + later, cap, skip=skip)
            else:
                p = self._draft(i, req, skip=skip)
            gates.append(g if p.proposed else None)
            pending.append(p)
            other_rows += 1 + p.tree.num_nodes
            other_committed += 1.0 + p.predicted
        if not pending:
            return pending, 0.0
        items = [
            VerifyItem(p.request.state, int(p.request.root), p.tree, p.request.want_hidden, p.lazy)  # type: ignore[arg-type]
            for p in pending
        ]
        t1 = time.perf_counter()
        outs = self.target.verify(items)
        results = [self._accept(p, out, t1, solo=len(pending) == 1) for p, out in zip(pending, outs)]
        decode_s = time.perf_counter() - t_decode
        if any(g is not None for g in gates):
            observe_gates(pending, results, gates, decode_s)
        return pending, decode_s

    # ------------------------------------------------------------------ thin loops
    def stream(
        self,
        prompt: Union[Prompt, Messages],
        params: Optional[RequestParams] = None,
        *,
        chat: bool = True,
        should_cancel: Optional[Callable[[], bool]] = None,
        document_ids: Optional[Sequence[Sequence[int]]] = None,
        **fields: Any,
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, but yields :class:`StreamChunk` s as tokens are committed.

        No chunk ever carries text that a later stop string removes. The last chunk has
        ``finish_reason`` ("stop", "length", "cancelled" or "error") and ``stats``. Closing the
        iterator, or ``should_cancel()`` returning True, ends the generation within one step.

        Raises (at the call, before any forward):
            TypeError: an unknown keyword.
            PromptTooLongError, ConfigError, DatastoreNotFoundError, IsolationError: as :meth:`start`.
        """
        req = self.request(prompt, params, chat=chat, document_ids=document_ids, **fields)
        return self.iterate(req, should_cancel)

    def request(
        self,
        prompt: Union[Prompt, Messages],
        params: Optional[RequestParams] = None,
        *,
        chat: bool = True,
        document_ids: Optional[Sequence[Sequence[int]]] = None,
        **fields: Any,
    ) -> Request:
        """:meth:`start` with the request's parameters as ``params`` and/or keywords, the
        fields of :class:`~ragspec.params.RequestParams` (``max_new_tokens``, ``stop``,
        ``temperature`` ...; built in one place, :func:`ragspec.params.request_params`); no
        forward runs. ``document_ids`` (deprecated): token ids only the drafter reads; give
        texts as ``draft_documents``.

        Raises:
            TypeError: an unknown keyword.
            PromptTooLongError, ConfigError, DatastoreNotFoundError, IsolationError: as :meth:`start`.
        """
        params = request_params(params, **fields)
        if document_ids is None:
            return self.start(prompt, params, chat=chat)
        warn_deprecated(
            "Engine.request/stream/generate(document_ids=)",
            "draft_documents= (texts the drafter alone reads), or a PreparedPrompt to Engine.start",
        )
        prepared = self.prepare(prompt, params, chat=chat)
        extra = tuple(tuple(int(t) for t in d) for d in document_ids) if params.drafts else ()
        return self.start(PreparedPrompt(prepared.prompt_ids, prepared.document_ids + extra), params)

    def run_requests(
        self, starts: Sequence[Callable[[], Request]], in_flight: int
    ) -> Iterator[list[tuple[int, StreamChunk]]]:
        """Continuous batching over a list of requests: ``starts[i]()`` (e.g. a
        :meth:`request` call) is called in order whenever fewer than ``in_flight`` run,
        all running requests advance together (:meth:`step`), and each leaves once its
        chunk carries a finish reason, its slot taken by the next.

        Yields:
            per step, ``(i, chunk)`` for every request of the step (``i`` its index in
            ``starts``), in start order.

        Raises:
            ConfigError: ``in_flight`` < 1.
        """
        if in_flight < 1:
            raise ConfigError(f"in_flight must be >= 1, got {in_flight}")
        waiting = list(range(len(starts)))
        running: list[tuple[int, Request]] = []
        while waiting or running:
            while waiting and len(running) < in_flight:
                i = waiting.pop(0)
                running.append((i, starts[i]()))
            chunks = self.step([r for _, r in running])
            yield [(i, c) for (i, _), c in zip(running, chunks)]
            running = [(i, r) for (i, r), c in zip(running, chunks) if c.finish_reason is None]

    def iterate(self, req: Request, should_cancel: Optional[Callable[[], bool]] = None) -> Iterator[StreamChunk]:
        """Step ``req`` alone until it finishes, yielding its non-empty chunks and the last.
        ``should_cancel`` is asked before every step after the first."""
        while True:
            if should_cancel is not None and req.started_s and should_cancel():
                req.cancel()
            (chunk,) = self.step([req])
            if chunk.text or chunk.token_ids or chunk.finish_reason:
                yield chunk
            if chunk.finish_reason:
                return

    def generate(
        self, prompt: Union[Prompt, Messages], params: Optional[RequestParams] = None, **kwargs: Any
    ) -> GenerationOutput:
        """Generate a completion.

        Args:
            prompt: text (chat-templated when ``chat=True``), token ids, or a chat
                (``{"role", "content"}`` messages).
            params: the request's parameters (:class:`~ragspec.params.RequestParams`); the
                keywords below, its fields, build one or replace its values:
            max_new_tokens: most tokens generated (default 128).
            stop: stop strings; the text from the first match on is dropped.
            documents: texts the model reads as grounding (the chat template's documents,
                else laid before the prompt: :mod:`ragspec.prompts`) and the drafter copies
                from.
            draft_documents: texts only the drafter copies from (e.g. passages the prompt
                already holds in another form).
            datastore: the name of the datastore to draft from (:attr:`datastores`; None:
                the default).
            speculative: False for plain decoding (no drafts).
            max_draft_tokens: this request's draft budget per step, under the engine's
                (None: the engine's; 0: plain decoding, as ``speculative=False``).
            temperature, top_k, top_p, seed: sampling settings (temperature 0 = greedy).
            return_steps: keep per-step stats in ``stats.steps``.
            cache_salt: the request's partition of the prefix and response caches (see
                :meth:`start`; None: the shared one).
            chat: apply the chat template to a text prompt.
            should_cancel: asked before each step; True ends the generation.

        Returns:
            GenerationOutput with ``.text``, ``.token_ids`` (generated only), ``.stats``
            and, when asked (``logprobs``), ``.logprobs`` (one entry per token).

        Raises:
            TypeError: an unknown keyword.
            PromptTooLongError: prompt + max_new_tokens exceed the context length.
            ConfigError: invalid settings; UnsupportedParameterError: a field the engine
                does not implement yet (``n``, ``logprobs`` ...).
            DatastoreNotFoundError, IsolationError: as :meth:`start`.
        """
        text_parts: list[str] = []
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        stats = None
        for chunk in self.stream(prompt, params, **kwargs):
            text_parts.append(chunk.text)
            tokens.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            if chunk.stats is not None:
                stats = chunk.stats
        assert stats is not None, "stream ended without a final chunk"
        return GenerationOutput("".join(text_parts), tokens, stats, logprobs)

    # ------------------------------------------------------------------ stages
    def _draft(
        self,
        index: int,
        req: Request,
        other_rows: int = 0,
        other_committed: float = 0.0,
        cap: Optional[int] = None,
        skip: bool = False,
    ) -> Pending:
        """Stage 1 for one request: :func:`~ragspec.draft_choice.draft_for_step` with this
        engine's target and policy (``other_rows``, ``other_committed``, ``cap``, ``skip``:
        see there)."""
        return draft_for_step(
            self.target,
            self.policy,
            index,
            req,
            lazy_rows=self._lazy_rows,
            on_invalid=self._dropped_invalid_drafts,
            other_rows=other_rows,
            other_committed=other_committed,
            cap=cap,
            skip=skip,
        )

    def _dropped_invalid_drafts(self, stats: GenerationStats, raw: DraftTree, kept: DraftTree, dropped: int) -> None:
        """Count draft nodes dropped by :func:`~ragspec.tree.drop_invalid_nodes`; warn once
        per source."""
        stats.num_invalid_draft_tokens += dropped
        sources = sorted(set((Counter(raw.sources) - Counter(kept.sources)).keys()) or {"draft"})
        new = [s for s in sources if s not in self._invalid_draft_sources]
        if new:
            self._invalid_draft_sources.update(new)
            logger.warning(
                "drafter %s proposed token ids outside the vocabulary [0, %d) or a malformed tree: %d node(s) "
                "dropped (counted in stats.num_invalid_draft_tokens; a datastore may be damaged: "
                "ragspec datastore info --verify DIR); further drops from it are not logged",
                "/".join(new),
                self.target.vocab_size,
                dropped,
            )

    def _accept(self, p: Pending, out: Any, t1: float, solo: bool) -> VerifyResult:
        """Stages 2-4 for one request: verify its tree against ``out`` (the backend's
        :class:`~ragspec.backend.base.ForwardOutput`), commit, feed back. Returns the
        verification's result."""
        req, tree = p.request, p.tree
        chain = req.processors
        row_fn = chain.rows(tree) if chain else None
        lp = step_logprob_rows(req.params, row_fn)  # None unless the request returns logprobs
        fn = lp if lp is not None else row_fn
        try:
            if req.verifier.greedy:
                logits = out.row_logits if out.row_logits is not None else out.logits
                res = verify_greedy(tree, logits, fn)
            else:
                logits = out.logits if out.logits is not None else out.row_logits.full()
                res = req.verifier(tree, logits, req.generator, fn)
        except NoTokenLeftError as e:  # the path up to that row is committed, nothing from it
            res = ended_before(tree, e.row)
        if req.want_hidden:
            # features of the positions now kept in the cache: root + accepted path
            rows = [0] + [1 + i for i in res.accepted_nodes]
            req.session.extend_hidden(out.hidden[rows])  # type: ignore[union-attr]
        # 3. commit: KV rollback, then the stop conditions token by token
        self.target.commit(req.state, p.past, res.accepted_nodes)
        t2 = time.perf_counter()
        committed = res.tokens
        kept = commit_tokens(req, committed, self.eos_token_ids)
        if res.ended:
            end_in_error(req)
        if chain:  # what the output kept: a step may verify past an EOS or a stop string
            chain.commit(committed[:kept])
        if lp is not None:
            req.logprobs.extend(lp.entries(step_rows(logits), res)[:kept])
        # 4. feedback
        if tree.num_nodes and not res.ended:
            req.acceptance.observe(tree, res)
            if req.session is not None:
                req.session.observe(tree, res)
        if solo:
            # the latency model is of one request's forward; a batch's time is not
            early = out.row_logits is not None and out.row_logits.rows_computed == 1
            req.latency.observe(1 + tree.num_nodes, t2 - t1, early=early)
        if req.session is not None and not req.finish_reason:
            req.session.extend(committed)
        req.root = committed[-1] if committed else req.root
        record_step(req.stats, tree, res, kept, p.draft_s, t2 - t1, p.predicted, req.decode.return_steps)
        return res


def _is_messages(prompt: Any) -> bool:
    """Whether ``prompt`` is a chat (a non-empty sequence of mappings), not text or token ids."""
    return not isinstance(prompt, str) and len(prompt) > 0 and isinstance(prompt[0], Mapping)
