"""Distribution test of constrained sampling through ``ragspec.Engine``: under a regular
expression, with drafts that are right, wrong, or outside the grammar (pruned before
verification) and the grammar's forced tokens, the first 3 generated tokens over many
seeded generations must follow the target's distribution renormalised over the tokens
the grammar allows at each position (then temperature and top-k, as plain sampling
applies them), computed here from the scripted target's logits and llguidance's own mask
(sampling_fit.py: chi-square, false-alarm rate 1e-4)."""

from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

import numpy as np
import pytest
import torch
from sampling_fit import exact_first_tokens, goodness_of_fit, hf_processed_probs

from ragspec import DraftTree, Engine, PolicyConfig
from ragspec.config import SamplingParams
from ragspec.structured import ResponseFormat
from ragspec_testing import FakeTarget, make_json_tokenizer, make_tree

EOS = 2
NUM_TOKENS = 3
NUM_SAMPLES = 6_000
FORMAT = ResponseFormat.regex(r"[abc]:[a-e]-?[abx]")  # ":" is forced: a draft of the grammar


class Drafts:
    """Per step, one of: the two likeliest allowed tokens as a chain, a tree whose first
    root child leaves the grammar (pruned) beside a wrong and a likely one, or nothing."""

    name = "scripted"
    isolation = "own"

    def __init__(self, likely, seed: int) -> None:
        self.likely = likely  # context -> tokens by target probability, allowed first
        self.rng = random.Random(seed)

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _Session(self, tuple(prompt_ids))


class _Session:
    def __init__(self, owner: Drafts, ctx: tuple) -> None:
        self.o, self.ctx = owner, ctx

    def extend(self, token_ids: Sequence[int]) -> None:
        self.ctx += tuple(int(t) for t in token_ids)

    def observe(self, tree, result) -> None:
        pass

    def propose(self, max_tokens: int) -> DraftTree:
        kind = self.o.rng.randrange(3)
        ranked = self.o.likely(self.ctx)
        if kind == 0:
            first = ranked[0]
            return DraftTree.chain([first, self.o.likely(self.ctx + (first,))[0]]).truncate(max_tokens)
        if kind == 1:  # outside the grammar, a wrong one, the likeliest with a child
            outside, wrong, best = ranked[-1], ranked[2], ranked[0]
            nxt = self.o.likely(self.ctx + (best,))[0]
            return make_tree([outside, wrong, best, nxt], [-1, -1, -1, 2]).truncate(max_tokens)
        return DraftTree.empty()


def test_constrained_sampling_keeps_the_renormalised_distribution():
    tok = make_json_tokenizer()
    target = FakeTarget(vocab_size=len(tok) + 3, eos_token_id=EOS)
    engine = Engine(target, tok, policy=PolicyConfig(max_draft_tokens=6, adaptive=False), eos_token_ids=[EOS])
    grammar = engine.grammars.compile(FORMAT)
    params = SamplingParams(temperature=0.8, top_k=3)
    prompt = tuple(tok.encode("pick:", add_special_tokens=False))
    n = len(prompt)

    def allowed(ctx: tuple) -> torch.Tensor:
        import llguidance.numpy

        m = grammar.matcher()
        assert m.consume_tokens(list(ctx[n:])) if len(ctx) > n else True
        if m.is_stopped():
            out = torch.zeros(target.vocab_size, dtype=torch.bool)
            out[EOS] = True
            return out
        words = llguidance.numpy.allocate_token_bitmask(1, target.vocab_size)
        llguidance.numpy.fill_next_token_bitmask(m, words)
        return torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little")[: target.vocab_size]).bool()

    probs: dict[tuple, torch.Tensor] = {}

    def law(ctx: tuple) -> torch.Tensor:
        if ctx not in probs:
            logits = target.logits_after(list(ctx)).clone()
            logits[~allowed(ctx)] = float("-inf")
            probs[ctx] = hf_processed_probs(logits[None], params)[0]
        return probs[ctx]

    def likely(ctx: tuple) -> list[int]:
        p = law(ctx)
        return sorted(range(target.vocab_size), key=lambda t: (-float(p[t]), t))

    engine = engine.with_drafter(Drafts(likely, seed=3))
    counts: Counter = Counter()
    for i in range(NUM_SAMPLES):
        out: list[int] = []
        stream = engine.stream(
            list(prompt),
            max_new_tokens=6,
            temperature=params.temperature,
            top_k=params.top_k,
            seed=1_000 + i,
            response_format=FORMAT,
            chat=False,
        )
        for chunk in stream:
            out.extend(chunk.token_ids)
            if len(out) >= NUM_TOKENS:
                stream.close()
                break
        counts[tuple(out[:NUM_TOKENS])] += 1
    exact = exact_first_tokens(law, prompt, NUM_TOKENS)
    fit = goodness_of_fit(counts, exact)
    assert fit.ok, str(fit)


pytestmark = pytest.mark.slow
