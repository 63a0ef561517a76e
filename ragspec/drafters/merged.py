"""One draft tree from all sources: retrieval's branches, the EAGLE head's, and retrieval's
copies hung under the head's tokens, the nodes chosen by expected acceptance.

Prompt lookup loses most where the output *starts* a copy: the model writes one fresh
token (one that follows no occurrence of the context's last token), then copies a long span
from the prompt ("has criticized" then " Messi and Cristiano Ronaldo", copied from
"Pastore believes Lionel Messi and ..."); no suffix match of the context can see that
span before its first token is written (``ragspec bench --replay``: the ``span_start``
class, 22-27% of rag / summarization steps). The EAGLE head can propose that first token.
So per step:

1. retrieval proposes its tree R (prompt lookup, documents, datastore, response cache);
2. the head proposes its EAGLE-2 tree E, unless R's first level is likely enough accepted
   (``head_skip_p``), the step's budget is under ``head_min_tokens`` nodes (a batched
   step's share), or, with ``calibrate``, the head's draft time is not worth what it adds
   (below);
3. for each node of E in its first ``seed_levels`` levels, retrieval proposes the tree
   that would follow the context extended by that node's path (its ``propose_after``:
   lookup of the suffix ..., root, child), hung under the node, its sources tagged
   ``"<source>@head"`` (e.g. ``"prompt@head"``) so that their acceptance is learned apart
   from retrieval's own;
4. R, E and the seeded copies merge into one trie (shared prefixes become one node, which
   keeps the source that gives it the higher acceptance estimate), and the ``max_tokens``
   nodes of highest path acceptance (product of conditional acceptances from the root)
   are kept.

Acceptance estimates come from :class:`~ragspec.policy.AcceptanceModel`, the engine's own
model, mirrored per request: the session observes the same verified trees and results as
the engine's copy (same priors), so the nodes it keeps are the ones the engine's cost
model (:func:`~ragspec.policy.choose_draft`) ranks best, and the engine then cuts the tree
to what maximises expected committed tokens per second. Each node carries its own match
length (``DraftTree.node_match_len``) and is rated within its source's run
(:func:`~ragspec.policy.run_depths`): a copy under a head token is rated as a first copied
token, not as the continuation of the head's path.

The head's draft time is the one cost the engine's cost model does not see (it prices
verification rows only): on a 2-core CPU a 4-level head draft takes ~2.5-4 ms (its layer
through the fused step over Q8_0 weights; ~5-8 ms through transformers' layer) beside an
8-18 ms step. With ``calibrate`` (default) the session measures, per request and on an injected
clock, the head's draft time ``t_head`` and the rest of a step ``T`` (seconds), and, per
*retrieval state* (R empty, or R's match-length bucket: 1, 2, 3, 4-5, 6-9, 10+ tokens),
the head's *gain*: accepted tokens of a step where it ran minus what R alone would have
accepted of the committed tokens, and ``a``, what R alone accepts. In a step whose state
is s it runs the head while (the rule of :mod:`ragspec.policy`: committed tokens per
second)::

    (1 + a(s) + gain(s)) / (T_head(s) + t_head)  >=  (1 + a(s)) / T(s),

where ``T_head(s)`` and ``T(s)`` are the state's measured step seconds with and without the
head's tree offered (its nodes add verification rows; the mean over all steps until
measured; once a state has a head step timed, its next step runs without the head to time
the baseline), and otherwise skips it, trying it again every ``head_retry`` skipped steps. A
step whose proposal the engine's cost model declined entirely counts as a head step with
gain 0 (its draft time bought nothing), and a head that backed off on its own (an empty
tree) neither counts as a head step nor pulls ``t_head`` down. The priors
(``prior_gain``, ``prior_alone`` per state, each worth ``prior_weight`` steps) favour the
head where R has nothing or a short match and R where its match is long (a span being
copied). Without ``calibrate`` (the reproducible form used for seeded sampling) the head
runs at every step R does not skip it (``head_skip_p``).

Verification: every node of the merged tree is deterministic (``draft_probs`` None): the
head's top-k children are deterministic already (see :mod:`ragspec.eagle.head`), lookups
are, and a tree pruned by its nodes' scores must be verified as deterministic anyway
(the contract in :mod:`ragspec.sampling`): lossless for any choice of nodes. Should a
source ever propose sampled nodes with draft probabilities, they are verified as
deterministic here too (still lossless; only their acceptance rule changes).

The old behaviour, one source winning a whole step, is
:class:`~ragspec.drafters.selecting.SelectingDrafter` (``--drafting select``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

from ..errors import ConfigError
from ..policy import AcceptanceModel, AcceptedPerStep, ema_update
from ..tree import follow_path, path_to_node
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

logger = logging.getLogger(__name__)

__all__ = ["MergedDrafter", "SEEDED_SUFFIX"]

SEEDED_SUFFIX = "@head"
"""Appended to a retrieval source's tag for its copies hung under the head's tokens."""
_HEAD = "eagle"


class MergedDrafter:
    """Retrieval, the EAGLE head and retrieval seeded by the head's tokens, merged into one
    tree per step (see the module docstring).

    Args:
        retrieval: the retrieval drafter (prompt lookup, a composite of lookups); its
            sessions' ``propose_after`` (where they define it) gives the seeded copies.
        eagle: the head's drafter (:class:`~ragspec.eagle.drafter.EagleDrafter`).
        seed_levels: levels of the head's tree whose nodes get a seeded copy (0: none, the
            plain merge of R and E).
        head_skip_p: the head is not run in a step where retrieval's first level is
            accepted with at least this estimated probability (its draft time would buy
            little); 1 or more: the head runs every step.
        acceptance: makes the per-request acceptance model; it must rate nodes as the
            engine's does (the default is the engine's default model).
        calibrate: skip the head where its measured gain does not pay for its draft time
            (see the module docstring).
        clock: seconds, monotonic (default ``time.perf_counter``); tests inject their own.

    Raises:
        ConfigError: ``seed_levels`` < 0 or ``head_skip_p`` <= 0.
    """

    # per retrieval state: R empty, then R's match-length buckets 1, 2, 3, 4-5, 6-9, 10+
    prior_gain = (1.0, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1)  # accepted tokens a head step adds
    prior_alone = (0.0, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0)  # accepted tokens of R alone
    prior_weight = 3.0  # steps each prior is worth
    head_retry = 16  # skipped head steps before the head is tried again
    # the head is not run for a proposal of fewer nodes: its fixed cost per proposal (a
    # catch-up and a forward per level, ~1.5-2 ms on the 2-core CPU, its first catch-up in a
    # request ~20 ms) is not paid back by one or two nodes. A batched step's share of rows is
    # that small (8 requests sharing 16 rows: 1 node each), and there every request waits
    # for every other's drafting (ragspec.policy.DraftTimeGate)
    head_min_tokens = 3

    def __init__(
        self,
        retrieval: Drafter,
        eagle: Drafter,
        *,
        seed_levels: int = 1,
        head_skip_p: float = 0.8,
        acceptance: Callable[[], AcceptanceModel] = AcceptanceModel,
        calibrate: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if seed_levels < 0:
            raise ConfigError(f"seed_levels must be >= 0, got {seed_levels}")
        if head_skip_p <= 0:
            raise ConfigError(f"head_skip_p must be > 0, got {head_skip_p}")
        self.retrieval = retrieval
        self.eagle = eagle
        self.seed_levels = seed_levels
        self.head_skip_p = head_skip_p
        self.acceptance = acceptance
        self.calibrate = calibrate
        self.clock = clock
        self.name = f"{retrieval.name}+{eagle.name}"

    def _like(self, retrieval: Drafter, calibrate: bool) -> "MergedDrafter":
        return MergedDrafter(
            retrieval,
            self.eagle,
            seed_levels=self.seed_levels,
            head_skip_p=self.head_skip_p,
            acceptance=self.acceptance,
            calibrate=calibrate,
            clock=self.clock,
        )

    def reproducible(self) -> Optional[Drafter]:
        """The drafter for seeded sampled requests (see :class:`~ragspec.drafters.base.Drafter`):
        the same merge without the timed head gate (a timed choice changes which drafts
        are verified, hence how many random draws a request uses and so its samples), over
        retrieval's reproducible form; ``self`` when that changes nothing; the head alone
        when no retrieval drafter remains."""
        retrieval = reproducible_drafter(self.retrieval)
        if retrieval is None:
            return self.eagle
        if retrieval is self.retrieval and not self.calibrate:
            return self
        return self._like(retrieval, calibrate=False)

    @property
    def isolation(self) -> TenantIsolation:
        """``SALTED`` when retrieval or the head is (a response cache among retrieval).

        Raises:
            IsolationError: one of them does not declare its own.
        """
        return combined_isolation((self.retrieval, self.eagle))

    def salted(self, salt: str) -> "MergedDrafter":
        """The same over retrieval's salted form (a response cache among it drafts from
        ``salt``'s partition only); ``self`` when that changes nothing."""
        retrieval = salted_drafter(self.retrieval, salt)
        return self if retrieval is self.retrieval or retrieval is None else self.with_retrieval(retrieval)

    def with_retrieval(self, retrieval: Drafter) -> "MergedDrafter":
        """The same merge over another retrieval drafter (another datastore)."""
        return self._like(retrieval, self.calibrate)

    def start_request(
        self, prompt_ids: Sequence[int], documents: Sequence[Sequence[int]] = (), *, eos_token_ids: Iterable[int] = ()
    ) -> "_MergedSession":
        eos = [int(e) for e in eos_token_ids]
        return _MergedSession(
            self,
            self.retrieval.start_request(prompt_ids, documents, eos_token_ids=eos),
            self.eagle.start_request(prompt_ids, documents, eos_token_ids=eos),
            frozenset(eos),
        )


