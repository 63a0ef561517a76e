"""Cost-aware speculation: how many draft nodes to verify in a step (0 = plain decoding).

Two models feed one choice (as in Sequoia / SpecDec++ style cost models, and the
"expected accepted tokens per unit of verification cost" rule of SuffixDecoding, Oliaro et
al. 2024, section 4.3):

* :class:`LatencyModel`: seconds for one target forward of ``q`` new tokens, measured at
  start-up (:mod:`ragspec.calibrate`) and refined online from real steps;
* :class:`AcceptanceModel`: for each draft node, the chance it is accepted given that its
  parent is, per drafter source, suffix-match length and depth, calibrated online from
  accepted lengths (Beta-Bernoulli counts);
* :class:`AcceptedPerStep` and :class:`StepTimer`: the same two quantities per *arm* of a
  choice between drafters (accepted tokens per verified step, seconds from one step to the
  next), for :class:`~ragspec.drafters.selecting.SelectingDrafter`.

:func:`choose_draft` keeps the prefix of the draft (best nodes first) that maximises
expected committed tokens per second: ``(1 + E[accepted]) / latency(1 + n)``.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch

from .errors import ConfigError
from .types import DraftTree, VerifyResult

__all__ = [
    "DEFAULT_LATENCY",
    "LatencyModel",
    "LatencyTable",
    "AcceptanceModel",
    "run_depths",
    "AcceptedPerStep",
    "StepTimer",
    "ema_update",
    "DraftTimeGate",
    "choose_draft",
    "DraftChoice",
]


# Greedy verification computes the output layer's rows lazily (the first row, then the rest
# once a first draft token is accepted: ragspec.types.LazyLogits) only while the chance of
# that acceptance is below this: an accepted step then pays two passes over the output
# layer (on the 2-core CPU, 49152 x 576: 8.5 ms for 1 row, then 13 ms for 8) instead of
# one (13.4 ms for 9 rows), a rejected one saves 5 ms; break-even near 0.4.
LAZY_LOGITS_MAX_P = 0.5


# Default latency table (seconds per forward of q new tokens) measured on the reference
# 2-core CPU with the default model at ~700 tokens of context (shared/BASELINE.md): an
# engine's until it measures its own (ragspec.loading does).
DEFAULT_LATENCY = {
    1: 0.0419,
    2: 0.0677,
    3: 0.0827,
    4: 0.0631,
    6: 0.0638,
    8: 0.0643,
    12: 0.0712,
    16: 0.0796,
    32: 0.1065,
}


class LatencyModel:
    """Forward latency (seconds) of the target for ``q`` new tokens.

    Args:
        table: measured seconds per q (q = 1 is plain decoding); missing q are interpolated
            from the nearest measured ones, q past the largest measured extrapolate linearly.
        ema: weight of a new observation in the online refinement (0 = frozen).
    """

    def __init__(self, table: dict[int, float], ema: float = 0.05, early: Optional[dict[int, float]] = None) -> None:
        if not table or 1 not in table:
            raise ValueError("LatencyModel needs at least the latency of q=1")
        self._table = {int(k): float(v) for k, v in table.items()}
        # seconds when only the first row of the output layer is computed (greedy
        # verification of a draft rejected at its first token; see ragspec.types.LazyLogits)
        self._early = {int(k): float(v) for k, v in early.items()} if early else None
        self.ema = ema
        self._scale = 1.0

    def fork(self, ema: Optional[float] = None) -> "LatencyModel":
        """An independent copy (same measured tables and current scale), e.g. per request."""
        other = LatencyModel(self._table, self.ema if ema is None else ema, self._early)
        other._scale = self._scale
        return other

    def early(self, q: int) -> float:
        """Seconds for a forward of q new tokens of which only the first row's logits are
        computed (= ``self(q)`` where that was not measured)."""
        if self._early is None:
            return self(q)
        return min(self._shape(q, self._early), self._shape(q)) * self._scale

    def expected(self, q: int, p_first: float) -> float:
        """Expected seconds of a greedy step: when a first draft token is likely accepted
        (``p_first >= LAZY_LOGITS_MAX_P``) every row's logits are computed at once (the full
        cost); below, lazily: the full cost when a first draft token is accepted
        (probability ``p_first``), the early-exit cost otherwise."""
        full = self(q)
        if self._early is None or p_first >= LAZY_LOGITS_MAX_P:
            return full
        return p_first * full + (1.0 - p_first) * self.early(q)

    @property
    def table(self) -> dict[int, float]:
        """Current estimate per measured q (seconds), the online scale applied."""
        return {q: v * self._scale for q, v in sorted(self._table.items())}

    @property
    def early_table(self) -> Optional[dict[int, float]]:
        """Measured seconds per q with only the first row's logits (None: not measured)."""
        return dict(sorted(self._early.items())) if self._early is not None else None

    def __call__(self, q: int) -> float:
        """Seconds for one forward of q new tokens (q >= 1)."""
        return self._shape(q) * self._scale

    def _shape(self, q: int, table: Optional[dict[int, float]] = None) -> float:
        t = self._table if table is None else table
        if q in t:
            return t[q]
        keys = sorted(t)
        lo = max((k for k in keys if k < q), default=keys[0])
        hi = min((k for k in keys if k > q), default=None)
        if hi is None:
            if len(keys) >= 2:
                k1, k2 = keys[-2], keys[-1]
                slope = max(0.0, (t[k2] - t[k1]) / (k2 - k1))
            else:
                slope = t[lo]
            return t[keys[-1]] + slope * (q - keys[-1])
        w = (q - lo) / (hi - lo)
        return t[lo] * (1 - w) + t[hi] * w

    def observe(self, q: int, seconds: float, early: bool = False) -> None:
        """Refine from one measured step: the measured shape over q is kept, and one scale
        factor follows the observed/predicted ratio (longer contexts, other load), so the
        relative cost of drafting stays calibrated for every q. ``early``: the step
        computed only the first row of logits."""
        if self.ema <= 0 or seconds <= 0:
            return
        shape = self._shape(q, self._early) if (early and self._early is not None) else self._shape(q)
        ratio = seconds / shape
        ratio = min(4.0, max(0.25, ratio))  # one stalled step must not swing the model
        self._scale = (1 - self.ema) * self._scale + self.ema * ratio

    @classmethod
    def from_table(cls, measured: "LatencyTable") -> "LatencyModel":
        """The model the engine uses from a measured table: the seconds per q averaged over
        the measured contexts (linear between them, at their mean), and the first-row-only
        forwards' seconds where they were measured (:func:`ragspec.calibrate.measure_latency`
        measures the table).

        Raises:
            ValueError: the table holds no full-forward timings.
        """
        mid = statistics.fmean(measured.full)
        early_table = measured.at(mid, early=True) if measured.early else None
        return cls(measured.at(mid), early=early_table)


