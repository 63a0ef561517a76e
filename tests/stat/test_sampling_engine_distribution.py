"""Distribution test through ``ragspec.Engine``: a tiny random Llama (vocabulary of 12),
the real HFTarget (tree attention, KV-cache rollback after rejections) and a scripted
drafter whose drafts are sometimes right and sometimes wrong, deterministic or sampled with
their draft probabilities. The first 3 generated tokens over 20k seeded generations must
follow the exact law of plain sampling, computed from full (cache-free) forwards with
transformers' own warpers (sampling_fit.py; chi-square, false-alarm rate 1e-4).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Sequence

import pytest
import torch
from sampling_fit import exact_first_tokens, goodness_of_fit, hf_processed_probs

from ragspec import DraftTree, Engine, PolicyConfig
from ragspec.backend.hf import HFTarget
from ragspec.config import SamplingParams

V = 12
PROMPT = (1, 5, 7)
NUM_TOKENS = 3
NUM_SAMPLES = 20_000


def make_model():
    """1-layer Llama over 12 tokens; an untied output layer of std 0.5 gives logits of
    std ~2 (the default init gives near-uniform distributions, a weak test)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    return model


class ScriptedDrafter:
    """Per step, one of: the most likely 3-token chain (often right), a tree of siblings
    [best, least likely, second] with children, or a chain of 3 tokens sampled from a
    fixed noisy draft model with its draft probabilities. Drawn with its own Python RNG."""

    name = "scripted"

    def __init__(self, probs_fn, draft_fn, seed: int) -> None:
        self.probs_fn = probs_fn  # ctx -> processed target probs (python list)
        self.draft_fn = draft_fn  # ctx -> draft distribution (python list)
        self.rng = random.Random(seed)

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _Session(self, tuple(prompt_ids))


class _Session:
    def __init__(self, drafter: ScriptedDrafter, ctx: tuple) -> None:
        self.d = drafter
        self.ctx = ctx

    def extend(self, token_ids: Sequence[int]) -> None:
        self.ctx += tuple(int(t) for t in token_ids)

    def observe(self, tree, result) -> None:
        pass

    def _ranked(self, ctx: tuple) -> list[int]:
        p = self.d.probs_fn(ctx)
        return sorted(range(V), key=lambda t: (-p[t], t))

    def propose(self, max_tokens: int) -> DraftTree:
        kind = self.d.rng.randrange(3)
        c = self.ctx
        if kind == 0:  # oracle chain
            toks = []
            for _ in range(3):
                toks.append(self._ranked(c)[0])
                c += (toks[-1],)
            return DraftTree.chain(toks).truncate(max_tokens)
        if kind == 1:  # mixed tree: best, worst, second at the root; best and second continue
            r = self._ranked(c)
            a, b, s = r[0], r[-1], r[1]
            tree = DraftTree(
                tokens=torch.tensor([a, b, s, self._ranked(c + (a,))[0], self._ranked(c + (s,))[0]]),
                parents=torch.tensor([-1, -1, -1, 0, 2]),
                depth=torch.tensor([0, 0, 0, 1, 1]),
            )
            return tree.truncate(max_tokens)
        toks, rows = [], []  # sampled chain with draft probabilities
        for _ in range(3):
            q = self.d.draft_fn(c)
            toks.append(self.d.rng.choices(range(V), weights=q)[0])
            rows.append(q)
            c += (toks[-1],)
        n = len(toks)
        tree = DraftTree(
            tokens=torch.tensor(toks),
            parents=torch.arange(-1, n - 1),
            depth=torch.arange(n),
            draft_probs=torch.tensor(rows, dtype=torch.float32),
        )
        return tree.truncate(max_tokens)


@pytest.fixture(scope="module")
def setup(char_tokenizer):
    model = make_model()
    cache_logits: dict[tuple, torch.Tensor] = {}

    def logits(ctx: tuple) -> torch.Tensor:
        """Reference logits after ctx: a full forward, no KV cache, no tree."""
        if ctx not in cache_logits:
            with torch.inference_mode():
                cache_logits[ctx] = model(torch.tensor([ctx])).logits[0, -1].float()
        return cache_logits[ctx]

    return model, logits, char_tokenizer


