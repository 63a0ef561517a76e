"""The decode loop on a tiny random Llama: lossless output, stop conditions, streaming, stats."""

from __future__ import annotations

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.drafters import PromptLookupDrafter
from ragspec.errors import PromptTooLongError
from ragspec.policy import LatencyModel
from ragspec_testing import ScriptedDrafter, make_tiny_llama, oracle_plan, wrong_plan

PROMPT = "the cat sat on the mat. the cat sat on the hat."
FLAT_LATENCY = {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.013, 16: 0.015}


def make_engine(model, tok, drafter=None, adaptive=False, eos=(), max_draft=8):
    return Engine(
        HFTarget(model),
        tok,
        drafter=drafter,
        policy=PolicyConfig(max_draft_tokens=max_draft, adaptive=adaptive),
        latency=LatencyModel(dict(FLAT_LATENCY)),
        eos_token_ids=eos,
    )


@pytest.mark.parametrize("adaptive", [False, True])
def test_oracle_and_wrong_drafters_reproduce_greedy(no_eos_setup, char_tokenizer, adaptive):
    # the oracle's drafts are all accepted, the wrong drafter's none: both must equal plain greedy
    model, prompt, ref = no_eos_setup
    v = model.config.vocab_size
    for plan in (oracle_plan(ref), wrong_plan(ref, v)):
        eng = make_engine(model, char_tokenizer, ScriptedDrafter(plan), adaptive=adaptive)
        out = eng.generate(prompt, max_new_tokens=40, chat=False)
        assert out.token_ids == ref
        assert out.stats.num_accepted_tokens <= out.stats.num_drafted_tokens


