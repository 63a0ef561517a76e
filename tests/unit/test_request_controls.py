"""Per-request speculation controls in the engine and runtime datastore additions below the
server: a request's own draft budget (``DecodeConfig.max_draft_tokens``, capped by the
engine's), its drafting statistics under vLLM's per-request names
(``GenerationStats.spec_decode_metrics``), and texts added to a datastore on disk
(``add_texts_to_datastore``, ``ragspec.serving.add_to_datastore``)."""

from __future__ import annotations

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.config import DecodeConfig
from ragspec.datastore import Datastore, add_texts_to_datastore, build_datastore
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import ConfigError, DatastoreInputError, DatastoreNotFoundError, EmptyCorpusError
from ragspec.loading import engine_over
from ragspec.serving import add_documents, add_to_datastore
from ragspec.types import GenerationStats
from ragspec_testing import ScriptedDrafter, greedy_reference, oracle_plan

# repeats itself: prompt lookup has something to copy
PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the"


@pytest.fixture(scope="module")
def engine(tiny_model, char_tokenizer, single_thread) -> Engine:
    return Engine(
        HFTarget(tiny_model),
        char_tokenizer,
        drafter=PromptLookupDrafter(),
        policy=PolicyConfig(max_draft_tokens=8, adaptive=False),
        model_name="tiny-llama",
    )


# ---------------------------------------------------------------------- the draft budget
def test_a_budget_of_zero_is_plain_decoding_with_the_same_text(engine):
    on = engine.generate(PROMPT, max_new_tokens=24, chat=False)
    off = engine.generate(PROMPT, max_new_tokens=24, chat=False, max_draft_tokens=0)
    plain = engine.generate(PROMPT, max_new_tokens=24, chat=False, speculative=False)
    assert on.stats.num_drafted_tokens > 0  # the prompt repeats: speculation drafts
    assert off.token_ids == on.token_ids == plain.token_ids
    assert off.stats.num_drafted_tokens == 0 and off.stats.draft_s == 0.0
    metrics = off.stats.spec_decode_metrics()
    # 24 tokens: the first from the prefill, 23 plain steps of one token each
    assert metrics["num_spec_steps"] == 23 and metrics["num_draft_tokens"] == 0
    assert metrics["mean_acceptance_length"] == 1.0 and metrics["acceptance_histogram"] == [23]
    req = engine.request(PROMPT, chat=False, max_draft_tokens=0)
    assert req.session is None and engine.step_tokens(req) > 0  # no session, as speculative=False


def test_a_request_budget_caps_every_step_and_the_engines_caps_it(tiny_model, char_tokenizer, single_thread):
    ids = char_tokenizer(PROMPT)["input_ids"]
    ref = greedy_reference(tiny_model, ids, 30)
    eng = Engine(
        HFTarget(tiny_model),
        char_tokenizer,
        drafter=ScriptedDrafter(oracle_plan(ref, k=8)),  # always 8 right tokens: the cap decides
        policy=PolicyConfig(max_draft_tokens=6, adaptive=False),
    )
    for cap, most in ((3, 3), (6, 6), (50, 6), (None, 6)):
        out = eng.generate(ids, max_new_tokens=30, max_draft_tokens=cap, return_steps=True)
        assert out.token_ids == ref, cap
        assert max(s.num_drafted for s in out.stats.steps) == most, cap
    req = eng.request(ids, max_draft_tokens=3)
    eng.step([req])  # the prefill
    assert eng.step_tokens(req) == 1 + 3  # a scheduler's budget sees the request's cap


def test_the_draft_budget_is_validated():
    for bad in (-1, True, 2.0, "3"):
        with pytest.raises(ConfigError, match="max_draft_tokens"):
            DecodeConfig(max_draft_tokens=bad)
    assert DecodeConfig(max_draft_tokens=0).max_draft_tokens == 0


