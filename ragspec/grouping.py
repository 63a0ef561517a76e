"""Decode groups: which waiting requests start now beside the decoding ones and which wait
for a later group, chosen by an exact small optimisation on the cost model; and the
simulator it prices schedules with.

Why groups: on a CPU a prompt token costs about as much in any forward, so prefills do
not batch, while a decoding step of b requests costs far less than b steps of one (the
weights are read once). Running a queue one request after another wastes the batching;
running it all at once makes every request wait for every prefill. In between, the queue
splits into *groups* that prefill one request after another and then decode together, a
group starting when the one before it has finished.

Glossary:
    task: a request as the planner sees it (:class:`Task`): prompt tokens left, decode steps
        left, rows per step, seconds it has waited.
    group: tasks that prefill one after another and then decode together.
    schedule: the queue cut into consecutive groups (:class:`Schedule`); its first group
        joins the decoding requests now (empty: the queue waits for them).
    flow time: seconds from a request's arrival to its completion (its waited seconds plus
        its completion from now).

The machine :func:`simulate` replays (the engine's step): a step runs at most one prefill
chunk, the next joining task's, and one decoding forward over every decoding task. It costs
the chunk's tokens times :attr:`StepCosts.prefill_token_s` plus :meth:`StepCosts.step_s`
of the decoding tasks (their number and rows). A task decodes from the step after its last
chunk, one step fewer each step, and completes when its steps run out.

The choice (:func:`plan_groups`): the queue stays in its order (the composer's: tenants in
turn, least work first); every cut of it into consecutive groups is a candidate. Among
those whose makespan is within ``slack`` of the least (the throughput bound), the one of
least sum of squared flow times is chosen (the l2 norm of flow time, after Bansal and
Pruhs, "Server scheduling in the Lp norm": the mean and the spread at once). The mean
alone is nearly indifferent between a first group of 4 and of 5 among 8 equal requests,
though 5 finish early in one and 4 in the other; the squared flow times weigh the
requests finishing last, and a request that has waited longer weighs more, so the schedule
is time-consistent: replanned after each step, the rest of the chosen schedule stays the
choice while the costs hold. It is exact over the cuts of the first ``horizon`` tasks:
a dynamic programme over the queue's suffixes keeps, for each, the schedules not beaten on
all of (squared flow, sum of completions, makespan), so a suffix is simulated once per
group, not once per cut. Tasks past the horizon count as starting when the horizon's
schedule ends.

Pure: no clock, no torch; the composer (:mod:`ragspec.scheduling`) builds the tasks and
costs from its requests and cost model, ``scripts/composer_schedule.py`` from measured
costs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .errors import ConfigError

__all__ = ["Task", "StepCosts", "Schedule", "simulate", "plan_groups", "one_after_another", "all_at_once"]

_EPS = 1e-9
MAX_FRONT = 256
"""Most schedules kept per queue suffix (never reached below a horizon of 9 tasks)."""


@dataclass(frozen=True)
class Task:
    """A request as :func:`plan_groups` and :func:`simulate` see it.

    Attributes:
        prompt_left: prompt tokens still to prefill (0: it decodes).
        chunk: prompt tokens per prefill step (>= 1).
        steps: decode steps left after its prefill (tokens left over tokens per step; a
            prefilling request's first token comes with its last chunk).
        rows: verification rows per decode step.
        waited_s: seconds since it arrived.
        forked: its prefill is a copy of another request's (one step, no prompt token
            priced).
    """

    prompt_left: int = 0
    chunk: int = 256
    steps: float = 0.0
    rows: int = 1
    waited_s: float = 0.0
    forked: bool = False


@dataclass(frozen=True)
class StepCosts:
    """What a step costs, in seconds.

    Attributes:
        prefill_token_s: seconds per prompt token of a prefill chunk.
        decode_s: seconds of a decoding step of ``(requests, rows)`` (its one forward,
            drafting and commits).
    """

    prefill_token_s: float
    decode_s: Callable[[int, int], float]
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    def step_s(self, requests: int, rows: int) -> float:
        """Seconds of a decoding step of ``requests`` requests verifying ``rows`` rows (0.0
        with no request); memoised."""
        if requests <= 0:
            return 0.0
        key = (requests, rows)
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = float(self.decode_s(requests, rows))
        return value

    @classmethod
    def linear(
        cls, latency: Callable[[int], float], prefill_token_s: float, per_request_s: float = 0.0, scale: float = 1.0
    ) -> "StepCosts":
        """The composer's model: a decoding step costs ``scale * (latency(rows) +
        (requests - 1) * per_request_s)`` (``latency``: seconds of a forward of q rows,
        e.g. a :class:`~ragspec.policy.LatencyModel`)."""
        return cls(prefill_token_s, lambda b, rows: scale * (latency(max(1, rows)) + (b - 1) * per_request_s))


@dataclass(frozen=True)
class Schedule:
    """A schedule and what :func:`simulate` makes of it.

    Attributes:
        groups: queue indices per group, in order; ``groups[0]`` joins the decoding tasks
            after ``hold_steps`` (empty: the queue waits for them); each later group starts
            when the one before has completed.
        completion_s: seconds from now to each task's completion: the decoding tasks', then
            the queue's, in the order given to :func:`simulate`.
        makespan_s: seconds from now until the last completion.
        flow_s: each task's flow time (``waited_s + completion_s``), same order.
        hold_steps: decoding steps the decoding tasks run alone before ``groups[0]``
            starts (0: it starts now), so that one about to finish is not delayed by
            prefills.
    """

    groups: tuple[tuple[int, ...], ...]
    completion_s: tuple[float, ...]
    makespan_s: float
    flow_s: tuple[float, ...]
    hold_steps: float = 0.0

    @property
    def starts_now(self) -> tuple[int, ...]:
        """The queue positions that start in the next step (``groups[0]`` unless held)."""
        return () if self.hold_steps > 0 or not self.groups else self.groups[0]

    @property
    def squared_flow(self) -> float:
        """Sum of squared flow times (what :func:`plan_groups` minimises), seconds^2."""
        return sum(f * f for f in self.flow_s)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Tasks per group (the first counts the queue's joiners only)."""
        return tuple(len(g) for g in self.groups)


