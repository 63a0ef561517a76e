"""Lossless speculative sampling: verify a draft tree so that the committed tokens follow
exactly the distribution plain sampling from the target would give.

Glossary (as in :mod:`ragspec.verify` and vLLM's rejection sampler):
  * target_probs: the target's *processed* next-token distribution (temperature, then
    top-k, then top-p, as transformers' ``generate(do_sample=True)``): what plain
    sampling draws from;
  * draft_probs: the distribution a draft token was drawn from (``DraftTree.draft_probs``);
    None for deterministic drafts (prompt lookup, datastore);
  * residual: what is left of ``target_probs`` at a node once some of its children were
    rejected (renormalised); the bonus token is drawn from it;
  * accepted tokens, bonus token: as in :mod:`ragspec.verify` (after a rejection the
    bonus token is the "recovered" token).

One rule covers chains, trees, deterministic and sampled drafts. Walk from the root; at
each node, with ``residual = target_probs`` of that node's row, try its children in tree
order. A child with token x and draft row ``q``:

  * deterministic (no draft probabilities, i.e. ``q`` is the point mass on x): accept with
    probability ``residual(x)``; on rejection ``residual(x) <- 0`` and renormalise;
  * sampled: accept with probability ``min(1, residual(x) / q(x))``; on rejection
    ``residual <- norm(max(0, residual - q))``;

then move to the accepted child and start again with its row, or, when no child is
accepted (or the node is a leaf), draw the bonus token from the residual. The deterministic
case is the sampled one with ``q`` one-hot, so a deterministic node inside a sampled tree
is simply a one-hot row. References: Leviathan et al. 2023 (Alg. 1) and Chen et al. 2023
for one draft token; SpecInfer (Miao et al. 2024, section 4.3, "multi-step speculative
sampling") for siblings; EAGLE's ``evaluate_posterior`` (sampling branch) for the
deterministic multi-candidate rule. One random decision per tried child: unlike REST's
per-row sampling, which favours drafts, this is exactly lossless.

Why it is lossless (per node, by induction on the siblings): if child i is drawn from
``q_i`` given everything drawn before it, then "accept x_i w.p. min(1, r_i(x_i)/q_i(x_i)),
else continue with ``r_{i+1} = norm(max(0, r_i - q_i))``" outputs a token distributed as
``r_i`` as soon as the continuation outputs one distributed as ``r_{i+1}`` (Leviathan et
al., Theorem 1); the last continuation is a plain draw from the residual.

**Contract on draft probabilities** (the part a drafter must get right). Row i of
``tree.draft_probs`` must be the distribution node i's token was *actually drawn from*,
given its parent path *and its earlier siblings*:

  * siblings drawn i.i.d. (**with replacement**; SpecInfer's and EAGLE's sampled trees):
    every sibling carries the same row ``q``, and duplicates must stay separate nodes. A
    duplicate of a rejected sibling is rejected again (its residual probability is 0), but
    its residual update still counts; merging duplicates into one node is lossy.
    (Equal *deterministic* siblings are harmless: the second one changes nothing.)
  * siblings drawn **without replacement** (e.g. Gumbel-top-k): row j is ``q`` with the
    tokens of siblings 1..j-1 removed and renormalised,
    ``q_j(x) = q(x) [x not in x_1..x_{j-1}] / (1 - sum_{i<j} q(x_i))``; the same rule
    then gives Recursive Speculative Decoding (Jeon et al. 2024). Declaring ``q`` for
    such siblings (the with-replacement rows) is lossy.
  * the tree must be grown in drawing order and not pruned afterwards by its own tokens
    (e.g. by the draft probability of the drawn tokens, as EAGLE-2's reranking, or by
    :func:`ragspec.policy.choose_draft` when the scores depend on the drawn tokens): such a
    selection biases the kept tokens. A tree cut that way must drop ``draft_probs``; the
    deterministic rule is lossless for *any* choice of children. Cutting to the first k
    nodes (``DraftTree.truncate``) with k chosen without looking at the tokens is fine.

The tests in ``tests/stat/`` check all of this against the exact law of plain sampling,
including drafts that break the contract (they must fail).

Randomness comes only from the request's ``torch.Generator``: one uniform per child whose
acceptance is uncertain, one per bonus token (inverse-CDF draw). Greedy decoding
(temperature 0) never comes here (:class:`ragspec.verify.GreedyVerifier`).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .config import SamplingParams
from .errors import ConfigError
from .processors import RowFn
from .types import DraftTree, VerifyResult

logger = logging.getLogger(__name__)

__all__ = ["process_logits", "sample_from", "verify_sampling", "SamplingVerifier"]

# First number of best tokens looked at by top-p (widened x8 until their mass reaches
# top_p): a top-k of 256 costs ~0.13 ms on a 49152-token row, a full sort ~4 ms.
_TOP_P_FIRST_K = 256
# Logit blocks of at most this many elements are processed in one call rather than row by
# row (e.g. 17 rows of a 3000-token vocabulary).
_EAGER_NUMEL = 1 << 16


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits into the distribution plain sampling draws from.

    Temperature, then top-k, then top-p, then min-p, with the semantics of transformers'
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` and
    ``MinPLogitsWarper`` (the order ``generate(do_sample=True)`` applies them): top-k
    keeps every token whose logit is at least the k-th largest (ties kept); top-p keeps
    the tokens whose cumulative probability in ascending order exceeds ``1 - top_p``, i.e.
    in descending order each token whose predecessors hold less than ``top_p``; min-p
    keeps the tokens of at least ``min_p`` times the likeliest one's probability; at least
    one token is always kept. Equal to
    transformers up to float rounding at the top-p boundary (transformers sums all V
    probabilities in ascending order; this sums the largest ones, without a full sort).

    Example: logits [[2., 1., 0., -1.]], temperature 1, top_k 3 -> the -1 token gets
    probability 0; then top_p 0.6 keeps only token 0 (p = 0.67 >= 0.6) -> [[1, 0, 0, 0]].

    Args:
        logits: float [R, V] (any float dtype and device).
        params: sampling settings; temperature must be > 0.

    Returns:
        target_probs: float32 [R, V], each row sums to 1, on the logits' device.

    Raises:
        ConfigError: temperature 0 (greedy decoding has no distribution to sample).
    """
    if params.greedy:
        raise ConfigError("temperature 0 is greedy decoding: there is no distribution to sample from")
    assert logits.dim() == 2, f"logits must be [R, V], got shape {tuple(logits.shape)}"
    scores = logits.float()  # [R, V]
    if params.temperature != 1.0:
        scores = scores / params.temperature
    vocab = scores.shape[-1]
    top_k = params.top_k if 0 < params.top_k < vocab else 0
    if top_k == 0 and params.top_p >= 1.0:
        return _min_p(torch.softmax(scores, dim=-1), params.min_p)
    # The kept tokens are among the best few: work on them ([R, K], best first) and
    # scatter back, instead of masking and re-normalising all V.
    if top_k:
        vals, idx = torch.topk(scores, top_k, dim=-1)  # [R, K]
        if bool(((scores >= vals[:, -1:]).sum(dim=-1) > top_k).any()):
            # ties with the k-th logit are kept too (as transformers does): mask all V
            scores = scores.masked_fill(scores < vals[:, -1:], float("-inf"))
            vals, idx = _best_mass(torch.softmax(scores, dim=-1), params.top_p)
        else:
            vals = torch.softmax(vals, dim=-1)  # [R, K] renormalised over the top k
    else:
        vals, idx = _best_mass(torch.softmax(scores, dim=-1), params.top_p)
    if params.top_p < 1.0:
        before = torch.cumsum(vals, dim=-1) - vals  # [R, K] mass of the better tokens
        keep = before < params.top_p
        keep[:, 0] = True  # min_tokens_to_keep = 1
        vals = vals * keep
    vals = vals / vals.sum(dim=-1, keepdim=True)
    return _min_p(torch.zeros_like(scores).scatter_(1, idx, vals), params.min_p)  # [R, V]


