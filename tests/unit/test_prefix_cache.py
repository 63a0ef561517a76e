"""Prefix caching (ragspec/prefix_cache.py): prompts that begin alike skip that prefill,
and the output stays what it is without the cache, bit for bit. Tiny random Llamas built
here; the native-step variant needs the compiled kernels (as test_native_step.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_native_step import _llama, _target, kernels  # noqa: F401 (a fixture)

from ragspec.backend.hf import HFTarget
from ragspec.config import PLDConfig, PolicyConfig
from ragspec.drafters import PromptLookupDrafter, SessionCapability
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.prefix_cache import PrefixCache
from ragspec.types import DraftTree
from ragspec_testing import FakeTarget, make_char_tokenizer, make_tiny_llama

DOC = "the cat sat on a mat and the dog ran off to the park while it rained. " * 6  # 438 characters


@pytest.fixture(scope="module")
def tok():
    return make_char_tokenizer()


def _engines(target, tok, chunk=64, cache_tokens=1024, drafter=None):
    """(an engine with a prefix cache, the same target's engine without one)"""
    drafter = drafter if drafter is not None else PromptLookupDrafter(PLDConfig())
    on = Engine(
        target, tok, drafter=drafter, policy=PolicyConfig(prefill_chunk_tokens=chunk, prefix_cache_tokens=cache_tokens)
    )
    off = on.with_drafter(drafter, policy=dataclasses.replace(on.policy, prefix_cache_tokens=0))
    assert on.prefix_cache is not None and off.prefix_cache is None
    return on, off


def test_prompts_sharing_documents_skip_their_prefill_with_the_same_output(tok):
    """Questions after the same 438-token document: the second and later requests take the
    document's whole chunks from the cache; greedy and seeded sampled outputs equal the
    engine's without a cache."""
    on, off = _engines(HFTarget(make_tiny_llama(seed=0, eos_token_id=None, max_position_embeddings=1024)), tok)
    first = on.generate(DOC + "Q: what sat?", max_new_tokens=30, chat=False)
    assert first.stats.num_cached_prompt_tokens == 0
    for question, sampling in (("Q: who ran?", {}), ("Q: where?", {"temperature": 0.9, "seed": 5})):
        prompt = DOC + question
        got = on.generate(prompt, max_new_tokens=30, chat=False, **sampling)
        want = off.generate(prompt, max_new_tokens=30, chat=False, **sampling)
        assert got.token_ids == want.token_ids
        assert got.stats.num_cached_prompt_tokens == 6 * 64  # the document's whole chunks (438 // 64)
        assert got.stats.num_prefill_chunks == want.stats.num_prefill_chunks - 6
    stats = on.prefix_cache.stats
    assert stats.hit_tokens == 2 * 6 * 64 and stats.queried_tokens == sum(
        len(DOC) + len(q) for q in ("Q: what sat?", "Q: who ran?", "Q: where?")
    )


def test_a_cached_chunk_holds_what_the_prefill_writes_bit_for_bit(tok):
    target = HFTarget(make_tiny_llama(seed=1, eos_token_id=None, max_position_embeddings=1024))
    ids = tok(DOC)["input_ids"]
    fresh = target.new_state()
    for a in range(0, 256, 64):
        target.prefill(fresh, ids[a : a + 64])
    blocks = [target.export_kv(fresh, a, a + 64) for a in range(0, 256, 64)]
    rebuilt = target.new_state()
    target.import_kv(rebuilt, blocks)
    assert target.state_length(rebuilt) == 256
    assert torch.equal(target.export_kv(rebuilt, 0, 256), target.export_kv(fresh, 0, 256))
    a = target.prefill(fresh, ids[256:300]).logits
    b = target.prefill(rebuilt, ids[256:300]).logits
    assert torch.equal(a, b)
    with pytest.raises(ConfigError):
        target.export_kv(fresh, 0, 10_000)


def test_an_identical_prompt_needs_no_prefill_forward(tok):
    """A prompt asked again (a repeated question, a regenerated answer) finds its final part
    too, with the last position's logits: no prefill forward, the same output (greedy and
    seeded sampling). A prompt that continues it reuses its whole chunks only."""
    on, off = _engines(HFTarget(make_tiny_llama(seed=2, eos_token_id=None, max_position_embeddings=1024)), tok)
    for prompt in (DOC[:128], DOC[:150], DOC[:40]):  # a chunk boundary at its end, past it, one part only
        for sampling in ({}, {"temperature": 0.9, "seed": 3}):
            first = on.generate(prompt, max_new_tokens=10, chat=False, **sampling)
            again = on.generate(prompt, max_new_tokens=10, chat=False, **sampling)
            want = off.generate(prompt, max_new_tokens=10, chat=False, **sampling)
            assert first.token_ids == again.token_ids == want.token_ids
            assert again.stats.num_cached_prompt_tokens == len(prompt) and again.stats.num_prefill_chunks == 0
            assert again.stats.num_forward_passes == want.stats.num_forward_passes  # the prefill counts once
    longer = on.generate(DOC[:129], max_new_tokens=10, chat=False)
    assert longer.stats.num_cached_prompt_tokens == 128 and longer.stats.num_prefill_chunks == 1
    assert longer.token_ids == off.generate(DOC[:129], max_new_tokens=10, chat=False).token_ids


def test_the_cache_keeps_its_token_budget_evicting_the_least_recently_used(tok):
    on, off = _engines(
        HFTarget(make_tiny_llama(seed=3, eos_token_id=None, max_position_embeddings=1024)), tok, cache_tokens=128
    )
    cache = on.prefix_cache
    texts = ["a" * 70 + "1", "b" * 70 + "2", "c" * 70 + "3"]  # one whole chunk each
    for t in texts[:2]:
        on.generate(t, max_new_tokens=2, chat=False)
    assert len(cache) == 2 and cache.cached_tokens == 128
    assert on.generate(texts[0], max_new_tokens=2, chat=False).stats.num_cached_prompt_tokens == 64  # a's is used
    on.generate(texts[2], max_new_tokens=2, chat=False)  # evicts b's, the least recently used
    # evicted: b's chunk, and before it a's final part (7 tokens) to make room for b's chunk
    # (a final part, only an identical prompt's, never evicts a whole chunk)
    assert cache.cached_tokens <= 128 and cache.stats.evicted_tokens == 64 + 7
    assert on.generate(texts[1], max_new_tokens=2, chat=False).stats.num_cached_prompt_tokens == 0  # stored again
    assert on.generate(texts[2], max_new_tokens=2, chat=False).stats.num_cached_prompt_tokens == 64
    assert on.generate(texts[0], max_new_tokens=2, chat=False).stats.num_cached_prompt_tokens == 0  # a's evicted now
    # the evicted entries' memory took the later stores: those hits still give the output
    for t in texts:
        assert (
            on.generate(t, max_new_tokens=8, chat=False).token_ids
            == off.generate(t, max_new_tokens=8, chat=False).token_ids
        )
    held = {b.kv.data_ptr() for b in cache._blocks.values()}
    cache.clear()
    assert cache.cached_tokens == 0 and len(cache._free) == 2 and {t.data_ptr() for t in cache._free} == held
    reused = cache.reusable()
    with torch.inference_mode():  # as the engine's steps
        on.target.prefill(state := on.target.new_state(), tok(texts[0])["input_ids"])
        assert on.target.export_kv(state, 0, 64, out=reused).data_ptr() == reused.data_ptr()


def test_a_digest_collision_is_no_hit():
    """Each hit compares the chunk's own tokens too."""
    cache = PrefixCache(256, 4)
    key = cache.digests([1, 2, 3, 4, 5], 1)[0]
    cache.store([key], [9, 9, 9, 9], torch.zeros(1, 2, 1, 4, 2), None)  # stored under another prompt's key
    assert cache.lookup([1, 2, 3, 4, 5]) == []
    cache.store([key], [1, 2, 3, 4], torch.zeros(1, 2, 1, 4, 2), None)
    assert len(cache.lookup([1, 2, 3, 4, 5])) == 1
    snap = cache.snapshot()
    cache.clear()
    assert cache.lookup([1, 2, 3, 4, 5]) == []
    cache.restore(snap)
    assert len(cache.lookup([1, 2, 3, 4, 5])) == 1
    with pytest.raises(ConfigError):
        PrefixCache(-1, 4)
    for bad in (-5, 1.5, "abc", True):
        with pytest.raises(ConfigError):
            PolicyConfig(prefix_cache_tokens=bad)


def test_a_prompt_longer_than_the_budget_keeps_its_first_chunks_regression(tok):
    """A repeated prompt longer than the cache used to never hit: least recently used
    evicted its first chunks for its later ones, and the later ones cannot be reached
    without them. The deepest chunks go first now, and a chunk whose parents are gone is
    not stored."""
    on, off = _engines(
        HFTarget(make_tiny_llama(seed=5, eos_token_id=None, max_position_embeddings=1024)), tok, cache_tokens=128
    )
    prompt = DOC[:400]  # 6 whole chunks of 64, against a budget of 2
    for _ in range(2):
        out = on.generate(prompt, max_new_tokens=8, chat=False)
    assert out.stats.num_cached_prompt_tokens == 128
    assert out.token_ids == off.generate(prompt, max_new_tokens=8, chat=False).token_ids
    assert on.generate(DOC[:200], max_new_tokens=4, chat=False).stats.num_cached_prompt_tokens == 128
    # another prompt's chunks evict the least recently used: the deeper chunk first
    on.generate("x" * 70, max_new_tokens=2, chat=False)
    assert len(on.prefix_cache) == 2
    assert on.generate(prompt, max_new_tokens=2, chat=False).stats.num_cached_prompt_tokens == 64


def test_a_cache_that_cannot_hold_a_chunk_is_off_with_a_warning(tok, caplog):
    target = HFTarget(make_tiny_llama(seed=6, eos_token_id=None))
    with caplog.at_level("WARNING", logger="ragspec.engine"):
        assert Engine(target, tok, policy=PolicyConfig(prefix_cache_tokens=100)).prefix_cache is None
        assert Engine(target, tok, policy=PolicyConfig(prefill_chunk_tokens=0)).prefix_cache is None
    assert "less than one chunk" in caplog.text and "unchunked" in caplog.text


def test_no_cache_when_off_unchunked_or_the_target_cannot_copy_kv(tok):
    target = HFTarget(make_tiny_llama(seed=4, eos_token_id=None))
    assert Engine(target, tok, policy=PolicyConfig(prefix_cache_tokens=0)).prefix_cache is None
    assert Engine(target, tok, policy=PolicyConfig(prefill_chunk_tokens=0)).prefix_cache is None
    assert Engine(FakeTarget(vocab_size=50), tok).prefix_cache is None
    assert Engine(target, tok).prefix_cache is not None  # on by default


class _HiddenRecorder:
    """A drafter whose sessions record the hidden states the engine hands them (as an EAGLE
    head's) and never propose."""

    name = "hidden-recorder"

    def __init__(self):
        self.seen = []

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        parts = []
        self.seen.append(parts)

        class _Session:
            capabilities = frozenset({SessionCapability.HIDDEN_STATES})

            def extend(self, token_ids):
                pass

            def extend_hidden(self, hidden):
                parts.append(hidden.clone())

            def propose(self, max_tokens):
                return DraftTree.empty()

            def observe(self, tree, result):
                pass

        return _Session()


def _prompt_hidden(recorder, prompt_len):
    return torch.cat(recorder.seen[-1])[:prompt_len]


@pytest.mark.parametrize("native", [False, True])
def test_cached_prefixes_give_feature_drafters_the_same_hidden_states(tok, kernels, native):  # noqa: F811
    """An EAGLE-style session gets the cached chunks' hidden states: bit for bit those of
    its own prefill (the transformers path and the native step)."""
    make = lambda: _target(kernels, _llama(seed=7, hidden=64, head_dim=32), native)  # noqa: E731
    ids = torch.randint(3, 96, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    rec_on, rec_off = _HiddenRecorder(), _HiddenRecorder()
    target = make()
    on = Engine(target, tok, drafter=rec_on, policy=PolicyConfig(prefill_chunk_tokens=64))
    off = Engine(target, tok, drafter=rec_off, policy=PolicyConfig(prefill_chunk_tokens=64, prefix_cache_tokens=0))
    on.generate(ids[:200] + [5, 6, 7], max_new_tokens=4, chat=False)
    prompt = ids[:200] + ids[250:300]
    got = on.generate(prompt, max_new_tokens=12, chat=False)
    want = off.generate(prompt, max_new_tokens=12, chat=False)
    assert got.stats.num_cached_prompt_tokens == 192 and got.token_ids == want.token_ids
    assert torch.equal(_prompt_hidden(rec_on, len(prompt)), _prompt_hidden(rec_off, len(prompt)))


def test_requests_of_other_salts_never_hit_each_others_chunks(tok):
    """Tenant isolation (issue 42): the salt roots the digest chain, so a prompt stored by
    one ``cache_salt`` is a hit for that salt only; another salt (or none) prefills it
    whole, counts no cached token, and gets the same output."""
    on, off = _engines(HFTarget(make_tiny_llama(seed=4, eos_token_id=None, max_position_embeddings=1024)), tok)
    prompt = DOC[:200]
    first = on.generate(prompt, max_new_tokens=8, chat=False, cache_salt="tenant-a")
    assert first.stats.num_cached_prompt_tokens == 0
    again = on.generate(prompt, max_new_tokens=8, chat=False, cache_salt="tenant-a")
    assert again.stats.num_cached_prompt_tokens == len(prompt)  # the same salt: the whole prompt
    for salt in ("tenant-b", ""):
        other = on.generate(prompt, max_new_tokens=8, chat=False, cache_salt=salt)
        assert other.stats.num_cached_prompt_tokens == 0, salt
        assert other.token_ids == first.token_ids == off.generate(prompt, max_new_tokens=8, chat=False).token_ids
    cache = on.prefix_cache
    ids = tok(prompt)["input_ids"]
    assert cache.digests(ids, 2, salt="a") != cache.digests(ids, 2, salt="b") != cache.digests(ids, 2)
    assert cache.lookup(ids, salt="tenant-c") == []
