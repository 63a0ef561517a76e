"""Retrieval first, the EAGLE head otherwise: the per-step choice between a retrieval
drafter (prompt lookup, documents, datastore) and a learned head.

The choice reuses :mod:`ragspec.policy`'s models, per request: accepted tokens per verified
step per arm (:class:`~ragspec.policy.AcceptedPerStep`) and the seconds from one step to
the next per arm (:class:`~ragspec.policy.StepTimer`, on an injected clock). The drafter
itself is stateless across requests; everything it learns lives in the request's session.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..errors import ConfigError
from ..policy import AcceptedPerStep, StepTimer
from ..types import DraftTree, VerifyResult
from .base import (
    Drafter,
    DraftSession,
    SessionCapability,
    TenantIsolation,
    combined_isolation,
    reproducible_drafter,
    salted_drafter,
    session_capabilities,
)

__all__ = ["SelectingDrafter"]

# match-length buckets of retrieval drafts: 1, 2, 3, 4-5, 6-9, 10+ (lengths 0 and 1 share
# the first)
_BUCKETS = (0, 0, 1, 2, 3, 3, 4, 4, 4, 4)
_BUCKET_MIN_MATCH = (1, 2, 3, 4, 6, 10)  # shortest match length of each bucket
_HEAD = "head"


def _bucket(match_len: int) -> int:
    return _BUCKETS[match_len] if match_len < len(_BUCKETS) else len(_BUCKET_MIN_MATCH) - 1


class SelectingDrafter:
    """Retrieval when its match is worth more than the head's draft, the EAGLE head otherwise.

    Per step the retrieval drafter proposes first (it is nearly free). Its tree is used when
    its suffix match is long enough; otherwise the head grows a tree (costing draft time),
    and the retrieval tree is used only when the head has none.

    With ``calibrate`` (default) the threshold is learned per request: the session keeps,
    per match-length bucket of retrieval drafts and for the head, the mean accepted tokens
    per verified step, and each side's step time (from one proposal to the next: for the
    head its draft time plus verifying its wider trees). Retrieval wins at match length m
    when its expected committed tokens per second beat the head's (the rule of
    :mod:`ragspec.policy`: expected accepted tokens per unit of step cost)::

        (1 + a_retrieval(m)) / T_retrieval  >=  (1 + a_head) / T_head

    The head itself runs only while ``(1 + a_head) / T_head >= 1 / T_plain`` (T_plain: steps
    that verified nothing); on a CPU, where its draft costs about half a target forward, that
    keeps it from slowing down text it predicts poorly (retried every ``head_retry`` skipped
    steps). ``min_match`` sets the prior: buckets below it start at ``prior_short`` accepted
    tokens per step, the others at ``prior_long``. When the head wins a step, the retrieval
    draft it beat is scored too, against the tokens committed from that step on (what greedy
    verification would have accepted of it), so the rule keeps learning about match lengths
    it does not pick.

    Why not ``CompositeDrafter(mode="longest_match")``: prompt lookup with ``min_ngram=1``
    matches some 1-gram at almost every step, so "any match wins" leaves the head nearly
    unused, while 1- and 2-token matches are mostly wrong from their first token on
    (shared/BASELINE.md: 8-16% of such drafted tokens accepted).

    Args:
        retrieval: the retrieval drafter (its trees carry ``match_len``).
        eagle: the head's drafter (:class:`~ragspec.eagle.drafter.EagleDrafter`).
        min_match: shortest suffix match (tokens) that wins a priori (and always, when
            ``calibrate`` is False).
        calibrate: learn the threshold online from the request's own steps.
        clock: seconds, monotonic (default ``time.perf_counter``); tests inject their own.

    Raises:
        ConfigError: ``min_match`` < 1.
    """

    prior_short = 0.3  # accepted tokens per step, a priori, below min_match
    prior_long = 1.5
    prior_head = 0.8
    prior_weight = 3.0
    head_retry = 16  # skipped head steps before the head is tried again

    def __init__(
        self,
        retrieval: Drafter,
        eagle: Drafter,
        min_match: int = 3,
        calibrate: bool = True,
        *,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if min_match < 1:
            raise ConfigError(f"min_match must be >= 1, got {min_match}")
        self.retrieval = retrieval
        self.eagle = eagle
        self.min_match = min_match
        self.calibrate = calibrate
        self.clock = clock
        self.name = f"{retrieval.name}|{eagle.name}"

    def reproducible(self) -> Drafter:
        """The drafter for requests whose output must follow from their seed alone (seeded
        sampling): the same retrieval and head, chosen by the fixed ``min_match`` rule,
        without step timing. A calibrated selection's choice depends on timings, which
        changes which drafts are verified, hence how many random draws a request uses and
        so its samples (not their distribution). ``self`` when not calibrated; retrieval
        drafters without a reproducible form (a response cache) are left out."""
        retrieval = reproducible_drafter(self.retrieval)
        if not self.calibrate and retrieval is self.retrieval:
            return self
        if retrieval is None:
            return self.eagle  # nothing reproducible to select against: the head alone
        return SelectingDrafter(retrieval, self.eagle, self.min_match, calibrate=False, clock=self.clock)

    @property
    def isolation(self) -> TenantIsolation:
        """``SALTED`` when retrieval or the head is (a response cache among retrieval).

        Raises:
            IsolationError: one of them does not declare its own.
        """
        return combined_isolation((self.retrieval, self.eagle))

    def salted(self, salt: str) -> "SelectingDrafter":
        """The same over retrieval's salted form (a response cache among it drafts from
        ``salt``'s partition only); ``self`` when that changes nothing."""
        retrieval = salted_drafter(self.retrieval, salt)
        return self if retrieval is self.retrieval or retrieval is None else self.with_retrieval(retrieval)

    def with_retrieval(self, retrieval: Drafter) -> "SelectingDrafter":
        """The same selection over another retrieval drafter (another datastore)."""
        return SelectingDrafter(retrieval, self.eagle, self.min_match, self.calibrate, clock=self.clock)

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> "_SelectingSession":
        eos = list(eos_token_ids)
        return _SelectingSession(
            self,
            self.retrieval.start_request(prompt_ids, documents, eos_token_ids=eos),
            self.eagle.start_request(prompt_ids, documents, eos_token_ids=eos),
        )


