"""Per-row logit processing (ragspec.processors, ragspec.logit_processors) through the
engine: greedy output with each processor is plain processed decoding token for token,
drafts on (all accepted, none accepted, prompt lookup) as drafts off, solo and batched;
pruning never changes the output; the row functions see only their own path."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from ragspec import Engine, PolicyConfig, RequestParams
from ragspec.backend.hf import HFTarget
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import ConfigError, InvalidParameterError
from ragspec.logit_processors import LogitBias, MinTokens, Penalties
from ragspec.processing import ProcessorContext, build_processors
from ragspec.processors import row_paths
from ragspec_testing import (
    PROCESSOR_PROMPTS,
    ScriptedDrafter,
    greedy_reference,
    make_tiny_llama,
    make_tree,
    oracle_plan,
    wrong_plan,
)

PROMPTS = PROCESSOR_PROMPTS
EOS = 2


class _Bias(LogitsProcessor):
    def __init__(self, bias):
        self.bias = bias

    def __call__(self, input_ids, scores):
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


class _FreqPresence(LogitsProcessor):
    """OpenAI's formula over the generated tokens, written from scratch."""

    def __init__(self, prompt_len, frequency, presence):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_len :].tolist()
        for t in set(out):
            scores[0, t] -= self.frequency * out.count(t) + self.presence
        return scores


def reference(model, prompt_ids, max_new_tokens, params: RequestParams, eos=None):
    """transformers' greedy generate with transformers' own (or from-scratch) processors."""
    procs = LogitsProcessorList()
    if params.min_tokens and eos is not None:
        procs.append(MinNewTokensLengthLogitsProcessor(len(prompt_ids), params.min_tokens, eos))
    if params.logit_bias:
        procs.append(_Bias(params.logit_bias))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.frequency_penalty or params.presence_penalty:
        procs.append(_FreqPresence(len(prompt_ids), params.frequency_penalty, params.presence_penalty))
    return greedy_reference(model, prompt_ids, max_new_tokens, eos_token_id=eos, logits_processor=procs)


@pytest.fixture(scope="module")
def setup(char_tokenizer, single_thread):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=EOS)
    return model, char_tokenizer


def _engine(model, tok, drafter=None, adaptive=False, eos=(EOS,)):
    return Engine(
        HFTarget(model),
        tok,
        drafter=drafter,
        policy=PolicyConfig(max_draft_tokens=8, adaptive=adaptive),
        eos_token_ids=eos,
    )


PROCESSED = {
    "logit_bias": dict(logit_bias={5: 3.0, 20: -100.0, 33: 1.5, EOS: -4.0}),
    "frequency_penalty": dict(frequency_penalty=1.5),
    "presence_penalty": dict(presence_penalty=-1.0),
    "repetition_penalty": dict(repetition_penalty=1.8),
    # EOS made likely, then masked for 20 tokens
    "min_tokens": dict(min_tokens=20, logit_bias={EOS: 4.0}),
    "all": dict(
        min_tokens=5, logit_bias={EOS: 2.0, 9: 1.0}, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.3
    ),
}


@pytest.mark.parametrize("name", sorted(PROCESSED))
def test_greedy_with_a_processor_is_plain_processed_decoding_drafts_on_and_off(setup, name):
    model, tok = setup
    params = RequestParams(max_new_tokens=30, **PROCESSED[name])
    prompt = tok(PROMPTS[0])["input_ids"]
    ref = reference(model, prompt, 30, params, eos=EOS)
    unprocessed = params.replace(min_tokens=0) if name == "min_tokens" else RequestParams(max_new_tokens=30)
    assert ref != reference(model, prompt, 30, unprocessed, eos=EOS)  # the processor matters
    v = model.config.vocab_size
    plain = _engine(model, tok).generate(prompt, params, chat=False)
    assert plain.token_ids == ref
    for drafter in (ScriptedDrafter(oracle_plan(ref)), ScriptedDrafter(wrong_plan(ref, v)), PromptLookupDrafter()):
        out = _engine(model, tok, drafter).generate(prompt, params, chat=False)
        assert out.token_ids == ref, type(drafter).__name__
        assert out.stats.num_drafted_tokens > 0