# ---------------------------------------------------------------------- the metrics
def test_spec_decode_metrics_are_the_engines_statistics(engine):
    stats = engine.generate(PROMPT, max_new_tokens=24, chat=False).stats
    m = stats.spec_decode_metrics()
    assert m["num_spec_steps"] == stats.num_steps == stats.num_forward_passes - 1
    assert m["num_draft_tokens"] == stats.num_drafted_tokens > 0
    assert m["num_accepted_draft_tokens"] == stats.num_accepted_tokens
    assert m["mean_acceptance_length"] == pytest.approx(1 + stats.num_accepted_tokens / stats.num_steps)
    assert m["draft_acceptance_rate"] == stats.acceptance_rate
    assert sum(m["acceptance_histogram"]) == stats.num_steps
    assert {k: v for k, v in enumerate(m["acceptance_histogram"]) if v} == stats.accepted_histogram
    assert m["draft_s"] == stats.draft_s and m["verify_s"] == stats.verify_s


def test_spec_decode_metrics_of_no_step():
    # a request that ended at its prefill (max_tokens 1): no step, nothing to average
    m = GenerationStats(num_forward_passes=1, num_generated_tokens=1).spec_decode_metrics()
    assert m["num_spec_steps"] == 0 and m["mean_acceptance_length"] == 0.0 and m["acceptance_histogram"] == []


# ---------------------------------------------------------------------- runtime additions
def _store(tmp_path, tok):
    src = tmp_path / "corpus.txt"
    src.write_text("a dog ran in the park and a bird sang.")
    build_datastore([src], tmp_path / "ds", tok, progress=False)
    return tmp_path / "ds"


def test_texts_added_to_a_datastore_become_a_shard(tmp_path, char_tokenizer):
    d = _store(tmp_path, char_tokenizer)
    info = add_texts_to_datastore(d, ["the cat sat.", "one two three"], char_tokenizer, source="api")
    assert info.num_shards == 2 and info.num_documents == 3
    ds = Datastore.open(d, tokenizer=char_tokenizer)
    (record,) = ds.sources(1)  # the new shard's one source: the texts, 12 + 13 bytes
    assert (record["path"], record["bytes"], record["num_documents"]) == ("api", 25, 2)
    assert list(ds.document(1)) == char_tokenizer("the cat sat.", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "texts, error",
    [
        ([], EmptyCorpusError),  # nothing to add
        (["fine", "  \n"], DatastoreInputError),  # an empty document
        (["bin\0ary"], DatastoreInputError),  # binary content
        (["\ud800 lone surrogate"], DatastoreInputError),  # not valid Unicode
        ([b"bytes"], DatastoreInputError),  # not a string
    ],
)
def test_a_bad_text_refuses_the_whole_addition_and_writes_nothing(tmp_path, char_tokenizer, texts, error):
    d = _store(tmp_path, char_tokenizer)
    manifest = (d / "manifest.json").read_bytes()
    with pytest.raises(error):
        add_texts_to_datastore(d, texts, char_tokenizer)
    assert (d / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in d.iterdir() if p.name.startswith("shard")) == ["shard-00000"]


def test_serving_add_to_datastore_swaps_it_in_and_requests_started_keep_theirs(tmp_path, engine):
    d = _store(tmp_path, engine.tokenizer)
    served = engine_over(engine, {"kb": Datastore.open(d, engine.tokenizer)})
    started = served.request(PROMPT, max_new_tokens=4, chat=False, datastore="kb")
    before = served.datastores["kb"]
    info = add_to_datastore(served, "kb", ["the cat sat on the mat."])
    assert info.num_documents == 2 and served.datastores["kb"].num_documents == 2
    assert served.datastore is served.datastores["kb"]  # the default: requests naming none see it too
    assert before.num_documents == 1  # the request started before drafts from the datastore as it was
    assert served.target is engine.target  # no model loaded
    while not started.done:
        served.step([started])
    with pytest.raises(DatastoreNotFoundError, match="no-such"):
        add_to_datastore(served, "no-such", ["x"])
    # the deprecated form: the default datastore, swapped in the same engine
    with pytest.warns(DeprecationWarning):
        same, info = add_documents(served, ["a dog ran."])
    assert same is served and info.num_documents == 3
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="no named datastore"):
        add_documents(engine, ["x"])
