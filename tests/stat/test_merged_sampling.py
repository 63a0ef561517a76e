"""Distribution tests of sampling with merged multi-source draft trees
(ragspec.drafters.merged), through the whole engine.

A tiny random Llama with a 12-token vocabulary is the target. Each step's tree merges
prompt lookup's deterministic copies, a head's nodes and prompt lookup's copies hung under
the head's tokens (``prompt@head``), pruned by the acceptance model's path estimates: a
selection that looks at the drafted tokens, so the merged tree must be (and is) verified
as deterministic. Two heads:

* the real EAGLE head (random weights): deterministic top-k children;
* a scripted head that *samples* its children (three i.i.d. draws from a noisy draft
  model, duplicates included) and declares their draft probabilities: merged with
  deterministic lookup nodes (and duplicates folded into one node, siblings reordered and
  pruned by score), those probabilities no longer describe how the kept nodes were drawn.
  The merged tree drops them and is verified by the deterministic rule, lossless for any
  choice of nodes. The negative control keeps them (one-hot rows for the lookup nodes,
  the head's rows for its own): the same check must then fail.

The joint law of the first 3 generated tokens over many seeded generations must match the
exact law of plain sampling, computed from full forwards with transformers' own warpers
(sampling_fit.py; chi-square, false-alarm rate 1e-4).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from sampling_fit import exact_first_tokens, goodness_of_fit, hf_processed_probs

from ragspec.backend.hf import HFTarget
from ragspec.config import PolicyConfig, SamplingParams
from ragspec.drafters import MergedDrafter, PromptLookupDrafter
from ragspec.eagle import EagleDrafter, EagleHead, EagleTreeConfig
from ragspec.engine import Engine
from ragspec.policy import AcceptanceModel
from ragspec.types import DraftTree
from ragspec_testing import make_tiny_llama

V = 12
PROMPT = [3, 7, 1, 9, 4, 3, 7]  # repeats: prompt lookup has copies to propose
NUM_TOKENS = 3


def _tiny_llama(seed: int = 3):
    """A tiny random Llama over V tokens (hidden 32, 2 layers): test_eagle_sampling's model
    (the same weights: ``make_tiny_llama`` with its seed and initializer range)."""
    return make_tiny_llama(vocab_size=V, seed=seed, eos_token_id=None, std=0.3, max_position_embeddings=256)


@pytest.fixture(scope="module")
def setup(char_tokenizer):
    model = _tiny_llama()
    target = HFTarget(model)
    torch.manual_seed(0)
    head = EagleHead.from_target(target).eval()
    cache: dict[tuple, torch.Tensor] = {}

    def logits(ctx: tuple) -> torch.Tensor:
        """Reference logits after ctx: a full forward, no KV cache, no tree."""
        if ctx not in cache:
            with torch.inference_mode():
                cache[ctx] = model(torch.tensor([list(ctx)])).logits[0, -1].float()
        return cache[ctx]

    return model, target, head, logits, char_tokenizer


def _exact(logits, params: SamplingParams) -> dict:
    return exact_first_tokens(lambda c: hf_processed_probs(logits(c)[None], params)[0], tuple(PROMPT), NUM_TOKENS)


def _sample(engine, params: SamplingParams, runs: int) -> tuple[Counter, Counter, int]:
    """Counts of the first NUM_TOKENS tokens over ``runs`` seeded generations of 8 tokens
    (the first step's budget is then 6 nodes: room for all three kinds), the sources of
    the verified trees, and the accepted draft tokens."""
    counts: Counter = Counter()
    sources: Counter = Counter()
    accepted = 0
    for seed in range(runs):
        out = engine.generate(
            PROMPT,
            max_new_tokens=8,
            chat=False,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            seed=seed,
            return_steps=True,
        )
        counts[tuple(out.token_ids[:NUM_TOKENS])] += 1
        sources.update(s.source for s in out.stats.steps if s.num_drafted)
        accepted += out.stats.num_accepted_tokens
    return counts, sources, accepted


def _mixed(sources: Counter) -> tuple[int, int]:
    """Verified trees holding the head's nodes and lookup nodes at once, and those holding
    copies hung under the head's tokens."""
    mixed = sum(c for s, c in sources.items() if "eagle" in s.split("+") and len(s.split("+")) > 1)
    seeded = sum(c for s, c in sources.items() if "prompt@head" in s.split("+"))
    return mixed, seeded


def _merged(head, **kw) -> MergedDrafter:
    """Prompt lookup and ``head`` merged, the head run every step, and lookup copies
    trusted a priori (prior 0.6 for a first copied token) so that the 8-node trees mix all
    three kinds of nodes."""
    return MergedDrafter(
        PromptLookupDrafter(),
        head,
        head_skip_p=1.0,
        acceptance=lambda: AcceptanceModel(prior_first=0.6),
        calibrate=False,  # (seeded requests use the untimed form anyway)
        **kw,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=6, top_p=0.9)],
    ids=["t1", "t0.7-k6-p0.9"],
)
def test_sampling_with_merged_eagle_and_lookup_trees_matches_target(setup, params):
    model, target, head, logits, tok = setup
    eagle = EagleDrafter(head, target, EagleTreeConfig(depth=2, top_k=3, min_path_prob=0.0))
    engine = Engine(target, tok, drafter=_merged(eagle), policy=PolicyConfig(max_draft_tokens=8, adaptive=False))
    runs = 2000
    counts, sources, accepted = _sample(engine, params, runs)
    fit = goodness_of_fit(counts, _exact(logits, params))
    assert fit.ok, str(fit)
    mixed, seeded = _mixed(sources)
    assert mixed > runs // 2 and seeded > runs // 4, f"few merged trees were verified: {sources.most_common(6)}"
    assert accepted > runs // 10, "drafts were hardly ever accepted: the test would be vacuous"


