"""``n`` choices of one request (Engine.start_choices): one prefill shared (the others copy
its KV entries), each choice its own generator seeded ``seed + i``, stepped together; the
same seed reproduces them, and each equals the solo request of its seed."""

from __future__ import annotations

import pytest

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.backend.base import Capability
from ragspec.backend.hf import HFTarget
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import ConfigError, InvalidParameterError
from ragspec_testing import make_char_tokenizer, make_tiny_llama

PROMPT = "the cat sat on the mat. the cat sat on the hat."


class _CountPrefills(HFTarget):
    def __init__(self, model, kv=True):
        super().__init__(model)
        self.prefills = 0
        self.kv = kv

    def prefill(self, state, input_ids, *, return_hidden=False):
        self.prefills += 1
        return super().prefill(state, input_ids, return_hidden=return_hidden)

    def capability(self, name):
        if name == Capability.PREFIX_KV and not self.kv:
            return None
        return super().capability(name)


@pytest.fixture(scope="module")
def setup(single_thread):
    tok = make_char_tokenizer()
    return make_tiny_llama(vocab_size=len(tok.get_vocab()) + 3, eos_token_id=None), tok


def _engine(model, tok, kv=True, chunk=0):
    policy = PolicyConfig(prefill_chunk_tokens=chunk, prefix_cache_tokens=0)
    return Engine(_CountPrefills(model, kv), tok, drafter=PromptLookupDrafter(), policy=policy)


@pytest.mark.parametrize("chunk", [0, 16])
def test_n_seeded_choices_share_one_prefill_and_equal_their_solo_requests(setup, chunk):
    model, tok = setup
    params = RequestParams(n=4, temperature=1.0, seed=11, max_new_tokens=16, logprobs=True)
    engine = _engine(model, tok, chunk=chunk)
    outs = engine.generate_choices(PROMPT, params, chat=False)
    prompt_len = outs[0].stats.num_prompt_tokens
    assert engine.target.prefills == (-(-prompt_len // chunk) if chunk else 1)  # choice 0's prefill only
    assert [o.stats.num_cached_prompt_tokens for o in outs] == [0] + [prompt_len] * 3
    assert all(o.stats.num_forward_passes == o.stats.num_steps + 1 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # different samples
    again = _engine(model, tok, chunk=chunk).generate_choices(PROMPT, params, chat=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # the seed reproduces them
    for i, out in enumerate(outs):
        solo = _engine(model, tok, chunk=chunk).generate(PROMPT, params.replace(n=1, seed=11 + i), chat=False)
        assert solo.token_ids == out.token_ids
        assert [e.logprob for e in solo.logprobs] == [e.logprob for e in out.logprobs]


def test_choices_without_kv_copies_prefill_each(setup):
    model, tok = setup
    params = RequestParams(n=3, temperature=0.8, seed=5, max_new_tokens=8)
    forked = _engine(model, tok).generate_choices(PROMPT, params, chat=False)
    engine = _engine(model, tok, kv=False)
    own = engine.generate_choices(PROMPT, params, chat=False)
    assert engine.target.prefills == 3
    assert [o.token_ids for o in own] == [o.token_ids for o in forked]


def test_greedy_choices_are_the_greedy_output(setup):
    model, tok = setup
    engine = _engine(model, tok)
    outs = engine.generate_choices(PROMPT, RequestParams(n=2, max_new_tokens=10), chat=False)
    assert outs[0].token_ids == outs[1].token_ids == engine.generate(PROMPT, max_new_tokens=10, chat=False).token_ids


def test_a_cancelled_first_choice_lets_the_others_prefill(setup):
    model, tok = setup
    engine = _engine(model, tok)
    choices = engine.start_choices(PROMPT, RequestParams(n=2, max_new_tokens=6), chat=False)
    choices[0].cancel()
    chunks = engine.step(choices)
    assert chunks[0].finish_reason == "cancelled"
    while not choices[1].done:
        engine.step([choices[1]])
    assert choices[1].stats.num_generated_tokens == 6 and choices[1].stats.num_cached_prompt_tokens == 0


def test_n_is_checked_and_start_takes_one_choice(setup):
    model, tok = setup
    with pytest.raises(InvalidParameterError) as e:
        RequestParams(n=0)
    assert e.value.param == "n"
    with pytest.raises(ConfigError, match="start_choices"):
        _engine(model, tok).start(PROMPT, RequestParams(n=2), chat=False)
