"""Verification of a draft tree against the target's logits.

Glossary (as in vLLM's rejection sampler):
  * accepted tokens: draft tokens the target agrees with, root to leaf;
  * bonus token: the token the target itself produces after the last accepted node (after a
    full acceptance it is the "bonus"; after a rejection it is the "recovered" token).
A step therefore always commits ``num_accepted + 1`` tokens, and an empty draft is plain
decoding.
"""

from __future__ import annotations

from typing import Optional, Protocol, Union

import torch

from .processors import RowFn, identity_rows
from .tree import path_to_node
from .types import DraftTree, LazyLogits, VerifyResult

__all__ = ["Verifier", "verify_greedy", "GreedyVerifier", "ended_before"]


class Verifier(Protocol):
    """Decides which draft nodes to accept and which bonus token to commit.

    Attributes:
        greedy: the verifier's kind. True: greedy verification (the target's argmax, no
            random number drawn), which the engine runs as :func:`verify_greedy`, over
            :class:`~ragspec.types.LazyLogits` where the target computes rows on demand
            (``Capability.LAZY_ROWS``). False: a sampling verifier
            (:class:`~ragspec.sampling.SamplingVerifier`), called with full logits and
            the request's generator.
    """

    greedy: bool

    def __call__(
        self,
        tree: DraftTree,
        target_logits: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        rows: Optional[RowFn] = None,
    ) -> VerifyResult:
        """Args:
        tree: the draft tree (N nodes).
        target_logits: float32 [N + 1, V]; row 0 after the root, row i + 1 after node i.
        generator: the request's random generator (unused by greedy verification).
        rows: the request's processing of each row it reaches (:mod:`ragspec.processors`),
            applied to a copy of the row before the token is chosen; None: raw rows.
        """


def verify_greedy(
    tree: DraftTree, target_logits: Union[torch.Tensor, LazyLogits], rows: Optional[RowFn] = None
) -> VerifyResult:
    """Greedy verification: follow the tree from the root, at each node taking the child
    whose token equals the target's argmax; stop where none does. The argmax there is the
    bonus token. Output equals plain greedy decoding token for token (Leviathan et al.
    2023, section 2.3, with temperature 0).

    Args:
        tree: N nodes.
        target_logits: float [N + 1, V], or :class:`~ragspec.types.LazyLogits` computed on
            demand: row 0 alone first, then, once a child is accepted, that child's whole
            subtree in one group, so a draft rejected at its first token costs one row of
            the output layer.
        rows: the request's processing of each row it reaches (:data:`ragspec.processors.RowFn`,
            applied to a copy of the row), the argmax then taken of the processed row: plain
            processed greedy decoding. None: the raw rows' argmax (no copy, no processing).

    Returns:
        VerifyResult with the accepted path; never draws a random number.

    Example: tree tokens [5, 6, 7] as a chain, argmax rows [5, 6, 9, 4] -> accepted nodes
    (0, 1), tokens (5, 6), bonus 9.
    """
    n = tree.num_nodes
    if rows is not None:
        fn, source = rows, target_logits

        def pred(row: int, node: int) -> int:
            if isinstance(source, torch.Tensor):
                raw = source[row]
            else:
                raw = source.row(row, [1 + d for d in _descendants(parents, node)] if node >= 0 else ())
            return int(fn(row, raw if fn is identity_rows or getattr(fn, "copies", False) else raw.clone()).argmax())
    elif isinstance(target_logits, torch.Tensor):
        preds = target_logits.argmax(dim=-1).tolist()  # [N+1]

        def pred(row: int, node: int) -> int:
            return preds[row]
    else:
        lazy = target_logits

        def pred(row: int, node: int) -> int:
            # first access inside an accepted node's subtree: compute the whole subtree
            return lazy.argmax(row, [1 + d for d in _descendants(parents, node)] if node >= 0 else ())

    if n == 0:
        return VerifyResult((), (), int(pred(0, -1)), 0)
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    # children of each node keyed by parent (-1 = root), in tree order
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    node, row = -1, 0
    acc_nodes: list[int] = []
    acc_tokens: list[int] = []
    while True:
        want = pred(row, node)
        nxt = next((c for c in kids.get(node, ()) if tokens[c] == want), None)
        if nxt is None:
            return VerifyResult(tuple(acc_nodes), tuple(acc_tokens), int(want), n)
        acc_nodes.append(nxt)
        acc_tokens.append(want)
        node, row = nxt, nxt + 1


def ended_before(tree: DraftTree, row: int) -> VerifyResult:
    """The result of a verification that reached ``row`` and found no token there (its
    processing left none: :class:`~ragspec.errors.NoTokenLeftError`): the nodes on the path
    root -> node ``row - 1`` accepted (a verifier reaches a row only once its node was
    accepted), no bonus token, ``ended``.

    Example: tokens [5, 6, 7], parents [-1, 0, -1], row 2 (after node 1) -> accepted nodes
    (0, 1), tokens (5, 6), ended.
    """
    path = path_to_node(tree, row - 1)  # row 0 (after the root): node -1, no path
    tokens = tree.tokens.tolist()
    return VerifyResult(tuple(path), tuple(tokens[i] for i in path), -1, tree.num_nodes, ended=True)


def _descendants(parents: list[int], node: int) -> list[int]:
    """Nodes in the subtree of ``node`` (itself included); parents precede children."""
    inside = {node}
    for i in range(node + 1, len(parents)):
        if parents[i] in inside:
            inside.add(i)
    return sorted(inside)


class GreedyVerifier:
    """:func:`verify_greedy` as a :class:`Verifier` (``greedy`` True)."""

    greedy = True

    def __call__(
        self,
        tree: DraftTree,
        target_logits: Union[torch.Tensor, LazyLogits],
        generator: Optional[torch.Generator] = None,
        rows: Optional[RowFn] = None,
    ) -> VerifyResult:
        return verify_greedy(tree, target_logits, rows)
