"""Drafters: who proposes the tokens the target verifies.

A :class:`Drafter` is shared and stateless across requests; per-request state lives in the
:class:`DraftSession` it starts (``start_request``). A session is told every committed
token (``extend``), proposes a :class:`~ragspec.types.DraftTree` (``propose``), and may learn
from verification results (``observe``). Token ids only; deterministic; an empty tree is a
valid answer (the step is then plain decoding). A session's optional parts are declared by
name in its ``capabilities`` (:class:`SessionCapability`, read with
:func:`session_capabilities`), never found by looking for a method.
"""

from __future__ import annotations

import enum
import logging
from typing import Any, Iterable, Optional, Protocol, Sequence, runtime_checkable

from ..errors import ConfigError, IsolationError
from ..tree import merge_trees
from ..types import DraftTree, VerifyResult

logger = logging.getLogger(__name__)

__all__ = [
    "Drafter",
    "DraftSession",
    "TenantIsolation",
    "drafter_isolation",
    "combined_isolation",
    "SessionCapability",
    "session_capabilities",
    "CompositeDrafter",
    "reproducible_drafter",
    "salted_drafter",
]


class SessionCapability:
    """Names of the optional parts a :class:`DraftSession` may declare in its
    ``capabilities`` (a frozenset of these names, usually a class attribute); the engine
    and the composite sessions use a part only when its session declares it.

    * ``PROPOSE_AFTER``: ``propose_after(token_ids, max_tokens) -> DraftTree`` proposes the
      tree that would follow the context extended by ``token_ids`` (tokens not committed,
      e.g. an EAGLE head's draft tokens; the session is left unchanged), hanging below the
      last of them. Lookup drafters have it; the merged drafter
      (:mod:`ragspec.drafters.merged`) hangs their copies under the head's tokens with it.
    * ``FINISH``: ``finish(token_ids, reason, text="")`` is told once, when the request
      ends, every token it generated, the finish reason ("stop", "length", "cancelled", "error")
      and the text (a response cache learns from it).
    * ``HIDDEN_STATES``: ``extend_hidden(hidden)`` receives the target's last hidden
      states (float [R, H], after the final norm) of every position that enters the KV
      cache: all prompt positions after the prefill, then root + accepted nodes after
      each step. Feature-level drafters (EAGLE) have it; the engine then asks the target
      for hidden states (``Capability.HIDDEN_STATES``).
    """

    PROPOSE_AFTER = "propose_after"
    FINISH = "finish"
    HIDDEN_STATES = "hidden_states"


def session_capabilities(session: Any) -> frozenset[str]:
    """The optional parts ``session`` declares (its ``capabilities``,
    :class:`SessionCapability` names); none for a session that declares nothing."""
    return frozenset(getattr(session, "capabilities", ()))