def one_after_another(n: int) -> tuple[tuple[int, ...], ...]:
    """The groups of a queue of ``n`` run one request after another."""
    return tuple((i,) for i in range(n))


def all_at_once(n: int) -> tuple[tuple[int, ...], ...]:
    """The groups of a queue of ``n`` all started now."""
    return (tuple(range(n)),)


def _run(
    costs: StepCosts, decoding: Sequence[Task], joiners: Sequence[Task], hold: float = 0.0
) -> tuple[list[float], float]:
    """One group from now: ``decoding`` decode (alone for ``hold`` steps) while ``joiners``
    prefill one after another, then all decode together until done. Returns each one's
    completion (decoding first) and the seconds until the last."""
    done = [0.0] * (len(decoding) + len(joiners))
    active: list[list] = [[t.steps, max(1, t.rows), i] for i, t in enumerate(decoding) if t.steps > _EPS]
    now = 0.0
    while hold > _EPS and active:
        burst = min(hold, min(a[0] for a in active))
        now += burst * costs.step_s(len(active), sum(a[1] for a in active))
        hold -= burst
        active = _advance(active, burst, now, done)
    for j, task in enumerate(joiners):
        left = 0 if task.forked else max(0, task.prompt_left)
        size = max(1, task.chunk)
        chunks = 1 if task.forked else max(1, math.ceil(left / size))
        while chunks > 0:
            burst = chunks
            if active:
                burst = min(chunks, max(1, math.ceil(min(a[0] for a in active) - _EPS)))
            tokens = min(left, burst * size)
            now += tokens * costs.prefill_token_s + burst * costs.step_s(len(active), sum(a[1] for a in active))
            left -= tokens
            chunks -= burst
            active = _advance(active, burst, now, done)
        if task.steps > _EPS:
            active.append([task.steps, max(1, task.rows), len(decoding) + j])
        else:
            done[len(decoding) + j] = now
    while active:
        least = min(a[0] for a in active)
        now += least * costs.step_s(len(active), sum(a[1] for a in active))
        active = _advance(active, least, now, done)
    return done, now