def _tree_match(tree: DraftTree, tokens: Sequence[int]) -> int:
    """Length of the longest root path of ``tree`` whose tokens are a prefix of ``tokens``
    (what greedy verification would accept if ``tokens`` were the target's choices)."""
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    node, n = -1, 0
    for t in tokens:
        nxt = next((i for i, p in enumerate(parents) if p == node and toks[i] == t), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n


class _SelectingSession:
    def __init__(self, owner: SelectingDrafter, retrieval: DraftSession, eagle: DraftSession) -> None:
        self._retrieval = retrieval
        self._eagle = eagle
        self._min_match = owner.min_match
        self._calibrate = owner.calibrate
        self._head_retry = owner.head_retry
        priors: dict[object, float] = {
            b: owner.prior_short if m < owner.min_match else owner.prior_long for b, m in enumerate(_BUCKET_MIN_MATCH)
        }
        priors[_HEAD] = owner.prior_head
        self._accepted = AcceptedPerStep(priors, owner.prior_weight)
        # seconds from one proposal to the next, per winner ("plain": nothing was verified)
        self._timer = StepTimer(owner.clock, ("retrieval", _HEAD, "plain")) if owner.calibrate else None
        self._winner: Optional[str] = None  # who won the last proposal
        self._verified = False  # observe() saw a non-empty draft since the last proposal
        self._head_skipped = 0  # consecutive steps the head was judged not worth its cost
        # retrieval drafts of steps the head won, with the tokens committed since (scored
        # once those tokens decide how much of the draft the target would have accepted)
        self._shadows: list[tuple[DraftTree, list[int]]] = []
        # a response cache among the retrieval drafters learns when the request finishes
        finish = session_capabilities(retrieval) & {SessionCapability.FINISH}
        self.capabilities: frozenset[str] = finish | session_capabilities(eagle) & {SessionCapability.HIDDEN_STATES}

    def finish(self, token_ids: Sequence[int], reason: str, text: str = "") -> None:
        self._retrieval.finish(token_ids, reason, text)  # type: ignore[attr-defined]

    def extend(self, token_ids: Sequence[int]) -> None:
        self._retrieval.extend(token_ids)
        self._eagle.extend(token_ids)
        if self._shadows:
            self._score_shadows(token_ids)

    def _score_shadows(self, token_ids: Sequence[int]) -> None:
        """Score the retrieval drafts the head beat against the tokens committed since
        their step: the length of the draft path those tokens follow (what greedy
        verification would have accepted), counted once a mismatch or the draft's depth
        decides it. Tokens of later steps count too, so the score is not capped by what
        the head's own step committed."""
        pending = []
        for shadow, seen in self._shadows:
            seen.extend(int(t) for t in token_ids)
            matched = _tree_match(shadow, seen)
            if matched < len(seen) or matched >= int(shadow.depth.max()) + 1:
                self._accepted.observe(_bucket(shadow.match_len), matched)
            else:
                pending.append((shadow, seen))
        self._shadows = pending

    def extend_hidden(self, hidden: torch.Tensor) -> None:
        self._eagle.extend_hidden(hidden)  # type: ignore[attr-defined]

    def _period(self, arm: str) -> float:
        return self._timer[arm] if self._timer is not None else 0.0

    def _retrieval_wins(self, match_len: int) -> bool:
        t_r, t_h = self._period("retrieval"), self._period(_HEAD)
        if not self._calibrate or t_r <= 0 or t_h <= 0:
            return match_len >= self._min_match
        a_r = self._accepted.mean(_bucket(match_len))
        a_h = self._accepted.mean(_HEAD)
        return (1 + a_r) * t_h >= (1 + a_h) * t_r

    def _head_pays_off(self) -> bool:
        """Whether a head step is expected to commit more tokens per second than a plain
        one: (1 + a_head) / T_head >= 1 / T_plain (true until both are timed)."""
        t_h, t_p = self._period(_HEAD), self._period("plain")
        if not self._calibrate or t_h <= 0 or t_p <= 0 or self._head_skipped >= self._head_retry:
            return True
        return (1 + self._accepted.mean(_HEAD)) * t_p >= t_h

    def propose(self, max_tokens: int) -> DraftTree:
        if self._timer is not None and self._winner is not None:
            self._timer.tick(self._winner if self._verified else "plain")
        elif self._timer is not None:
            self._timer.tick("plain")  # the first tick only starts the clock
        self._verified = False
        r = self._retrieval.propose(max_tokens)
        # until both step times are known, the side not yet timed is tried once
        t_r, t_h = self._period("retrieval"), self._period(_HEAD)
        try_r = self._calibrate and t_r <= 0 < t_h
        try_h = self._calibrate and t_h <= 0 < t_r
        if r.num_nodes and not try_h and (try_r or self._retrieval_wins(max(1, r.match_len))):
            self._winner = "retrieval"
            return r
        if not try_h and not self._head_pays_off():
            # the head's tokens per second (its draft time included) lose to plain decoding:
            # skip it (retried every `head_retry` steps, as the request's text changes)
            self._head_skipped += 1
            self._winner = "retrieval"
            return r
        self._head_skipped = 0
        e = self._eagle.propose(max_tokens)
        self._winner = _HEAD if e.num_nodes else "retrieval"
        if e.num_nodes and r.num_nodes and self._calibrate:
            self._shadows.append((r, []))  # scored against the tokens committed from here on
        return e if e.num_nodes else r

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        self._retrieval.observe(tree, result)
        self._eagle.observe(tree, result)
        if tree.num_nodes == 0:
            return
        self._verified = True
        head = bool(tree.sources) and tree.sources[0] == "eagle"
        self._accepted.observe(_HEAD if head else _bucket(tree.match_len), result.num_accepted)
