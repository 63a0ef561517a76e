"""The response cache (SuffixDecoding-style drafting from the service's own earlier
responses): lookup, bounds and eviction, persistence and bad logs, and in the engine:
greedy output unchanged, repeated requests drafted from the cache, seeded sampling
independent of the cache's contents, cancelled requests not cached."""

from __future__ import annotations

import json

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.drafters import CompositeDrafter, PromptLookupDrafter, reproducible_drafter
from ragspec.drafters.response_cache import ResponseCache, ResponseCacheDrafter, ResponseLogError
from ragspec.errors import ConfigError
from ragspec.loading import engine_over, with_response_cache
from ragspec.params import RequestParams
from ragspec.policy import LatencyModel
from ragspec_testing import greedy_reference

FLAT = {1: 0.010, 8: 0.011, 32: 0.013}


def test_lookup_copies_the_response_after_the_same_prompt_end():
    cache = ResponseCache(1000, context_tokens=4)
    cache.add([9, 9, 1, 2, 3, 4], [10, 11, 12, 13, 14])
    cands, n = cache.lookup([7, 1, 2, 3, 4], 3)
    assert cands == [[10, 11, 12]] and n == 4  # the whole stored prompt tail matched
    cands, n = cache.lookup([5, 11, 12], 8)
    assert cands == [[13, 14]] and n == 2
    assert cache.lookup([40, 41], 4) == ([], 0)
    assert cache.lookup([1, 2, 3, 4], 0) == ([], 0)
    # drafts stop after an EOS id
    cache.add([1, 2], [20, 21, 2, 22])
    assert cache.lookup([2, 20], 4, frozenset({2})) == ([[21, 2]], 2)


def test_longest_true_match_wins_over_recency():
    cache = ResponseCache(1000, context_tokens=0, max_ngram=2)
    cache.add([], [1, 2, 3, 4, 50])  # context ...2,3,4 matched 3 deep
    cache.add([], [9, 3, 4, 60])  # latest, but only 2 deep
    cands, n = cache.lookup([1, 2, 3, 4], 1)
    assert cands[0] == [50] and n == 4 and [60] in cands


def test_bounded_by_tokens_fifo_and_lru_eviction_leave_no_stale_index():
    fifo = ResponseCache(10, context_tokens=0, eviction="fifo")
    fifo.add([], [1, 2, 3, 4])
    fifo.add([], [5, 6, 7, 8])
    fifo.add([], [9, 10, 11])  # 11 tokens > 10: the first goes
    assert fifo.num_tokens == 7 and len(fifo) == 2 and fifo.evicted == 1
    assert fifo.lookup([1, 2], 2) == ([], 0)
    assert fifo.lookup([5, 6], 2)[0] == [[7, 8]]

    lru = ResponseCache(10, context_tokens=0, eviction="lru")
    lru.add([], [1, 2, 3, 4])
    lru.add([], [5, 6, 7, 8])
    assert lru.lookup([1, 2], 1)[0] == [[3]]  # the first is used: the second is now the oldest
    lru.add([], [9, 10, 11])
    assert lru.lookup([1, 2], 1)[0] == [[3]] and lru.lookup([5, 6], 1) == ([], 0)
    # evicting everything leaves an empty index (memory is bounded by what is held)
    small = ResponseCache(5, context_tokens=0)
    for i in range(20):
        small.add([], [100 + i, 200 + i, 300 + i])
    assert small.num_tokens <= 5 and len(small._table) <= 3 * 7
    assert not small.add([], list(range(6)))  # larger than the whole cache: not cached
    again = ResponseCache(100, context_tokens=1)
    assert again.add([7], [1, 2, 3]) and again.add([7], [1, 2, 3]) and again.add([8], [1, 2, 3])
    assert len(again) == 2 and again.num_tokens == 8  # the same tail and answer once


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": True},
        {"min_ngram": 3, "max_ngram": 2},
        {"eviction": "random"},
        {"context_tokens": -1},
    ],
)
def test_bad_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        ResponseCache(**{"max_tokens": 100, **kwargs})


def test_save_load_roundtrip_and_bad_logs_are_typed_errors(tmp_path):
    cache = ResponseCache(1000, context_tokens=2, model="m")
    cache.add([1, 2, 3], [4, 5, 6], "abc")
    cache.add([7], [8, 9], "de")
    log = tmp_path / "responses.jsonl"
    assert cache.save(log) == 2
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert rows[0] == {"model": "m", "prompt_tail": [2, 3], "output": [4, 5, 6], "text": "abc"}
    again = ResponseCache(1000, context_tokens=2, model="m")
    assert again.load(log, vocab_size=10) == 2
    assert again.lookup([0, 2, 3], 3)[0] == cache.lookup([0, 2, 3], 3)[0] == [[4, 5, 6]]

    bad = {
        "not_json.jsonl": "{nope\n",
        "not_object.jsonl": "[1, 2]\n",
        "bad_ids.jsonl": json.dumps({"output": [1, "x"]}) + "\n",
        "bool_ids.jsonl": json.dumps({"output": [True]}) + "\n",
        "other_model.jsonl": json.dumps({"model": "other", "output": [1]}) + "\n",
        "out_of_vocab.jsonl": json.dumps({"output": [1, 99]}) + "\n",
        "bad_text.jsonl": json.dumps({"output": [1], "text": 3}) + "\n",
    }
    for name, content in bad.items():
        path = tmp_path / name
        path.write_text(content)
        fresh = ResponseCache(1000, model="m")
        with pytest.raises(ResponseLogError):
            fresh.load(path, vocab_size=10)
        assert len(fresh) == 0, name  # nothing added from a bad log
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    with pytest.raises(ResponseLogError):
        ResponseCache(1000).load(binary)