def _advance(active: list[list], steps: float, now: float, done: list[float]) -> list[list]:
    """``active`` after ``steps`` steps ending at ``now``: the finished recorded in ``done``."""
    kept = []
    for a in active:
        a[0] -= steps
        if a[0] <= _EPS:
            done[a[2]] = now
        else:
            kept.append(a)
    return kept


def simulate(
    costs: StepCosts,
    decoding: Sequence[Task],
    queue: Sequence[Task],
    groups: Sequence[Sequence[int]],
    hold: float = 0.0,
) -> Schedule:
    """Replay a schedule on the cost model: ``decoding`` (decoding now) with ``groups[0]``
    of ``queue`` joining them after ``hold`` decoding steps, each later group starting
    when the one before has completed. ``groups`` must cover ``queue`` in order (the first
    may be empty).

    Raises:
        ConfigError: the groups do not cut the queue into consecutive parts in order.
    """
    flat = [i for g in groups for i in g]
    if flat != list(range(len(queue))) or any(not g for g in list(groups)[1:]):
        raise ConfigError(f"groups {list(map(list, groups))} do not cut a queue of {len(queue)} in order")
    completion = [0.0] * (len(decoding) + len(queue))
    first = list(groups[0]) if groups else []
    done, now = _run(costs, decoding, [queue[i] for i in first], hold)
    completion[: len(decoding)] = done[: len(decoding)]
    for i, c in zip(first, done[len(decoding) :]):
        completion[len(decoding) + i] = c
    for g in list(groups)[1:]:
        done, span = _run(costs, (), [queue[i] for i in g])
        for i, c in zip(g, done):
            completion[len(decoding) + i] = now + c
        now += span
    waited = [t.waited_s for t in decoding] + [t.waited_s for t in queue]
    flow = tuple(w + c for w, c in zip(waited, completion))
    return Schedule(tuple(tuple(g) for g in groups) or ((),), tuple(completion), now, flow, hold if first else 0.0)


@dataclass(frozen=True)
class _Entry:
    """A schedule of a queue suffix started on an idle machine at 0: ``value``: sum over
    its tasks of ``s^2 + 2 * waited * s`` (``s``: completion), ``total``: sum of ``s``,
    ``makespan``; ``ends``: where its groups end."""

    value: float
    total: float
    makespan: float
    ends: tuple[int, ...]


def _pareto(entries: list[_Entry]) -> list[_Entry]:
    """The entries no other beats on value, total and makespan together (at most
    :data:`MAX_FRONT`, the least values kept)."""
    kept: list[_Entry] = []
    for e in sorted(entries, key=lambda e: (e.value, e.total, e.makespan)):
        if not any(k.total <= e.total + _EPS and k.makespan <= e.makespan + _EPS for k in kept):
            kept.append(e)
            if len(kept) >= MAX_FRONT:
                break
    return kept