@pytest.mark.parametrize("name", sorted(PROCESSED))
def test_four_processed_requests_batched_equal_their_solo_outputs(setup, name):
    model, tok = setup
    params = RequestParams(max_new_tokens=24, **PROCESSED[name])
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    refs = [reference(model, p, 24, params, eos=EOS) for p in prompts]
    engine = _engine(model, tok, PromptLookupDrafter(), adaptive=True)
    got: dict[int, list[int]] = {i: [] for i in range(4)}
    starts = [lambda p=p: engine.request(p, params, chat=False) for p in prompts]
    for step in engine.run_requests(starts, in_flight=4):
        for i, chunk in step:
            got[i].extend(chunk.token_ids)
    assert [got[i] for i in range(4)] == refs


def test_banned_tokens_are_pruned_from_drafts_and_counted(setup):
    model, tok = setup
    params = RequestParams(max_new_tokens=12, logit_bias={7: -100.0})
    prompt = tok(PROMPTS[0])["input_ids"]
    ref = reference(model, prompt, 12, params, eos=EOS)
    # every draft starts with the banned token: pruned whole, never verified
    out = _engine(model, tok, ScriptedDrafter(lambda step, gen: [7, 8, 9])).generate(prompt, params, chat=False)
    assert out.token_ids == ref
    assert out.stats.num_drafted_tokens == 0 and out.stats.num_pruned_draft_tokens >= 3 * (out.stats.num_steps - 2)


def test_logit_bias_checks_its_token_ids_and_values(setup):
    model, tok = setup
    with pytest.raises(InvalidParameterError) as e:
        _engine(model, tok).start("abc", RequestParams(logit_bias={10_000: 1.0}), chat=False)
    assert e.value.param == "logit_bias"
    for bad in ({5: 101.0}, {-1: 1.0}, {"5": 1.0}, {5: float("nan")}):
        with pytest.raises(InvalidParameterError) as e:
            RequestParams(logit_bias=bad)
        assert e.value.param == "logit_bias"
    assert RequestParams(logit_bias={}).logit_bias is None


def test_an_empty_chain_leaves_the_request_unprocessed(setup):
    model, tok = setup
    req = _engine(model, tok).start("abc", RequestParams(), chat=False)
    assert not req.processors
    ctx = ProcessorContext((1, 2, 3), 50, (EOS,))
    assert not build_processors(RequestParams(), ctx)
    chain = build_processors(RequestParams(logit_bias={3: 1.0}, min_tokens=2, frequency_penalty=0.5), ctx)
    assert [type(p) for p in chain.processors] == [MinTokens, LogitBias, Penalties]


def test_row_functions_see_only_their_own_path():
    # tokens [5, 6, 7] with 6 under 5 and 7 under the root: row 2 (after 6) saw 5, 6; row 3 saw 7
    tree = make_tree([5, 6, 7], [-1, 0, -1])
    assert row_paths(tree) == [(), (5,), (5, 6), (7,)]
    pen = Penalties((), frequency=1.0)
    pen.commit([9])
    fn = pen.rows(tree)
    rows = [fn(r, torch.zeros(12)) for r in range(4)]
    assert rows[2][5] == -1 and rows[2][6] == -1 and rows[2][7] == 0 and rows[2][9] == -1
    assert rows[3][5] == 0 and rows[3][7] == -1
    assert rows[0].tolist() == [0] * 9 + [-1, 0, 0]


def test_processor_ranges_are_checked_by_name():
    for field, value in (
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("min_p", 1.5),
        ("min_tokens", 200),
    ):
        with pytest.raises(InvalidParameterError) as e:
            RequestParams(**{field: value})
        assert e.value.param == field and isinstance(e.value, ConfigError)


def test_stop_strings_wait_for_min_tokens(setup):
    model, tok = setup
    prompt = tok(PROMPTS[0])["input_ids"]
    free = _engine(model, tok).generate(prompt, max_new_tokens=20, chat=False)
    stop = free.text[2:4]  # appears by the 4th token
    cut = _engine(model, tok).generate(prompt, max_new_tokens=20, stop=[stop], chat=False)
    assert len(cut.token_ids) <= 4
    late = _engine(model, tok).generate(prompt, max_new_tokens=20, stop=[stop], min_tokens=8, chat=False)
    assert late.token_ids[: len(cut.token_ids)] == free.token_ids[: len(cut.token_ids)]
    assert len(late.token_ids) >= 8