# match length -> bucket 1..6 of a non-empty retrieval tree (1, 2, 3, 4-5, 6-9, 10+); 0: empty
_STATE = (1, 1, 2, 3, 4, 4, 5, 5, 5, 5)


def _retrieval_state(tree: DraftTree) -> int:
    """The retrieval state of a step (the head gate's key): 0 when retrieval proposed
    nothing, else its match length's bucket, 1 (1 token) to 6 (10+)."""
    if tree.num_nodes == 0:
        return 0
    return _STATE[tree.match_len] if tree.match_len < len(_STATE) else 6


class _Pool:
    """The merged trie being built: nodes appended after their parents (topological)."""

    def __init__(self, acceptance: AcceptanceModel) -> None:
        self.acc = acceptance
        self.tok: list[int] = []
        self.par: list[int] = []
        self.dep: list[int] = []
        self.src: list[str] = []
        self.ml: list[int] = []
        self.sc: list[float] = []
        self.run: list[int] = []  # depth within the source's run (policy.run_depths)
        self.cond: list[float] = []  # acceptance estimate given the parent
        self.head: list[bool] = []  # proposed by the head (possibly among other sources)
        self._index: dict[tuple[int, int], int] = {}

    def add(self, tree: DraftTree, under: int = -1, suffix: str = "", head: bool = False) -> list[int]:
        """Add ``tree``'s nodes, its root children below pool node ``under`` (-1: the
        root), sources tagged with ``suffix``. Returns the pool node of each tree node."""
        scores = tree.scores.tolist() if tree.scores is not None else [1.0] * tree.num_nodes
        sources = tree.sources or ("draft",) * tree.num_nodes
        lens = tree.match_lens()
        mapping: list[int] = []
        for i, (t, p) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
            parent = under if p < 0 else mapping[p]
            src = sources[i] + suffix
            run = 0 if parent < 0 or self.src[parent] != src else self.run[parent] + 1
            cond = self.acc.prob(src, lens[i], run, scores[i])
            node = self._index.get((parent, t))
            if node is None:
                node = len(self.tok)
                self._index[(parent, t)] = node
                self.tok.append(int(t))
                self.par.append(parent)
                self.dep.append(0 if parent < 0 else self.dep[parent] + 1)
                self.src.append(src)
                self.ml.append(lens[i])
                self.sc.append(scores[i])
                self.run.append(run)
                self.cond.append(cond)
                self.head.append(head)
            else:
                # two sources propose the same node: it keeps the more trusted one's rating
                if cond > self.cond[node]:
                    self.src[node], self.ml[node], self.sc[node] = src, lens[i], scores[i]
                    self.run[node], self.cond[node] = run, cond
                self.head[node] = self.head[node] or head
            mapping.append(node)
        return mapping

    def best(self, max_nodes: int, match_len: int) -> tuple[DraftTree, list[bool]]:
        """The ``max_nodes`` nodes of highest path acceptance as a tree (siblings best
        first), rated by the acceptance model as the engine will rate them; and which of
        them the head proposed."""
        n = len(self.tok)
        if n == 0 or max_nodes <= 0:
            return DraftTree.empty(), []
        full = DraftTree(
            tokens=torch.tensor(self.tok, dtype=torch.long),
            parents=torch.tensor(self.par, dtype=torch.long),
            depth=torch.tensor(self.dep, dtype=torch.long),
            sources=tuple(self.src),
            scores=torch.tensor(self.sc, dtype=torch.float32),
            match_len=match_len,
            node_match_len=torch.tensor(self.ml, dtype=torch.long),
        )
        cond = self.acc.node_probs(full)
        path = [0.0] * n
        for i in range(n):
            path[i] = cond[i] * (path[self.par[i]] if self.par[i] >= 0 else 1.0)
        # a child's path never beats its parent's (cond <= 1) and ties go to the shallower
        # node, so the best k are closed under parents
        order = sorted(range(n), key=lambda i: (-path[i], self.dep[i], i))[:max_nodes]
        rank = {node: r for r, node in enumerate(order)}
        chosen = sorted(order, key=lambda i: (self.dep[i], rank[i]))
        new = {old: j for j, old in enumerate(chosen)}
        idx = torch.tensor(chosen, dtype=torch.long)
        tree = DraftTree(
            tokens=full.tokens[idx],
            parents=torch.tensor([new[self.par[i]] if self.par[i] >= 0 else -1 for i in chosen], dtype=torch.long),
            depth=full.depth[idx],
            sources=tuple(self.src[i] for i in chosen),
            scores=None if full.scores is None else full.scores[idx],
            draft_probs=None,
            match_len=match_len,
            node_match_len=None if full.node_match_len is None else full.node_match_len[idx],
        )
        return tree, [self.head[i] for i in chosen]