def _fronts(costs: StepCosts, queue: Sequence[Task], max_group: int) -> list[list[_Entry]]:
    """For each suffix ``queue[j:]``, its schedules from an idle machine not beaten on
    (value, total, makespan)."""
    n = len(queue)
    waited_after = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        waited_after[i] = waited_after[i + 1] + queue[i].waited_s
    fronts: list[list[_Entry]] = [[] for _ in range(n)] + [[_Entry(0.0, 0.0, 0.0, ())]]
    for j in range(n - 1, -1, -1):
        entries = []
        for k in range(j + 1, min(n, j + max_group) + 1):
            done, span = _run(costs, (), queue[j:k])
            value = sum(s * s + 2 * queue[j + i].waited_s * s for i, s in enumerate(done))
            total, after = sum(done), n - k
            for e in fronts[k]:
                shifted = e.value + 2 * span * e.total + after * span * span + 2 * span * waited_after[k]
                entries.append(_Entry(value + shifted, total + e.total + after * span, span + e.makespan, (k, *e.ends)))
        fronts[j] = _pareto(entries)
    return fronts


def plan_groups(
    costs: StepCosts,
    decoding: Sequence[Task],
    queue: Sequence[Task],
    *,
    slack: Optional[float] = 0.05,
    max_group: Optional[int] = None,
    horizon: int = 8,
    elapsed_s: float = 0.0,
) -> Schedule:
    """The schedule of least sum of squared flow times among those within the throughput
    bound (see the module docstring), simulated.

    Args:
        costs: what a step costs.
        decoding: the tasks decoding now (they stay in the first group).
        queue: the waiting tasks, in the order they may start.
        slack: the throughput bound: a schedule may end at most ``slack * (elapsed_s +
            least makespan)`` seconds after the one that ends soonest (None: no bound).
        max_group: most tasks decoding together (the decoding ones included; None: any).
        horizon: the queue tasks planned exactly; later ones wait for them, count as
            starting when their schedule ends, and appear as one last group.
        elapsed_s: seconds the machine has been busy with these requests (the bound is
            on the whole busy period, so a plan followed step by step keeps its choice).

    Raises:
        ConfigError: ``slack`` < 0, ``max_group`` or ``horizon`` < 1.
    """
    if slack is not None and not slack >= 0:
        raise ConfigError(f"slack must be >= 0 or None, got {slack!r}")
    if (max_group is not None and max_group < 1) or horizon < 1:
        raise ConfigError(f"max_group and horizon must be >= 1, got {max_group!r}, {horizon!r}")
    planned, tail = list(queue[:horizon]), list(queue[horizon:])
    n = len(planned)
    cap = n if max_group is None else max_group
    fronts = _fronts(costs, planned, max(1, cap))
    joinable = n if max_group is None else max(0, min(n, max_group - len(decoding)))
    # the first group may also wait until a decoding task finishes (not the last: that is k 0)
    ends = sorted({math.ceil(t.steps - _EPS) for t in decoding if t.steps > _EPS})
    options = []  # (squared flow, makespan, hold, -k, ends)
    for hold in [0, *ends[:-1]]:
        for k in range(1 if hold else 0, joinable + 1):
            if k == 0 and not decoding and n:
                continue  # an idle machine: someone starts
            done, span = _run(costs, decoding, planned[:k], hold)
            head = sum((t.waited_s + c) ** 2 for t, c in zip([*decoding, *planned[:k]], done))
            rest = sum((t.waited_s + span) ** 2 for t in planned[k:])
            for e in fronts[k]:
                end = span + e.makespan
                late = sum((t.waited_s + end) ** 2 for t in tail)
                options.append((head + rest + e.value + 2 * span * e.total + late, end, hold, -k, (k, *e.ends)))
    least = min(o[1] for o in options)
    bound = math.inf if slack is None else least + slack * (elapsed_s + least) + _EPS
    best = min((o for o in options if o[1] <= bound), key=lambda o: (o[0], o[2], o[3]))
    groups: list[tuple[int, ...]] = []
    start = 0
    for end in best[4]:  # the first group's end (0: empty), then each later group's
        groups.append(tuple(range(start, end)))
        start = end
    if tail:
        groups.append(tuple(range(n, n + len(tail))))
    return simulate(costs, decoding, list(planned) + tail, groups, float(best[2]))