def _scripted_engine(model, tokenizer, logits, probs_list, seed: int) -> Engine:
    """The engine over ``model`` drafting with :class:`ScriptedDrafter` (``probs_list``: the
    processed target law; its sampled chains from a fixed noisy draft model)."""

    def draft_list(ctx: tuple) -> list[float]:
        """A fixed noisy draft model: its samples are sometimes right, sometimes wrong."""
        g = torch.Generator().manual_seed(sum(t * 131**i for i, t in enumerate(ctx)) % 2_147_483_647)
        return torch.softmax(0.7 * logits(ctx) + 1.5 * torch.randn(V, generator=g), -1).tolist()

    return Engine(
        HFTarget(model),
        tokenizer,
        drafter=ScriptedDrafter(probs_list, draft_list, seed=seed),
        policy=PolicyConfig(max_draft_tokens=6, adaptive=False),
    )


def first_tokens(engine: Engine, params: SamplingParams, seed: int, **fields) -> tuple:
    """The first NUM_TOKENS generated tokens (the generation is closed after the step that
    produced them); ``fields``: more request parameters (penalties)."""
    out: list[int] = []
    stream = engine.stream(
        list(PROMPT),
        max_new_tokens=8,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=seed,
        **fields,
    )
    for chunk in stream:
        out.extend(chunk.token_ids)
        if len(out) >= NUM_TOKENS:
            stream.close()
            break
    return tuple(out[:NUM_TOKENS])


def test_engine_first_tokens_match_plain_sampling(setup):
    # lossless end to end: prefill sampling, tree verification with the real target and
    # KV rollback, deterministic and sampled drafts, temperature 0.7 with top-k and top-p
    model, logits, tokenizer = setup
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9)
    probs = {}

    def probs_list(ctx: tuple) -> list[float]:
        if ctx not in probs:
            probs[ctx] = hf_processed_probs(logits(ctx)[None], params)[0].tolist()
        return probs[ctx]

    engine = _scripted_engine(model, tokenizer, logits, probs_list, seed=7)
    counts = Counter(first_tokens(engine, params, seed=10_000 + i) for i in range(NUM_SAMPLES))
    exact = exact_first_tokens(lambda c: torch.tensor(probs_list(c), dtype=torch.float64), PROMPT, NUM_TOKENS)
    fit = goodness_of_fit(counts, exact)
    assert fit.ok, str(fit)


@pytest.mark.slow
@pytest.mark.parametrize(
    "params, penalty",
    [
        (SamplingParams(temperature=0.9, top_k=10), 1.2),  # frequency penalty, on each row's own path
        (SamplingParams(temperature=1.0, min_p=0.15), 0.0),  # min-p
    ],
    ids=["frequency_penalty", "min_p"],
)
def test_engine_first_tokens_match_plain_processed_sampling(setup, params, penalty):
    # the penalty of a tree row counts the tokens of its own path (committed + ancestors),
    # never its siblings': the law is plain sampling's with the penalty applied per position
    model, logits, tokenizer = setup
    probs = {}

    def probs_list(ctx: tuple) -> list[float]:
        if ctx not in probs:
            row = logits(ctx).clone()
            for t in set(ctx[len(PROMPT) :]):  # OpenAI's frequency penalty over the output
                row[t] -= penalty * ctx[len(PROMPT) :].count(t)
            probs[ctx] = hf_processed_probs(row[None], params)[0].tolist()
        return probs[ctx]

    engine = _scripted_engine(model, tokenizer, logits, probs_list, seed=11)
    fields = {"frequency_penalty": penalty} if penalty else {}
    counts = Counter(first_tokens(engine, params, seed=20_000 + i, **fields) for i in range(NUM_SAMPLES))
    exact = exact_first_tokens(lambda c: torch.tensor(probs_list(c), dtype=torch.float64), PROMPT, NUM_TOKENS)
    fit = goodness_of_fit(counts, exact)
    assert fit.ok, str(fit)