def test_oracle_accepts_everything_and_saves_forwards(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    eng = make_engine(model, char_tokenizer, ScriptedDrafter(oracle_plan(ref, k=8)))
    out = eng.generate(prompt, max_new_tokens=40, chat=False)
    assert out.stats.acceptance_rate == 1.0
    # 1 prefill token, then 9 tokens (8 drafted + bonus) per step: ceil(39 / 9) = 5 steps
    assert out.stats.num_forward_passes == 1 + 5


def test_wrong_drafter_accepts_nothing(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    eng = make_engine(model, char_tokenizer, ScriptedDrafter(wrong_plan(ref, model.config.vocab_size)))
    out = eng.generate(prompt, max_new_tokens=20, chat=False)
    assert out.stats.num_accepted_tokens == 0
    assert out.stats.num_forward_passes == 20
    assert out.stats.mean_accepted_tokens == 1.0


def test_eos_accepted_mid_draft_ends_output(no_eos_setup, char_tokenizer):
    # the token at index 6 of the greedy answer is declared EOS; an oracle draft covers it
    model, prompt, ref = no_eos_setup
    eos = ref[6]
    first = ref.index(eos)  # the first occurrence ends the generation
    eng = make_engine(model, char_tokenizer, ScriptedDrafter(oracle_plan(ref, k=8)), eos=(eos,))
    chunks = list(eng.stream(prompt, max_new_tokens=40, chat=False))
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == ref[: first + 1]
    assert chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == char_tokenizer.decode(ref[:first], skip_special_tokens=True)


def test_stop_string_across_two_tokens_mid_draft(no_eos_setup, char_tokenizer):
    # a 2-character stop string (two tokens of the char tokenizer) completed inside an accepted draft
    model, prompt, ref = no_eos_setup
    text = char_tokenizer.decode(ref)
    stop = text[5:7]
    cut = text.find(stop)
    eng = make_engine(model, char_tokenizer, ScriptedDrafter(oracle_plan(ref, k=8)))
    chunks = list(eng.stream(prompt, max_new_tokens=40, chat=False, stop=[stop]))
    joined = "".join(c.text for c in chunks)
    assert joined == text[:cut]
    assert stop not in joined
    assert chunks[-1].finish_reason == "stop"
    # no chunk ever held text past the cut
    emitted = ""
    for c in chunks:
        emitted += c.text
        assert text[:cut].startswith(emitted)
    # generation stopped in the step that completed the stop: tokens end with the completing one
    out = eng.generate(prompt, max_new_tokens=40, chat=False, stop=[stop])
    assert out.token_ids == ref[: cut + 2]
    assert out.stats.num_forward_passes == 1 + 1  # prefill + one step of 8 drafted tokens


def test_max_new_tokens_never_exceeded_by_long_draft(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    eng = make_engine(model, char_tokenizer, ScriptedDrafter(oracle_plan(ref, k=16)), max_draft=16)
    out = eng.generate(prompt, max_new_tokens=5, chat=False)
    assert out.token_ids == ref[:5]
    assert out.stats.finish_reason == "length"


def test_stop_wins_over_cap_in_same_step(no_eos_setup, char_tokenizer):
    # the stop string completes at token 4 and the cap is 5: both fall in one accepted draft
    model, prompt, ref = no_eos_setup
    text = char_tokenizer.decode(ref)
    stop = text[3:5]
    if text.find(stop) != 3:
        pytest.skip("reference text repeats the chosen stop string earlier")  # pragma: no cover
    eng = make_engine(model, char_tokenizer, ScriptedDrafter(oracle_plan(ref, k=8)))
    out = eng.generate(prompt, max_new_tokens=5, chat=False, stop=[stop])
    assert out.text == text[:3]
    assert out.stats.finish_reason == "stop"


def test_model_without_eos_generates_exactly_max_new_tokens(char_tokenizer):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=None, seed=3)
    eng = make_engine(model, char_tokenizer, PromptLookupDrafter(), eos=())
    out = eng.generate(PROMPT, max_new_tokens=33, chat=False)
    assert len(out.token_ids) == 33
    assert out.stats.finish_reason == "length"


def test_draft_length_zero_equals_no_drafter(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    a = make_engine(model, char_tokenizer, ScriptedDrafter(oracle_plan(ref)), max_draft=0)
    b = make_engine(model, char_tokenizer, None)
    oa = a.generate(prompt, max_new_tokens=25, chat=False)
    ob = b.generate(prompt, max_new_tokens=25, chat=False)
    assert oa.token_ids == ob.token_ids == ref[:25]
    assert oa.stats.num_drafted_tokens == ob.stats.num_drafted_tokens == 0
    assert oa.stats.num_forward_passes == ob.stats.num_forward_passes == 25


def test_scripted_drafter_stats_are_exact(no_eos_setup, char_tokenizer):
    # drafts of 1, 5, 5 tokens with 0, 3, 5 correct leading tokens, then 12 tokens in all
    model, prompt, ref = no_eos_setup
    v = model.config.vocab_size
    script = [(1, 0), (5, 3), (5, 5)]

    def plan(step, gen):
        if step >= len(script):
            return []
        length, good = script[step]
        true = ref[len(gen) : len(gen) + length]
        return true[:good] + [(t + 1) % v for t in true[good:]]

    eng = make_engine(model, char_tokenizer, ScriptedDrafter(plan))
    out = eng.generate(prompt, max_new_tokens=12, chat=False)
    s = out.stats
    assert out.token_ids == ref[:12]
    assert s.num_forward_passes == 4  # prefill + 3 steps committing 1, 4, 6 tokens
    assert s.num_drafted_tokens == 11
    assert s.num_accepted_tokens == 8
    assert s.acceptance_rate == pytest.approx(8 / 11)
    assert s.mean_accepted_tokens == pytest.approx(11 / 3)
    assert s.accepted_histogram == {0: 1, 3: 1, 5: 1}


def test_prompt_lookup_is_lossless(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    for adaptive in (False, True):
        eng = make_engine(model, char_tokenizer, PromptLookupDrafter(), adaptive=adaptive)
        assert eng.generate(prompt, max_new_tokens=40, chat=False).token_ids == ref


def test_stream_joined_equals_generate(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    eng = make_engine(model, char_tokenizer, PromptLookupDrafter())
    chunks = list(eng.stream(prompt, max_new_tokens=40, chat=False, stop=["zz"]))
    out = eng.generate(prompt, max_new_tokens=40, chat=False, stop=["zz"])
    assert "".join(c.text for c in chunks) == out.text
    assert [t for c in chunks for t in c.token_ids] == out.token_ids
    assert chunks[-1].stats is not None and all(c.stats is None for c in chunks[:-1])


def test_prompt_too_long_is_refused(char_tokenizer):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3)
    eng = make_engine(model, char_tokenizer)
    with pytest.raises(PromptTooLongError):
        eng.generate([5] * 500, max_new_tokens=100, chat=False)


def test_closing_stream_stops_generation(no_eos_setup, char_tokenizer):
    model, prompt, ref = no_eos_setup
    eng = make_engine(model, char_tokenizer, None)
    calls = []
    it = eng.stream(prompt, max_new_tokens=40, chat=False, should_cancel=lambda: calls.append(1) or len(calls) > 3)
    chunks = list(it)
    assert chunks[-1].finish_reason == "cancelled"
    assert sum(len(c.token_ids) for c in chunks) == 4


def test_cli_compare_with_stop_string_is_not_reported_as_mismatch():
    """Regression (fresh-user trial): `generate --stop ... --compare` said "token-identical:
    NO" because plain `model.generate` knows no stop strings and ran on past the stop."""
    from types import SimpleNamespace

    from ragspec.cli.commands import _identity

    stopped = SimpleNamespace(token_ids=[5, 6, 7], stats=SimpleNamespace(finish_reason="stop"))
    assert _identity(stopped, [5, 6, 7, 8, 9]).startswith("yes")
    assert _identity(stopped, [5, 6, 9, 8]) == "NO"
    capped = SimpleNamespace(token_ids=[5, 6, 7], stats=SimpleNamespace(finish_reason="length"))
    assert _identity(capped, [5, 6, 7, 8]) == "NO"
    assert _identity(capped, [5, 6, 7]) == "yes"


def test_plain_decoding_counts_no_draft_seconds(no_eos_setup, char_tokenizer):
    """Regression (a ``--no-speculation`` server's ``ragspec_draft_seconds_total`` grew by
    ~3 ms per 128-token request: each plain step timed the engine's own drafting stage, which
    proposed nothing): a step that asks the drafter for nothing counts no draft seconds."""
    model, prompt, ref = no_eos_setup
    eng = make_engine(model, char_tokenizer, PromptLookupDrafter(), adaptive=True)
    plain = eng.generate(prompt, max_new_tokens=24, chat=False, speculative=False, return_steps=True)
    assert plain.token_ids == ref[:24]
    assert plain.stats.draft_s == 0.0 and all(s.draft_s == 0.0 for s in plain.stats.steps)
    assert make_engine(model, char_tokenizer).generate(prompt, max_new_tokens=8, chat=False).stats.draft_s == 0.0
    spec = eng.generate(prompt, max_new_tokens=24, chat=False)
    assert spec.token_ids == ref[:24]
    assert spec.stats.draft_s > 0.0  # prompt lookup was asked every step
