"""The step composer: which requests prefill a chunk and which decode in the next step,
chosen with the measured cost model so that requests wait little at the same throughput.

A step of the engine runs each chosen request's next prefill chunk (a forward of its own)
and one verification forward over every decoding request's rows. How a schedule spends the
machine depends on what a forward costs (:class:`~ragspec.policy.LatencyModel`: seconds for
a forward of q rows, measured at start-up):

* on a CPU a prompt token costs about as much in any forward (prefill is compute-bound),
  and every verification row adds a visible share of the step: running the requests of a
  queue side by side finishes none of them sooner than running them one after another, it
  only makes each wait for all;
* on a GPU rows are nearly free up to a point: a request decoding beside others costs the
  step next to nothing, and everyone should run at once.

:class:`StepComposer` decides per step from the cost model:

1. every decoding request decodes (decodes are never starved: a stream once started keeps
   flowing);
2. requests still to prefill are candidates, in turn order (:func:`fair_turns`: a tenant
   with fewer requests in flight goes first) and then least remaining work first (its
   remaining prompt and tokens in seconds), oldest on ties: a short prompt passes a long
   one at its next chunk boundary;
3. the first ``max_prefills`` candidates (one by default) that have a reason run one chunk
   each; the reasons, in the order tried (:attr:`StepPlan.why`):

   - ``idle``: nothing decodes and no chunk was chosen: the machine is free;
   - ``shorter``: it has less work left than every request decoding or chosen (shortest
     remaining work first, which minimises the mean waiting time on one machine);
   - ``batched``: starting it now beside the running requests lowers the mean waiting
     time: what it adds to their steps (its rows by the latency model, what a request was
     observed to add beyond its rows: :meth:`StepComposer.observe`) and its prefill,
     spread over their steps left, are small against its own step's seconds
     (:meth:`StepComposer.joins_cheaply`). With a GPU's table this admits everyone;
   - ``tenant``: its tenant has nothing in flight (fairness: a tenant's request never
     waits for another tenant's backlog);
   - ``waited``: it has waited ``max_wait_s`` (no request starves).

   A request not started yet starts only while fewer than ``max_active`` are in flight
   (``tenant`` excepted), and a step's chunks after the first stay within
   ``max_step_tokens``.

The composer only chooses: every request's own steps (its chunks, drafts, tokens) are what
they are alone, so outputs do not depend on the schedule. The engine runs a plan with
:meth:`Engine.step(requests, plan) <ragspec.engine.Engine.step>`; :meth:`Engine.work
<ragspec.engine.Engine.work>` describes its requests as :class:`Work`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .errors import ConfigError
from .grouping import Schedule, StepCosts, Task, plan_groups
from .policy import LatencyModel, ema_update

__all__ = ["Work", "StepPlan", "ComposerConfig", "StepComposer", "fair_turns", "REASONS"]

REASONS = ("idle", "shorter", "batched", "grouped", "tenant", "waited")
"""Why a candidate's chunk joins a step (:attr:`StepPlan.why`), in the order they are tried."""


