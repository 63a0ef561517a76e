"""Cost-aware speculation: latency and acceptance models, and the choice they make."""

from __future__ import annotations

import pytest

from ragspec import Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.policy import AcceptanceModel, LatencyModel, choose_draft
from ragspec.types import DraftTree, VerifyResult
from ragspec_testing import ScriptedDrafter, greedy_reference, make_tiny_llama, oracle_plan, wrong_plan

CPU_LIKE = {1: 0.042, 2: 0.068, 3: 0.083, 4: 0.063, 8: 0.064, 16: 0.080}  # verification not free
GPU_LIKE = {1: 0.010, 2: 0.010, 4: 0.010, 8: 0.0101, 16: 0.0102}  # verification ~free


def test_latency_model_interpolates_and_extrapolates():
    lat = LatencyModel({1: 1.0, 4: 4.0, 8: 6.0})
    assert lat(2) == pytest.approx(2.0)
    assert lat(12) == pytest.approx(8.0)  # slope of the last segment
    lat.observe(1, 2.0)
    assert 1.0 < lat(1) < 2.0


def test_injected_latencies_change_the_choice():
    # the same uncertain draft: worth verifying where verification is free, not on a slow CPU
    tree = DraftTree.chain([1, 2, 3, 4, 5, 6, 7, 8], match_len=1)
    acc = AcceptanceModel(prior_first=0.12, prior_next=0.5)
    cpu = choose_draft(tree, LatencyModel(CPU_LIKE), acc, 8)
    gpu = choose_draft(tree, LatencyModel(GPU_LIKE), acc, 8)
    assert cpu.tree.num_nodes == 0
    assert gpu.tree.num_nodes >= 4


def test_choice_skips_the_expensive_two_and_three_token_shapes():
    # on the CPU table 4 tokens cost less than 2 or 3: never verify exactly 1 or 2 drafts
    tree = DraftTree.chain([1, 2, 3, 4, 5, 6, 7, 8], match_len=4)
    acc = AcceptanceModel(prior_first=0.6, prior_next=0.6)
    choice = choose_draft(tree, LatencyModel(CPU_LIKE), acc, 8)
    assert choice.tree.num_nodes not in (1, 2)


def test_acceptance_model_learns_from_rejections():
    acc = AcceptanceModel()
    tree = DraftTree.chain([1, 2, 3], source="prompt", match_len=2)
    before = acc.node_probs(tree)[0]
    for _ in range(10):
        acc.observe(tree, VerifyResult((), (), 0, 3))
    assert acc.node_probs(tree)[0] < before / 2


FLAT = {1: 0.040, 4: 0.060, 8: 0.062, 16: 0.080}


@pytest.fixture(scope="module")
def setup(char_tokenizer):
    model = make_tiny_llama(vocab_size=len(char_tokenizer.get_vocab()) + 3, eos_token_id=None)
    prompt = char_tokenizer("policy test prompt")["input_ids"]
    return model, prompt, greedy_reference(model, prompt, 40, eos_token_id=None)


def test_always_wrong_drafter_stops_being_verified_within_a_few_steps(setup, char_tokenizer):
    model, prompt, ref = setup
    eng = Engine(
        HFTarget(model),
        char_tokenizer,
        drafter=ScriptedDrafter(wrong_plan(ref, model.config.vocab_size)),
        policy=PolicyConfig(adaptive=True),
        latency=LatencyModel(dict(FLAT), ema=0.0),
    )
    out = eng.generate(prompt, max_new_tokens=40, chat=False, return_steps=True)
    assert out.token_ids == ref
    drafted_steps = [i for i, s in enumerate(out.stats.steps) if s.num_drafted]
    assert len(drafted_steps) <= 5 and (not drafted_steps or drafted_steps[-1] < 8)


def test_oracle_drafter_drafts_long(setup, char_tokenizer):
    model, prompt, ref = setup
    eng = Engine(
        HFTarget(model),
        char_tokenizer,
        drafter=ScriptedDrafter(oracle_plan(ref, k=8)),
        policy=PolicyConfig(adaptive=True),
        latency=LatencyModel(dict(FLAT), ema=0.0),
    )
    out = eng.generate(prompt, max_new_tokens=40, chat=False, return_steps=True)
    assert out.token_ids == ref
    assert out.stats.mean_accepted_tokens > 5
    assert max(s.num_drafted for s in out.stats.steps) == 8


def test_latency_calibration_is_monotone_in_q_after_a_disturbed_sample():
    from ragspec.policy import _monotone

    # a burst of load during the q = 1 samples read 80 ms beside 63 ms for q = 2
    assert _monotone({1: 0.080, 2: 0.063, 4: 0.070, 8: 0.065}) == {1: 0.063, 2: 0.063, 4: 0.065, 8: 0.065}
    target = HFTarget(make_tiny_llama(layers=1))
    lat = LatencyModel.measure(target, qs=(1, 2, 4, 8), context=32, repeats=2)
    for table in (lat.table, {q: lat.early(q) for q in (1, 2, 4, 8)}):
        values = [table[q] for q in (1, 2, 4, 8)]
        assert all(v > 0 for v in values)
        assert values == sorted(values)


def test_a_copy_in_progress_is_trusted_a_priori():
    """A suffix match of 16+ tokens (a repeated question's cached answer, a passage quoted at
    length) starts at priors 0.9 / 0.95 (first / deeper nodes), so the cost model verifies
    (nearly) a whole 8-token copy from the first step; shorter matches keep the formula."""
    acc = AcceptanceModel()
    assert acc.prob("responses", 20, 0) == pytest.approx(0.9) and acc.prob("responses", 40, 3) == pytest.approx(0.95)
    assert acc.prob("prompt", 3, 0) == pytest.approx(0.25 + 0.07 * 2) and acc.prob("prompt", 3, 2) == pytest.approx(0.8)
    plain = AcceptanceModel(long_match_priors=None)
    assert plain.prob("responses", 20, 3) == pytest.approx(0.8)
    tree = DraftTree.chain(list(range(10, 18)), source="responses", match_len=24)
    # seconds per forward of q rows as measured on the 2-core Xeon (660 cached tokens)
    latency = LatencyModel({1: 0.0095, 2: 0.0105, 4: 0.013, 8: 0.019, 16: 0.034})
    chosen = choose_draft(tree, latency, acc, 8)
    assert chosen.tree.num_nodes >= 7  # 4 with the shorter matches' priors
    assert choose_draft(tree, latency, plain, 8).tree.num_nodes <= 4
