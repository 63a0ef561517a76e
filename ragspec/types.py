"""Contracts between the parts of the engine: draft trees, verification results, stats.

Letters used in shapes: N draft-tree nodes, V vocabulary, D depth, T time (tokens).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Protocol, Sequence, runtime_checkable

import torch

__all__ = [
    "DraftTree",
    "LazyLogits",
    "VerifyResult",
    "StepStats",
    "GenerationStats",
    "GenerationOutput",
    "StreamChunk",
    "TokenLogprob",
]


@dataclass(frozen=True)
class DraftTree:
    """A draft tree of N nodes hanging below the *root*: the last committed token, whose
    KV entry is not yet in the cache (the "pending" token).

    Attributes:
        tokens: int64 [N] token id of each node.
        parents: int64 [N] index of each node's parent node, -1 for children of the root.
            Parents always come before their children (topological order).
        depth: int64 [N] number of draft ancestors (0 for children of the root); the node's
            position is ``root_position + 1 + depth``.
        sources: one short tag per node naming the drafter that proposed it ("prompt",
            "documents", "datastore", "eagle", ...).
        scores: float32 [N] the drafter's estimate that the node is accepted, given that its
            parent is (used by the cost model; 1.0 where a drafter has no estimate).
        draft_probs: float32 [N, V] or None: the draft distribution each node was *sampled
            from* (row i is the distribution over node i's token given its parent path).
            None for deterministic drafts (prompt lookup, datastore).
        match_len: length in tokens of the context suffix the draft was matched on (0 when
            not a lookup draft); a feature of the acceptance model.
        node_match_len: int64 [N] or None: the suffix-match length of each node, for trees
            whose nodes come from several lookups (a merged tree: retrieval's own matches,
            lookups seeded by the EAGLE head's tokens, the head's nodes at 0); None: every
            node's is ``match_len``.

    An empty tree (N = 0) is valid: the step degrades to plain decoding.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    sources: tuple[str, ...] = ()
    scores: Optional[torch.Tensor] = None
    draft_probs: Optional[torch.Tensor] = None
    match_len: int = 0
    node_match_len: Optional[torch.Tensor] = None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @staticmethod
    def empty() -> "DraftTree":
        z = torch.zeros(0, dtype=torch.long)
        return DraftTree(tokens=z, parents=z.clone(), depth=z.clone(), sources=(), scores=torch.zeros(0))

    @staticmethod
    def chain(
        tokens: Sequence[int], source: str = "draft", scores: Optional[Sequence[float]] = None, match_len: int = 0
    ) -> "DraftTree":
        """A chain is a tree with one child per node: ``tokens[i]`` has parent ``i - 1``."""
        n = len(tokens)
        t = torch.as_tensor(list(tokens), dtype=torch.long).reshape(n)
        sc = torch.ones(n) if scores is None else torch.as_tensor(list(scores), dtype=torch.float32)
        return DraftTree(
            tokens=t,
            parents=torch.arange(-1, n - 1, dtype=torch.long),
            depth=torch.arange(n, dtype=torch.long),
            sources=(source,) * n,
            scores=sc,
            match_len=match_len,
        )

    def match_lens(self) -> list[int]:
        """The suffix-match length of each node (``node_match_len``, else ``match_len``
        for every node): N ints."""
        if self.node_match_len is not None:
            return [int(m) for m in self.node_match_len.tolist()]
        return [int(self.match_len)] * self.num_nodes

    @property
    def is_chain(self) -> bool:
        n = self.num_nodes
        return bool(n == 0 or torch.equal(self.parents, torch.arange(-1, n - 1, dtype=torch.long)))

    def children(self, node: int) -> list[int]:
        """Indices of the children of ``node`` (-1 = root), in tree order."""
        return [i for i, p in enumerate(self.parents.tolist()) if p == node]

    def truncate(self, max_nodes: int) -> "DraftTree":
        """Keep the first ``max_nodes`` nodes (still a valid tree: parents come first)."""
        if max_nodes >= self.num_nodes:
            return self
        k = max(0, max_nodes)
        return DraftTree(
            tokens=self.tokens[:k],
            parents=self.parents[:k],
            depth=self.depth[:k],
            sources=self.sources[:k],
            scores=None if self.scores is None else self.scores[:k],
            draft_probs=None if self.draft_probs is None else self.draft_probs[:k],
            match_len=self.match_len,
            node_match_len=None if self.node_match_len is None else self.node_match_len[:k],
        )


@runtime_checkable
class LazyLogits(Protocol):
    """A target's logits over N + 1 verified rows, computed on demand (a backend's
    ``Capability.LAZY_ROWS``): greedy verification reads only the rows on the accepted path.

    Attributes:
        rows_computed: how many rows the output layer has been applied to so far.
    """

    rows_computed: int

    def __len__(self) -> int:
        """N + 1."""

    def argmax(self, row: int, group: Sequence[int] = ()) -> int:
        """Argmax token of ``row``; when not known yet, computed together with the rows in
        ``group`` (one pass over the output layer)."""

    def row(self, row: int, group: Sequence[int] = ()) -> torch.Tensor:
        """The logits of ``row``, float32 [V]; when not computed yet, computed together
        with the rows in ``group`` (one pass over the output layer), whose logits are then
        kept too. For verification rows that are processed (:mod:`ragspec.processors`) or
        whose log-probabilities are returned: only such requests pay for keeping rows. The
        tensor returned is the one kept: callers copy it before editing it."""

    def full(self) -> torch.Tensor:
        """All rows: float32 [N + 1, V]."""


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one draft tree.

    Attributes:
        accepted_nodes: indices of the accepted draft nodes, root to leaf (length A).
        accepted_tokens: their token ids (length A).
        bonus_token: the token the target produces after the last accepted node (the
            "bonus" on full acceptance, the correction on a rejection); -1 when ``ended``.
        num_drafted: nodes in the verified tree (N).
        ended: no token could follow the accepted path (its row's processing left none:
            :class:`~ragspec.errors.NoTokenLeftError`); there is no bonus token and the
            request ends.
    """

    accepted_nodes: tuple[int, ...]
    accepted_tokens: tuple[int, ...]
    bonus_token: int
    num_drafted: int
    ended: bool = False

    @property
    def num_accepted(self) -> int:
        return len(self.accepted_tokens)

    @property
    def tokens(self) -> tuple[int, ...]:
        """Committed tokens of this step: accepted draft tokens then the bonus token (the
        accepted ones alone when ``ended``)."""
        return self.accepted_tokens if self.ended else self.accepted_tokens + (self.bonus_token,)


@dataclass
class StepStats:
    """One decode step (one target forward pass).

    ``source``: the verified tree's sources, distinct, in node order, joined by "+"
    ("eagle"; a merged tree's "prompt+eagle+prompt@head"); ``accepted_source``: the same
    over the accepted path ("" when nothing was accepted).
    """

    num_drafted: int
    num_accepted: int
    num_committed: int
    draft_s: float
    verify_s: float
    source: str = ""
    predicted_accepted: float = 0.0
    accepted_source: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class GenerationStats:
    """Counters and timings of one generation (times in seconds, counts in tokens).

    ``num_forward_passes`` counts target forwards including the prefill (a chunked prefill
    counts once, as does one the prefix cache served whole); decode steps are ``num_forward_passes - 1``. ``mean_accepted_tokens`` is committed tokens per decode
    step, bonus included (plain decoding gives 1.0). ``num_invalid_draft_tokens`` counts
    proposed draft nodes dropped before verification because a drafter returned token ids
    outside the vocabulary or a malformed tree (see :func:`ragspec.tree.drop_invalid_nodes`);
    they are not in ``num_drafted_tokens``.
    """

    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_forward_passes: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_invalid_draft_tokens: int = 0
    num_pruned_draft_tokens: int = 0
    """Draft nodes the request's logit processors forbade (a token its grammar, its
    ``min_tokens`` or a ``logit_bias`` of -100 rules out at that node), dropped with their
    subtrees before verification (:mod:`ragspec.processors`); not in ``num_drafted_tokens``."""
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    time_to_first_token_s: float = 0.0
    """From the request's first step (its first prefill chunk) to its first token."""
    queue_s: float = 0.0
    """From :meth:`~ragspec.Engine.start` to the request's first step."""
    num_prefill_chunks: int = 0
    """Forwards its prompt took (chunked prefill: ceil(prompt / chunk), less the chunks served
    by the prefix cache); counted in ``num_forward_passes``, one of them as the prefill."""
    num_cached_prompt_tokens: int = 0
    """Prompt tokens whose KV entries came from the engine's prefix cache (not prefilled;
    OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""
    finish_reason: str = ""
    accepted_histogram: dict[int, int] = field(default_factory=dict)
    accepted_per_position: dict[int, int] = field(default_factory=dict)
    drafted_per_position: dict[int, int] = field(default_factory=dict)
    accepted_per_source: dict[str, int] = field(default_factory=dict)
    """Accepted draft tokens (kept: a stop may cut a step short) by the tag of the source
    that proposed them (``DraftTree.sources``: ``"prompt"``, ``"datastore"``, ``"eagle"``,
    ``"grammar"`` for a grammar's forced tokens ...); they sum to ``num_accepted_tokens``."""
    drafted_per_source: dict[str, int] = field(default_factory=dict)
    """Verified draft tokens by source tag; they sum to ``num_drafted_tokens``."""
    steps: list[StepStats] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return max(0, self.num_forward_passes - 1)

    @property
    def mean_accepted_tokens(self) -> float:
        """Tokens committed per decode step, bonus included (1.0 for plain decoding)."""
        steps = self.num_steps
        if steps == 0:
            return 0.0
        # the first generated token comes from the prefill; every later one from a step
        return max(0, self.num_generated_tokens - 1) / steps if self.num_generated_tokens else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted tokens, in [0, 1] (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.total_s if self.total_s > 0 else 0.0

    def spec_decode_metrics(self) -> dict:
        """This generation's drafting statistics under vLLM's per-request names
        (``--per-request-spec-decode-metrics``), for the servers' ``usage``:

        * ``num_spec_steps``: decode steps (``num_steps``), each one target forward verifying
          this request's draft tree, possibly empty (a plain step);
        * ``num_draft_tokens``, ``num_accepted_draft_tokens``: ``num_drafted_tokens``,
          ``num_accepted_tokens``;
        * ``mean_acceptance_length``: tokens committed per step, the bonus token included,
          ``1 + num_accepted_draft_tokens / num_spec_steps`` (1.0 for plain decoding, 0.0
          without a step; SGLang's ``spec_accept_length``);
        * ``draft_acceptance_rate``: ``acceptance_rate``;
        * ``acceptance_histogram``: ints [max accepted + 1], steps by accepted draft tokens
          (``accepted_histogram`` as a list; ``[]`` without a step);
        * ``num_draft_tokens_per_source``, ``num_accepted_draft_tokens_per_source``: the
          same two counts by the source that proposed each token (``drafted_per_source``,
          ``accepted_per_source``: ``"grammar"`` for a grammar's forced tokens);
        * ``draft_s``, ``verify_s``: seconds drafting and verifying.
        """
        steps = self.num_steps
        top = max(self.accepted_histogram, default=-1)
        return {
            "num_spec_steps": steps,
            "num_draft_tokens": self.num_drafted_tokens,
            "num_accepted_draft_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / steps if steps else 0.0,
            "draft_acceptance_rate": self.acceptance_rate,
            "acceptance_histogram": [self.accepted_histogram.get(k, 0) for k in range(top + 1)],
            "num_draft_tokens_per_source": dict(sorted(self.drafted_per_source.items())),
            "num_accepted_draft_tokens_per_source": dict(sorted(self.accepted_per_source.items())),
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
        }

    def to_dict(self, with_steps: bool = False) -> dict:
        d = {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_forward_passes": self.num_forward_passes,
            "num_drafted_tokens": self.num_drafted_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_invalid_draft_tokens": self.num_invalid_draft_tokens,
            "num_pruned_draft_tokens": self.num_pruned_draft_tokens,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "total_s": self.total_s,
            "time_to_first_token_s": self.time_to_first_token_s,
            "queue_s": self.queue_s,
            "num_prefill_chunks": self.num_prefill_chunks,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "tokens_per_s": self.tokens_per_s,
            "finish_reason": self.finish_reason,
            "accepted_histogram": {str(k): v for k, v in sorted(self.accepted_histogram.items())},
            "drafted_per_source": dict(sorted(self.drafted_per_source.items())),
            "accepted_per_source": dict(sorted(self.accepted_per_source.items())),
        }
        if with_steps:
            d["steps"] = [s.to_dict() for s in self.steps]
        return d


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one generated token (:mod:`ragspec.logprobs`).

    Attributes:
        token_id: the token.
        logprob: its log-probability (or logit, per the request's ``logprobs_mode``);
            ``-inf`` for a token the processing ruled out.
        top: the request's ``top_logprobs`` likeliest tokens of that position as
            ``(token_id, logprob)``, likeliest first (empty when it asked for none).
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class GenerationOutput:
    """Result of :meth:`ragspec.Engine.generate`.

    Attributes:
        text: generated text, cut before a stop string if one matched.
        token_ids: generated token ids (prompt excluded); when a stop string matched, up to
            and including the token that completed it.
        stats: counters and timings.
        logprobs: one entry per token of ``token_ids`` when the request asked for
            ``logprobs``, else empty.
    """

    text: str
    token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class StreamChunk:
    """One piece of a streamed generation: new text and the token ids it came from.

    ``finish_reason`` is set on the last chunk only ("stop", "length", "cancelled", or
    "error": the request's processing left no token to choose); ``stats`` too. ``logprobs``: one entry per token of
    ``token_ids`` when the request asked for them, else empty. ``token_texts``: the text
    each token of ``token_ids`` brings (their concatenation is ``text``; empty when the
    chunk has no token), for streaming one token per event.
    """

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None
    logprobs: tuple[TokenLogprob, ...] = ()
    token_texts: tuple[str, ...] = ()
