"""Forced tokens as drafts: where a request's grammar allows exactly one continuation (a
JSON key and its quotes, ``", "``, the closing braces, a tool call's fixed text), those
tokens are proposed first, as a chain tagged ``"grammar"``, and the request's own drafter
continues after them (its ``propose_after``: a copy from the documents hung below the
forced key). Verification treats them as any draft, so output stays exact; under the
grammar's mask they are the only token allowed at their row, so a greedy target always
accepts them, and they cost one verification row each instead of one forward each.

:class:`ForcedTokenSession` wraps a request's draft session (or none: a request on an
engine without a drafter still drafts its forced tokens); the engine makes it for
requests with a structured-output constraint (:mod:`ragspec.grammar` supplies the
:class:`ForcedTokens`).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch

from ..types import DraftTree, VerifyResult
from .base import DraftSession, SessionCapability, session_capabilities

__all__ = ["ForcedTokens", "ForcedTokenSession", "hang_below", "SOURCE"]

SOURCE = "grammar"
"""The ``DraftTree.sources`` tag of forced tokens."""


class ForcedTokens(Protocol):
    """What the grammar forces after a request's committed output
    (:class:`ragspec.grammar.GrammarFollower`)."""

    def extend(self, tokens: Sequence[int]) -> None:
        """The tokens committed since the last call, in order."""

    def forced(self, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` tokens forced next (empty: the next token is a choice)."""


def hang_below(chain: DraftTree, sub: DraftTree) -> DraftTree:
    """``sub`` hung below the last node of ``chain`` (a chain of L nodes): one tree of
    L + M nodes, ``sub``'s root children now children of node L - 1.

    Example: chain [5, 6], sub tokens [7, 8] with parents [-1, -1] -> tokens [5, 6, 7, 8],
    parents [-1, 0, 1, 1], depth [0, 1, 2, 2].
    """
    if sub.num_nodes == 0:
        return chain
    n = chain.num_nodes
    if n == 0:
        return sub
    last = n - 1
    parents = torch.where(sub.parents >= 0, sub.parents + n, torch.full_like(sub.parents, last))
    chain_scores = chain.scores if chain.scores is not None else torch.ones(n)
    sub_scores = sub.scores if sub.scores is not None else torch.ones(sub.num_nodes)
    return DraftTree(
        tokens=torch.cat([chain.tokens, sub.tokens]),
        parents=torch.cat([chain.parents, parents]),
        depth=torch.cat([chain.depth, sub.depth + int(chain.depth[last]) + 1]),
        sources=tuple(chain.sources or ("draft",) * n) + tuple(sub.sources or ("draft",) * sub.num_nodes),
        scores=torch.cat([chain_scores.float(), sub_scores.float()]),
        # the sub-tree's draft distribution was drawn after another context: verified as a
        # deterministic draft (lossless for any draft; ragspec.sampling)
        draft_probs=None,
        match_len=sub.match_len,
        node_match_len=torch.tensor(chain.match_lens() + sub.match_lens(), dtype=torch.long),
    )


class ForcedTokenSession:
    """A request's draft session with the grammar's forced tokens first (module docstring).

    Args:
        inner: the request's own draft session (None: forced tokens only).
        forced: the grammar following the request's output.

    Declares the inner session's capabilities but ``propose_after`` (it is the outermost
    session: nothing seeds it).
    """

    def __init__(self, inner: Optional[DraftSession], forced: ForcedTokens) -> None:
        self._inner = inner
        self._forced = forced
        caps = session_capabilities(inner) if inner is not None else frozenset()
        self._after: Any = getattr(inner, "propose_after", None) if SessionCapability.PROPOSE_AFTER in caps else None
        self.capabilities: frozenset[str] = caps - {SessionCapability.PROPOSE_AFTER}

    def extend(self, token_ids: Sequence[int]) -> None:
        self._forced.extend(token_ids)
        if self._inner is not None:
            self._inner.extend(token_ids)

    def propose(self, max_tokens: int) -> DraftTree:
        """The forced chain (at most ``max_tokens``), the inner session's proposal after it
        in the nodes left; the inner session's own proposal where nothing is forced."""
        if max_tokens <= 0:
            return DraftTree.empty()
        forced = self._forced.forced(max_tokens)
        if not forced:
            return self._inner.propose(max_tokens) if self._inner is not None else DraftTree.empty()
        chain = DraftTree.chain(forced, source=SOURCE)
        left = max_tokens - len(forced)
        if left <= 0 or self._after is None:
            return chain
        return hang_below(chain, self._after(forced, left))

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        if self._inner is not None:
            self._inner.observe(tree, result)

    def extend_hidden(self, hidden: torch.Tensor) -> None:
        self._inner.extend_hidden(hidden)  # type: ignore[union-attr]  # declared only when the inner session has it

    def finish(self, token_ids: Sequence[int], reason: str, text: str = "") -> None:
        self._inner.finish(token_ids, reason, text)  # type: ignore[union-attr]  # declared only when it has it
