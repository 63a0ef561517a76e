"""Log-probabilities from the verify pass (ragspec.logprobs): in exact numerics (the CPU
backend's compiled few-row kernels, each row computed on its own) every committed token's
entry, top log-probabilities included, is bit for bit what plain decoding returns, drafts
on or off, solo or batched, greedy or seeded sampling; the entries follow the tokens
through streaming; the processed modes are the distribution the token was chosen from."""

from __future__ import annotations

import math

import pytest
import torch

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.backend.hf import HFTarget
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import InvalidParameterError
from ragspec.processors import ProcessorChain
from ragspec.sampling import process_logits
from ragspec_testing import (
    PROCESSOR_PROMPTS,
    ForceTokens,
    ScriptedDrafter,
    exact_cpu_target,
    make_char_tokenizer,
    make_tiny_llama,
    oracle_plan,
    wrong_plan,
)

PROMPTS = PROCESSOR_PROMPTS
EOS = 2


@pytest.fixture(scope="module")
def exact(single_thread):
    """(engine factory over an exact-numerics CPU target, tokenizer)."""
    tok = make_char_tokenizer()
    # head size, hidden and intermediate sizes multiples of 32: every row computed alike
    model = make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, layers=2, head_dim=32, eos_token_id=None)
    target = exact_cpu_target(model)
    if target is None:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")

    def make(drafter=None, adaptive=False):
        policy = PolicyConfig(max_draft_tokens=8, adaptive=adaptive, prefix_cache_tokens=0)
        return Engine(target, tok, drafter=drafter, policy=policy, eos_token_ids=[])

    return make, tok


def _lp(out):
    return [(e.token_id, e.logprob, e.top) for e in out.logprobs]


@pytest.mark.parametrize("top", [0, 5])
def test_greedy_logprobs_drafts_on_equal_drafts_off_bit_for_bit(exact, top):
    make, tok = exact
    prompt = tok(PROMPTS[0])["input_ids"]
    params = RequestParams(max_new_tokens=30, logprobs=True, top_logprobs=top)
    plain = make().generate(prompt, params, chat=False)
    assert len(plain.logprobs) == len(plain.token_ids) == 30
    assert all(len(e.top) == top for e in plain.logprobs)
    assert [e.token_id for e in plain.logprobs] == plain.token_ids
    v = make().target.vocab_size
    for drafter in (ScriptedDrafter(oracle_plan(plain.token_ids)), ScriptedDrafter(wrong_plan(plain.token_ids, v))):
        out = make(drafter).generate(prompt, params, chat=False)
        assert out.token_ids == plain.token_ids and out.stats.num_drafted_tokens > 0
        assert _lp(out) == _lp(plain)  # float equality: bit for bit
    if top:  # the top entries are the row's own, best first: the greedy token leads
        assert all(e.top[0] == (e.token_id, e.logprob) for e in plain.logprobs)


def test_four_processed_requests_batched_in_one_forward_equal_their_solo_runs(exact):
    # every processor but min_tokens (no EOS here), 4 requests verified in one forward
    make, tok = exact
    params = RequestParams(
        max_new_tokens=20,
        logprobs=True,
        top_logprobs=3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={5: 2.0, 9: -100.0},
    )
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    solo = [make().generate(p, params, chat=False) for p in prompts]
    engine = make(PromptLookupDrafter(), adaptive=True)
    got: dict[int, list] = {i: [] for i in range(4)}
    toks: dict[int, list] = {i: [] for i in range(4)}
    starts = [lambda p=p: engine.request(p, params, chat=False) for p in prompts]
    for step in engine.run_requests(starts, in_flight=4):
        for i, chunk in step:
            assert len(chunk.logprobs) == len(chunk.token_ids)  # each chunk carries its tokens' entries
            got[i].extend((e.token_id, e.logprob, e.top) for e in chunk.logprobs)
            toks[i].extend(chunk.token_ids)
    for i in range(4):
        assert toks[i] == solo[i].token_ids
        assert got[i] == _lp(solo[i])


def test_seeded_sampling_logprobs_are_plain_decodings_of_the_same_tokens(exact):
    make, tok = exact
    prompt = tok(PROMPTS[2])["input_ids"]
    params = RequestParams(max_new_tokens=24, temperature=0.9, seed=7, logprobs=True, top_logprobs=4)
    for drafter in (PromptLookupDrafter(), None):
        sampled = make(drafter).generate(prompt, params, chat=False)
        assert (sampled.stats.num_drafted_tokens > 0) == (drafter is not None)
        # plain greedy decoding forced along the sampled tokens: its raw rows are plain decoding's
        req = make().start(prompt, RequestParams(max_new_tokens=24, logprobs=True, top_logprobs=4), chat=False)
        req.processors = ProcessorChain([ForceTokens(sampled.token_ids)])
        forced = [e for c in make().iterate(req) for e in c.logprobs]
        assert [e.token_id for e in forced] == sampled.token_ids
        assert [(e.token_id, e.logprob, e.top) for e in forced] == _lp(sampled)


def test_processed_logprobs_are_the_distribution_the_token_came_from(exact):
    make, tok = exact
    prompt = tok(PROMPTS[1])["input_ids"]
    bias = {5: 2.0, 9: -1.0}
    kw = dict(max_new_tokens=6, logprobs=True, top_logprobs=20, chat=False, logit_bias=bias)
    modes = ("raw_logprobs", "raw_logits", "processed_logprobs")
    raw, logits, processed = (make().generate(prompt, logprobs_mode=m, **kw) for m in modes)
    assert raw.token_ids == logits.token_ids == processed.token_ids
    for r, lg, pr in zip(raw.logprobs, logits.logprobs, processed.logprobs):
        # the raw logprobs are log_softmax of the raw logits: the same ranks, shifted values
        assert [t for t, _ in r.top] == [t for t, _ in lg.top]
        shift = {round(x - y, 4) for (_, x), (_, y) in zip(lg.top, r.top)}
        assert len(shift) == 1
        # processed: the bias moved the distribution; the chosen token is its argmax (greedy)
        assert pr.top[0][0] == pr.token_id
    assert [e.logprob for e in processed.logprobs] != [e.logprob for e in raw.logprobs]
    # sampling: processed_logprobs is log of the top-k distribution (-inf outside it)
    sampled = make().generate(
        prompt,
        max_new_tokens=5,
        temperature=0.7,
        top_k=3,
        seed=1,
        logprobs=True,
        top_logprobs=5,
        chat=False,
        logprobs_mode="processed_logprobs",
    )
    for e in sampled.logprobs:
        assert [lp for _, lp in e.top][3:] == [float("-inf")] * 2
        assert math.isclose(sum(math.exp(lp) for _, lp in e.top[:3]), 1.0, rel_tol=1e-5)


def test_logprob_parameters_are_checked_by_name():
    for fields, param in (
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(logprobs=True, logprobs_mode="sampled"), "logprobs_mode"),
    ):
        with pytest.raises(InvalidParameterError) as e:
            RequestParams(**fields)
        assert e.value.param == param


def test_a_request_without_logprobs_returns_none(single_thread):
    tok = make_char_tokenizer()
    engine = Engine(HFTarget(make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3)), tok, eos_token_ids=[EOS])
    out = engine.generate("abc", max_new_tokens=4, chat=False)
    assert out.logprobs == [] and all(not c.logprobs for c in engine.stream("abc", max_new_tokens=4, chat=False))
    # the test processor (used above) and process_logits agree on what forcing means
    assert process_logits(torch.tensor([[0.0, float("-inf")]]), RequestParams(temperature=1.0).sampling)[0, 1] == 0
