"""The draft a request verifies in a step of :meth:`Engine.step
<ragspec.engine.Engine.step>` (stage 1 of the decode loop): its draft session's proposal,
stripped of invalid nodes and of the nodes its logit processors forbid, cut to the part worth verifying by the policy
(:func:`draft_for_step`), alone or weighed against the rest of a batched step (its
``other_rows`` / ``other_committed``, at most :func:`per_request_drafts` nodes); and, after
the step, what each gated request's drafting paid for (:func:`observe_gates`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .backend.base import Target
from .config import PolicyConfig
from .policy import DraftTimeGate, LatencyModel, choose_draft
from .processors import keep_subtrees
from .request import Request
from .tree import drop_invalid_nodes
from .types import DraftTree, GenerationStats, VerifyResult

__all__ = ["Pending", "draft_for_step", "per_request_drafts", "observe_gates"]

InvalidDrafts = Callable[[GenerationStats, DraftTree, DraftTree, int], None]
"""Told of draft nodes :func:`~ragspec.tree.drop_invalid_nodes` dropped: ``(stats, raw
proposal, kept tree, nodes dropped)``."""


@dataclass
class Pending:
    """A request's part of a step between drafting and verification."""

    index: int
    request: Request
    tree: DraftTree
    predicted: float
    lazy: bool
    draft_s: float
    past: int
    proposed: bool = False
    """The session was asked for a proposal (a budget above 0, not skipped)."""


def draft_for_step(
    target: Target,
    policy: PolicyConfig,
    index: int,
    req: Request,
    *,
    lazy_rows: bool,
    on_invalid: InvalidDrafts,
    other_rows: int = 0,
    other_committed: float = 0.0,
    cap: Optional[int] = None,
    skip: bool = False,
) -> Pending:
    """Stage 1: the part of the session's proposal worth verifying (``index``: the
    request's place in the step; ``lazy_rows``: the target computes only the rows'
    logits it is asked for (``Capability.LAZY_ROWS``); ``on_invalid``: told of dropped
    invalid nodes; ``other_rows``, ``other_committed``: the rest of a batched step, see
    :meth:`Engine.step <ragspec.engine.Engine.step>`; ``cap``: most draft nodes; ``skip``:
    no proposal, a plain step)."""
    max_draft = req.draft_budget(policy.max_draft_tokens)
    if cap is not None:
        max_draft = min(cap, max_draft)
    remaining = req.decode.max_new_tokens - req.num_generated_tokens
    past = target.state_length(req.state)
    limit = target.max_length
    room = (limit - past - 2) if limit else max_draft
    budget = max(0, min(max_draft, remaining - 1, room))
    # greedy verification needs only the output-layer rows on the accepted path
    greedy = req.verifier.greedy and lazy_rows
    t0 = time.perf_counter()
    tree = DraftTree.empty()
    predicted = 0.0
    lazy = greedy
    proposed = req.session is not None and budget > 0 and not skip
    if proposed:
        raw = req.session.propose(budget)  # type: ignore[union-attr]
        # a misbehaving drafter (a damaged datastore, ...) never reaches the target
        proposal, dropped = drop_invalid_nodes(raw, target.vocab_size)
        if dropped:
            on_invalid(req.stats, raw, proposal, dropped)
        if req.processors and proposal.num_nodes:
            proposal = _prune(req, proposal)
        if proposal.num_nodes:
            if policy.adaptive:
                choice = choose_draft(
                    proposal,
                    req.latency,
                    req.acceptance,
                    budget,
                    lazy=greedy,
                    other_rows=other_rows,
                    other_committed=other_committed,
                )
                tree, predicted = choice.tree, choice.expected_accepted
                # a draft likely accepted from its first token: all rows' logits at once
                lazy = greedy and choice.lazy_logits
            else:
                tree = proposal.truncate(budget)
    # a plain step (speculation off, no budget, skipped) spends no time drafting
    draft_s = time.perf_counter() - t0 if proposed else 0.0
    return Pending(index, req, tree, predicted, lazy, draft_s, past, proposed)


def _prune(req: Request, tree: DraftTree) -> DraftTree:
    """``tree`` without the nodes the request's processors forbid
    (:func:`~ragspec.processors.keep_subtrees`), counted in its stats. A tree cut by its
    tokens is no longer distributed as a sampling drafter drew it: it is verified as a
    deterministic draft (lossless for any choice of nodes; :mod:`ragspec.sampling`)."""
    kept, pruned = keep_subtrees(tree, req.processors.prune(tree))
    if not pruned:
        return tree
    req.stats.num_pruned_draft_tokens += pruned
    return dataclasses.replace(kept, draft_probs=None) if kept.draft_probs is not None else kept


def per_request_drafts(policy: PolicyConfig, latency: LatencyModel, n: int) -> int:
    """Most draft nodes per request in a step verifying ``n`` requests: the step's row
    budget (``policy.max_step_rows``, default ``latency``'s largest measured q) shared
    evenly, one row of each request being its root."""
    rows = policy.max_step_rows or max(latency.table)
    return max(0, rows // max(1, n) - 1)


def observe_gates(
    pending: Sequence[Pending],
    results: Sequence[VerifyResult],
    gates: Sequence[Optional[DraftTimeGate]],
    seconds: float,
) -> None:
    """Feed ``gates[i]`` (a :class:`~ragspec.policy.DraftTimeGate` of ``pending[i]``'s
    request, None: not gated in this step) with what its drafting paid for in this step,
    alone or batched (``seconds``: the step's decoding part, drafting to commit). A
    request's draft rows are charged their share of the measured forward by its latency
    model's shape, ``1 - latency(rows - nodes) / latency(rows)``, so a model whose scale
    is off (a frozen table, a slower machine) prices them in this machine's seconds."""
    if seconds <= 0:
        return
    rate = sum(len(r.tokens) for r in results) / seconds  # committed tokens per second
    rows = sum(1 + p.tree.num_nodes for p in pending)
    forward_s = max(0.0, seconds - sum(p.draft_s for p in pending))
    for p, res, gate in zip(pending, results, gates):
        if gate is None:
            continue
        nodes = p.tree.num_nodes
        share = 1.0 - p.request.latency(rows - nodes) / p.request.latency(rows) if nodes else 0.0
        gate.observe(res.num_accepted, rate, p.draft_s, forward_s * max(0.0, share))