def _min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """transformers' ``MinPLogitsWarper`` on a distribution ``probs`` [R, V]: the tokens
    below ``min_p`` times the row's likeliest token dropped (the likeliest kept), the rest
    renormalised; ``probs`` itself when ``min_p`` is 0."""
    if min_p <= 0.0:
        return probs
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)  # [R, V]; the maximum always
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def _best_mass(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The K best tokens of each row of probs [R, V] (values and ids [R, K], best first),
    K the smallest of 256, 2048, ..., V whose tokens hold ``top_p`` in every row (no token
    past them can then survive top-p). With top_p >= 1, every token of positive probability."""
    vocab = probs.shape[-1]
    k = min(vocab, _TOP_P_FIRST_K)
    if top_p >= 1.0:
        k = min(vocab, max(k, int((probs > 0).sum(dim=-1).max())))
    while True:
        vals, idx = torch.topk(probs, k, dim=-1)  # [R, K] descending
        if k == vocab or bool((vals.sum(dim=-1) >= top_p).all()):
            return vals, idx
        k = min(vocab, k * 8)


def _uniform(generator: torch.Generator) -> float:
    """One uniform draw in [0, 1) from ``generator`` (float64, on its device)."""
    return float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device).item())


def sample_from(probs: torch.Tensor, generator: torch.Generator) -> int:
    """Draw one token from ``probs`` (float [V] on the generator's device, non-negative,
    not necessarily normalised) by inversion: one ``torch.rand`` from ``generator``. Never
    returns a token of probability 0."""
    cdf = torch.cumsum(probs.double(), dim=0)  # [V]
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=cdf.device) * cdf[-1]
    # first index whose cdf exceeds u: its own probability is > 0
    return min(int(torch.searchsorted(cdf, u, right=True).item()), probs.shape[0] - 1)


def verify_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    rows: Optional[RowFn] = None,
) -> VerifyResult:
    """Lossless speculative sampling over a draft tree (see the module docstring for the
    rule, the references and the contract on ``tree.draft_probs``).

    Only the rows on the walked path are processed (at most depth + 1 of them; a small
    block, such as a tiny vocabulary's, at once). The walk runs on the generator's device.

    Args:
        tree: N nodes; ``tree.draft_probs`` float [N, V] or None (deterministic drafts).
        target_logits: float [N + 1, V]; row 0 after the root, row i + 1 after node i.
        params: temperature (> 0), top_k, top_p, min_p applied to every row.
        generator: the request's generator; the only source of randomness.
        rows: the request's processing of each row it reaches
            (:data:`ragspec.processors.RowFn`: penalties, logit bias, a grammar), applied
            to a copy of the row before temperature, top-k, top-p and min-p; None: none.

    Returns:
        VerifyResult: the accepted path and the bonus token. The committed tokens follow
        exactly the law of plain sampling from the processed target distributions.

    Example: a chain [5, 6] whose processed rows put probability 1 on 5, then 1 on 6, then
    1 on 9 -> accepted (5, 6), bonus 9, whatever the generator.
    """
    if generator is None:
        raise ConfigError("sampling verification needs the request's torch.Generator")
    n = tree.num_nodes
    assert target_logits.shape[0] == n + 1, f"expected {n + 1} logit rows for {n} nodes, got {target_logits.shape[0]}"
    draft_probs = tree.draft_probs
    if draft_probs is not None:
        assert draft_probs.shape == (n, target_logits.shape[1]), (
            f"draft_probs must be [N, V] = [{n}, {target_logits.shape[1]}], got {tuple(draft_probs.shape)}"
        )
    dev = generator.device
    tokens = tree.tokens.tolist()
    kids: dict[int, list[int]] = {}  # parent (-1 = root) -> children in tree order
    for i, p in enumerate(tree.parents.tolist()):
        kids.setdefault(p, []).append(i)
    # Rows are processed when first reached (at most depth + 1 of the N + 1); a small block
    # (tiny vocabularies, as in the tests) is processed at once: there per-call overhead
    # dominates. Each row is reached at most once, so it can be edited in place.
    all_probs = None
    if rows is None and target_logits.numel() <= _EAGER_NUMEL:
        all_probs = process_logits(target_logits, params).to(dev, torch.float64)  # [N+1, V]
    node, row = -1, 0
    acc_nodes: list[int] = []
    acc_tokens: list[int] = []
    while True:
        # the residual starts as this node's processed target distribution; it is kept
        # unnormalised, with its mass
        if all_probs is not None:
            residual = all_probs[row]  # [V]
        elif rows is not None:
            raw = target_logits[row]  # [V]
            processed = rows(row, raw if getattr(rows, "copies", False) else raw.clone())
            residual = process_logits(processed[None], params)[0].to(dev, torch.float64)  # [V]
        else:
            residual = process_logits(target_logits[row : row + 1], params)[0].to(dev, torch.float64)  # [V]
        mass = float(residual.sum().item())
        accepted = None
        for child in kids.get(node, ()):
            x = tokens[child]
            p_x = float(residual[x].item()) / mass
            if draft_probs is None:
                if p_x == 0.0:
                    continue  # rejected for sure, and the residual does not change
                q = None
                ratio = p_x
            else:
                q = draft_probs[child].to(dev, torch.float64)  # [V]
                q = q / q.sum()
                q_x = float(q[x].item())
                # q_x == 0: the token could not have been drawn (a broken draft): reject it
                ratio = p_x / q_x if q_x > 0.0 else 0.0
            if ratio >= 1.0 or (ratio > 0.0 and _uniform(generator) < ratio):
                accepted = child
                break
            # rejected: continue with the residual
            if q is None:
                rest = residual
                rest[x] = 0.0  # [V]
            else:
                rest = (residual / mass - q).clamp_(min=0.0)  # [V]
            rest_mass = float(rest.sum().item())
            # rest_mass > 0 unless the rejected child held all the mass up to rounding (ratio ~1)
            if rest_mass > 0.0:
                residual, mass = rest, rest_mass
        if accepted is None:
            return VerifyResult(tuple(acc_nodes), tuple(acc_tokens), sample_from(residual, generator), n)
        acc_nodes.append(accepted)
        acc_tokens.append(tokens[accepted])
        node, row = accepted, accepted + 1


class SamplingVerifier:
    """:func:`verify_sampling` as a :class:`~ragspec.verify.Verifier`.

    Args:
        params: sampling settings; temperature must be > 0 (greedy decoding uses
            :class:`~ragspec.verify.GreedyVerifier`, which draws no random number).

    Raises:
        ConfigError: temperature 0.
    """

    greedy = False
    """The verifier's kind (:class:`~ragspec.verify.Verifier`): sampling, not greedy."""

    def __init__(self, params: SamplingParams) -> None:
        if params.greedy:
            raise ConfigError("temperature 0 is greedy decoding: use GreedyVerifier, not SamplingVerifier")
        self.params = params

    def __call__(
        self,
        tree: DraftTree,
        target_logits: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        rows: Optional[RowFn] = None,
    ) -> VerifyResult:
        """Args:
        tree: the draft tree (N nodes).
        target_logits: float [N + 1, V]; row 0 after the root, row i + 1 after node i.
        generator: the request's random generator (required).
        rows: the request's processing of each row reached (None: none).
        """
        if generator is None:
            raise ConfigError("sampling verification needs the request's torch.Generator")
        return verify_sampling(tree, target_logits, self.params, generator, rows)