class _SampledHead:
    """A head that samples: per step three i.i.d. root children from a fixed noisy draft
    model (its own Python RNG), each with one sampled child, with their draft
    probabilities (``declare``: None for the stand-in of a deterministic head)."""

    name = "eagle"

    def __init__(self, draft_fn, seed: int) -> None:
        self.draft_fn = draft_fn  # ctx -> draft distribution (python list of V floats)
        self.rng = random.Random(seed)

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        return _SampledSession(self, tuple(prompt_ids))


class _SampledSession:
    def __init__(self, head: _SampledHead, ctx: tuple) -> None:
        self.h, self.ctx = head, ctx

    def extend(self, token_ids) -> None:
        self.ctx += tuple(int(t) for t in token_ids)

    def observe(self, tree, result) -> None:
        pass

    def propose(self, max_tokens: int) -> DraftTree:
        tokens, parents, rows = [], [], []
        q = self.h.draft_fn(self.ctx)
        for _ in range(3):  # i.i.d. root children, duplicates kept
            tokens.append(self.h.rng.choices(range(V), weights=q)[0])
            parents.append(-1)
            rows.append(q)
        for j in range(3):
            qc = self.h.draft_fn(self.ctx + (tokens[j],))
            tokens.append(self.h.rng.choices(range(V), weights=qc)[0])
            parents.append(j)
            rows.append(qc)
        n = len(tokens)
        return DraftTree(
            tokens=torch.tensor(tokens),
            parents=torch.tensor(parents),
            depth=torch.tensor([0] * 3 + [1] * 3),
            sources=("eagle",) * n,
            scores=torch.tensor([rows[i][tokens[i]] for i in range(n)], dtype=torch.float32),
            draft_probs=torch.tensor(rows, dtype=torch.float32),
        ).truncate(max_tokens)


