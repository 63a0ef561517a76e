"""Unit tests of ragspec.sampling: logits processing against transformers' warpers, and
the verification rule on literal trees whose outcome is certain.

Distribution tests (the rule is lossless) live in tests/stat/.
"""

from __future__ import annotations

import pytest
import torch

from ragspec.config import SamplingParams
from ragspec.errors import ConfigError
from ragspec.sampling import SamplingVerifier, process_logits, sample_from, verify_sampling
from ragspec.types import DraftTree

NEG = -1e4  # a logit whose probability underflows to exactly 0 next to 0-logits


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference: transformers' warpers in the order generate(do_sample=True) applies them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    s = logits.float()
    if p.temperature != 1.0:
        s = TemperatureLogitsWarper(p.temperature)(None, s)
    if p.top_k:
        s = TopKLogitsWarper(p.top_k)(None, s)
    if p.top_p < 1.0:
        s = TopPLogitsWarper(p.top_p)(None, s)
    return s.softmax(-1)


def one_hot_rows(wanted: list[int], vocab: int = 10) -> torch.Tensor:
    """Logits [len(wanted), V] whose processed distribution is a point mass on wanted[i]."""
    rows = torch.full((len(wanted), vocab), NEG)
    for i, w in enumerate(wanted):
        rows[i, w] = 0.0
    return rows


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


T1 = SamplingParams(temperature=1.0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
        SamplingParams(temperature=1.3, top_p=0.95),
        SamplingParams(temperature=1.0, top_p=0.01),  # keeps exactly the best token
        SamplingParams(temperature=0.5, top_k=100),  # k > V: no-op
    ],
)
def test_process_logits_matches_transformers(params):
    # same kept set and same probabilities as transformers' Temperature/TopK/TopP warpers
    logits = torch.randn(64, 20, generator=gen(1)) * 2.0
    mine = process_logits(logits, params)
    ref = hf_probs(logits, params)
    assert mine.dtype == torch.float32 and mine.shape == (64, 20)
    assert torch.equal(mine > 0, ref > 0)
    torch.testing.assert_close(mine, ref, atol=1e-6, rtol=1e-5)


def test_process_logits_top_p_wide_nucleus():
    # a flat row over 5000 tokens: the nucleus is larger than the first top-k window (256),
    # so the window must widen; the result still equals transformers'
    logits = torch.randn(3, 5000, generator=gen(2)) * 0.1
    params = SamplingParams(temperature=1.0, top_p=0.95)
    mine = process_logits(logits, params)
    ref = hf_probs(logits, params)
    assert int((mine[0] > 0).sum()) > 2000
    assert torch.equal(mine > 0, ref > 0)
    torch.testing.assert_close(mine, ref, atol=1e-7, rtol=1e-4)


def test_process_logits_docstring_example():
    # temperature 1, top_k 3 drops token 3; top_p 0.6 then keeps only token 0 (p = 0.67)
    out = process_logits(torch.tensor([[2.0, 1.0, 0.0, -1.0]]), SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    assert out.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_process_logits_top_k_keeps_ties():
    # transformers keeps every token tied with the k-th best logit
    out = process_logits(torch.tensor([[3.0, 1.0, 1.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (out[0] > 0).tolist() == [True, True, True, False]


def test_process_logits_ties_with_top_p_match_transformers():
    # ties at the k-th logit (kept by top-k) followed by top-p: same result as transformers
    logits = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    for params in (SamplingParams(temperature=1.0, top_k=2, top_p=0.9), SamplingParams(temperature=0.5, top_k=3)):
        torch.testing.assert_close(process_logits(logits, params), hf_probs(logits, params).float())


def test_process_logits_bf16_input():
    # bf16 logits are processed in float32
    out = process_logits(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16), T1)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.sum(-1), torch.ones(1))


def test_greedy_is_refused():
    # temperature 0 is greedy decoding: no distribution, no sampling verifier
    with pytest.raises(ConfigError):
        SamplingVerifier(SamplingParams(temperature=0.0))
    with pytest.raises(ConfigError):
        process_logits(torch.zeros(1, 4), SamplingParams(temperature=0.0))


def test_generator_required():
    # no hidden global RNG: a missing generator is an error, not torch's default generator
    with pytest.raises(ConfigError):
        SamplingVerifier(T1)(DraftTree.empty(), torch.zeros(1, 4), None)


def test_certain_chain_accepted_with_bonus():
    # docstring example: rows are point masses on 5, 6, 9 -> accept (5, 6), bonus 9
    tree = DraftTree.chain([5, 6])
    for seed in range(5):
        res = SamplingVerifier(T1)(tree, one_hot_rows([5, 6, 9]), gen(seed))
        assert (res.accepted_nodes, res.accepted_tokens, res.bonus_token, res.num_drafted) == ((0, 1), (5, 6), 9, 2)


def test_certain_chain_rejected_at_second():
    # the target wants 5 then 7: node 1 (6) has probability 0 -> accepted (5,), bonus 7
    res = verify_sampling(DraftTree.chain([5, 6]), one_hot_rows([5, 7, 9]), T1, gen())
    assert (res.accepted_tokens, res.bonus_token) == ((5,), 7)


def test_empty_tree_samples_row_zero():
    # an empty tree is plain sampling from row 0
    res = verify_sampling(DraftTree.empty(), one_hot_rows([3]), T1, gen())
    assert (res.accepted_nodes, res.bonus_token, res.num_drafted) == ((), 3, 0)


def test_second_sibling_accepted_after_first_rejected():
    # root children 4 (probability 0) and 8 (probability 1): the second sibling is accepted
    # and its own child 2 too; then the bonus comes from the row after node 2
    tree = DraftTree(tokens=torch.tensor([4, 8, 2]), parents=torch.tensor([-1, -1, 1]), depth=torch.tensor([0, 0, 1]))
    rows = one_hot_rows([8, 0, 2, 6])  # row 0 root, 1 after node 0, 2 after node 1, 3 after node 2
    res = verify_sampling(tree, rows, T1, gen())
    assert (res.accepted_nodes, res.accepted_tokens, res.bonus_token) == ((1, 2), (8, 2), 6)


def test_filtered_token_never_accepted_nor_sampled():
    # top_k=1 makes sampling greedy in effect: a draft of the second-best token is never
    # accepted and the bonus is always the best token
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0]])
    params = SamplingParams(temperature=1.0, top_k=1)
    for seed in range(20):
        res = verify_sampling(DraftTree.chain([2]), torch.cat([logits, logits]), params, gen(seed))
        assert res.accepted_tokens == () and res.bonus_token == 1


