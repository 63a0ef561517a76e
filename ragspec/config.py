"""Frozen, validated settings. Each component takes only the settings it needs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import ConfigError

__all__ = [
    "SamplingParams",
    "DecodeConfig",
    "PLDConfig",
    "PolicyConfig",
    "NUMERICS",
    "DRAFTING_MODES",
    "AUTO_DRAFTING",
    "check_drafting",
]

NUMERICS = ("exact", "fast")
"""The target's arithmetic (``--numerics``): ``exact`` (default) float32 over the model's
weights, greedy output token-identical to transformers'; ``fast`` (opt-in, CPU with AVX-512
VNNI) int8 activations in the GGUF-block linears, speculative == plain decoding bit for bit
within the mode (see :func:`ragspec.backend.cpu.build.read_gguf_blocks`)."""

DRAFTING_MODES = ("merged", "select", "retrieval")
"""How retrieval and an EAGLE head share a step (``--drafting``; the default ``"auto"`` picks
one from the device: :func:`ragspec.loading.resolve_drafting`): ``"merged"``, one tree from
all sources, retrieval's copies also hung under the head's tokens
(:class:`~ragspec.drafters.merged.MergedDrafter`); ``"select"``, one source wins the step
(:class:`~ragspec.drafters.selecting.SelectingDrafter`, the behaviour before merged trees);
``"retrieval"``, retrieval's drafts only, a loaded head left unused (the target then
returns no hidden states for it either)."""

AUTO_DRAFTING = "auto"
"""The default drafting: :func:`ragspec.loading.resolve_drafting` picks the mode from the device."""


def check_drafting(drafting: str) -> str:
    """``drafting`` itself when it is ``"auto"`` or one of :data:`DRAFTING_MODES`.

    Raises:
        ConfigError: any other value (the message names the options that take it).
    """
    if drafting != AUTO_DRAFTING and drafting not in DRAFTING_MODES:
        raise ConfigError(
            f"unknown drafting mode {drafting!r}: use {AUTO_DRAFTING} or one of {', '.join(DRAFTING_MODES)} "
            "(--drafting, --also-drafting, RAGSPEC_DRAFTING)"
        )
    return drafting


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into a token.

    ``temperature == 0`` is greedy decoding and never draws a random number.
    """

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    seed: Optional[int] = None
    """Seed of the request's own ``torch.Generator``; None draws a fresh seed."""
    min_p: float = 0.0
    """Keep the tokens of probability at least min_p times the likeliest one's, after
    top-k and top-p (0 = off)."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DecodeConfig:
    """Limits of one generation."""

    max_new_tokens: int = 128
    """Most tokens generated (never exceeded, whatever the draft length)."""
    stop: tuple[str, ...] = ()
    """Stop strings, matched on decoded text; the text from the stop on is never emitted."""
    speculative: bool = True
    """Draft and verify; False: plain decoding (one token per target forward)."""
    return_steps: bool = False
    """Keep per-step stats in ``GenerationStats.steps``."""
    max_draft_tokens: Optional[int] = None
    """Most draft tokens this request verifies per step, under the engine's own budget
    (``PolicyConfig.max_draft_tokens``, which stays the cap); None: the engine's budget;
    0: plain decoding, as ``speculative=False``."""

    def __post_init__(self) -> None:
        if self.max_draft_tokens is not None and (
            isinstance(self.max_draft_tokens, bool) or not isinstance(self.max_draft_tokens, int)
        ):
            raise ConfigError(f"max_draft_tokens must be an integer or None, got {self.max_draft_tokens!r}")
        if self.max_draft_tokens is not None and self.max_draft_tokens < 0:
            raise ConfigError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ConfigError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {self.stop!r}")


@dataclass(frozen=True)
class PLDConfig:
    """Prompt-lookup (n-gram) drafting (Saxena 2023; vLLM ``ngram_proposer``)."""

    max_ngram: int = 4
    """Longest suffix n-gram matched (tokens)."""
    min_ngram: int = 1
    """Shortest suffix n-gram matched (tokens)."""
    max_candidates: int = 4
    """Most distinct continuations kept per n-gram (more than 1 builds a draft tree; the
    cost model keeps only the branches worth verifying). 4 measured best in an offline
    replay of greedy outputs on rag/summarization (1.26x/1.38x predicted vs 1.20x/1.36x
    with 1)."""

    def __post_init__(self) -> None:
        if self.min_ngram < 1 or self.max_ngram < self.min_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.max_candidates < 1:
            raise ConfigError(f"max_candidates must be >= 1, got {self.max_candidates}")


@dataclass(frozen=True)
class PolicyConfig:
    """How much work one step does: draft sizes, prefill chunks."""

    max_draft_tokens: int = 8
    """Most draft tokens (tree nodes) verified in one step."""
    adaptive: bool = True
    """Choose the draft size per step from the latency and acceptance models (cost-aware);
    when False every proposed draft (up to ``max_draft_tokens``) is verified."""
    prefill_chunk_tokens: int = 256
    """Chunked prefill (vLLM's term): a prompt enters the KV cache at most this many tokens
    per step, so a long prompt arriving never holds up the other requests' steps for more
    than one chunk (0 = the whole prompt in one forward). Chunk boundaries depend only on the
    prompt, never on the other requests, so a request's output is the same alone or in a
    batch; against an unchunked prefill only float rounding differs (other matmul shapes)."""
    batch_aware: bool = True
    """With ``adaptive``: when several requests are verified in one forward, choose each
    one's draft for the committed tokens per second of the whole step, within
    ``max_step_rows`` (drafts shrink as the batch grows; see :meth:`Engine.step`). Seeded
    sampled requests keep their solo choice (same seed, same output)."""
    draft_time_gate: bool = True
    """With ``adaptive``: a request alone, or in a batched step with ``batch_aware``, drafts
    only while its drafting has been adding more committed tokens than its drafting seconds
    and draft rows cost the step (:class:`~ragspec.policy.DraftTimeGate`; one gate for its
    steps alone, one for its batched steps); otherwise its steps are plain ones, with a
    retry every few steps. Seeded sampled requests are never gated."""
    max_step_rows: Optional[int] = None
    """Most verification rows (roots + draft nodes of all requests) one step budgets for
    (None: the latency model's largest measured q, where the cost model knows the cost; at
    least one row per request is always verified)."""
    prefill_step_tokens: Optional[int] = None
    """Most prompt tokens one step prefills over all requests (vLLM's token budget for
    chunked prefill), the earliest request first: later ones wait their turn, so the first
    to arrive gets its first token after its own prefill instead of everyone's, and a step
    that also verifies decoding requests holds them up by at most this much prefill (one
    chunk always runs). None: one chunk (``prefill_chunk_tokens``) per step when chunked,
    every prefilling request's whole prompt when unchunked."""

    prefix_cache_tokens: int = 4096
    """Prefix caching (vLLM's automatic prefix caching): the KV entries of up to this many
    prompt tokens, in whole prefill chunks, kept across requests, so a prompt that begins
    like an earlier one (a shared system prompt, the same documents, a follow-up turn) skips
    that part of its prefill (:mod:`ragspec.prefix_cache`; least recently used evicted).
    Exact: a cached chunk holds bit for bit what the request's own prefill would write.
    Needs chunked prefill; 0 = off. Default model: ~46 KB per token in float32."""

    def __post_init__(self) -> None:
        if type(self.prefix_cache_tokens) is not int:  # noqa: E721 (bool is an int subclass)
            raise ConfigError(f"prefix_cache_tokens must be an integer (tokens), got {self.prefix_cache_tokens!r}")
        if self.prefix_cache_tokens < 0:
            raise ConfigError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.max_draft_tokens < 0:
            raise ConfigError(f"max_draft_tokens must be >= 0, got {self.max_draft_tokens}")
        if isinstance(self.prefill_chunk_tokens, bool) or self.prefill_chunk_tokens < 0:
            raise ConfigError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        for name in ("adaptive", "batch_aware", "draft_time_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.max_step_rows is not None and self.max_step_rows < 1:
            raise ConfigError(f"max_step_rows must be >= 1 or None, got {self.max_step_rows}")
        if self.prefill_step_tokens is not None and (
            isinstance(self.prefill_step_tokens, bool) or self.prefill_step_tokens < 1
        ):
            raise ConfigError(f"prefill_step_tokens must be >= 1 or None, got {self.prefill_step_tokens}")