class _KeepsDraftProbs(MergedDrafter):
    """Negative control: the merge, but the head's draft probabilities are kept on its
    nodes (one-hot rows on the lookup nodes), as if the merged tree were still a sampled
    tree. Lossy: duplicates were folded and nodes reordered and pruned by their scores."""

    def reproducible(self):
        return self  # (seeded requests draft through it: it must not fall back to the plain merge)

    def start_request(self, prompt_ids, documents=(), *, eos_token_ids=()):
        session = super().start_request(prompt_ids, documents, eos_token_ids=eos_token_ids)
        head = session._eagle
        merged_propose = session.propose
        last: dict = {}

        def head_propose(n):
            last["tree"] = _SampledSession.propose(head, n)
            return last["tree"]

        def propose(n):
            last.clear()
            tree = merged_propose(n)
            h = last.get("tree")
            if not tree.num_nodes or h is None:
                return tree
            # each node's row: the head's row of the same root path, else one-hot
            head_rows = {}
            hp, ht = h.parents.tolist(), h.tokens.tolist()
            for i in range(h.num_nodes):
                path = (ht[hp[i]],) if hp[i] >= 0 else ()
                head_rows[path + (ht[i],)] = h.draft_probs[i]
            rows, paths = [], []
            tp, tt = tree.parents.tolist(), tree.tokens.tolist()
            for i in range(tree.num_nodes):
                paths.append((paths[tp[i]] if tp[i] >= 0 else ()) + (tt[i],))
                row = head_rows.get(paths[i])
                rows.append(row if row is not None else torch.nn.functional.one_hot(torch.tensor(tt[i]), V).float())
            return DraftTree(
                tree.tokens,
                tree.parents,
                tree.depth,
                tree.sources,
                tree.scores,
                torch.stack(rows),
                tree.match_len,
                tree.node_match_len,
            )

        head.propose = head_propose
        session.propose = propose
        return session


def _noisy_draft(logits):
    def draft(ctx: tuple) -> list[float]:
        """A fixed noisy draft model: its samples are sometimes right, sometimes wrong."""
        g = torch.Generator().manual_seed(sum(t * 131**i for i, t in enumerate(ctx)) % 2_147_483_647)
        return torch.softmax(0.7 * logits(ctx) + 1.5 * torch.randn(V, generator=g), -1).tolist()

    return draft


@pytest.mark.slow
def test_sampled_head_nodes_merged_with_lookup_nodes_match_target(setup):
    # the merged tree mixes the sampled head's nodes with deterministic lookup nodes; it
    # drops the head's draft probabilities and stays lossless
    model, target, _, logits, tok = setup
    params = SamplingParams(temperature=0.8)
    drafter = _merged(_SampledHead(_noisy_draft(logits), seed=7))
    engine = Engine(target, tok, drafter=drafter, policy=PolicyConfig(max_draft_tokens=8, adaptive=False))
    runs = 3000
    counts, sources, accepted = _sample(engine, params, runs)
    fit = goodness_of_fit(counts, _exact(logits, params))
    assert fit.ok, str(fit)
    mixed, seeded = _mixed(sources)
    assert mixed > runs // 2 and seeded > runs // 4, f"few merged trees were verified: {sources.most_common(6)}"
    assert accepted > runs // 10, "drafts were hardly ever accepted: the test would be vacuous"


@pytest.mark.slow
def test_merged_tree_keeping_the_sampled_heads_draft_probs_fails(setup):
    # the contract matters: declaring the head's draft rows on a folded, pruned tree is lossy
    model, target, _, logits, tok = setup
    params = SamplingParams(temperature=0.8)
    head = _SampledHead(_noisy_draft(logits), seed=7)
    drafter = _KeepsDraftProbs(
        PromptLookupDrafter(),
        head,
        head_skip_p=1.0,
        acceptance=lambda: AcceptanceModel(prior_first=0.6),
        calibrate=False,
    )
    engine = Engine(target, tok, drafter=drafter, policy=PolicyConfig(max_draft_tokens=8, adaptive=False))
    counts, _, _ = _sample(engine, params, 3000)
    fit = goodness_of_fit(counts, _exact(logits, params))
    assert not fit.ok, f"a lossy verification passed: {fit}"