@dataclass(frozen=True)
class Work:
    """What the composer knows of one request before a step.

    Attributes:
        index: its position in the list the plan indexes.
        arrival_s: when it arrived (seconds on the composer's clock; lower is older).
        prompt_left: prompt tokens not in its KV cache yet (> 0: it is prefilling).
        chunk: tokens of its next prefill chunk (0 when decoding).
        rows: verification rows one decode step of it takes (root + the draft nodes it
            verifies on average; 1 before it decoded).
        tokens_left: most tokens it may still generate.
        started: it has had a step (it is in flight).
        done: it finishes without a forward (finished or cancelled): no candidate.
        tenant: whose it is (an API key's digest, a client address; "" for one tenant).
        blocked: it cannot work in this step (a choice waiting for the prefill it shares
            with another choice of its request): no candidate.
        forked: its prefill is a copy of another request's (no forward of its own).
        tokens_per_step: tokens its decode steps committed on average (0.0 before it
            decoded).
    """

    index: int
    arrival_s: float
    prompt_left: int = 0
    chunk: int = 0
    rows: int = 1
    tokens_left: int = 0
    started: bool = False
    done: bool = False
    tenant: str = ""
    blocked: bool = False
    forked: bool = False
    tokens_per_step: float = 0.0

    @property
    def prefilling(self) -> bool:
        return not self.done and self.prompt_left > 0

    @property
    def decoding(self) -> bool:
        return not self.done and self.prompt_left <= 0


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: ``prefill`` (indices, one chunk each, in this order) and
    ``decode`` (indices verified in the step's one forward); ``why[k]`` is the reason
    ``prefill[k]`` joins (one of :data:`REASONS`). Requests in neither list do no work in
    the step (finished or cancelled ones still end in it)."""

    prefill: tuple[int, ...] = ()
    decode: tuple[int, ...] = ()
    why: tuple[str, ...] = ()

    @property
    def indices(self) -> tuple[int, ...]:
        """Every request doing work in the step."""
        return self.prefill + self.decode


@dataclass(frozen=True)
class ComposerConfig:
    """The bounds of :class:`StepComposer`.

    Attributes:
        max_prefills: most requests prefilling a chunk in one step (>= 1).
        max_step_tokens: prompt tokens plus decode rows of one step beyond its first chunk
            (None: no bound; the first chunk always runs).
        max_active: most requests in flight (started, not finished): one not started yet
            waits while this many are, unless its tenant has none in flight (None: no bound).
        max_wait_s: seconds after which a waiting request runs its chunk whatever the
            others (> 0).
        throughput_slack: how much later than the soonest-ending schedule the decode
            groups may end, as a share of the busy period (``grouped``;
            :func:`~ragspec.grouping.plan_groups`'s ``slack``): 0.05 keeps at least ~95% of
            the throughput of starting everyone at once; None: no bound (the least squared
            flow times whatever the throughput).
        group_horizon: waiting requests the decode groups are planned for exactly (>= 1);
            later ones wait for them.

    Raises:
        ConfigError: a bound out of range.
    """

    max_prefills: int = 1
    max_step_tokens: Optional[int] = None
    max_active: Optional[int] = None
    max_wait_s: float = 30.0
    throughput_slack: Optional[float] = 0.05
    group_horizon: int = 8

    def __post_init__(self) -> None:
        if type(self.max_prefills) is not int or self.max_prefills < 1:
            raise ConfigError(f"max_prefills must be an integer >= 1, got {self.max_prefills!r}")
        for name in ("max_step_tokens", "max_active"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{name} must be an integer >= 1 or None, got {value!r}")
        if not isinstance(self.max_wait_s, (int, float)) or not self.max_wait_s > 0 or math.isinf(self.max_wait_s):
            raise ConfigError(f"max_wait_s must be a finite number of seconds > 0, got {self.max_wait_s!r}")
        slack = self.throughput_slack
        if slack is not None and (not isinstance(slack, (int, float)) or not 0 <= slack < math.inf):
            raise ConfigError(f"throughput_slack must be a finite number >= 0 or None, got {slack!r}")
        if type(self.group_horizon) is not int or self.group_horizon < 1:
            raise ConfigError(f"group_horizon must be an integer >= 1, got {self.group_horizon!r}")


def fair_turns(work: Sequence[Work], rank: Callable[[Work], tuple]) -> dict[int, int]:
    """The turn of each prefilling request (index -> turn; lower goes first): round-robin
    over tenants, a tenant's requests taken in ``rank`` order, each tenant's decoding
    requests counted first. So a tenant with fewer requests in flight is served first and
    one tenant's backlog never queues another's; with one tenant the turns follow
    ``rank``.

    Example: tenant "a" decoding 2 requests and waiting with 3, tenant "b" waiting with 1:
    b's request has turn 0, a's turns 2, 3, 4.
    """
    decoding: dict[str, int] = defaultdict(int)
    for w in work:
        if w.decoding:
            decoding[w.tenant] += 1
    by_tenant: dict[str, list[Work]] = defaultdict(list)
    for w in work:
        if w.prefilling:
            by_tenant[w.tenant].append(w)
    turns: dict[int, int] = {}
    for tenant, items in by_tenant.items():
        for k, w in enumerate(sorted(items, key=rank)):
            turns[w.index] = decoding[tenant] + k
    return turns


class StepComposer:
    """Chooses each step's prefill chunks and decodes from the cost model (see the module
    docstring).

    Args:
        latency: the target's forward seconds per q rows (the engine's model, read only).
        config: the bounds (:class:`ComposerConfig`).
        clock: seconds, the clock of :attr:`Work.arrival_s` (``time.perf_counter``; a
            scripted one in tests).
        prefill_ema: weight of a newly observed prefill rate (:meth:`observe`; 0: the
            latency model's estimate only).
    """

    def __init__(
        self,
        latency: LatencyModel,
        config: ComposerConfig = ComposerConfig(),
        *,
        clock: Callable[[], float] = time.perf_counter,
        prefill_ema: float = 0.2,
    ) -> None:
        self.latency = latency
        self.config = config
        self.clock = clock
        self.prefill_ema = prefill_ema
        self._prefill_rate = 0.0  # seconds per prompt token observed (0: none yet)
        self._scale = 0.0  # observed / modelled seconds of one request's decoding step (0: none yet)
        self._per_request = 0.0  # model seconds a request adds beyond its rows
        self._batched = False  # a step of several requests was observed
        self._tokens_per_step = 0.0  # decoding requests' tokens per step (0: none seen yet)
        self._rows = 0.0  # decoding requests' rows per step (0: none seen yet)

    # ------------------------------------------------------------------ costs
    def observe(
        self, prefill_tokens: int, prefill_s: float, requests: int = 0, rows: int = 0, decode_s: float = 0.0
    ) -> None:
        """Learn from one step (an engine's :class:`~ragspec.request.StepReport`): the
        prefill's seconds per prompt token (``prefill_tokens`` in ``prefill_s``), and from
        its decoding part (``requests`` verified in one forward of ``rows`` rows in
        ``decode_s`` seconds) what a request costs beside others beyond its rows: the
        latency model prices one request's rows, and a step of several requests also pays
        per request (its own cache's attention, drafting, commits). Steps of one request
        give the model's scale on this machine, steps of several the cost per extra request
        in the model's units. Nothing is learned with ``prefill_ema`` 0."""
        w = self.prefill_ema
        if w <= 0:
            return
        if prefill_tokens > 0 and prefill_s > 0:
            self._prefill_rate = ema_update(self._prefill_rate, prefill_s / prefill_tokens, w)
        if requests < 1 or rows < requests or decode_s <= 0:
            return
        modelled = self.latency(rows)
        if requests == 1:
            self._scale = ema_update(self._scale, decode_s / modelled, w)
        else:
            extra = max(0.0, decode_s / (self._scale or 1.0) - modelled) / (requests - 1)
            self._per_request = ema_update(self._per_request, extra, w) if self._batched else extra
            self._batched = True

    @property
    def per_request_s(self) -> float:
        """Seconds (in the latency model's units) a request adds to a decoding step beyond
        its rows, as observed (0 before a step of several requests was seen: the rows alone
        price it)."""
        return self._per_request

    def prefill_seconds(self, tokens: int, chunk: int = 256) -> float:
        """Seconds to prefill ``tokens`` prompt tokens: the observed rate, else the latency
        model's forward of one ``chunk`` (extrapolated past its largest q) per chunk."""
        if tokens <= 0:
            return 0.0
        if self._prefill_rate > 0:
            return tokens * self._prefill_rate
        chunk = max(1, min(chunk, tokens))
        return tokens / chunk * self.latency(chunk)

    def remaining_s(self, w: Work) -> float:
        """Seconds of work ``w`` has left alone: its prompt's prefill (none when it copies
        another's) and a one-row step per token it may still generate."""
        prefill = 0.0 if w.forked else self.prefill_seconds(w.prompt_left, w.chunk or 256)
        return prefill + max(0, w.tokens_left) * self.latency(1)

    def row_s(self) -> float:
        """Seconds a verification row adds to a forward: the latency model's mean over its
        measured q (its largest q's seconds less one row's, per row; a table's local
        plateaus do not make a row free)."""
        top = max(self.latency.table)
        return max(0.0, self.latency(top) - self.latency(1)) / (top - 1) if top > 1 else self.latency(1)

    def joins_cheaply(self, rows: int, decoding: int, prefill_s: float = 0.0, steps_left: float = math.inf) -> bool:
        """Whether a request of ``rows`` rows per step, with ``prefill_s`` seconds of
        prefill left, should start now beside ``decoding`` decoding requests that have
        ``steps_left`` steps to go (the shortest), rather than after them.

        Starting now delays each of them by its prefill and, for each shared step, by the
        seconds it adds to a step ``a`` (:meth:`row_s` per row plus :attr:`per_request_s`);
        it gains, per shared step, its own step's seconds ``L`` less ``a``. For the mean
        waiting time it starts now when ``a <= (L - decoding * prefill_s / steps_left) /
        (decoding + 1)``: with no prefill, when ``a`` is at most ``L`` over the batch size
        plus one (two requests of equal work then finish, on average, sooner together than
        one after the other). A CPU's rows, requests and prefills cost too much for it; a
        GPU's rows nearly nothing."""
        return self._joins(rows, decoding, prefill_s, steps_left, self.row_s())

    def _joins(self, rows: int, decoding: int, prefill_s: float, steps_left: float, row_s: float) -> bool:
        rows = max(1, rows)
        added = rows * row_s + self._per_request
        spread = decoding * prefill_s / steps_left if steps_left > 0 else math.inf
        return added <= (self.latency(rows) - spread) / (decoding + 1)

    # ------------------------------------------------------------------ decode groups
    def step_costs(self) -> StepCosts:
        """The cost model as :mod:`ragspec.grouping` prices steps: seconds per prompt token
        (observed, else the latency model's 256-row forward per row) and a decoding step's
        seconds, ``scale * (latency(rows) + (requests - 1) * per_request_s)`` (``scale``:
        this machine's observed over the model's seconds of a one-request step, 1 before
        one was seen)."""
        per_token = self._prefill_rate or self.prefill_seconds(256) / 256
        return StepCosts.linear(self.latency, per_token, self._per_request, self._scale or 1.0)

    def learn_decoding(self, work: Sequence[Work]) -> None:
        """Learn the decoding requests' mean tokens and rows per step (what a waiting
        request is expected to decode at); nothing with ``prefill_ema`` 0."""
        seen = [w for w in work if w.decoding and w.tokens_per_step > 0]
        if seen and self.prefill_ema > 0:
            tokens = sum(w.tokens_per_step for w in seen) / len(seen)
            rows = sum(max(1, w.rows) for w in seen) / len(seen)
            self._tokens_per_step = ema_update(self._tokens_per_step, tokens, self.prefill_ema)
            self._rows = ema_update(self._rows, rows, self.prefill_ema)

    def task(self, w: Work, now: float) -> Task:
        """``w`` as :mod:`ragspec.grouping` sees it at ``now``: decode steps left (tokens
        left over its tokens per step, else the learned mean, else 1; a prefilling
        request's first token comes with its prefill) and rows (a prefilling request's:
        the learned mean)."""
        per_step = w.tokens_per_step or self._tokens_per_step or 1.0
        waited = max(0.0, now - w.arrival_s)
        if w.decoding:
            return Task(steps=max(0, w.tokens_left) / per_step, rows=max(1, w.rows), waited_s=waited)
        rows = max(1, w.rows, round(self._rows))
        steps = max(0, w.tokens_left - 1) / per_step
        return Task(w.prompt_left, max(1, w.chunk), steps, rows, waited, w.forked)

    def group_plan(self, work: Sequence[Work], queue: Sequence[Work], now: Optional[float] = None) -> Schedule:
        """The decode groups of the waiting requests ``queue`` (in the order they may
        start) beside ``work``'s decoding ones (:func:`~ragspec.grouping.plan_groups` with
        this composer's costs and bounds; the busy period: since the oldest request of
        ``work`` arrived). ``groups[0]`` holds the positions in ``queue`` that start now."""
        now = self.clock() if now is None else now
        live = [w for w in work if not w.done]
        elapsed = max(0.0, now - min((w.arrival_s for w in live), default=now))
        cfg = self.config
        return plan_groups(
            self.step_costs(),
            [self.task(w, now) for w in live if w.decoding],
            [self.task(w, now) for w in queue],
            slack=cfg.throughput_slack,
            max_group=cfg.max_active,
            horizon=cfg.group_horizon,
            elapsed_s=elapsed,
        )

    # ------------------------------------------------------------------ the plan
    def plan(self, work: Sequence[Work]) -> StepPlan:
        """The next step's plan over ``work`` (each with its ``index`` in the list the plan
        indexes). Never empty while some request can work."""
        cfg = self.config
        decoders = [w for w in work if w.decoding]
        decode = tuple(w.index for w in decoders)
        ready = [w for w in work if w.prefilling and not w.blocked]
        if not ready:
            return StepPlan((), decode, ())
        left = {w.index: self.remaining_s(w) for w in work if not w.done}

        def rank(w: Work) -> tuple:
            return (left[w.index], w.arrival_s, w.index)

        turns = fair_turns(work, rank)
        candidates = sorted(ready, key=lambda w: (turns[w.index], *rank(w)))
        in_flight = sum(w.started for w in work if not w.done)
        busy_tenants = {w.tenant for w in work if w.started and not w.done}
        shortest = min((left[w.index] for w in decoders), default=math.inf)
        steps_left = min((max(0, w.tokens_left) for w in decoders), default=math.inf)
        group = len(decoders)  # who will decode together: the decoding and the chosen requests
        used = sum(max(1, w.rows) for w in decoders)
        now, row_s = self.clock(), self.row_s()
        self.learn_decoding(decoders)
        joining: Optional[set[int]] = None

        def grouped(w: Work) -> bool:  # planned once per step, when first asked
            nonlocal joining
            if joining is None:
                first = self.group_plan(work, candidates, now).starts_now
                joining = {candidates[i].index for i in first}
            # fairness: one tenant's group does not delay another tenant's shorter request
            prefill_s = 0.0 if w.forked else self.prefill_seconds(w.prompt_left, w.chunk or 256)
            return w.index in joining and not any(d.tenant != w.tenant and left[d.index] < prefill_s for d in decoders)

        prefill: list[int] = []
        why: list[str] = []
        for w in candidates:
            if len(prefill) >= cfg.max_prefills:
                break
            if prefill and cfg.max_step_tokens is not None and used + w.chunk > cfg.max_step_tokens:
                continue
            new_tenant = w.tenant not in busy_tenants
            if not w.started and cfg.max_active is not None and in_flight >= cfg.max_active and not new_tenant:
                continue
            reason = self._reason(w, left[w.index], group, steps_left, shortest, new_tenant, now, row_s, grouped)
            if reason is None:
                continue
            prefill.append(w.index)
            why.append(reason)
            used += w.chunk
            group += 1
            shortest = min(shortest, left[w.index])
            if not w.started:
                in_flight += 1
                busy_tenants.add(w.tenant)
        return StepPlan(tuple(prefill), decode, tuple(why))

    def _reason(
        self,
        w: Work,
        left: float,
        group: int,
        steps_left: float,
        shortest: float,
        new_tenant: bool,
        now: float,
        row_s: float,
        grouped: Callable[[Work], bool],
    ) -> Optional[str]:
        """Why candidate ``w`` (``left`` seconds of work left) runs a chunk in this step
        (None: it waits). ``group``: the requests decoding or chosen to prefill so far;
        ``steps_left``: the fewest tokens a decoding one has left (inf: none decodes);
        ``shortest``: the least work left of one of them (inf: none); ``row_s``: a row's
        seconds (:meth:`row_s`); ``grouped(w)``: the decode groups start ``w`` now."""
        if group == 0:
            return "idle"
        if left < shortest:
            return "shorter"
        prefill_s = 0.0 if w.forked else self.prefill_seconds(w.prompt_left, w.chunk or 256)
        if self._joins(w.rows, group, prefill_s, steps_left, row_s):
            return "batched"
        if grouped(w):
            return "grouped"
        if new_tenant:
            return "tenant"
        if now - w.arrival_s >= self.config.max_wait_s:
            return "waited"
        return None