def test_a_pruned_sampled_draft_is_verified_as_a_deterministic_one(setup):
    """Pruning by token biases a sampled draft's siblings: the kept tree drops its draft
    probabilities (the deterministic rule is lossless for any choice of nodes)."""
    from ragspec.draft_choice import draft_for_step
    from ragspec_testing import FixedDrafter

    model, tok = setup
    v = model.config.vocab_size
    tree = make_tree([7, 8, 9], [-1, -1, 0], draft_probs=[[1.0 / v] * v] * 3, source="sampled")
    engine = _engine(model, tok, FixedDrafter(tree))
    params = RequestParams(max_new_tokens=8, temperature=1.0, seed=1, logit_bias={8: -100.0})
    req = engine.start(PROMPTS[0], params, chat=False)
    engine.step([req])  # the prefill
    pending = draft_for_step(engine.target, engine.policy, 0, req, lazy_rows=False, on_invalid=None)
    assert pending.tree.tokens.tolist() == [7, 9] and pending.tree.draft_probs is None
    assert req.stats.num_pruned_draft_tokens == 1
    unpruned = engine.start(PROMPTS[0], params.replace(logit_bias=None), chat=False)
    engine.step([unpruned])
    kept = draft_for_step(engine.target, engine.policy, 0, unpruned, lazy_rows=False, on_invalid=None)
    assert kept.tree.draft_probs is not None  # nothing pruned: drawn as the drafter drew it


class _EmptyAt:
    """A processor that leaves no token in the row of output position ``at`` (every logit
    -inf): what a failing grammar engine does."""

    def __init__(self, at: int) -> None:
        self.at, self.generated = at, 0

    def prune(self, tree):
        return [True] * tree.num_nodes

    def rows(self, tree):
        before = [0] + [d + 1 for d in tree.depth.tolist()]

        def fn(row, logits):
            if self.generated + before[row] == self.at:
                logits.fill_(float("-inf"))
            return logits

        return fn

    def commit(self, tokens):
        self.generated += len(tokens)


@pytest.mark.parametrize("at", [0, 1, 7])
def test_a_row_with_no_token_left_ends_the_request_in_error_and_commits_nothing_from_it(setup, monkeypatch, caplog, at):
    """Regression: a processed row with no finite logit had its argmax (token 0) committed.
    The engine ends the request instead (finish_reason "error"), committing the tokens
    accepted before that row and nothing from it, drafts on or off, greedy or sampled, and
    logs what happened."""
    import ragspec.engine as engine_mod
    from ragspec.processors import ProcessorChain

    model, tok = setup
    prompt = tok(PROMPTS[0])["input_ids"]
    ref = reference(model, prompt, 20, RequestParams(max_new_tokens=20), eos=EOS)
    assert len(ref) > at + 2
    monkeypatch.setattr(engine_mod, "build_processors", lambda params, ctx: ProcessorChain([_EmptyAt(at)]))
    for drafter in (None, ScriptedDrafter(oracle_plan(ref)), PromptLookupDrafter()):
        for params in (
            RequestParams(max_new_tokens=20),
            RequestParams(max_new_tokens=20, logprobs=True, top_logprobs=2, logprobs_mode="processed_logprobs"),
            RequestParams(max_new_tokens=20, temperature=0.9, seed=3),
        ):
            caplog.clear()
            with caplog.at_level("WARNING"):
                out = _engine(model, tok, drafter).generate(prompt, params, chat=False)
            assert out.stats.finish_reason == "error" and out.stats.num_generated_tokens == at
            assert len(out.token_ids) == at
            if params.greedy:
                assert out.token_ids == ref[:at], type(drafter).__name__
            if params.logprobs:
                assert len(out.logprobs) == at
            assert any(f"ended in error after {at} generated tokens" in r.getMessage() for r in caplog.records)
    # streamed: the tokens before come, the last chunk says "error"
    chunks = list(_engine(model, tok).stream(prompt, RequestParams(max_new_tokens=20), chat=False))
    assert chunks[-1].finish_reason == "error" and [t for c in chunks for t in c.token_ids] == ref[:at]
