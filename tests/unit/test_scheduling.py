"""The step composer (ragspec/scheduling.py): each reason a prefill chunk joins a step, with
fake latency tables (a CPU's, where every row costs; a GPU's, where rows are nearly free)
and a scripted clock; the engine running its plans with outputs equal to solo ones, greedy
and seeded, for every reason; tenants served in turn through the stepper (one tenant's 30
streams do not hold up another's small request). Tiny random models built here."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional

import pytest
import torch

from ragspec.backend.hf import HFTarget
from ragspec.config import PLDConfig, PolicyConfig
from ragspec.drafters import PromptLookupDrafter
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.policy import LatencyModel
from ragspec.scheduling import REASONS, ComposerConfig, StepComposer, StepPlan, Work, fair_turns
from ragspec_testing import make_char_tokenizer, make_tiny_llama, word_text

# a CPU's table: every row ~8 ms (prefill compute-bound), a GPU's: flat up to 256 rows
CPU = {1: 0.010, 2: 0.018, 4: 0.034, 8: 0.066, 16: 0.130, 32: 0.258}
GPU = {1: 0.010, 16: 0.0102, 64: 0.0105, 256: 0.011, 1024: 0.04}
# a 2-core CPU's measured table: decode batches (8 rows cost 2.7 one row's), prefill does not
CPU_LIKE = {1: 0.0039, 2: 0.005, 3: 0.0056, 4: 0.0064, 6: 0.0085, 8: 0.0105, 12: 0.0157, 16: 0.0202}


def _latency(table) -> LatencyModel:
    return LatencyModel(dict(table), ema=0.0)


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _composer(table=CPU, clock: Optional[Clock] = None, **config) -> StepComposer:
    return StepComposer(_latency(table), ComposerConfig(**config), clock=clock or Clock(1.0))


def _prefilling(i, prompt, tokens=64, arrival=0.0, started=False, tenant="", chunk=256) -> Work:
    return Work(
        i, arrival, prompt_left=prompt, chunk=min(chunk, prompt), tokens_left=tokens, started=started, tenant=tenant
    )


def _decoding(i, tokens=100, rows=1, tenant="", arrival=0.0) -> Work:
    return Work(i, arrival, rows=rows, tokens_left=tokens, started=True, tenant=tenant)


# ---------------------------------------------------------------------------- the reasons
def test_idle_runs_the_least_work_first_and_a_short_prompt_passes_a_long_one():
    c = _composer()
    long_started = _prefilling(0, 700, started=True, arrival=0.0)  # one chunk in already
    short_new = _prefilling(1, 40, arrival=0.5)
    other = _prefilling(2, 900, arrival=0.1)
    plan = c.plan([long_started, short_new, other])
    assert plan == StepPlan(prefill=(1,), decode=(), why=("idle",))
    # equal work: the oldest first
    assert c.plan([_prefilling(0, 300, arrival=2.0), _prefilling(1, 300, arrival=1.0)]).prefill == (1,)


def test_a_cpu_keeps_decoding_before_starting_a_longer_request():
    """Rows cost on a CPU: a second request of more work waits for the running one (the
    mean waiting time is lower one after the other); decodes are never starved."""
    c = _composer(CPU)
    plan = c.plan([_decoding(0, tokens=50), _prefilling(1, 700, tokens=128)])
    assert plan == StepPlan(prefill=(), decode=(0,), why=())


def test_shorter_a_short_request_starts_beside_a_long_decode():
    c = _composer(CPU)
    plan = c.plan([_decoding(0, tokens=120), _prefilling(1, 30, tokens=8)])
    assert plan.prefill == (1,) and plan.why == ("shorter",) and plan.decode == (0,)


def test_batched_a_gpu_table_admits_everyone():
    c = _composer(GPU, max_prefills=8)
    work = [_decoding(0, tokens=20)] + [_prefilling(i, 700, tokens=128, arrival=float(i)) for i in range(1, 6)]
    plan = c.plan(work)
    assert plan.prefill == (1, 2, 3, 4, 5) and set(plan.why) == {"batched"}
    # the same queue on a CPU: nobody joins
    assert _composer(CPU, max_prefills=8).plan(work).prefill == ()
    # no decoder, several prefills allowed: the first is idle, the others batched (GPU) / wait (CPU)
    queue = [_prefilling(i, 300, arrival=float(i)) for i in range(3)]
    assert _composer(GPU, max_prefills=3).plan(queue).why == ("idle", "batched", "batched")
    assert _composer(CPU, max_prefills=3).plan(queue).why == ("idle",)


def test_joins_cheaply_is_the_exchange_rule():
    # latency(q) = 10 + 3q ms: one more 1-row request beside r of them adds 3 ms, worth it
    # while 3 <= 13 / (r + 1), so up to r = 3
    lat = StepComposer(_latency({q: (10 + 3 * q) / 1e3 for q in (1, 2, 4, 8, 16)}))
    assert lat.row_s() == pytest.approx(0.003)
    assert [lat.joins_cheaply(1, r) for r in range(1, 8)] == [True] * 3 + [False] * 4
    # a prefill to run first delays the running ones: 1 request with 100 steps left, 0.5 s
    # of prefill: (13 - 5) / 2 = 4 ms >= 3 ms: joins; 1 s of prefill: 1.5 ms: waits
    assert lat.joins_cheaply(1, 1, prefill_s=0.5, steps_left=100)
    assert not lat.joins_cheaply(1, 1, prefill_s=1.0, steps_left=100)
    assert not lat.joins_cheaply(1, 1, prefill_s=0.001, steps_left=0)


def test_what_a_request_adds_to_a_step_is_learned_from_observed_steps():
    """The latency model prices one request's rows; a step of several requests also pays
    per request. Seen costly, a GPU-like table stops admitting; until then rows alone count."""
    c = _composer(GPU)
    assert c.joins_cheaply(1, 2) and c.per_request_s == 0.0
    c.observe(0, 0.0, requests=1, rows=1, decode_s=2 * c.latency(1))  # this machine: twice the model
    c.observe(0, 0.0, requests=2, rows=2, decode_s=2 * (c.latency(2) + 0.010))  # 10 ms per extra request
    assert c.per_request_s == pytest.approx(0.010)
    assert not c.joins_cheaply(1, 2)
    frozen = StepComposer(_latency(GPU), prefill_ema=0.0)
    frozen.observe(256, 1.0, requests=2, rows=2, decode_s=1.0)
    assert frozen.per_request_s == 0.0 and frozen.prefill_seconds(256) == pytest.approx(frozen.latency(256))


def test_tenant_a_tenant_with_nothing_in_flight_starts_at_once():
    c = _composer(CPU)
    work = [_decoding(0, tenant="k1", tokens=20), _prefilling(1, 900, tokens=128, tenant="k1", arrival=0.0)]
    work.append(_prefilling(2, 900, tokens=128, tenant="k2", arrival=5.0))
    plan = c.plan(work)
    assert plan.prefill == (2,) and plan.why == ("tenant",)


def test_waited_no_request_starves():
    clock = Clock(10.0)
    c = _composer(CPU, clock=clock, max_wait_s=30.0)
    work = [_decoding(0, tokens=20), _prefilling(1, 900, tokens=128, arrival=0.0)]
    assert c.plan(work).prefill == ()
    clock.now = 30.0
    assert c.plan(work).why == ("waited",)


def test_max_active_holds_new_requests_of_a_busy_tenant_not_a_new_tenant():
    c = _composer(CPU, max_active=1)
    short = _prefilling(1, 20, tokens=4, tenant="a", arrival=1.0)
    work = [_decoding(0, tokens=100, tenant="a"), short]
    assert c.plan(work).prefill == ()  # shorter, but one is in flight already
    other = dataclasses.replace(short, index=2, tenant="b")
    assert c.plan(work + [other]).prefill == (2,)
    # started ones always continue
    assert c.plan([_decoding(0, tenant="a"), dataclasses.replace(short, started=True)]).prefill == (1,)


def test_a_blocked_request_is_no_candidate_and_a_forked_prefill_costs_nothing():
    c = _composer(CPU)
    source, waiting = _prefilling(0, 700, arrival=1.0), dataclasses.replace(_prefilling(1, 700), blocked=True)
    assert c.plan([waiting, source]).prefill == (0,)  # the one it waits for runs, though younger
    forked = dataclasses.replace(_prefilling(2, 700, tokens=8), forked=True)
    assert c.remaining_s(forked) == pytest.approx(8 * c.latency(1))
    assert c.plan([_decoding(0, tokens=100), forked]).why == ("shorter",)


def test_max_step_tokens_bounds_the_chunks_after_the_first():
    c = _composer(GPU, max_prefills=4, max_step_tokens=600)
    work = [_decoding(0, rows=9)] + [_prefilling(i, 700, arrival=float(i)) for i in range(1, 4)]
    assert c.plan(work).prefill == (1, 2)  # 9 + 256 + 256 fits 600, a third chunk does not
    alone = _composer(GPU, max_step_tokens=10).plan([_prefilling(0, 700)])
    assert alone.prefill == (0,)  # the first chunk always runs


def test_fair_turns_round_robin_over_tenants():
    work = [_decoding(0, tenant="a"), _decoding(1, tenant="a")]
    work += [_prefilling(2 + k, 100 + k, tenant="a") for k in range(3)] + [_prefilling(5, 500, tenant="b")]
    turns = fair_turns(work, lambda w: (w.prompt_left, w.index))
    assert turns == {5: 0, 2: 2, 3: 3, 4: 4}


def test_the_prefill_cost_is_learned_from_observed_steps():
    c = _composer(CPU)
    model = c.prefill_seconds(512)
    assert model == pytest.approx(2 * c.latency(256))
    c.observe(256, 0.512)
    assert c.prefill_seconds(512) == pytest.approx(1.024)
    c.observe(0, 1.0)  # nothing prefilled: nothing learned
    assert c.prefill_seconds(512) == pytest.approx(1.024)


def test_a_plan_is_never_empty_while_a_request_can_work():
    g = torch.Generator().manual_seed(0)
    for table in (CPU, GPU):
        for _ in range(200):
            n = int(torch.randint(1, 7, (1,), generator=g))
            work = []
            for i in range(n):
                kind = int(torch.randint(3, (1,), generator=g))
                tenant = "ab"[int(torch.randint(2, (1,), generator=g))]
                left = int(torch.randint(1, 2000, (1,), generator=g))
                if kind == 0:
                    work.append(_decoding(i, tokens=left % 200, tenant=tenant))
                elif kind == 1:
                    work.append(_prefilling(i, left, tenant=tenant, started=bool(left % 2), arrival=float(left)))
                else:
                    work.append(Work(i, 0.0, done=True, tenant=tenant))
            plan = _composer(table, max_active=2).plan(work)
            if any(not w.done for w in work):
                assert plan.indices, work
            assert set(plan.why) <= set(REASONS)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_prefills": 0}, {"max_step_tokens": 0}, {"max_active": 0}, {"max_wait_s": 0}, {"max_wait_s": float("inf")}],
)
def test_composer_config_rejects_bad_bounds(kwargs):
    with pytest.raises(ConfigError):
        ComposerConfig(**kwargs)


# ---------------------------------------------------------------------------- the engine runs plans
_text = word_text


@pytest.fixture(scope="module")
def engine():
    tok = make_char_tokenizer()
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None, max_position_embeddings=1024)
    # no prefix cache: the solo runs would serve the scheduled ones' chunks
    policy = PolicyConfig(prefill_chunk_tokens=64, prefix_cache_tokens=0)
    return Engine(HFTarget(model), tok, drafter=PromptLookupDrafter(PLDConfig()), policy=policy)


# (prompt characters, max new tokens, arrival step, tenant)
_SCENARIOS = {
    "idle": [(300, 12, 0, ""), (200, 12, 0, "")],
    "shorter": [(300, 30, 0, ""), (20, 4, 6, "")],
    "batched": [(150, 10, 0, ""), (200, 10, 0, ""), (90, 10, 1, "")],
    "grouped": [(150, 20, 0, ""), (150, 20, 0, ""), (150, 20, 0, ""), (150, 20, 0, "")],
    "tenant": [(200, 20, 0, "k1"), (200, 20, 0, "k1"), (250, 6, 4, "k2")],
    "waited": [(120, 24, 0, ""), (200, 6, 1, "")],
}


def _drive(eng: Engine, composer: StepComposer, specs, sampled: bool, clock: Optional[Clock] = None):
    """Start each request at its arrival step, step the composer's plans until all are
    done; returns each one's tokens and the reasons seen."""
    kw = dict(temperature=0.8, top_k=20) if sampled else {}
    live: list = []
    outs: dict[int, list[int]] = collections.defaultdict(list)
    reasons: set[str] = set()
    step = 0
    while step == 0 or live:
        for k, (n, tokens, at, tenant) in enumerate(specs):
            if at == step:
                req = eng.request(_text(n, k), max_new_tokens=tokens, chat=False, seed=k if sampled else None, **kw)
                live.append((k, req, tenant))
        plan = composer.plan(eng.work([r for _, r, _ in live], [t for _, _, t in live]))
        reasons.update(plan.why)
        chunks = eng.step([r for _, r, _ in live], plan)
        for (k, _, _), c in zip(live, chunks):
            outs[k].extend(c.token_ids)
        live = [(k, r, t) for k, r, t in live if not r.done]
        step += 1
        if clock is not None:
            clock.now += 1.0
        assert step < 500
    return [outs[k] for k in range(len(specs))], reasons


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("reason", list(_SCENARIOS))
def test_scheduled_answers_equal_solo_ones_for_every_reason(engine, reason, sampled):
    specs = _SCENARIOS[reason]
    kw = dict(temperature=0.8, top_k=20) if sampled else {}
    solo = [
        engine.generate(_text(n, k), max_new_tokens=t, chat=False, seed=k if sampled else None, **kw).token_ids
        for k, (n, t, _, _) in enumerate(specs)
    ]
    clock = Clock(time.perf_counter())  # the requests' arrival clock, one second a step
    table = GPU if reason == "batched" else CPU_LIKE if reason == "grouped" else CPU
    composer = StepComposer(
        _latency(table), ComposerConfig(max_wait_s=3.0 if reason == "waited" else 30.0), clock=clock
    )
    outs, reasons = _drive(engine, composer, specs, sampled, clock)
    assert reason in reasons
    assert outs == solo


