"""Helpers of the distribution tests: the goodness-of-fit check and the exact
reference distribution of the first tokens under plain sampling.

The check is a chi-square goodness-of-fit test of observed counts against *exact*
probabilities (not against a second sample), with cells of expected count < 5 pooled into
one. Its false-alarm rate is ``ALPHA`` per check (for a random seed); the tests use fixed
seeds, so they are reproducible: a pass stays a pass. Any observed outcome of exact
probability 0 (e.g. a token removed by top-k / top-p) fails the check outright.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ragspec.config import SamplingParams

ALPHA = 1e-4
"""False-alarm rate of one check (about 20 checks run: < 0.2% for the whole suite)."""


@dataclass(frozen=True)
class FitResult:
    """Outcome of a goodness-of-fit check (n samples)."""

    n: int
    chi2: float
    dof: int
    p_value: float
    tv: float  # total-variation distance between the empirical and exact distributions
    num_impossible: int  # samples of an outcome whose exact probability is 0

    @property
    def ok(self) -> bool:
        return self.num_impossible == 0 and self.p_value > ALPHA

    def __str__(self) -> str:
        return (
            f"n={self.n} chi2={self.chi2:.1f} dof={self.dof} p={self.p_value:.3g} tv={self.tv:.4f} "
            f"impossible={self.num_impossible}"
        )


def goodness_of_fit(counts: Counter, exact: dict, min_expected: float = 5.0) -> FitResult:
    """Chi-square test of ``counts`` (outcome -> count) against ``exact`` (outcome ->
    probability, summing to 1)."""
    n = sum(counts.values())
    impossible = sum(c for o, c in counts.items() if exact.get(o, 0.0) <= 0.0)
    chi2, cells = 0.0, 0
    pooled_obs, pooled_exp = 0, 0.0
    for o, prob in exact.items():
        e = n * prob
        if e <= 0.0:
            continue
        obs = counts.get(o, 0)
        if e >= min_expected:
            chi2 += (obs - e) ** 2 / e
            cells += 1
        else:
            pooled_obs += obs
            pooled_exp += e
    if pooled_exp > 0.0:
        chi2 += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    dof = max(1, cells - 1)
    # chi-square survival function: the regularised upper incomplete gamma function
    shape = torch.tensor(dof / 2.0, dtype=torch.float64)
    p_value = float(torch.special.gammaincc(shape, torch.tensor(chi2 / 2.0, dtype=torch.float64)))
    keys = set(exact) | set(counts)
    tv = 0.5 * sum(abs(counts.get(o, 0) / n - exact.get(o, 0.0)) for o in keys)
    return FitResult(n, chi2, dof, p_value, tv, impossible)


def hf_processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution plain sampling draws from, computed with transformers' own warpers
    (independently of ragspec.sampling.process_logits): float64 [..., V]."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    s = logits.float().reshape(-1, logits.shape[-1])
    if params.temperature != 1.0:
        s = TemperatureLogitsWarper(params.temperature)(None, s)
    if params.top_k:
        s = TopKLogitsWarper(params.top_k)(None, s)
    if params.top_p < 1.0:
        s = TopPLogitsWarper(params.top_p)(None, s)
    if params.min_p > 0.0:
        s = MinPLogitsWarper(params.min_p)(None, s)
    return s.double().softmax(-1).reshape(logits.shape)


def exact_first_tokens(probs_fn: Callable[[tuple], torch.Tensor], prompt: Sequence[int], num_tokens: int) -> dict:
    """Exact law of the first ``num_tokens`` sampled tokens: the product of the processed
    conditionals ``probs_fn(context)`` (float64 [V]) along every sequence of positive
    probability. Returns {tuple of tokens: probability}."""
    dist: dict[tuple, float] = {}

    def rec(ctx: tuple, prefix: tuple, prob: float) -> None:
        if len(prefix) == num_tokens:
            dist[prefix] = prob
            return
        p = probs_fn(ctx)
        for t in torch.nonzero(p > 0).flatten().tolist():
            rec(ctx + (t,), prefix + (t,), prob * float(p[t]))

    rec(tuple(prompt), (), 1.0)
    total = sum(dist.values())
    assert math.isclose(total, 1.0, rel_tol=1e-9), f"exact distribution sums to {total}"
    return dist
