"""Distribution tests of the sampling verifier, driven directly (no neural network).

A toy "target model" maps a context (tuple of token ids, vocabulary of 8) to fixed random
logits; a toy draft model to other logits. A loop of draft -> verify -> commit generates
the first 3 tokens; their joint distribution over 20k runs must match the exact law of
plain sampling, the product of the processed conditionals computed with transformers' own
warpers (sampling_fit.py; chi-square, false-alarm rate 1e-4 per check). Drafts are right
sometimes and wrong sometimes: oracle, wrong, mixed trees of several branches, and sampled
drafts with probabilities (chains and trees, siblings drawn with and without
replacement). Deliberately broken verifiers and drafts that break the draft-probability
contract must FAIL the same check, so the check can fail.
"""

from __future__ import annotations

import random
from bisect import bisect
from collections import Counter
from functools import lru_cache
from itertools import accumulate
from typing import Callable, Optional

import pytest
import torch
from sampling_fit import exact_first_tokens, goodness_of_fit, hf_processed_probs

from ragspec.config import SamplingParams
from ragspec.sampling import process_logits, sample_from, verify_sampling
from ragspec.types import DraftTree, VerifyResult
from ragspec_testing import make_tree

V = 8
PROMPT = (1, 2)
NUM_TOKENS = 3
NUM_SAMPLES = 20_000


# ---------------------------------------------------------------- toy models
def _seed_of(ctx: tuple, salt: int) -> int:
    h = salt
    for t in ctx:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h


@lru_cache(maxsize=None)
def target_logits(ctx: tuple) -> torch.Tensor:
    """float32 [V]: the toy target's logits after ``ctx``."""
    return torch.randn(V, generator=torch.Generator().manual_seed(_seed_of(ctx, 17))) * 2.0


@lru_cache(maxsize=None)
def draft_dist(ctx: tuple) -> torch.Tensor:
    """float32 [V]: the toy draft model's distribution after ``ctx`` (close to the target's
    logits, with noise: its samples are sometimes right, sometimes wrong)."""
    noise = torch.randn(V, generator=torch.Generator().manual_seed(_seed_of(ctx, 29)))
    return torch.softmax(0.8 * target_logits(ctx) + 1.5 * noise, dim=-1)


@lru_cache(maxsize=None)
def target_probs(ctx: tuple, params: SamplingParams) -> torch.Tensor:
    """float64 [V]: the processed target distribution (transformers' warpers)."""
    return hf_processed_probs(target_logits(ctx)[None], params)[0]


# ---------------------------------------------------------------- drafters
Drafter = Callable[[tuple, SamplingParams, random.Random], DraftTree]
# Drafters draw with their own Python generator (cheap: no tensor op per draw); the
# verifier's randomness is the torch.Generator under test.


def draw(weights: list[float], dg: random.Random) -> int:
    """One token drawn in proportion to ``weights`` (need not be normalised)."""
    cum = list(accumulate(weights))
    return min(bisect(cum, dg.random() * cum[-1]), len(cum) - 1)


@lru_cache(maxsize=None)
def draft_list(ctx: tuple) -> list[float]:
    return draft_dist(ctx).double().tolist()


@lru_cache(maxsize=None)
def target_list(ctx: tuple, params: SamplingParams) -> list[float]:
    return target_probs(ctx, params).tolist()


def deterministic(fn: Callable[[tuple, SamplingParams], DraftTree]) -> Drafter:
    """A drafter that depends only on (context, params): its trees are cached."""
    cached = lru_cache(maxsize=None)(fn)

    def drafter(ctx: tuple, params: SamplingParams, dg: random.Random) -> DraftTree:
        return cached(ctx, params)

    drafter.__name__, drafter.__doc__ = fn.__name__, fn.__doc__
    return drafter


@lru_cache(maxsize=None)
def ranked(ctx: tuple, params: SamplingParams) -> list[int]:
    """Tokens by decreasing processed target probability (ties by id)."""
    p = target_list(ctx, params)
    return sorted(range(V), key=lambda t: (-p[t], t))


@deterministic
def oracle_chain(ctx, params):
    """The most likely 3-token continuation: right often, never always."""
    toks, c = [], ctx
    for _ in range(3):
        t = ranked(c, params)[0]
        toks.append(t)
        c = c + (t,)
    return DraftTree.chain(toks)


@deterministic
def wrong_chain(ctx, params):
    """The least likely tokens (probability 0 under top-k): almost always rejected."""
    toks, c = [], ctx
    for _ in range(3):
        t = ranked(c, params)[-1]
        toks.append(t)
        c = c + (t,)
    return DraftTree.chain(toks)