def test_rejected_token_not_resampled():
    # two tokens of equal probability; the draft proposes 0: when it is rejected, the
    # residual holds only token 1, so the bonus after a rejection is always 1
    logits = torch.tensor([[0.0, 0.0, NEG], [0.0, 0.0, NEG]])
    outcomes = set()
    for seed in range(40):
        res = verify_sampling(DraftTree.chain([0]), logits, T1, gen(seed))
        outcomes.add(res.tokens[:1] if res.accepted_tokens else (res.bonus_token,))
        if not res.accepted_tokens:
            assert res.bonus_token == 1
    assert outcomes == {(0,), (1,)}  # both happen over 40 seeds


def test_draft_probs_accepts_when_target_dominates():
    # target(x) >= draft(x): min(1, target/draft) = 1, accepted without a random draw
    logits = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    q = torch.tensor([[0.5, 0.2, 0.2, 0.1]])
    tree = DraftTree(torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]), draft_probs=q)
    for seed in range(10):
        assert verify_sampling(tree, logits, T1, gen(seed)).accepted_tokens == (0,)


def test_draft_probs_residual_excludes_overdrafted_tokens():
    # target [0.5, 0.5, 0], draft [1, 0, 0] proposing 0: accept w.p. 0.5; on rejection the
    # residual max(0, target - draft) is [0, 0.5, 0] -> bonus 1
    logits = torch.log(torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]]))
    tree = DraftTree(torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]), draft_probs=torch.tensor([[1.0, 0, 0]]))
    seen = set()
    for seed in range(40):
        res = verify_sampling(tree, logits, T1, gen(seed))
        if not res.accepted_tokens:
            assert res.bonus_token == 1
        seen.add(res.num_accepted)
    assert seen == {0, 1}


def test_sampled_draft_of_filtered_token_still_updates_residual():
    # regression (found by tests/stat): a sampled draft token that top-k removed from the
    # target (target 0, draft 0.5) is rejected, and the residual must still become
    # max(0, target - draft) = [0, 0, 0.5, 0]: the bonus is always 2, never 1
    logits = torch.log(torch.tensor([[1e-9, 0.5, 0.5, 1e-9], [0.25, 0.25, 0.25, 0.25]]))
    params = SamplingParams(temperature=1.0, top_k=2)
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    tree = DraftTree(torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]), draft_probs=q)
    for seed in range(30):
        res = verify_sampling(tree, logits, params, gen(seed))
        assert res.accepted_tokens == () and res.bonus_token == 2


def test_one_hot_draft_probs_equal_deterministic_rule():
    # a deterministic draft is a draft drawn from a point mass: with one-hot rows the
    # probability rule makes the same decisions from the same random numbers
    g = gen(3)
    vocab = 6
    logits = torch.randn(5, vocab, generator=g)
    tree = DraftTree(
        tokens=torch.tensor([1, 2, 3, 4]), parents=torch.tensor([-1, -1, 1, 1]), depth=torch.tensor([0, 0, 1, 1])
    )
    one_hot = torch.nn.functional.one_hot(tree.tokens, vocab).float()
    tree_q = DraftTree(tree.tokens, tree.parents, tree.depth, draft_probs=one_hot)
    for seed in range(50):
        a = verify_sampling(tree, logits, T1, gen(seed))
        b = verify_sampling(tree_q, logits, T1, gen(seed))
        assert a == b


def test_same_generator_state_same_result():
    # the generator is the only source of randomness: same seed, same result
    logits = torch.randn(4, 8, generator=gen(4))
    tree = DraftTree.chain([1, 2, 3])
    params = SamplingParams(temperature=0.7, top_p=0.9)
    for seed in range(10):
        assert verify_sampling(tree, logits, params, gen(seed)) == verify_sampling(tree, logits, params, gen(seed))


def test_no_global_rng_used():
    # verification leaves torch's global generator untouched
    state = torch.get_rng_state()
    logits = torch.randn(4, 8, generator=gen(5))
    for seed in range(10):
        verify_sampling(DraftTree.chain([1, 2, 3]), logits, T1, gen(seed))
    assert torch.equal(state, torch.get_rng_state())


def test_sample_from_skips_zero_probability():
    # inversion never lands on a zero-probability token, normalised or not
    probs = torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0])
    drawn = {sample_from(probs, gen(s)) for s in range(200)}
    assert drawn == {1, 3}
