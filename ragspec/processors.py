"""Per-row logit processing on each row's own path: the one place where a request's
constraints and penalties turn a target row's logits into the logits its token is chosen
from (greedy argmax, lossless sampling, the prefill's first token alike).

Why per row and on the path: a verification step scores N + 1 rows at once (row 0 after
the root, row ``i + 1`` after draft node ``i``). Plain decoding would have produced row
``i + 1``'s token after the committed output *and the tokens of node i's ancestors*, never
after a sibling's. A processor that reads that path, and only it, gives every row exactly
the logits plain decoding would have processed at that position; with row-invariant
target logits (exact numerics), speculative output then equals plain processed decoding
token for token, and sampled output keeps the processed target distribution.

The contract, per request (one processor object per request, made at
:meth:`Engine.start <ragspec.engine.Engine.start>` from its
:class:`~ragspec.params.RequestParams`; never shared between requests):

1. ``prune(tree) -> keep``: before verification, which draft nodes may be verified at
   all; a node the processor forbids (a token a grammar rejects at that node, EOS before
   ``min_tokens``, a token banned by ``logit_bias`` -100) is dropped with its subtree
   (:func:`keep_subtrees`): a verification row is never spent on a token that cannot be
   accepted. Pruning never changes the output, only the rows spent.
2. ``rows(tree) -> RowFn``: for the (pruned) tree about to be verified, a function
   ``fn(row, logits) -> logits`` applying the processing of row ``row``'s path to one row
   ``logits: float32 [V]`` (raw target logits; it may edit them in place and must return
   the row to use). Called lazily, only for the rows the verifier reaches, at most once per
   row. ``rows(DraftTree.empty())`` serves the prefill's first token (row 0 alone).
3. ``commit(tokens)``: the tokens a step committed (accepted draft tokens then the bonus
   token), in order, so the processor's own state (token counts, a grammar matcher)
   follows the request's output.

A row no token survives (every logit ``-inf``) is never chosen from: the chain's row
function raises :class:`~ragspec.errors.NoTokenLeftError` and the engine ends the request
(``finish_reason`` "error"), committing the tokens accepted before that row and nothing
from it.

Invariants (the tests check them): ``rows`` of row ``i + 1`` depends only on the committed
output and the tokens on the path root -> node i; ``prune`` keeps every node whose token
the processed row of its parent gives a finite logit (a greedy-accepted or sampleable
token is never pruned); processors compose (:class:`ProcessorChain`) in a fixed order.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from .errors import NoTokenLeftError
from .tree import select_nodes
from .types import DraftTree

__all__ = ["RowFn", "LogitsProcessor", "ProcessorChain", "keep_subtrees", "row_paths", "identity_rows"]

RowFn = Callable[[int, torch.Tensor], torch.Tensor]
"""``fn(row, logits) -> logits``: row 0 is after the root, row ``i + 1`` after node ``i``;
``logits: float32 [V]`` raw target logits of that row (may be edited in place); returns
the processed row, float32 [V] (``-inf`` for a forbidden token)."""


def identity_rows(row: int, logits: torch.Tensor) -> torch.Tensor:
    """The :data:`RowFn` of no processing."""
    return logits


@runtime_checkable
class LogitsProcessor(Protocol):
    """One request's logit processing along each row's own path (see the module docstring
    for the contract). Implementations: penalties, ``logit_bias``, ``min_tokens``, a
    grammar (structured outputs)."""

    def prune(self, tree: DraftTree) -> Sequence[bool]:
        """Which of ``tree``'s N nodes may be verified: bool per node, in node order
        (a False node's subtree is dropped too by :func:`keep_subtrees`)."""
        ...

    def rows(self, tree: DraftTree) -> RowFn:
        """The processing of each verification row of ``tree`` (already pruned)."""
        ...

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens a step committed, in order (accepted draft tokens, then the bonus)."""
        ...


class ProcessorChain:
    """Several processors as one, applied in the given order (each row through every
    processor's row function in turn; a node kept only where every processor keeps it).

    Args:
        processors: the request's processors, in application order.
    """

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = tuple(processors)

    def __bool__(self) -> bool:
        return bool(self.processors)

    def prune(self, tree: DraftTree) -> list[bool]:
        keep = [True] * tree.num_nodes
        for proc in self.processors:
            for i, ok in enumerate(proc.prune(tree)):
                if not ok:
                    keep[i] = False
        return keep

    def rows(self, tree: DraftTree) -> RowFn:
        """Each row through every processor in turn.

        Raises (from the row function):
            NoTokenLeftError: the processed row has no finite logit (no token to choose:
                the grammar engine failed, or the processors together forbid every
                token); the engine then ends the request, committing nothing from it.
        """
        fns = [proc.rows(tree) for proc in self.processors]
        if not fns:
            return identity_rows

        def fn(row: int, logits: torch.Tensor) -> torch.Tensor:
            for f in fns:
                logits = f(row, logits)
            if float(logits.max()) == float("-inf"):
                raise NoTokenLeftError(row)
            return logits

        return fn

    def commit(self, tokens: Sequence[int]) -> None:
        for proc in self.processors:
            proc.commit(tokens)


def row_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """The draft tokens on each verification row's path: ``[()] + [tokens root -> node i]``
    (N + 1 tuples; row 0 has none).

    Example: tokens [5, 6, 7], parents [-1, 0, -1] -> [(), (5,), (5, 6), (7,)].
    """
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    paths: list[tuple[int, ...]] = [()]
    for i, p in enumerate(parents):
        paths.append((paths[p + 1] if p >= 0 else ()) + (tokens[i],))
    return paths


def keep_subtrees(tree: DraftTree, keep: Sequence[bool]) -> tuple[DraftTree, int]:
    """``tree`` without the nodes whose ``keep`` is False, and without their descendants.

    Example: tokens [5, 6, 7, 8], parents [-1, 0, -1, 1], keep [True, False, True, True]:
    node 1 is dropped and node 3 (its child) with it -> tokens [5, 7], parents [-1, -1]; 2
    dropped.

    Args:
        tree: N nodes.
        keep: N booleans.

    Returns:
        (the kept nodes, parents re-indexed; nodes dropped); ``tree`` itself when nothing
        is dropped.
    """
    n = tree.num_nodes
    if all(keep) or n == 0:
        return tree, 0
    parents = tree.parents.tolist()
    kept_mask: list[bool] = []
    for i in range(n):
        p = parents[i]
        kept_mask.append(bool(keep[i]) and (p < 0 or kept_mask[p]))
    return select_nodes(tree, kept_mask)
