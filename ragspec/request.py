"""A request of the decode loop: its state (:class:`Request`, made by
:meth:`Engine.start <ragspec.engine.Engine.start>`, advanced by
:meth:`Engine.step <ragspec.engine.Engine.step>`) and the steps of its lifecycle that touch
nothing but it: committed tokens through the stop conditions (:func:`commit_tokens`), the
chunk a step returns (:func:`take_chunk`), the stats of a decode step (:func:`record_step`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from .config import DecodeConfig, SamplingParams
from .detok import TextAssembler
from .drafters.base import DraftSession, SessionCapability, session_capabilities
from .params import RequestParams
from .policy import AcceptanceModel, DraftTimeGate, LatencyModel
from .processors import ProcessorChain
from .scheduling import Work
from .types import DraftTree, GenerationStats, StepStats, StreamChunk, TokenLogprob, VerifyResult
from .verify import Verifier

__all__ = ["Request", "StepReport", "commit_tokens", "end_in_error", "take_chunk", "record_step"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Request:
    """One generation: everything that is per request, never shared.

    Made by :meth:`Engine.start`; advanced by :meth:`Engine.step`. Its first step is the
    prefill; it is finished once a step returned its final chunk (``finish_reason`` set).

    Attributes:
        prompt_ids: the prompt's token ids (documents laid in).
        params: what the request asked for (:class:`~ragspec.params.RequestParams`; its
            ``decode`` limits and ``sampling`` are read from it).
        state: the backend's KV state of this request.
        session: the drafter's per-request session, or None (plain decoding).
        generator: the request's random generator (None when greedy).
        root: the last committed token, whose KV entry is not in the cache yet (None
            before the prefill).
        stats: counters and timings so far.
        finish_reason: "stop", "length", "cancelled" or "error" (its processing left no
            token to choose: :class:`~ragspec.errors.NoTokenLeftError`) once finished,
            else "".
    """

    prompt_ids: list[int]
    params: RequestParams
    state: Any
    verifier: Verifier
    session: Optional[DraftSession]
    generator: Optional[torch.Generator]
    acceptance: AcceptanceModel
    latency: LatencyModel
    assembler: TextAssembler
    want_hidden: bool = False
    prefill_chunk: int = 0
    """Prompt tokens per prefill step (0: the whole prompt at once); fixed at start."""
    prefilled: int = 0
    """Prompt tokens already in ``state`` (chunked prefill progress)."""
    batch_independent: bool = False
    """Its drafts never depend on the other requests of a step (seeded sampling)."""
    draft_gate: DraftTimeGate = field(default_factory=DraftTimeGate)
    """Whether its drafting pays for its seconds in batched steps (``PolicyConfig.draft_time_gate``)."""
    solo_draft_gate: DraftTimeGate = field(default_factory=DraftTimeGate.solo)
    """The same for its steps alone (:meth:`DraftTimeGate.solo`)."""
    processors: ProcessorChain = field(default_factory=lambda: ProcessorChain(()))
    """Its logit processors (:mod:`ragspec.processors`; empty: none, the unprocessed path)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """One entry per generated token when ``params.logprobs`` (else empty)."""
    fork_of: Optional["Request"] = None
    """Another choice of the same request (``n`` > 1) whose prefill this one shares: it
    waits for that prefill, then copies its KV entries instead of running its own
    (:func:`ragspec.prefill.fork_prefill`); None once forked, or for a request of its own."""
    shares_prefill: bool = False
    """Other choices fork from its prefill: it keeps its prompt's last logits
    (:attr:`fork_logits`) and, where its drafter reads them, hidden states (:attr:`fork_hidden`)."""
    fork_logits: Optional[torch.Tensor] = None
    """The prompt's last logits float32 [1, V] once its prefill ran, where :attr:`shares_prefill`."""
    fork_hidden: list[torch.Tensor] = field(default_factory=list)
    """The prompt's hidden states, chunk by chunk, where :attr:`shares_prefill` and its
    drafter reads them."""
    root: Optional[int] = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    finish_reason: str = ""
    cancel_requested: bool = False
    done: bool = False
    """The final chunk has been returned; stepping it again is an error."""
    started_s: float = 0.0
    """``time.perf_counter()`` at its first step (0 before)."""
    created_s: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when :meth:`Engine.start` made it."""

    @property
    def decode(self) -> DecodeConfig:
        """Its limits (``max_new_tokens``, stop strings, speculation on/off, its own draft
        budget ``max_draft_tokens``)."""
        return self.params.decode

    @property
    def sampling(self) -> SamplingParams:
        """How its tokens are chosen (temperature 0 = greedy)."""
        return self.params.sampling

    @property
    def cache_salt(self) -> str:
        """Its partition of the caches shared across requests (prefix cache, response
        cache): hits only among requests of the same salt ("": the shared partition)."""
        return self.params.cache_salt

    def cancel(self) -> None:
        """Ask the engine to end this request at its next step (with ``finish_reason``
        "cancelled"; no forward is run for it)."""
        self.cancel_requested = True

    @property
    def num_generated_tokens(self) -> int:
        return len(self.assembler.token_ids)

    @property
    def prefilling(self) -> bool:
        """Whether its prompt is not fully in its KV cache yet (its next step is a chunk)."""
        return self.root is None and not self.finish_reason

    def next_prefill_tokens(self) -> int:
        """Prompt tokens its next step puts through the model (0 once prefilled)."""
        if not self.prefilling or self.fork_of is not None:
            return 0  # a choice forking another's prefill runs no prompt token
        left = len(self.prompt_ids) - self.prefilled
        return min(left, self.prefill_chunk) if self.prefill_chunk else left

    def work(self, index: int, tenant: str = "") -> Work:
        """This request as a :class:`~ragspec.scheduling.StepComposer` sees it before a
        step (``index``: its position in the step's list; ``tenant``: whose it is): prompt
        left, next chunk, rows and tokens per decode step (root + the draft nodes it verified
        per step so far; tokens committed per step), tokens left, whether it started or ends
        without a forward; a choice that shares another's prefill (:attr:`fork_of`) waits for it (``blocked``), then copies
        it (``forked``: no prefill forward of its own)."""
        stats = self.stats
        drafted = stats.num_drafted_tokens / stats.num_steps if stats.num_steps else 0.0
        source = self.fork_of
        waits = (
            source is not None
            and source.fork_logits is None
            and source.root is None
            and not source.finish_reason
            and not source.cancel_requested
        )
        return Work(
            index=index,
            arrival_s=self.created_s,
            prompt_left=len(self.prompt_ids) - self.prefilled if self.prefilling else 0,
            chunk=self.next_prefill_tokens(),
            rows=1 + round(drafted),
            tokens_left=max(0, self.decode.max_new_tokens - self.num_generated_tokens),
            started=bool(self.started_s),
            done=bool(self.done or self.finish_reason or self.cancel_requested),
            tenant=tenant,
            blocked=waits,
            forked=source is not None and not waits,
            tokens_per_step=stats.mean_accepted_tokens,
        )

    def draft_budget(self, engine_budget: int) -> int:
        """Most draft tokens a step of this request verifies: ``engine_budget`` (the
        engine's ``PolicyConfig.max_draft_tokens``), capped by its own
        ``decode.max_draft_tokens`` when set."""
        cap = self.decode.max_draft_tokens
        return engine_budget if cap is None else min(engine_budget, cap)


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`Engine.step` call did (``Engine.last_step``), for schedulers and
    metrics.

    Attributes:
        requests: requests handed to the step.
        verified: requests verified in its forward (decoding requests).
        rows: verification rows of that forward (roots + draft nodes, all requests).
        prefill_tokens: prompt tokens prefilled in it (all chunks).
        prefill_chunks: prefill forwards run in it.
        seconds: wall time of the step.
        prefill_s: seconds of it in prefill forwards.
        decode_s: seconds of its decoding part (drafting, the verification forward,
            commits; 0 without decoding requests).
        graph_steps: its forwards replayed from a CUDA graph (the CUDA backend; 0 elsewhere).
        eager_steps: its forwards a graph-replaying backend ran eagerly (a batch larger than
            its largest graph, a failed capture; 0 elsewhere).
    """

    requests: int = 0
    verified: int = 0
    rows: int = 0
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    seconds: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    graph_steps: int = 0
    eager_steps: int = 0


def commit_tokens(req: Request, tokens: Sequence[int], eos_token_ids: Sequence[int]) -> int:
    """Pass committed tokens one by one through the stop conditions (``eos_token_ids``,
    stop strings from the request's ``min_tokens``-th token on, ``max_new_tokens``).

    Returns how many of ``tokens`` were kept; sets ``req.finish_reason`` when the
    generation ends (EOS, stop string, max_new_tokens)."""
    kept = 0
    min_tokens = req.params.min_tokens
    for t in tokens:
        kept += 1
        if t in eos_token_ids:
            req.assembler.add(t, with_text=False)
            req.finish_reason = "stop"
            break
        # stop strings count from the min_tokens-th token on (vLLM's rule)
        if req.assembler.add(t, stop=len(req.assembler.token_ids) + 1 >= min_tokens):
            req.finish_reason = "stop"
            break
        if len(req.assembler.token_ids) >= req.decode.max_new_tokens:
            req.finish_reason = "length"
            break
    return kept


def end_in_error(req: Request) -> None:
    """End ``req`` with ``finish_reason`` "error" once its processing left a row with no
    token to choose (:class:`~ragspec.errors.NoTokenLeftError`), after the tokens
    accepted before that row were committed (unless they ended it themselves); logged."""
    if req.finish_reason:
        return
    req.finish_reason = "error"
    logger.warning(
        "a request ended in error after %d generated tokens: its logit processing left no token to choose "
        "(every logit -inf: the grammar engine failed, or its constraints together forbid every token); "
        "nothing was committed at that position",
        len(req.assembler.token_ids),
    )


def take_chunk(req: Request) -> StreamChunk:
    """The chunk of this step: new text and tokens; the last one with the stats (the
    request is then done, and its draft session told how it finished)."""
    if not req.finish_reason:
        text, toks, texts = req.assembler.take_tokens()
        return StreamChunk(text, toks, logprobs=_logprobs_of(req, toks), token_texts=texts)
    stats = req.stats
    stats.num_generated_tokens = req.num_generated_tokens
    stats.finish_reason = req.finish_reason
    stats.total_s = time.perf_counter() - req.started_s
    text, toks, texts = req.assembler.take_tokens(final=True)
    logprobs = _logprobs_of(req, toks)
    req.done = True
    session = req.session
    if session is not None and SessionCapability.FINISH in session_capabilities(session):
        tokens = list(req.assembler.token_ids)
        session.finish(tokens, req.finish_reason, req.assembler.text)  # type: ignore[attr-defined]
    return StreamChunk(text, toks, req.finish_reason, stats, logprobs, texts)


def _logprobs_of(req: Request, toks: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """The entries of ``toks``, the tokens a chunk emits next (those after the ones
    already emitted, in :attr:`Request.logprobs` order)."""
    if not toks or not req.logprobs:
        return ()
    end = req.assembler.emitted_tokens
    return tuple(req.logprobs[end - len(toks) : end])


def record_step(
    stats: GenerationStats,
    tree: DraftTree,
    res: VerifyResult,
    kept: int,
    draft_s: float,
    verify_s: float,
    predicted: float,
    keep_steps: bool,
) -> None:
    """Count one decode step in ``stats``: ``tree`` (the draft verified) and ``res`` (its
    verification), ``kept`` tokens of ``res.tokens`` committed (a stop may cut it short),
    ``draft_s`` / ``verify_s`` seconds drafting and verifying, ``predicted`` accepted
    tokens the policy expected; with ``keep_steps`` also a :class:`StepStats` in
    ``stats.steps``."""
    stats.num_forward_passes += 1
    stats.num_drafted_tokens += tree.num_nodes
    # accepted draft tokens that were actually kept (a stop may cut the step short)
    acc = min(res.num_accepted, kept)
    stats.num_accepted_tokens += acc
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    stats.accepted_histogram[res.num_accepted] = stats.accepted_histogram.get(res.num_accepted, 0) + 1
    if tree.num_nodes:
        sources = tree.sources if len(tree.sources) == tree.num_nodes else ("draft",) * tree.num_nodes
        for src in sources:
            stats.drafted_per_source[src] = stats.drafted_per_source.get(src, 0) + 1
        for i in res.accepted_nodes[:acc]:
            stats.accepted_per_source[sources[i]] = stats.accepted_per_source.get(sources[i], 0) + 1
    for d in range(int(tree.depth.max().item()) + 1 if tree.num_nodes else 0):
        stats.drafted_per_position[d] = stats.drafted_per_position.get(d, 0) + 1
        if d < res.num_accepted:
            stats.accepted_per_position[d] = stats.accepted_per_position.get(d, 0) + 1
    if keep_steps:
        stats.steps.append(
            StepStats(
                num_drafted=tree.num_nodes,
                num_accepted=res.num_accepted,
                num_committed=kept,
                draft_s=draft_s,
                verify_s=verify_s,
                source="+".join(dict.fromkeys(tree.sources)),
                predicted_accepted=predicted,
                accepted_source="+".join(dict.fromkeys(tree.sources[i] for i in res.accepted_nodes))
                if tree.sources
                else "",
            )
        )