class _MergedSession:
    _EMA = 0.2  # weight of the newest step in the step and head timings

    def __init__(self, owner: MergedDrafter, retrieval: DraftSession, eagle: DraftSession, eos: frozenset[int]):
        self._retrieval = retrieval
        self._eagle = eagle
        self._eos = eos
        self._seed_levels = owner.seed_levels
        self._head_skip_p = owner.head_skip_p
        self._acc = owner.acceptance()  # mirrors the engine's per-request model
        retrieval_caps, eagle_caps = session_capabilities(retrieval), session_capabilities(eagle)
        self._seek: Optional[Callable[[Sequence[int], int], DraftTree]] = None
        if SessionCapability.PROPOSE_AFTER in retrieval_caps:
            self._seek = retrieval.propose_after  # type: ignore[attr-defined]
        # token paths (root child first) of the last proposal's nodes the head proposed
        self._head_paths: set[tuple[int, ...]] = set()
        # the timed head gate (module docstring); None without calibration
        self._clock = owner.clock if owner.calibrate else None
        self._head_retry = owner.head_retry
        self._head_min_tokens = owner.head_min_tokens
        priors: dict[object, float] = {("gain", b): g for b, g in enumerate(owner.prior_gain)}
        priors.update({("alone", b): a for b, a in enumerate(owner.prior_alone)})
        self._gain = AcceptedPerStep(priors, owner.prior_weight)
        self._state = 0  # retrieval state of the last proposal (_retrieval_state)
        self._step_s = 0.0  # EMA of a step's seconds without the head's draft
        # the same per (retrieval state, whether the head's tree was offered): a step with the
        # head's nodes verifies more rows, and a state's plain step is its own baseline
        self._step_s_by: dict[tuple[int, bool], float] = {}
        self._head_s = 0.0  # EMA of the head's draft seconds (its tree and the seeded copies)
        self._last_tick: Optional[float] = None
        self._head_s_last = 0.0  # head seconds in the step since the last tick
        self._skipped = 0  # consecutive steps the gate skipped the head
        self._last_r: Optional[DraftTree] = None  # retrieval's tree of the last proposal
        self._head_ran = False  # the head proposed in the last proposal
        self._observed = False  # the engine verified (part of) the last proposal
        # a response cache among the retrieval drafters learns when the request finishes;
        # features only when the head wants them (the engine then asks the target for them)
        self.capabilities: frozenset[str] = retrieval_caps & {SessionCapability.FINISH} | eagle_caps & {
            SessionCapability.HIDDEN_STATES
        }

    def finish(self, token_ids: Sequence[int], reason: str, text: str = "") -> None:
        self._retrieval.finish(token_ids, reason, text)  # type: ignore[attr-defined]

    def extend_hidden(self, hidden: torch.Tensor) -> None:
        self._eagle.extend_hidden(hidden)  # type: ignore[attr-defined]

    def extend(self, token_ids: Sequence[int]) -> None:
        if self._clock is not None and self._head_ran and not self._observed:
            # the engine verified none of the last proposal (its cost model declined it):
            # the head's draft time bought nothing in this step
            self._gain.observe(("gain", self._state), 0)
        self._observed = True  # counted once
        self._retrieval.extend(token_ids)
        self._eagle.extend(token_ids)

    def _first_level_p(self, tree: DraftTree) -> float:
        """Estimated chance that some root child of ``tree`` is accepted (they exclude
        each other)."""
        probs = self._acc.node_probs(tree)
        return min(1.0, sum(p for p, d in zip(probs, tree.depth.tolist()) if d == 0))

    def _tick(self) -> None:
        """A new step: time the previous one, less its head draft."""
        if self._clock is None:
            return
        now = float(self._clock())
        if self._last_tick is not None:
            dt = max(0.0, now - self._last_tick - self._head_s_last)
            self._step_s = ema_update(self._step_s, dt, self._EMA)
            if self._observed:  # the last proposal's step completed (verified or declined)
                key = (self._state, self._head_ran)
                self._step_s_by[key] = ema_update(self._step_s_by.get(key, 0.0), dt, self._EMA)
        self._last_tick = now
        self._head_s_last = 0.0

    def _head_pays_off(self, state: int) -> bool:
        """(1 + a + gain) / (T_head + t_head) >= (1 + a) / T for the state (true until the
        times are measured, and every ``head_retry`` skipped steps): ``T_head`` and ``T``
        are the state's measured step seconds with and without the head's tree offered
        (the mean over all steps until each is measured); with both equal this is
        gain >= (1 + a) * t_head / T."""
        if self._clock is None or self._step_s <= 0 or self._head_s <= 0 or self._skipped >= self._head_retry:
            return True
        if (state, True) in self._step_s_by and (state, False) not in self._step_s_by:
            return False  # once per state: time a step without the head, the baseline
        t_with = self._step_s_by.get((state, True), self._step_s)
        t_without = self._step_s_by.get((state, False), self._step_s)
        if t_without <= 0:
            return True
        alone = 1.0 + self._gain.mean(("alone", state))
        return (alone + self._gain.mean(("gain", state))) * t_without >= alone * (t_with + self._head_s)

    def propose(self, max_tokens: int) -> DraftTree:
        self._tick()
        self._head_paths = set()
        self._head_ran = False
        self._observed = False
        self._last_r = None
        if max_tokens <= 0:
            return DraftTree.empty()
        r = self._retrieval.propose(max_tokens)
        self._last_r = r
        pool = _Pool(self._acc)
        pool.add(r)
        trusted = max_tokens < self._head_min_tokens or (
            self._head_skip_p < 1.0 and r.num_nodes and self._first_level_p(r) >= self._head_skip_p
        )
        self._state = _retrieval_state(r)
        if not trusted and self._head_pays_off(self._state):
            self._skipped = 0
            self._head_ran = True
            t0 = self._clock() if self._clock is not None else 0.0
            e = self._eagle.propose(max_tokens)
            if e.num_nodes:
                nodes = pool.add(e, head=True)
                self._seed(e, nodes, pool, max_tokens)
            else:
                # the head backed off (its own skip) or had nothing: not a head step, and
                # its near-zero time must not pull the head's timing down
                self._head_ran = False
            if self._clock is not None:
                dt = float(self._clock()) - t0
                self._head_s_last = dt
                if e.num_nodes:
                    self._head_s = ema_update(self._head_s, dt, self._EMA)
        elif not trusted:
            self._skipped += 1
        tree, head = pool.best(max_tokens, r.match_len)
        if tree.num_nodes:
            tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
            paths: list[tuple[int, ...]] = []
            for i, p in enumerate(parents):
                paths.append((paths[p] if p >= 0 else ()) + (tokens[i],))
            self._head_paths = {paths[i] for i in range(len(paths)) if head[i]}
        return tree

    def _seed(self, e: DraftTree, nodes: list[int], pool: _Pool, max_tokens: int) -> None:
        """Hang retrieval's copies under the head's nodes of its first ``seed_levels``
        levels (a copy following each node's path)."""
        if self._seek is None or self._seed_levels <= 0:
            return
        tokens = e.tokens.tolist()
        for i, d in enumerate(e.depth.tolist()):
            room = max_tokens - (d + 1)
            if d >= self._seed_levels or room <= 0 or tokens[i] in self._eos:
                continue
            after = [tokens[j] for j in path_to_node(e, i)]
            copy = self._seek(after, room)
            if copy.num_nodes:
                pool.add(copy, under=nodes[i], suffix=SEEDED_SUFFIX)

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        self._observed = True
        self._acc.observe(tree, result)
        self._retrieval.observe(tree, result)
        self._eagle.observe(self._as_head_saw_it(tree), result)
        if self._clock is not None and tree.num_nodes:
            alone = result.num_accepted
            if self._head_ran:
                # what retrieval's own tree would have accepted of the committed tokens
                alone = len(follow_path(self._last_r, result.tokens)) if self._last_r is not None else 0
                self._gain.observe(("gain", self._state), result.num_accepted - alone)
            self._gain.observe(("alone", self._state), alone)

    def _as_head_saw_it(self, tree: DraftTree) -> DraftTree:
        """``tree`` (the part of the last proposal the engine verified) with the nodes the
        head proposed tagged as the head's: a node shared with retrieval may carry
        retrieval's tag, and the head's session must still see it verified."""
        if not self._head_paths or tree.num_nodes == 0:
            return tree
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        paths: list[tuple[int, ...]] = []
        sources = list(tree.sources or ("draft",) * tree.num_nodes)
        for i, p in enumerate(parents):
            paths.append((paths[p] if p >= 0 else ()) + (tokens[i],))
            if paths[i] in self._head_paths:
                sources[i] = _HEAD
        return DraftTree(
            tree.tokens,
            tree.parents,
            tree.depth,
            tuple(sources),
            tree.scores,
            tree.draft_probs,
            tree.match_len,
            tree.node_match_len,
        )