@deterministic
def mixed_tree(ctx, params):
    """Several branches: best, worst, second best and a duplicate of the best at the root;
    best and second continue."""
    r = ranked(ctx, params)
    a, b, c = r[0], r[-1], r[1]
    ra, rc = ranked(ctx + (a,), params), ranked(ctx + (c,), params)
    aa = ra[0]
    return make_tree(
        [a, b, c, a, aa, ra[1], rc[0], ranked(ctx + (a, aa), params)[0]],
        [-1, -1, -1, -1, 0, 0, 2, 4],
    )


def draft_chain(ctx, params, dg):
    """Leviathan et al.: 3 tokens drawn from the draft model, with their distributions."""
    toks, rows, c = [], [], ctx
    for _ in range(3):
        t = draw(draft_list(c), dg)
        toks.append(t)
        rows.append(draft_list(c))
        c = c + (t,)
    return make_tree(toks, [-1, 0, 1], rows)


def _grow(spec: list[tuple[int, str]], ctx: tuple, dg: random.Random, merge_duplicates: bool = False) -> DraftTree:
    """Grow a sampled tree in drawing order. ``spec``: (parent, how) per node, how in
    "iid" (drawn from the draft distribution after the parent: with replacement among
    siblings), "wor" (without replacement: row = draft minus earlier "wor" siblings,
    renormalised), "wor_declared_iid" (drawn without replacement but its row claims the
    plain draft distribution: breaks the contract), "best" (deterministic, one-hot row).
    ``merge_duplicates`` merges equal siblings into one node (breaks the contract)."""
    toks: list[int] = []
    parents: list[int] = []
    rows: list[list[float]] = []
    ctxs: list[tuple] = []
    index: list[Optional[int]] = []  # spec position -> node (None when merged away)
    for parent_spec, how in spec:
        parent = -1 if parent_spec < 0 else index[parent_spec]
        if parent is None:
            index.append(None)
            continue
        c = ctx if parent < 0 else ctxs[parent]
        q = draft_list(c)
        siblings = [i for i, p in enumerate(parents) if p == parent]
        if how == "best":
            t = max(range(V), key=lambda v: q[v])
            row = [0.0] * V
            row[t] = 1.0
        elif how == "iid":
            t = draw(q, dg)
            row = q
        else:
            qq = list(q)
            for s in siblings:
                qq[toks[s]] = 0.0
            total = sum(qq)
            qq = [w / total for w in qq]
            t = draw(qq, dg)
            row = qq if how == "wor" else q
        if merge_duplicates and any(toks[s] == t for s in siblings):
            index.append(next(s for s in siblings if toks[s] == t))
            continue
        index.append(len(toks))
        toks.append(t)
        parents.append(parent)
        rows.append(row)
        ctxs.append(c + (t,))
    return make_tree(toks, parents, rows)


def draft_tree_iid(ctx, params, dg):
    """SpecInfer / EAGLE sampled tree: 3 siblings drawn i.i.d. (duplicates kept as
    separate nodes), each with one child, the first child with 2 i.i.d. children."""
    spec = [(-1, "iid"), (-1, "iid"), (-1, "iid"), (0, "iid"), (1, "iid"), (2, "iid"), (3, "iid"), (3, "iid")]
    return _grow(spec, ctx, dg)


def draft_tree_wor(ctx, params, dg):
    """Siblings drawn without replacement, rows renormalised (Jeon et al. 2024)."""
    return _grow([(-1, "wor"), (-1, "wor"), (-1, "wor"), (0, "iid"), (1, "wor"), (1, "wor"), (3, "iid")], ctx, dg)


def draft_tree_mixed(ctx, params, dg):
    """A deterministic sibling (one-hot row) before two sampled ones."""
    return _grow([(-1, "best"), (-1, "iid"), (-1, "iid"), (0, "iid"), (0, "best"), (1, "iid")], ctx, dg)


def draft_tree_wor_declared_iid(ctx, params, dg):
    """Contract broken: siblings drawn without replacement, rows claim the plain draft."""
    return _grow([(-1, "wor_declared_iid")] * 3, ctx, dg)


def draft_tree_iid_merged(ctx, params, dg):
    """Contract broken: siblings drawn i.i.d., duplicates merged into one node."""
    return _grow([(-1, "iid")] * 3, ctx, dg, merge_duplicates=True)


# ---------------------------------------------------------------- verifiers
Verify = Callable[[DraftTree, torch.Tensor, SamplingParams, torch.Generator], VerifyResult]