@runtime_checkable
class DraftSession(Protocol):
    """Per-request drafting state.

    Optional parts (``propose_after``, ``finish``, ``extend_hidden``) are declared by name
    in a ``capabilities`` attribute: see :class:`SessionCapability`.
    """

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append committed tokens (generated, after the prompt) to the context."""

    def propose(self, max_tokens: int) -> DraftTree:
        """Propose a draft tree of at most ``max_tokens`` nodes following the context."""

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        """Feedback: what the target accepted of the last proposal."""


class TenantIsolation(enum.Enum):
    """What a drafter reads besides the request's own tokens, declared by every drafter in
    its ``isolation`` (required: a drafter that does not declare it serves no salted
    request).

    * ``OWN_TOKENS``: only the request's own tokens (prompt, documents, generated tokens)
      and read-only sources every tenant may read (a datastore, an EAGLE head); nothing
      another request wrote. Its drafts for a request are the same whatever other requests
      ran.
    * ``SALTED``: also what other requests wrote (a response cache), partitioned by
      ``cache_salt``: its ``salted(salt)`` returns the drafter that reads and feeds only
      the partition of requests with that salt (the empty salt: the shared partition).
    """

    OWN_TOKENS = "own_tokens"
    SALTED = "salted"


@runtime_checkable
class Drafter(Protocol):
    """Factory of per-request draft sessions.

    Required: ``isolation`` (:class:`TenantIsolation`), and for a ``SALTED`` drafter
    ``salted(salt) -> Drafter``, the drafter of the partition of requests with that
    ``cache_salt`` (:func:`salted_drafter`).

    Optional: a drafter whose proposals depend on more than the request's own tokens
    (step timings, statistics of earlier requests) defines ``reproducible()``, returning
    one whose proposals do not; the engine uses it for seeded sampled requests, whose
    output must then follow from the seed alone (:func:`reproducible_drafter`).
    """

    name: str

    @property
    def isolation(self) -> TenantIsolation:
        """Whether it reads what other requests wrote, and how it partitions it by salt (a
        class attribute will do)."""

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> DraftSession:
        """Start drafting for one request.

        Args:
            prompt_ids: the prompt's token ids.
            documents: extra token sequences the drafter may copy from (each is matched on
                its own: no match runs across two documents).
            eos_token_ids: drafts are cut after an EOS token.
        """


def reproducible_drafter(drafter: Optional[Drafter]) -> Optional[Drafter]:
    """``drafter.reproducible()`` where the drafter defines it (see :class:`Drafter`), else
    ``drafter`` itself."""
    make = getattr(drafter, "reproducible", None)
    return make() if callable(make) else drafter


def drafter_isolation(drafter: Drafter) -> TenantIsolation:
    """What ``drafter`` declares in its ``isolation`` (see :class:`TenantIsolation`).

    Raises:
        IsolationError: it declares nothing, something else than a
            :class:`TenantIsolation`, or ``SALTED`` without a ``salted`` method.
    """
    name = getattr(drafter, "name", type(drafter).__name__)
    try:
        declared = drafter.isolation
    except AttributeError:
        raise IsolationError(
            f"drafter {name!r} ({type(drafter).__name__}) does not declare whether it reads other requests' "
            "tokens (Drafter.isolation, a TenantIsolation): a request with a cache_salt cannot start on it"
        ) from None
    if not isinstance(declared, TenantIsolation):
        raise IsolationError(
            f"drafter {name!r} ({type(drafter).__name__}) declares isolation {declared!r}, not a TenantIsolation"
        )
    if declared is TenantIsolation.SALTED and not callable(getattr(type(drafter), "salted", None)):
        raise IsolationError(
            f"drafter {name!r} ({type(drafter).__name__}) declares it partitions by salt but has no salted(salt)"
        )
    return declared


def combined_isolation(drafters: Iterable[Drafter]) -> TenantIsolation:
    """The isolation of a drafter made of ``drafters``: ``SALTED`` when one of them is,
    else ``OWN_TOKENS``.

    Raises:
        IsolationError: one of them does not declare its own (:func:`drafter_isolation`).
    """
    found = [drafter_isolation(d) for d in drafters]
    return TenantIsolation.SALTED if TenantIsolation.SALTED in found else TenantIsolation.OWN_TOKENS


def salted_drafter(drafter: Optional[Drafter], salt: str) -> Optional[Drafter]:
    """The drafter a request of ``cache_salt`` ``salt`` drafts with: ``drafter`` itself for
    the empty salt or an ``OWN_TOKENS`` drafter, ``drafter.salted(salt)`` for a ``SALTED``
    one (see :class:`TenantIsolation`).

    Raises:
        IsolationError: ``salt`` is set and ``drafter`` does not declare its isolation
            (fails closed: it might share drafts across tenants).
    """
    if drafter is None or not salt:
        return drafter
    if drafter_isolation(drafter) is TenantIsolation.OWN_TOKENS:
        return drafter
    return drafter.salted(salt)  # type: ignore[attr-defined]  # SALTED: drafter_isolation checked it


class _CompositeSession:
    def __init__(self, sessions: list[DraftSession], mode: str):
        self._sessions = sessions
        self._mode = mode
        caps = [session_capabilities(s) for s in sessions]

        def having(name: str) -> list[Any]:
            return [s for s, c in zip(sessions, caps) if name in c]

        self._hidden_users = having(SessionCapability.HIDDEN_STATES)
        self._seekers = having(SessionCapability.PROPOSE_AFTER)
        self._finishers = having(SessionCapability.FINISH)
        # what one child declares: the engine asks for features only when a child wants them
        self.capabilities: frozenset[str] = frozenset().union(*caps)

    def extend_hidden(self, hidden) -> None:
        for s in self._hidden_users:
            s.extend_hidden(hidden)

    def propose_after(self, token_ids: Sequence[int], max_tokens: int) -> DraftTree:
        return self._combine([s.propose_after(token_ids, max_tokens) for s in self._seekers], max_tokens)

    def finish(self, token_ids: Sequence[int], reason: str, text: str = "") -> None:
        for s in self._finishers:
            s.finish(token_ids, reason, text)

    def extend(self, token_ids: Sequence[int]) -> None:
        for s in self._sessions:
            s.extend(token_ids)

    def propose(self, max_tokens: int) -> DraftTree:
        return self._combine([s.propose(max_tokens) for s in self._sessions], max_tokens)

    def _combine(self, trees: list[DraftTree], max_tokens: int) -> DraftTree:
        """The children's trees as one, by the composite's mode."""
        trees = [t for t in trees if t.num_nodes]
        if not trees:
            return DraftTree.empty()
        if self._mode == "first":
            return trees[0]
        if self._mode == "longest_match":
            # prefer the longest suffix match (SAM-Decoding's rule), then the earlier drafter
            return max(trees, key=lambda t: t.match_len)
        return merge_trees(trees, max_tokens)

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        for s in self._sessions:
            s.observe(tree, result)


class CompositeDrafter:
    """Several drafters in priority order.

    Args:
        drafters: the drafters, best first.
        mode: "longest_match" (the draft of the longest suffix match wins, ties to the
            earlier drafter), "first" (the first non-empty draft), or "merge" (all drafts
            merged into one tree, earlier drafters' nodes kept first).
    """

    def __init__(self, drafters: Sequence[Drafter], mode: str = "longest_match") -> None:
        if mode not in ("longest_match", "first", "merge"):
            raise ConfigError(f"unknown composite mode {mode!r}")
        self.drafters = list(drafters)
        self.mode = mode
        self.name = "+".join(d.name for d in self.drafters)

    @property
    def isolation(self) -> TenantIsolation:
        """``SALTED`` when one of its drafters is (:func:`combined_isolation`).

        Raises:
            IsolationError: one of its drafters does not declare its own.
        """
        return combined_isolation(self.drafters)

    def reproducible(self) -> Optional[Drafter]:
        """The drafters' reproducible forms (:func:`reproducible_drafter`), those that have
        none (a response cache) left out; ``self`` when every drafter is reproducible
        already, None when none remains."""
        kids = [reproducible_drafter(d) for d in self.drafters]
        if all(k is d for k, d in zip(kids, self.drafters)):
            return self
        kept = [k for k in kids if k is not None]
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else CompositeDrafter(kept, self.mode)

    def salted(self, salt: str) -> "CompositeDrafter":
        """The drafters' salted forms (:func:`salted_drafter`); ``self`` when none changes."""
        kids = [salted_drafter(d, salt) for d in self.drafters]
        if all(k is d for k, d in zip(kids, self.drafters)):
            return self
        return CompositeDrafter([k for k in kids if k is not None], self.mode)

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> DraftSession:
        eos = list(eos_token_ids)
        return _CompositeSession(
            [d.start_request(prompt_ids, documents, eos_token_ids=eos) for d in self.drafters], self.mode
        )
