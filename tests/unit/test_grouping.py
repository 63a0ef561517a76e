"""Decode groups (ragspec/grouping.py): the simulator on hand-checked cases, the planner's
choice for 8 equal requests on a CPU-like table (prefill does not batch, decode does), and
the composer following the groups over a simulated run with a scripted clock."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pytest

from ragspec.errors import ConfigError
from ragspec.grouping import StepCosts, Task, all_at_once, one_after_another, plan_groups, simulate
from ragspec.policy import LatencyModel
from ragspec.scheduling import ComposerConfig, StepComposer, Work

# ms per forward of q rows, one request, measured on a 2-core CPU: decode batches, prefill does not
CPU_LIKE = {1: 0.0039, 2: 0.005, 3: 0.0056, 4: 0.0064, 6: 0.0085, 8: 0.0105, 12: 0.0157, 16: 0.0202}
PER_TOKEN, PER_REQUEST = 0.00085, 0.001


def _costs() -> StepCosts:
    return StepCosts.linear(LatencyModel(dict(CPU_LIKE), ema=0.0), PER_TOKEN, PER_REQUEST)


def _flat(prefill_token_s=1.0, step=lambda b, rows: 1.0 + b) -> StepCosts:
    return StepCosts(prefill_token_s, step)


def test_simulate_one_task_alone_is_prefill_then_its_steps():
    # 10 tokens in chunks of 4: 3 chunks (10 s), then 5 steps of one request (2 s each)
    s = simulate(_flat(), [], [Task(10, 4, steps=5)], [(0,)])
    assert s.completion_s == (20.0,) and s.makespan_s == 20.0 and s.flow_s == (20.0,)


def test_simulate_a_joiner_prefills_beside_the_decoding_and_then_decodes_with_them():
    # decoding: 3 steps left; joiner: 2 tokens in one chunk, then 2 steps.
    # step 1: chunk (2 s) + a step of 1 (2 s) = 4; then 2 decoding: 3 s a step;
    # the first ends after 2 more steps (t = 10), the joiner after its 2 (t = 10)
    s = simulate(_flat(), [Task(steps=3)], [Task(2, 4, steps=2)], [(0,)])
    assert s.completion_s == (10.0, 10.0)
    # the same joiner as a later group: 3 steps alone (6 s), then 2 s prefill + 2 steps of 2 s
    later = simulate(_flat(), [Task(steps=3)], [Task(2, 4, steps=2)], [(), (0,)])
    assert later.completion_s == (6.0, 12.0) and later.sizes == (0, 1)
    # held for 1 step: 2 s, then chunk + step (4 s), then 1 step of 2 together (3 s), 1 alone (2 s)
    held = simulate(_flat(), [Task(steps=3)], [Task(2, 4, steps=2)], [(0,)], hold=1)
    assert held.completion_s == (9.0, 11.0) and held.starts_now == ()


def test_simulate_counts_waited_seconds_in_the_flow_and_refuses_bad_groups():
    s = simulate(_flat(), [], [Task(1, 4, steps=0, waited_s=5.0)], [(0,)])
    assert s.completion_s == (1.0,) and s.flow_s == (6.0,) and s.squared_flow == 36.0
    with pytest.raises(ConfigError):
        simulate(_flat(), [], [Task(1), Task(1)], [(1,), (0,)])
    with pytest.raises(ConfigError):
        plan_groups(_flat(), [], [Task(1)], slack=-1.0)


def _p50(s) -> float:
    return statistics.median(s.completion_s)


def test_eight_equal_requests_get_a_batched_schedule_beating_both_extremes():
    costs, queue = _costs(), [Task(700, 256, steps=112 / 1.5, rows=2) for _ in range(8)]
    seq = simulate(costs, [], queue, one_after_another(8))
    together = simulate(costs, [], queue, all_at_once(8))
    plan = plan_groups(costs, [], queue)
    assert 1 < len(plan.groups) < 8 and max(plan.sizes) > 1
    assert _p50(plan) < _p50(seq) and _p50(plan) < _p50(together)
    assert plan.makespan_s < seq.makespan_s
    assert plan.makespan_s <= together.makespan_s * 1.05 + 1e-9  # the throughput bound
    # no bound: the least squared flow whatever the throughput; never above the bounded one's
    free = plan_groups(costs, [], queue, slack=None)
    assert free.squared_flow <= plan.squared_flow
    # a table where decode does not batch either: one after another
    linear = StepCosts(PER_TOKEN, lambda b, rows: 0.004 * rows)
    assert plan_groups(linear, [], queue).sizes == (1,) * 8


@dataclass
class _Req:
    prompt: int
    tokens: int
    arrival: float = 0.0
    prefilled: int = 0
    made: float = 0.0
    started: bool = False
    done_s: float = -1.0


def _run(reqs: list[_Req], **config) -> tuple[list[int], list[list[int]]]:
    """The composer driving fake requests on the cost model with a scripted clock (1.5 tokens
    and 2 rows per decode step, chunks of 256). Returns the order requests started in and
    the set decoding at each step."""
    now = [0.0]
    lat = LatencyModel(dict(CPU_LIKE), ema=0.0)
    composer = StepComposer(lat, ComposerConfig(**config), clock=lambda: now[0])
    costs = StepCosts.linear(lat, PER_TOKEN, PER_REQUEST)
    order: list[int] = []
    decoding: list[list[int]] = []
    for _ in range(5000):
        live = [k for k, r in enumerate(reqs) if r.done_s < 0 and r.arrival <= now[0]]
        if not live:
            break
        work = []
        for i, k in enumerate(live):
            r = reqs[k]
            left = r.prompt - r.prefilled
            work.append(
                Work(i, r.arrival, left, min(256, left), 2 if r.made else 1, math.ceil(r.tokens - r.made), r.started,
                     tokens_per_step=1.5 if r.made > 1 else 0.0)
            )  # fmt: skip
        plan = composer.plan(work)
        tokens = sum(work[i].chunk for i in plan.prefill)
        rows = sum(work[i].rows for i in plan.decode)
        step_s = costs.step_s(len(plan.decode), rows)
        now[0] += tokens * PER_TOKEN + step_s
        composer.observe(tokens, tokens * PER_TOKEN, len(plan.decode), rows, step_s)
        for i in plan.prefill:
            r = reqs[live[i]]
            if not r.started:
                order.append(live[i])
            r.started, r.prefilled = True, r.prefilled + work[i].chunk
            r.made = 1.0 if r.prefilled >= r.prompt else 0.0
        for i in plan.decode:
            reqs[live[i]].made += 1.5
        decoding.append([live[i] for i in plan.decode])
        for k in live:
            if reqs[k].made >= reqs[k].tokens:
                reqs[k].done_s = now[0]
    assert all(r.done_s >= 0 for r in reqs)
    return order, decoding


def test_the_composer_follows_the_decode_groups_over_a_simulated_run():
    reqs = [_Req(700, 113) for _ in range(8)]
    order, decoding = _run(reqs)
    assert sorted(order) == list(range(8))
    # a first group forms (several decode together) and the rest waits for it to finish
    first = max(decoding, key=len)
    assert 1 < len(first) < 8
    done = sorted(r.done_s for r in reqs)
    wall = done[-1]
    # better P50 than everyone at once, better wall than one after another (both simulated)
    costs, queue = _costs(), [Task(700, 256, steps=112 / 1.5, rows=2) for _ in range(8)]
    assert statistics.median(done) < _p50(simulate(costs, [], queue, all_at_once(8)))
    assert wall < simulate(costs, [], queue, one_after_another(8)).makespan_s
    # a short request arriving mid-way passes the long ones and finishes soon
    reqs = [_Req(700, 113) for _ in range(6)] + [_Req(60, 16, arrival=1.0)]
    _run(reqs)
    assert reqs[-1].done_s - 1.0 < 0.5


def test_max_wait_still_starts_a_request_held_for_a_later_group():
    reqs = [_Req(700, 113) for _ in range(8)]
    order, decoding = _run(reqs, max_wait_s=0.5)
    assert max(len(d) for d in decoding) >= 7  # nobody waits past half a second for a group
