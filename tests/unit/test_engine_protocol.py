"""The whole engine through the ``Target`` protocol alone: a scripted fake backend
(tests/ragspec_testing.py: FakeTarget, no transformers) under prefill, chains and trees,
rollback, EOS / stop strings / max_new_tokens, seeded sampling and several requests per
step. The fake checks on every forward that its cache holds exactly the committed
context, so a wrong rollback fails loudly."""

import pytest

from ragspec.backend.base import Target
from ragspec.config import DecodeConfig, PolicyConfig, SamplingParams
from ragspec.engine import Engine
from ragspec.errors import ConfigError, PromptTooLongError
from ragspec.params import RequestParams
from ragspec_testing import BranchingDrafter, FakeTarget, ScriptedDrafter, make_char_tokenizer, oracle_plan, wrong_plan

PROMPT = [10, 11, 12, 13, 14, 15]  # token ids: the char tokenizer's letters


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def _engine(target, tok, drafter=None, adaptive=False):
    # adaptive=False: every proposed draft is verified (the cost model is not under test)
    return Engine(target, tok, drafter=drafter, policy=PolicyConfig(adaptive=adaptive), eos_token_ids=[2])


def test_fake_target_satisfies_the_protocol():
    assert isinstance(FakeTarget(), Target)


@pytest.mark.parametrize("kind", ["none", "oracle", "wrong", "branching"])
def test_greedy_through_the_protocol_equals_the_reference(tok, kind):
    target = FakeTarget()
    ref = target.reference(PROMPT, 40)
    drafter = {
        "none": None,
        "oracle": ScriptedDrafter(oracle_plan(ref)),  # chains, all accepted
        "wrong": ScriptedDrafter(wrong_plan(ref, target.vocab_size)),  # all rejected: rollback each step
        "branching": BranchingDrafter(ref, target.vocab_size),  # trees: the second sibling is right
    }[kind]
    eng = _engine(target, tok, drafter)
    out = eng.generate(PROMPT, max_new_tokens=40, chat=False)
    assert out.token_ids == ref
    if kind in ("oracle", "branching"):
        assert out.stats.num_accepted_tokens > 0 and out.stats.num_forward_passes < 40
    if kind == "wrong":
        assert out.stats.num_drafted_tokens > 0 and out.stats.num_accepted_tokens == 0


def test_cache_after_each_step_is_the_committed_context(tok):
    target = FakeTarget()
    ref = target.reference(PROMPT, 30)
    eng = _engine(target, tok, BranchingDrafter(ref, target.vocab_size))
    req = eng.start(PROMPT, RequestParams(max_new_tokens=30), chat=False)
    generated = []
    while not req.done:
        (chunk,) = eng.step([req])
        generated.extend(chunk.token_ids)
        if not req.done:
            # every committed token but the pending root is in the cache, nothing else
            assert req.state.tokens == PROMPT + generated[:-1]
            assert req.root == generated[-1]
    assert generated == ref


def test_eos_stop_string_and_max_new_tokens(tok):
    # EOS: the model emits it once the context holds 20 tokens
    target = FakeTarget(eos_at=len(PROMPT) + 7)
    ref = target.reference(PROMPT, 40)
    assert ref[-1] == 2 and len(ref) == 8
    for drafter in (None, ScriptedDrafter(oracle_plan(ref))):
        out = _engine(target, tok, drafter).generate(PROMPT, max_new_tokens=40, chat=False)
        assert out.token_ids == ref and out.stats.finish_reason == "stop"
    # max_new_tokens is never exceeded, even when a draft would run past it
    target = FakeTarget()
    ref = target.reference(PROMPT, 40)
    out = _engine(target, tok, ScriptedDrafter(oracle_plan(ref, k=8))).generate(PROMPT, max_new_tokens=13, chat=False)
    assert out.token_ids == ref[:13] and out.stats.finish_reason == "length"
    # a stop string: the text ends before it, nothing after it is emitted
    full = _engine(target, tok).generate(PROMPT, max_new_tokens=40, chat=False).text
    stop = full[10:12]
    first = full.index(stop)
    out = _engine(target, tok, ScriptedDrafter(oracle_plan(ref))).generate(
        PROMPT, max_new_tokens=40, chat=False, stop=[stop]
    )
    assert out.text == full[:first] and out.stats.finish_reason == "stop"


def test_seeded_sampling_repeats_and_seeds_differ(tok):
    target = FakeTarget()
    ref = target.reference(PROMPT, 40)

    def sample(seed, drafter):
        eng = _engine(target, tok, drafter)
        return eng.generate(PROMPT, max_new_tokens=40, chat=False, temperature=1.0, seed=seed).token_ids

    for drafter in (None, BranchingDrafter(ref, target.vocab_size)):
        a, b = sample(3, drafter), sample(3, drafter)
        assert a == b and len(a) == 40
        assert sample(4, drafter) != a  # 40 tokens from 62 near-uniform choices: never equal by chance


def test_several_requests_in_one_step_each_get_their_solo_output(tok):
    target = FakeTarget()
    prompts = [PROMPT, [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37]]
    refs = [target.reference(p, 25) for p in prompts]
    # each request drafts from its own reference (the scripted drafter replays it)
    drafters = [ScriptedDrafter(oracle_plan(refs[0])), BranchingDrafter(refs[1], target.vocab_size), None]
    engines = [_engine(target, tok, d) for d in drafters]
    reqs = [
        e.start(p, RequestParams(max_new_tokens=25 - 5 * i), chat=False)
        for i, (e, p) in enumerate(zip(engines, prompts))
    ]
    outs = [[] for _ in reqs]
    target.verify_calls.clear()
    shared = _engine(target, tok)  # one engine steps all of them (their sessions are theirs)
    while not all(r.done for r in reqs):
        live = [i for i, r in enumerate(reqs) if not r.done]
        for i, chunk in zip(live, shared.step([reqs[i] for i in live])):
            outs[i].extend(chunk.token_ids)
    for i, ref in enumerate(refs):
        assert outs[i] == ref[: 25 - 5 * i]
    assert max(target.verify_calls) == 3  # one verify call for the three requests' rows


def test_cancel_ends_a_request_at_its_next_step_without_a_forward(tok):
    target = FakeTarget()
    eng = _engine(target, tok)
    req = eng.start(PROMPT, RequestParams(max_new_tokens=30), chat=False)
    eng.step([req])  # prefill
    eng.step([req])
    calls = len(target.verify_calls)
    req.cancel()
    (chunk,) = eng.step([req])
    assert chunk.finish_reason == "cancelled" and chunk.stats.num_generated_tokens == 2
    assert len(target.verify_calls) == calls
    with pytest.raises(ConfigError):
        eng.step([req])  # finished: its final chunk was returned


def test_start_checks_the_context_length_and_zero_tokens(tok):
    eng = _engine(FakeTarget(max_length=10), tok)
    with pytest.raises(PromptTooLongError):
        eng.start(PROMPT, RequestParams(max_new_tokens=5), chat=False)
    req = eng.start(PROMPT, RequestParams(max_new_tokens=0), chat=False)
    (chunk,) = eng.step([req])
    assert chunk.finish_reason == "length" and chunk.token_ids == ()
    with pytest.raises(ConfigError):
        DecodeConfig(max_new_tokens=True)  # not an integer
    with pytest.raises(ConfigError):
        SamplingParams(temperature=-1.0)