def test_a_plan_that_names_a_request_in_the_wrong_list_is_refused(engine):
    a = engine.request(_text(30, 1), max_new_tokens=4, chat=False)
    b = engine.request(_text(30, 2), max_new_tokens=4, chat=False)
    engine.step([a])
    with pytest.raises(ConfigError):
        engine.step([a, b], StepPlan(prefill=(0,)))  # a decodes
    with pytest.raises(ConfigError):
        engine.step([a, b], StepPlan(decode=(1,)))  # b has not prefilled
    (chunk_a, chunk_b) = engine.step([a, b], StepPlan(decode=(0,)))
    assert chunk_a.token_ids and not chunk_b.token_ids and not b.started_s  # b waits, not started
    assert engine.last_step.requests == 1 and engine.last_step.verified == 1


# ---------------------------------------------------------------------------- tenants through the stepper
def _tenant_steps(engine: Engine, table, k1_streams: int) -> tuple[int, float]:
    """Steps (and their seconds by the cost model) from K2's small request's submission to
    its last chunk, while tenant K1 holds ``k1_streams`` streams (0: alone)."""
    from ragspec.integrations.stepper import Job, Stepper, ThreadOutbox

    latency = _latency(table)
    composer = StepComposer(latency, ComposerConfig(max_active=8), prefill_ema=0.0)  # no timing: deterministic
    stepper = Stepper(engine, composer=composer)
    jobs: list[Job] = []

    def submit(text: str, tokens: int, tenant: str) -> Job:
        job = Job(lambda: engine.request(text, max_new_tokens=tokens, chat=False), ThreadOutbox(), tenant=tenant)
        assert stepper._prepare(job)
        jobs.append(job)
        return job

    for k in range(k1_streams):
        submit(_text(120, 100 + k), 40, "k1")
    for _ in range(4):  # K1's streams under way
        stepper._round(jobs)
    k2 = submit(_text(100, 7), 4, "k2")
    steps, seconds = 0, 0.0
    while not k2.finished and k2 in jobs:
        stepper._round(jobs)
        steps += 1
        report = engine.last_step
        seconds += report.prefill_tokens * latency(64) / 64 + (latency(report.rows) if report.rows else 0.0)
        while not k2.outbox.queue.empty():
            kind, chunk = k2.outbox.get()
            k2.finished = k2.finished or (kind == "chunk" and chunk.finish_reason is not None)
    assert k2.finished
    return steps, seconds


