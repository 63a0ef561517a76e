"""Distribution test of sampling with EAGLE draft trees, through the whole engine.

A tiny random Llama with a 12-token vocabulary is the target; a randomly initialised EAGLE
head drafts top-k trees (right sometimes, wrong sometimes: with 3 children out of 12
tokens, and deeper levels). ``Engine.generate`` samples 5 tokens per run (so that the first
step verifies a 3-node tree: siblings and a deeper level) and the joint law of the first 3 tokens over many
seeded runs must match the exact law of plain sampling, computed from the target's logits
with transformers' own warpers (sampling_fit.py; chi-square, false-alarm rate 1e-4).

EAGLE trees carry no ``draft_probs`` (deterministic top-k children, see ragspec.eagle):
the negative control declares them as drawn from a uniform distribution, which they were
not, and the same check must fail.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from sampling_fit import exact_first_tokens, goodness_of_fit, hf_processed_probs

from ragspec.backend.hf import HFTarget
from ragspec.config import PolicyConfig, SamplingParams
from ragspec.drafters import SessionCapability
from ragspec.eagle import EagleDrafter, EagleHead, EagleTreeConfig
from ragspec.engine import Engine
from ragspec.types import DraftTree

V = 12
PROMPT = [3, 7, 1, 9, 4]
NUM_TOKENS = 3
NUM_RUNS = 2000
NEGATIVE_RUNS = 800


def _tiny_llama(seed: int = 3):
    """A tiny random Llama over V tokens (hidden 32, 2 layers), as tests/conftest.py's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def setup(char_tokenizer):
    model = _tiny_llama()
    target = HFTarget(model)
    torch.manual_seed(0)
    head = EagleHead.from_target(target).eval()
    return model, target, head, char_tokenizer


def _exact(model, params: SamplingParams) -> dict:
    cache: dict[tuple, torch.Tensor] = {}

    def probs(ctx: tuple) -> torch.Tensor:
        if ctx not in cache:
            with torch.inference_mode():
                logits = model(torch.tensor([list(ctx)])).logits[0, -1].float()
            cache[ctx] = hf_processed_probs(logits[None], params)[0]
        return cache[ctx]

    return exact_first_tokens(probs, tuple(PROMPT), NUM_TOKENS)


class _UniformClaim:
    """Negative control: the head's trees, declared as sampled from a uniform draft."""

    name = "eagle-broken"

    def __init__(self, inner):
        self.inner = inner

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _UniformSession(self.inner.start_request(prompt_ids, documents, eos_token_ids=eos_token_ids))


class _UniformSession:
    capabilities = frozenset({SessionCapability.HIDDEN_STATES})

    def __init__(self, inner):
        self.inner = inner

    def extend(self, ids):
        self.inner.extend(ids)

    def extend_hidden(self, hidden):
        self.inner.extend_hidden(hidden)

    def observe(self, tree, res):
        self.inner.observe(tree, res)

    def propose(self, n):
        t = self.inner.propose(n)
        if not t.num_nodes:
            return t
        q = torch.full((t.num_nodes, V), 1.0 / V)
        return DraftTree(t.tokens, t.parents, t.depth, t.sources, t.scores, q, t.match_len)


def _sample(engine, params: SamplingParams, runs: int = NUM_RUNS) -> tuple[Counter, int]:
    """Counts of the first NUM_TOKENS tokens over ``runs`` seeded generations of 5 tokens
    (the first verified tree then has 3 nodes: siblings and a deeper level)."""
    counts: Counter = Counter()
    accepted = 0
    for seed in range(runs):
        out = engine.generate(
            PROMPT,
            max_new_tokens=5,
            chat=False,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
        )
        counts[tuple(out.token_ids[:NUM_TOKENS])] += 1
        accepted += out.stats.num_accepted_tokens
    return counts, accepted


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["t1", "t0.7-k6-p0.9"],
)
def test_sampling_with_eagle_trees_matches_target(setup, params):
    model, target, head, tok = setup
    drafter = EagleDrafter(head, target, EagleTreeConfig(depth=3, top_k=3, min_path_prob=0.0))
    engine = Engine(target, tok, drafter=drafter, policy=PolicyConfig(max_draft_tokens=6, adaptive=False))
    counts, accepted = _sample(engine, params)
    fit = goodness_of_fit(counts, _exact(model, params))
    assert fit.ok, str(fit)
    assert accepted > NUM_RUNS // 10, "drafts were hardly ever accepted: the test would be vacuous"


@pytest.mark.slow
def test_top_k_children_declared_as_sampled_fail(setup):
    # the draft-probability contract matters: the same trees with a false q are lossy
    model, target, head, tok = setup
    params = SamplingParams(temperature=1.0)
    drafter = _UniformClaim(EagleDrafter(head, target, EagleTreeConfig(depth=3, top_k=3, min_path_prob=0.0)))
    engine = Engine(target, tok, drafter=drafter, policy=PolicyConfig(max_draft_tokens=6, adaptive=False))
    counts, _ = _sample(engine, params, NEGATIVE_RUNS)
    fit = goodness_of_fit(counts, _exact(model, params))
    assert not fit.ok, f"a lossy verification passed: {fit}"