# ---------------------------------------------------------------------- in the engine
def _engine(model, tok, cache):
    return Engine(
        HFTarget(model),
        tok,
        drafter=CompositeDrafter([PromptLookupDrafter(), ResponseCacheDrafter(cache)]),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        latency=LatencyModel(dict(FLAT)),
        eos_token_ids=(),
    )


def test_repeated_request_drafts_from_the_cache_and_output_is_unchanged(no_eos_setup, char_tokenizer, single_thread):
    model, prompt, ref = no_eos_setup
    cache = ResponseCache(10_000)
    engine = _engine(model, char_tokenizer, cache)
    first = engine.generate(prompt, max_new_tokens=40)
    assert first.token_ids == ref and len(cache) == 1
    second = engine.generate(prompt, max_new_tokens=40)
    assert second.token_ids == ref
    # the whole earlier answer is drafted: far fewer steps, most drafts accepted
    assert second.stats.num_forward_passes < first.stats.num_forward_passes
    assert second.stats.mean_accepted_tokens >= 4.0 > first.stats.mean_accepted_tokens
    # another prompt is still decoded exactly
    other = char_tokenizer("a dog ran far, a dog ran fast.")["input_ids"]
    assert engine.generate(other, max_new_tokens=30).token_ids == greedy_reference(model, other, 30)


def test_regression_seeded_sampling_does_not_depend_on_the_response_cache(no_eos_setup, char_tokenizer, single_thread):
    model, prompt, _ = no_eos_setup
    full = ResponseCache(10_000)
    warm = _engine(model, char_tokenizer, full)
    warm.generate(prompt, max_new_tokens=30)  # the cache now holds a greedy answer
    assert len(full) == 1
    empty = _engine(model, char_tokenizer, ResponseCache(10_000))
    kw = dict(max_new_tokens=30, temperature=0.9, seed=1234)
    a = warm.generate(prompt, **kw)
    b = empty.generate(prompt, **kw)
    assert a.token_ids == b.token_ids
    # the reproducible form leaves the cache out; seeded answers are not cached either
    assert reproducible_drafter(warm.drafter).name == "prompt"
    assert len(full) == 1


def test_cancelled_requests_are_not_cached(no_eos_setup, char_tokenizer, single_thread):
    model, prompt, _ = no_eos_setup
    cache = ResponseCache(10_000)
    engine = _engine(model, char_tokenizer, cache)
    req = engine.start(prompt, RequestParams(max_new_tokens=40))
    engine.step([req])
    engine.step([req])
    req.cancel()
    (chunk,) = engine.step([req])
    assert chunk.finish_reason == "cancelled" and len(cache) == 0


def test_engine_over_keeps_a_custom_drafter_beside_the_cache(no_eos_setup, char_tokenizer, single_thread):
    model, prompt, ref = no_eos_setup
    base = Engine(HFTarget(model), char_tokenizer, drafter=PromptLookupDrafter(), eos_token_ids=())
    cache = ResponseCache(10_000)
    engine = engine_over(base, None, cache)
    assert engine.parts.response_cache is cache and engine.target is base.target
    assert engine.drafter.name == "prompt+responses"
    assert engine.generate(prompt, max_new_tokens=20).token_ids == ref[:20] and len(cache) == 1
    assert engine_over(engine, None, cache).drafter is engine.drafter  # the same cache: nothing added
    with pytest.raises(ConfigError):
        engine_over(engine, None, ResponseCache(100))
    with pytest.warns(DeprecationWarning):  # the old name, one release
        assert with_response_cache(base, cache).drafter.name == "prompt+responses"


def test_salted_responses_are_drafted_from_by_their_salt_only():
    """Tenant isolation (issue 42): a response cached under a ``cache_salt`` is found by
    lookups of that salt only; the same tokens under two salts are two entries; a salted
    drafter feeds and reads its own partition."""
    cache = ResponseCache(1000, context_tokens=4)
    cache.add([1, 2, 3, 4], [10, 11, 12, 13], salt="a")
    assert cache.lookup([3, 4], 4, salt="a") == ([[10, 11, 12, 13]], 2)
    assert cache.lookup([3, 4], 4, salt="b") == ([], 0)
    assert cache.lookup([3, 4], 4) == ([], 0)
    cache.add([1, 2, 3, 4], [10, 11, 12, 13], salt="b")
    assert len(cache) == 2 and cache.lookup([3, 4], 4, salt="b")[0] == [[10, 11, 12, 13]]
    drafter = ResponseCacheDrafter(cache)
    assert drafter.salted("") is drafter and drafter.salted("a").salted("a").salt == "a"
    composite = CompositeDrafter([PromptLookupDrafter(), drafter])
    salted = composite.salted("c")
    assert salted is not composite and salted.drafters[1].salt == "c"
    session = salted.start_request([7, 8, 9])
    session.finish([20, 21, 22], "stop")
    assert cache.lookup([8, 9], 3, salt="c") == ([[20, 21, 22]], 2)
    assert cache.lookup([8, 9], 3) == ([], 0)
    # evicting salted entries leaves no stale index rows
    small = ResponseCache(8, context_tokens=2)
    small.add([1, 2], [3, 4], salt="x")
    small.add([5, 6], [7, 8, 9, 10, 11, 12], salt="y")
    assert small.lookup([1, 2], 2, salt="x") == ([], 0) and len(small) == 1