@pytest.mark.parametrize("table", [CPU, GPU], ids=["cpu", "gpu"])
def test_one_tenants_thirty_streams_do_not_hold_up_anothers_small_request(engine, table):
    """Regression (one tenant could make another wait 400x: K1 holding 30 streams made K2's
    4-token request take 154 s instead of 0.37 s, the queue first come first served across
    keys). Tenants are served in turn: K2's request starts at once and shares its steps
    with K1's requests in flight only; in steps and in the cost model's seconds it takes at
    most 3x its time alone."""
    alone_steps, alone_s = _tenant_steps(engine, table, 0)
    steps, seconds = _tenant_steps(engine, table, 30)
    assert steps <= 3 * alone_steps, (steps, alone_steps)
    assert seconds <= 3 * alone_s, (seconds, alone_s)


def test_choices_sharing_a_prefill_are_scheduled_and_keep_their_outputs(engine):
    """A request's n choices share one prefill: the ones waiting for it are no candidates
    (a plan never hands them the step's chunk, so the prefill they wait for runs), then
    they copy it at no prefill cost; their outputs equal ``generate_choices``'."""
    from ragspec.params import RequestParams

    params = RequestParams(max_new_tokens=8, temperature=0.8, top_k=20, seed=5, n=3)
    prompt = _text(150, 3)
    want = [o.token_ids for o in engine.generate_choices(prompt, params, chat=False)]
    choices = engine.start_choices(prompt, params, chat=False)
    work = engine.work(choices)
    assert [w.blocked for w in work] == [False, True, True] and not any(w.forked for w in work)
    composer = StepComposer(_latency(CPU), prefill_ema=0.0)
    assert composer.plan(work).prefill == (0,)
    outs: dict[int, list[int]] = collections.defaultdict(list)
    live = list(range(3))
    forked_seen = False
    for _ in range(200):
        if not live:
            break
        reqs = [choices[i] for i in live]
        work = engine.work(reqs)
        forked_seen |= any(w.forked and w.prefilling for w in work)
        for i, c in zip(live, engine.step(reqs, composer.plan(work))):
            outs[i].extend(c.token_ids)
        live = [i for i in live if not choices[i].done]
    assert not live and forked_seen
    assert [outs[i] for i in range(3)] == want