@dataclass(frozen=True)
class LatencyTable:
    """Measured seconds per target forward, keyed by what they were measured on.

    Attributes:
        device: ``"cpu"``, or ``"cuda:<device name>"`` (e.g. ``"cuda:NVIDIA H200"``).
        dtype: the weights' dtype, e.g. ``"float32"``, ``"bfloat16"``.
        model: the model's name.
        full: context (cached tokens) -> q (new tokens) -> seconds, all N + 1 rows of
            logits computed.
        early: the same with only the first row's logits (empty where not measured).
    """

    device: str
    dtype: str
    model: str
    full: dict[int, dict[int, float]]
    early: dict[int, dict[int, float]]

    @property
    def key(self) -> tuple[str, str, str]:
        """``(device, dtype, model)``: tables of different keys are not interchangeable."""
        return (self.device, self.dtype, self.model)

    @property
    def contexts(self) -> tuple[int, ...]:
        return tuple(sorted(self.full))

    def at(self, context: float, early: bool = False) -> dict[int, float]:
        """q -> seconds at a ``context``-token cache, linear in the context between the two
        nearest measured contexts (the nearest one outside them): {512: {1: 0.010},
        2048: {1: 0.014}}.at(1280) -> {1: 0.012}."""
        tables = self.early if early else self.full
        if not tables:
            raise ValueError("no table measured" + (" with the first row only" if early else ""))
        ctx = sorted(tables)
        lo = max((c for c in ctx if c <= context), default=ctx[0])
        hi = min((c for c in ctx if c >= context), default=ctx[-1])
        if lo == hi:
            return dict(tables[lo])
        w = (context - lo) / (hi - lo)
        return {q: tables[lo][q] * (1 - w) + tables[hi][q] * w for q in tables[lo] if q in tables[hi]}

    def to_dict(self) -> dict:
        """JSON-able: ``{"device", "dtype", "model", "full": {ctx: {q: s}}, "early": ...}``
        (JSON keys are strings)."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "model": self.model,
            "full": {str(c): {str(q): s for q, s in t.items()} for c, t in self.full.items()},
            "early": {str(c): {str(q): s for q, s in t.items()} for c, t in self.early.items()},
        }

    @classmethod
    def from_dict(cls, data: dict) -> "LatencyTable":
        """Inverse of :meth:`to_dict`."""

        def tables(d: dict) -> dict[int, dict[int, float]]:
            return {int(c): {int(q): float(s) for q, s in t.items()} for c, t in d.items()}

        return cls(
            str(data["device"]),
            str(data["dtype"]),
            str(data["model"]),
            tables(data["full"]),
            tables(data.get("early", {})),
        )


@dataclass
class _Beta:
    success: float
    trials: float

    @property
    def mean(self) -> float:
        return self.success / self.trials if self.trials > 0 else 0.0


class AcceptanceModel:
    """P(node accepted | parent accepted), per (source, match-length bucket, depth bucket).

    Starts from priors (``prior_first`` for depth 0, ``prior_next`` deeper, each worth
    ``prior_weight`` pseudo-trials) and learns from each verified draft. One model per
    request: what the target accepts depends on the prompt.

    A node's match length is its own (``DraftTree.match_lens``: a merged tree's nodes come
    from several lookups), and its depth is counted within its *run*: the nodes of its
    source directly above it (:func:`run_depths`). In a single-source tree that is the
    depth; a lookup continuation hung under an EAGLE head's token starts at run depth 0,
    a first copied token like a retrieval draft's first, not the continuation of a copy.
    """

    MAX_DEPTH = 4
    # match-length buckets: 0 (not a lookup draft), 1, 2, 3, 4-5, 6-9, 10-15, 16+
    _MATCH_BUCKETS = (0, 1, 2, 3, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 6, 6)

    def __init__(
        self,
        prior_first: float = 0.25,
        prior_next: float = 0.8,
        prior_weight: float = 2.0,
        calibrated_sources: tuple[str, ...] = ("eagle", "grammar"),
        long_match_priors: Optional[tuple[float, float]] = (0.9, 0.95),
    ) -> None:
        self.prior_first = prior_first
        self.prior_next = prior_next
        # a suffix match of 16+ tokens (the last bucket) is a copy in progress: a repeated
        # question's earlier answer (a response cache), a passage quoted at length. Its
        # (first, deeper) nodes' priors; None: the formula of the shorter matches
        self.long_match_priors = long_match_priors
        self.prior_weight = prior_weight
        # sources whose scores are already acceptance estimates (EAGLE-2's draft
        # confidence, Li et al. 2024b, section 3; a grammar's forced tokens, score 1: the
        # only token its mask allows): their prior factor is 1 at every depth
        self.calibrated_sources = tuple(calibrated_sources)
        self._stats: dict[tuple[str, int, int], _Beta] = {}

    def _key(self, source: str, match_len: int, depth: int) -> tuple[str, int, int]:
        b = self._MATCH_BUCKETS[match_len] if match_len < len(self._MATCH_BUCKETS) else 7
        return (source, b, min(depth, self.MAX_DEPTH))

    def _beta(self, key: tuple[str, int, int]) -> _Beta:
        b = self._stats.get(key)
        if b is None:
            _, m, d = key
            prior = self.prior_first if d == 0 else self.prior_next
            # longer suffix matches (higher bucket) are more trustworthy a priori
            if d == 0 and m:
                prior = min(0.9, prior + 0.07 * (m - 1))
            if m == 7 and self.long_match_priors is not None:
                prior = self.long_match_priors[0 if d == 0 else 1]
            if key[0] in self.calibrated_sources:
                prior = 1.0
            b = _Beta(prior * self.prior_weight, self.prior_weight)
            self._stats[key] = b
        return b

    def prob(self, source: str, match_len: int, run_depth: int, score: float = 1.0) -> float:
        """Conditional acceptance probability of one node (its parent accepted): the
        calibrated rate of (source, match bucket, run depth) times the drafter's own
        ``score`` (clipped to [0, 1])."""
        p = self._beta(self._key(source, match_len, run_depth)).mean
        return min(1.0, p * min(1.0, max(0.0, score)))

    def node_probs(self, tree: DraftTree) -> list[float]:
        """Conditional acceptance probability of each node of ``tree`` (its parent accepted).

        The drafter's own ``scores`` (branch shares, draft probabilities) multiply in for
        nodes with siblings."""
        scores = tree.scores.tolist() if tree.scores is not None else [1.0] * tree.num_nodes
        sources = tree.sources or ("draft",) * tree.num_nodes
        return [self.prob(src, m, d, sc) for src, m, d, sc in zip(sources, tree.match_lens(), run_depths(tree), scores)]

    def observe(self, tree: DraftTree, result: VerifyResult) -> None:
        """Count, for each node whose parent was accepted, whether it was accepted too."""
        if tree.num_nodes == 0:
            return
        parents = tree.parents.tolist()
        accepted = set(result.accepted_nodes)
        reached = accepted | {-1}
        depth = run_depths(tree)
        lens = tree.match_lens()
        scores = tree.scores.tolist() if tree.scores is not None else [1.0] * tree.num_nodes
        for i in range(tree.num_nodes):
            if parents[i] not in reached:
                continue
            src = tree.sources[i] if tree.sources else "draft"
            b = self._beta(self._key(src, lens[i], depth[i]))
            # a trial weighs the drafter's own score: the mean is then accepted / sum of
            # scores, the factor that calibrates scores (node_probs = mean * score). With
            # unit trials, k siblings (EAGLE top-k, candidate branches) would divide the
            # mean by ~k and the draft would be judged worthless.
            b.trials += min(1.0, max(1e-3, scores[i]))
            if i in accepted:
                b.success += 1


def run_depths(tree: DraftTree) -> list[int]:
    """Depth of each node within its source's run: 0 when its parent is the root or has
    another source, else its parent's + 1 (the depth itself in a single-source tree).

    Example: sources (eagle, eagle, prompt@head, prompt@head), parents [-1, 0, 1, 2] ->
    [0, 1, 0, 1].
    """
    parents = tree.parents.tolist()
    sources = tree.sources or ("draft",) * tree.num_nodes
    out: list[int] = []
    for i, p in enumerate(parents):
        out.append(0 if p < 0 or sources[p] != sources[i] else out[p] + 1)
    return out


class AcceptedPerStep:
    """Mean accepted draft tokens per verified step, per arm (a drafter, or a drafter at
    one match-length bucket), from pseudo-counts: each arm starts at its ``prior`` mean,
    worth ``prior_weight`` steps, and every observed step adds one. One per request.

    Example: prior 1.5 at weight 3, then steps accepting 0 and 4 tokens: (4.5 + 0 + 4) / 5
    = 1.7.
    """

    def __init__(self, priors: Mapping[Hashable, float], prior_weight: float = 3.0) -> None:
        self._stats = {arm: _Beta(prior * prior_weight, prior_weight) for arm, prior in priors.items()}

    def mean(self, arm) -> float:
        """Expected accepted tokens of a verified step of ``arm``."""
        return self._stats[arm].mean

    def observe(self, arm, accepted: int) -> None:
        """One verified step of ``arm`` that accepted ``accepted`` draft tokens."""
        b = self._stats[arm]
        b.success += accepted
        b.trials += 1


def ema_update(average: float, x: float, weight: float) -> float:
    """One step of an exponential moving average of a positive quantity (seconds of a
    step, of a draft): ``x`` itself while ``average`` is 0 (nothing measured yet), else
    ``(1 - weight) * average + weight * x`` (``weight``: of the newest observation, in
    (0, 1]).

    Example: weight 0.2: from 0.0, x 1.0 -> 1.0; then x 2.0 -> 1.2.
    """
    return x if average <= 0 else (1 - weight) * average + weight * x


class StepTimer:
    """Seconds from one step to the next, per arm (:func:`ema_update` with weight ``ema``
    of the newest step), read from an injected ``clock`` (seconds; ``time.perf_counter``
    in production, a scripted clock in tests). One per request.

    Example: ticks at 0.0, 0.1 (charged to "a") and 0.4 (charged to "b"): ``timer["a"]``
    0.1, ``timer["b"]`` 0.3; an arm never charged reads 0.0.
    """

    def __init__(self, clock: Callable[[], float], arms: Sequence[str], ema: float = 0.2) -> None:
        self._clock = clock
        self._ema = ema
        self._period = {a: 0.0 for a in arms}
        self._last: Optional[float] = None

    def __getitem__(self, arm: str) -> float:
        return self._period[arm]

    def tick(self, previous_arm: str) -> None:
        """Start a new step, charging the seconds since the previous tick to
        ``previous_arm`` (the arm whose step that was)."""
        now = float(self._clock())
        if self._last is not None:
            self._period[previous_arm] = ema_update(self._period[previous_arm], now - self._last, self._ema)
        self._last = now


class DraftTimeGate:
    """Whether a request's drafting pays for its own seconds, alone or in a batched step.

    :func:`choose_draft` prices a draft's verification rows, not the seconds its drafter
    spends proposing it (prompt lookup's Python and the tree it builds, the cost model's own
    choice, the EAGLE head's forwards and catch-ups), nor whether the rows it chose were
    then accepted. In a batched step every request waits for every other's drafting: on the
    2-core CPU, 8 rag/summarization requests drafting cost ~4.1 ms of a ~44 ms step (the
    EAGLE head's whole-prompt catch-ups most of it) and gained 0.3 committed tokens of 8.3,
    so the step committed fewer tokens per second than with drafting off. Alone, a request
    pays ~0.15-0.2 ms of prompt lookup and choice per ~7 ms step (2-3%) at every step whose
    context has a suffix match, and where the output copies nothing the cost model declines
    most of those proposals (MT-bench writing: 1 in 5 verified, 0.05 tokens accepted per
    step), so drafting on was no faster than drafting off.

    Per request, after each step it drafted in, the net tokens its drafting added::

        net = accepted - rate * (draft_s + rows_s)

    where ``accepted`` is its accepted draft tokens, ``rate`` the step's committed tokens
    per second (all its requests), ``draft_s`` its drafting seconds and ``rows_s`` its draft
    rows' share of the forward (its measured seconds times ``1 - latency(rows - nodes) /
    latency(rows)``, :func:`ragspec.draft_choice.observe_gates`): the step
    committed more tokens per second than it would have without this request's drafting
    exactly when ``net >= 0`` (``(C - a) / (T - d) <= C / T`` for ``C`` tokens committed in
    ``T`` seconds, ``a`` of them accepted drafts that cost ``d`` seconds). It drafts while
    the running mean of ``net`` (an EMA of weight ``ema``, starting at ``prior`` tokens) is
    >= 0; otherwise it skips drafting (its step is a plain one) and drafts again after
    ``retry`` skipped steps, so a copy that starts later is found again. One per request
    and per setting (the engine keeps one for its batched steps, :meth:`solo` for its steps
    alone); greedy outputs never depend on it (the engine does not gate seeded sampled
    requests, whose drafts must not depend on timing).

    Raises:
        ConfigError: ``prior`` not a finite number, ``ema`` not in (0, 1], ``retry`` not an
            integer >= 1.

    Example: prior 0.5, ema 0.5, a step with net -2.0: mean -0.75 -> skip ``retry``
    steps, then draft once; net +3.0: mean 1.125 -> draft.
    """

    def __init__(self, prior: float = 0.5, ema: float = 0.3, retry: int = 8) -> None:
        def real(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not real(prior):
            raise ConfigError(f"prior must be a finite number (tokens), got {prior!r}")
        if not real(ema) or not 0.0 < ema <= 1.0:
            raise ConfigError(f"ema must be a number in (0, 1], got {ema!r}")
        if type(retry) is not int or retry < 1:
            raise ConfigError(f"retry must be an integer >= 1 (steps), got {retry!r}")
        self.mean = float(prior)
        self.ema = float(ema)
        self.retry = int(retry)
        self._skipped = 0

    @classmethod
    def solo(cls) -> "DraftTimeGate":
        """The gate of a request's steps alone: a longer memory (``ema`` 0.1) and sooner
        retries (every 3 skipped steps) than a batched step's (0.3, 8). Alone, a proposal
        the cost model declines costs ~0.03 tokens (its drafting seconds over one ~7 ms
        step) while a copy missed by a closed gate costs several, and accepted drafts come
        in bursts (copies) between runs of declined proposals: a short memory closes the
        gate between two copies and misses the start of the next. Simulated over 2
        Spec-Bench dev prompts per category (the calibrated CPU latency table, ~0.2 ms a
        proposal; decode phase, drafts on over off), the batched settings took
        summarization from 1.086x to 1.030x and reasoning from 1.089x to 1.043x; these keep
        every category within +-0.025 of ungated (all 13: 1.120x -> 1.121x) with 38-47%
        fewer proposals where little is copied (writing, math, stem, roleplay), and
        doubling the wait after each failed retry (tried: up to 16 or 24 steps) lost
        qa and rag copies (1.161x -> 1.067x)."""
        return cls(prior=0.5, ema=0.1, retry=3)

    def should_draft(self) -> bool:
        """Draft in this step? (Counts the step as skipped when not.)"""
        if self.mean >= 0.0 or self._skipped >= self.retry:
            self._skipped = 0
            return True
        self._skipped += 1
        return False

    def observe(self, accepted: int, rate: float, draft_s: float, rows_s: float) -> float:
        """One step the request drafted in (``rate``: committed tokens per second of the
        step, all its requests; seconds otherwise). Returns the step's net tokens."""
        net = float(accepted) - max(0.0, rate) * (max(0.0, draft_s) + max(0.0, rows_s))
        self.mean = (1.0 - self.ema) * self.mean + self.ema * net
        return net


@dataclass(frozen=True)
class DraftChoice:
    """The part of a proposed draft to verify, and what the models expect of it."""

    tree: DraftTree
    expected_accepted: float
    expected_s: float
    p_first: float = 0.0
    """Predicted chance that a first-level node of ``tree`` is accepted."""

    @property
    def lazy_logits(self) -> bool:
        """Whether greedy verification of ``tree`` should compute logits lazily (see
        ``LAZY_LOGITS_MAX_P``)."""
        return self.p_first < LAZY_LOGITS_MAX_P


def choose_draft(
    tree: DraftTree,
    latency: LatencyModel,
    acceptance: AcceptanceModel,
    max_nodes: int,
    lazy: bool = False,
    *,
    other_rows: int = 0,
    other_committed: float = 0.0,
) -> DraftChoice:
    """Keep the draft nodes that maximise expected committed tokens per second.

    Nodes are ranked by their path probability (the product of conditional acceptance
    probabilities from the root); keeping the k best (k = 0..max_nodes) is always a valid
    tree because a child's path probability never exceeds its parent's. The best k
    maximises ``(1 + sum of kept path probabilities) / latency(1 + k)``; k = 0 is plain
    decoding. With ``lazy`` (greedy verification computing logits only on the accepted
    path) the latency is the expected one: full when a first-level node is accepted, the
    early-exit cost otherwise (:meth:`LatencyModel.expected`).

    In a batched step (other requests' ``other_rows`` rows in the same forward, expected to
    commit ``other_committed`` tokens), the rate is the whole step's:
    ``(other_committed + 1 + E[accepted]) / latency(other_rows + 1 + k)``; with ``lazy``
    only this request's own rows' saving is counted (``(1 - p_first) * (latency(1 + k) -
    latency.early(1 + k))`` off). Defaults 0: the solo rule above. Example: with
    ``latency(q) = 40 + 3q`` ms, a node accepted with probability 0.3 is kept alone
    (1.3 / 46 ms > 1 / 43 ms) and dropped next to 8 plain requests (9.3 / 70 ms < 9 / 67 ms):
    a row's cost is shared by the batch's tokens, and so is its gain.

    Returns:
        DraftChoice with the kept tree (a sub-tree of ``tree``, topological order kept).
    """
    n = min(tree.num_nodes, max_nodes)
    rows0 = 1 + max(0, int(other_rows))
    extra = max(0.0, float(other_committed))
    base_s = latency(rows0)
    if n == 0:
        return DraftChoice(DraftTree.empty(), 0.0, base_s)
    cond = acceptance.node_probs(tree)
    parents = tree.parents.tolist()
    path = [0.0] * tree.num_nodes
    for i in range(tree.num_nodes):
        path[i] = cond[i] * (path[parents[i]] if parents[i] >= 0 else 1.0)
    order = sorted(range(tree.num_nodes), key=lambda i: (-path[i], tree.depth[i].item(), i))
    best_k, best_rate, best_exp, best_p = 0, (1.0 + extra) / base_s, 0.0, 0.0
    exp = 0.0
    p_first = 0.0  # chance some first-level node is accepted (they are exclusive)
    best_s = base_s
    for k in range(1, n + 1):
        i = order[k - 1]
        exp += path[i]
        if parents[i] < 0:
            p_first = min(1.0, p_first + path[i])
        if rows0 == 1:
            step_s = latency.expected(1 + k, p_first) if lazy else latency(1 + k)
        else:
            step_s = latency(rows0 + k)
            if lazy and p_first < LAZY_LOGITS_MAX_P:
                step_s -= (1.0 - p_first) * max(0.0, latency(1 + k) - latency.early(1 + k))
        rate = (1.0 + extra + exp) / step_s
        if rate > best_rate * 1.0001:
            best_k, best_rate, best_exp, best_s, best_p = k, rate, exp, step_s, p_first
    if best_k == 0:
        return DraftChoice(DraftTree.empty(), 0.0, base_s)
    keep = sorted(order[:best_k])  # original (topological) order
    return DraftChoice(_subtree(tree, keep), best_exp, best_s, best_p)


def _subtree(tree: DraftTree, keep: Sequence[int]) -> DraftTree:
    """The nodes ``keep`` (sorted, closed under parent) of ``tree``, re-indexed."""
    if len(keep) == tree.num_nodes:
        return tree
    new = {old: i for i, old in enumerate(keep)}
    idx = torch.tensor(list(keep), dtype=torch.long)
    parents = [new[p] if p >= 0 else -1 for p in tree.parents[idx].tolist()]
    return DraftTree(
        tokens=tree.tokens[idx],
        parents=torch.tensor(parents, dtype=torch.long),
        depth=tree.depth[idx],
        sources=tuple(tree.sources[i] for i in keep) if tree.sources else (),
        scores=None if tree.scores is None else tree.scores[idx],
        # a sub-tree picked by score is no longer distributed as the draft sampled it:
        # verify it as a deterministic draft (still lossless; see ragspec.sampling)
        draft_probs=None,
        match_len=tree.match_len,
        node_match_len=None if tree.node_match_len is None else tree.node_match_len[idx],
    )
