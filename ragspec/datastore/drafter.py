"""Datastore drafter (REST, He et al. 2024): draft trees from corpus continuations.

The drafter is shared across requests; each request gets a session holding its live
context (prompt, then every committed token). ``propose`` looks the context's longest
matching suffix up in the datastore and merges the continuations into a draft tree whose
nodes are weighted by how often each branch followed the suffix in the corpus.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

from ragspec.drafters.base import SessionCapability, TenantIsolation
from ragspec.tree import tree_from_candidates
from ragspec.types import DraftTree, VerifyResult

from .store import Lookup, PositionFilter

if TYPE_CHECKING:  # faiss is optional: semantic is imported only by those who use it
    from .semantic import SemanticSelector

logger = logging.getLogger(__name__)

__all__ = ["DatastoreDrafter", "cut_after_eos"]


def cut_after_eos(tokens: Sequence[int], eos_token_ids: frozenset[int]) -> tuple[int, ...]:
    """The tokens up to and including the first EOS (the EOS may be drafted, nothing after it).

    Example: cut_after_eos([4, 2, 9], {2}) == (4, 2).
    """
    for i, t in enumerate(tokens):
        if t in eos_token_ids:
            return tuple(tokens[: i + 1])
    return tuple(tokens)


class _DatastoreSession:
    capabilities = frozenset({SessionCapability.PROPOSE_AFTER})

    def __init__(
        self,
        drafter: "DatastoreDrafter",
        prompt_ids: Sequence[int],
        eos: frozenset[int],
        prefer: Optional[PositionFilter],
    ) -> None:
        self._drafter = drafter
        keep = drafter.max_match
        self._context = [int(t) for t in list(prompt_ids)[-keep:]]  # only the tail is ever searched
        self._eos = eos
        self._prefer = prefer

    def extend(self, token_ids: Sequence[int]) -> None:
        self._context.extend(int(t) for t in token_ids)
        keep = self._drafter.max_match
        if len(self._context) > 4 * keep:
            del self._context[:-keep]

    def propose(self, max_tokens: int) -> DraftTree:
        return self._propose(self._context[-self._drafter.max_match :], max_tokens)

    def propose_after(self, token_ids: Sequence[int], max_tokens: int) -> DraftTree:
        """The draft that would follow the context extended by ``token_ids`` (not
        committed; nothing changes): its nodes hang below the last of them."""
        suffix = (self._context + [int(t) for t in token_ids])[-self._drafter.max_match :]
        return self._propose(suffix, max_tokens)

    def _propose(self, suffix: list[int], max_tokens: int) -> DraftTree:
        d = self._drafter
        budget = min(d.max_nodes, max_tokens)
        if budget <= 0:
            return DraftTree.empty()
        kwargs = {"prefer": self._prefer} if self._prefer is not None else {}
        conts = d.datastore.continuations(
            suffix, max_len=min(d.max_len, budget), max_candidates=d.max_candidates, **kwargs
        )
        if not conts:
            return DraftTree.empty()
        cands = [cut_after_eos(c.tokens, self._eos) for c in conts] if self._eos else [c.tokens for c in conts]
        return tree_from_candidates(
            cands, counts=[c.count for c in conts], max_nodes=budget, source=d.name, match_len=conts[0].match_len
        )

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        return None


class DatastoreDrafter:
    """Drafts from a datastore (REST): the continuations of the context's longest suffix
    found in the corpus, merged into a tree of at most ``max_nodes`` nodes.

    Nodes are kept best-first by the number of occurrences through them, ties broken by
    depth then by token ids (continuations come sorted by count, then ids), so the same
    context always gives the same tree. No match gives an empty tree. Drafts stop after an
    EOS token.

    Args:
        datastore: a :class:`~ragspec.datastore.Datastore` (or any :class:`Lookup`).
        max_nodes: most draft nodes per step (the engine's ``max_tokens`` may lower it).
        max_len: most tokens per continuation (tree depth).
        max_candidates: most distinct continuations merged into the tree.
        max_match: context tokens passed to the lookup (the datastore's own ``max_match``
            caps the suffix length too).
        selector: optional semantic selection (see :mod:`.semantic`): at the start of a
            request it picks the corpus chunks nearest the prompt and its documents, and
            lookups prefer occurrences inside them. Off by default.
    """

    name = "datastore"
    isolation = TenantIsolation.OWN_TOKENS
    """Drafts from the request's own tokens and the datastore, read-only data every tenant
    of the engine may read (:class:`~ragspec.drafters.base.TenantIsolation`)."""

    def __init__(
        self,
        datastore: Lookup,
        *,
        max_nodes: int = 32,
        max_len: int = 10,
        max_candidates: int = 64,
        max_match: int = 16,
        selector: Optional["SemanticSelector"] = None,
    ) -> None:
        if max_nodes < 1 or max_len < 1 or max_candidates < 1 or max_match < 1:
            raise ValueError(
                f"max_nodes, max_len, max_candidates and max_match must be >= 1, got "
                f"{max_nodes}, {max_len}, {max_candidates}, {max_match}"
            )
        self.datastore = datastore
        self.max_nodes = max_nodes
        self.max_len = max_len
        self.max_candidates = max_candidates
        self.max_match = max_match
        self.selector = selector

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> _DatastoreSession:
        prefer = None
        if self.selector is not None:
            selection = self.selector.select([prompt_ids, *documents])
            prefer = None if selection.is_empty else selection  # nothing similar: no preference
        return _DatastoreSession(self, prompt_ids, frozenset(int(e) for e in eos_token_ids), prefer)