def accept_first_child(tree, logits, params, g):
    """Broken: always accepts the first child, bonus drawn from the target at the end."""
    node, row, acc = -1, 0, []
    parents = tree.parents.tolist()
    while True:
        kids = [i for i, p in enumerate(parents) if p == node]
        if not kids:
            bonus = sample_from(process_logits(logits[row : row + 1], params)[0], g)
            return VerifyResult(tuple(acc), tuple(tree.tokens[acc].tolist()), bonus, tree.num_nodes)
        node, row = kids[0], kids[0] + 1
        acc.append(node)


def no_residual(tree, logits, params, g):
    """Broken (a classic bug): chains only; after a rejection, the bonus token is drawn from
    the full target distribution instead of the residual."""
    acc: list[int] = []
    for i, x in enumerate(tree.tokens.tolist()):
        p = process_logits(logits[i : i + 1], params)[0].double()
        if float(torch.rand(1, generator=g, dtype=torch.float64)) < float(p[x]):
            acc.append(i)
            continue
        return VerifyResult(tuple(acc), tuple(tree.tokens[acc].tolist()), sample_from(p, g), tree.num_nodes)
    bonus = sample_from(process_logits(logits[-1:], params)[0], g)
    return VerifyResult(tuple(acc), tuple(tree.tokens.tolist()), bonus, tree.num_nodes)


# ---------------------------------------------------------------- the loop
def node_contexts(tree: DraftTree, ctx: tuple) -> list[tuple]:
    """Context after each node: ctx + the tokens on its path."""
    out: list[tuple] = []
    toks = tree.tokens.tolist()
    for i, p in enumerate(tree.parents.tolist()):
        out.append((ctx if p < 0 else out[p]) + (toks[i],))
    return out


def speculative_counts(
    drafter: Drafter, verify: Verify, params: SamplingParams, seed: int, n: int = NUM_SAMPLES
) -> Counter:
    """Counts of the first NUM_TOKENS tokens over n runs of draft -> verify -> commit."""
    g = torch.Generator().manual_seed(seed)
    dg = random.Random(seed + 1)
    counts: Counter = Counter()
    for _ in range(n):
        ctx, out = PROMPT, ()
        while len(out) < NUM_TOKENS:
            tree = drafter(ctx, params, dg)
            rows = torch.stack([target_logits(ctx)] + [target_logits(c) for c in node_contexts(tree, ctx)])  # [N+1, V]
            res = verify(tree, rows, params, g)
            out += res.tokens
            ctx += res.tokens
        counts[out[:NUM_TOKENS]] += 1
    return counts


def exact(params: SamplingParams) -> dict:
    return exact_first_tokens(lambda c: target_probs(c, params), PROMPT, NUM_TOKENS)


P07 = SamplingParams(temperature=0.7)
P10 = SamplingParams(temperature=1.0)
P07_K = SamplingParams(temperature=0.7, top_k=4)
P10_P = SamplingParams(temperature=1.0, top_p=0.8)
P07_KP = SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
P10_KP = SamplingParams(temperature=1.0, top_k=6, top_p=0.95)


@pytest.mark.parametrize(
    "drafter, params",
    [
        (oracle_chain, P07),
        (wrong_chain, P07_K),
        (mixed_tree, P10_P),
        (draft_chain, P07_KP),
        (draft_tree_iid, P10),
        (draft_tree_wor, P07_K),
        (draft_tree_mixed, P10_KP),
    ],
    ids=lambda v: v.__name__ if callable(v) else f"T{v.temperature}-k{v.top_k}-p{v.top_p}",
)
def test_first_tokens_match_plain_sampling(drafter, params):
    # lossless: the first 3 tokens of speculative sampling follow the exact law of plain
    # sampling (temperature, top-k, top-p), whatever the drafts
    counts = speculative_counts(drafter, verify_sampling, params, seed=1234)
    fit = goodness_of_fit(counts, exact(params))
    assert fit.ok, f"{drafter.__name__} {params}: {fit}"


@pytest.mark.parametrize(
    "drafter, verify, params",
    [
        (mixed_tree, accept_first_child, P10),  # favours drafts
        (oracle_chain, no_residual, P10),  # re-draws the rejected token
        (draft_tree_wor_declared_iid, verify_sampling, P10),  # without replacement, rows of with
        (draft_tree_iid_merged, verify_sampling, P10),  # with replacement, duplicates merged
    ],
    ids=["accept-first-child", "no-residual", "wor-declared-iid", "iid-merged"],
)
def test_broken_verification_fails_the_check(drafter, verify, params):
    # the check has power: a verifier that is not lossless, or draft probabilities that
    # break the contract of ragspec.sampling, fail the very same check
    counts = speculative_counts(drafter, verify, params, seed=1234)
    fit = goodness_of_fit(counts, exact(params))
    assert not fit.ok, f"the check missed a lossy verification: {fit}"
