"""Device timing for the latency model: how long the target's verification forward of q new
tokens takes on this machine, measured at start-up.

:func:`measure_latency` times the forwards and returns the :class:`~ragspec.policy.LatencyTable`
(seconds per forward, keyed by device, dtype and model); :func:`measure_latency_model` turns
it into the :class:`~ragspec.policy.LatencyModel` the engine's cost model uses
(:meth:`~ragspec.policy.LatencyModel.from_table`). The policy itself stays pure: it only
reads the tables measured here.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .backend.base import Capability, Target, VerifyItem
from .policy import LatencyModel, LatencyTable
from .progress import step
from .tree import interleaved_tree
from .types import DraftTree

logger = logging.getLogger(__name__)

__all__ = ["measure_latency", "measure_latency_model"]


def measure_latency_model(
    target: Target,
    qs: Optional[Sequence[int]] = None,
    context: Optional[int] = None,
    repeats: Optional[int] = None,
    early: Optional[bool] = None,
    *,
    contexts: Optional[Sequence[int]] = None,
    model_name: str = "",
) -> LatencyModel:
    """Time the target's verification forward for each q and return the model the
    engine uses: the measured seconds per q averaged over the measured contexts (see
    :func:`measure_latency` for the measurement, its device-dependent defaults and the
    full :class:`~ragspec.policy.LatencyTable`).

    Args:
        target: a :class:`~ragspec.backend.base.Target` (its ``verify``, ``prefill``,
            ``rollback``, ``new_state``, ``device``, ``dtype``).
        qs: new tokens per forward to time (None: 1-16 on CPU, 1-64 on CUDA).
        context: one cache length (tokens) to time at; ``contexts`` several (None for
            both: 512 on CPU, 512 and 2048 on CUDA).
        repeats: timed rounds after one warm-up round (None: 3 on CPU, 5 on CUDA).
        early: also time forwards that compute only the first row of logits (None: on
            CPU only, where greedy verification computes rows lazily).
        model_name: the model's name in the table's key (default: the config's
            ``_name_or_path``).

    Raises:
        ValueError: no q or context left to time (e.g. the model's context is too short),
            or both ``context`` and ``contexts`` given.
    """
    if context is not None and contexts is not None:
        raise ValueError("give context or contexts, not both")
    with step(
        "calibrating the latency model",
        "~10 s, timing the model's forwards; cached for this machine, model and threads",
    ):
        measured = measure_latency(
            target,
            qs=qs,
            contexts=(context,) if context is not None else contexts,
            repeats=repeats,
            early=early,
            model_name=model_name,
        )
    model = LatencyModel.from_table(measured)
    mid = statistics.fmean(measured.full)
    logger.info("latency model (ms), %s: %s", measured.key, {q: round(v * 1e3, 2) for q, v in measured.at(mid).items()})
    return model


#: q timed by default: CPU verification drafts at most 16 tokens; on CUDA a forward of up to
#: 64 new tokens costs about as much as one of 1 (launch-bound at batch 1), so larger drafts
#: are measured too.
_CPU_QS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
_CUDA_QS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def measure_latency(
    target: Target,
    *,
    qs: Optional[Sequence[int]] = None,
    contexts: Optional[Sequence[int]] = None,
    repeats: Optional[int] = None,
    early: Optional[bool] = None,
    model_name: str = "",
    batch: int = 1,
    trees: Optional[bool] = None,
) -> LatencyTable:
    """Time the target's verification forward of q new tokens over a cache of each context
    (with ``batch`` > 1: one forward over ``batch`` requests, each with its own cache of
    that context and q new tokens: the batched step's cost at ``batch * q`` rows).

    Defaults depend on the target's device: on CPU q = 1-16 at 512 cached tokens, 3 rounds,
    first-row-only forwards too (what greedy verification does there); on CUDA q = 1-64 at
    512 and 2048 cached tokens, 5 rounds, full forwards only. On CUDA every sample is taken
    between two ``torch.cuda.synchronize()`` calls, so it is the forward's wall time, not
    its launch time. Contexts are capped so that context + q fits the model's length.

    The q values are timed in interleaved rounds (q = 1, 2, ..., then again; the first
    round warms up), so a burst of load on a shared machine inflates one sample of several
    q instead of every sample of one q; the median per q is kept. A forward of fewer tokens
    is never slower than one of more, so each q's cost is capped by every larger q's (a
    disturbed q = 1 sample read 80 ms beside 63 ms for q = 2 on the 2-core CPU and made
    drafting look cheaper than it was). A few seconds on a 2-core CPU for a 135M model.

    Args:
        target: a :class:`~ragspec.backend.base.Target` (its ``verify``, ``prefill``,
            ``rollback``, ``new_state``, ``state_length``, ``capability``, ``device``,
            ``dtype``, ``vocab_size``).
        qs: new tokens per forward to time (None: 1-16 on CPU, 1-64 on CUDA).
        contexts: cache lengths (tokens) to time at (None: 512 on CPU, 512 and 2048 on CUDA).
        repeats: timed rounds after one warm-up round (None: 3 on CPU, 5 on CUDA).
        early: also time forwards that compute only the first row of logits (None: on CPU
            only, where greedy verification computes rows lazily).
        model_name: the model's name in the table's key (default: the config's
            ``_name_or_path``).
        batch: requests per forward, each with its own cache.
        trees: also time each q as a branching draft tree (q - 1 nodes, four branches
            below the root) and keep, per q, the slower of the chain and the tree (None: on
            CUDA, where the GPU draft policy picks trees of up to ~64 nodes from this table).

    Returns:
        a :class:`~ragspec.policy.LatencyTable` keyed by (device, dtype, model): seconds per
        forward, ``full[context][q]`` and ``early[context][q]``.

    Raises:
        ValueError: no q or context left to time, or ``batch`` < 1.
    """
    device = torch.device(target.device)
    plan = _plan(target, qs, contexts, repeats, early, batch, trees)
    gen = torch.Generator().manual_seed(0)
    full: dict[int, dict[int, float]] = {}
    first: dict[int, dict[int, float]] = {}
    with torch.inference_mode():
        for context in plan.contexts:
            samples = _samples_at(target, context, batch, plan, gen)
            full[context] = _monotone({q: _slowest(samples, q, False, plan.shapes) for q in plan.qs})
            if plan.early:
                first[context] = _monotone({q: _slowest(samples, q, True, plan.shapes) for q in plan.qs})
    name = model_name or str(getattr(target.capability(Capability.CONFIG), "_name_or_path", "") or "")
    table = LatencyTable(_device_key(device), str(target.dtype).removeprefix("torch."), name, full, first)
    for c in plan.contexts:
        logger.info("latency (ms) at %d cached tokens: %s", c, {q: round(v * 1e3, 2) for q, v in full[c].items()})
    return table


@dataclass(frozen=True)
class _Plan:
    """What :func:`measure_latency` times: the q values and contexts (ascending), the
    timed rounds after the warm-up one, whether first-row-only forwards too (``early``),
    and the draft shapes (False: a chain; True: a tree)."""

    qs: tuple[int, ...]
    contexts: tuple[int, ...]
    repeats: int
    early: bool
    shapes: tuple[bool, ...]


def _plan(
    target: Target,
    qs: Optional[Sequence[int]],
    contexts: Optional[Sequence[int]],
    repeats: Optional[int],
    early: Optional[bool],
    batch: int,
    trees: Optional[bool],
) -> _Plan:
    """:func:`measure_latency`'s arguments with the target's device's defaults filled in,
    its contexts capped to fit the model's length.

    Raises:
        ValueError: no q or context left to time, or ``batch`` < 1.
    """
    cuda = torch.device(target.device).type == "cuda"
    qs = tuple(sorted({int(q) for q in (qs if qs is not None else (_CUDA_QS if cuda else _CPU_QS)) if int(q) >= 1}))
    contexts = tuple(contexts) if contexts is not None else ((512, 2048) if cuda else (512,))
    repeats = int(repeats) if repeats is not None else (5 if cuda else 3)
    early = ((not cuda) if early is None else bool(early)) and bool(target.capability(Capability.LAZY_ROWS))
    shapes = (False, True) if (cuda if trees is None else trees) else (False,)
    if not qs:
        raise ValueError("no q to time")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    limit = target.max_length
    if limit:
        contexts = tuple(min(int(c), limit - qs[-1] - 2) for c in contexts)
    contexts = tuple(sorted({c for c in contexts if c >= 1}))
    if not contexts:
        raise ValueError(f"no context fits q up to {qs[-1]} in the model's {limit} positions")
    return _Plan(qs, contexts, repeats, early, shapes)


def _samples_at(
    target: Target, context: int, batch: int, plan: _Plan, gen: torch.Generator
) -> dict[tuple[int, bool, bool], list[float]]:
    """Seconds of each timed verification forward at one ``context``: ``batch`` random
    prompts of that length (drawn from ``gen``) prefilled, then the plan's rounds, each
    forward rolled back after it. Keyed by (q, first row only, tree)."""
    device = torch.device(target.device)
    cuda = device.type == "cuda"
    prompts = [torch.randint(0, target.vocab_size, (context,), generator=gen).tolist() for _ in range(batch)]
    samples: dict[tuple[int, bool, bool], list[float]] = {}
    states = []
    for ids in prompts:
        states.append(target.new_state())
        target.prefill(states[-1], ids)
    base = target.state_length(states[0])
    modes = (False, True) if plan.early else (False,)
    for rnd in range(plan.repeats + 1):
        for q in plan.qs:
            for lazy, wide in ((lazy, wide) for lazy in modes for wide in plan.shapes):
                # q - 1 draft tokens after each root (a chain or a tree); wrap around the prompt for long q
                items = [
                    VerifyItem(state, ids[-1], _draft([ids[i % context] for i in range(q - 1)], wide), lazy_logits=lazy)
                    for state, ids in zip(states, prompts)
                ]
                if cuda:
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for out in target.verify(items):
                    if out.row_logits is not None:
                        out.row_logits.argmax(0)
                if cuda:
                    torch.cuda.synchronize(device)
                dt = time.perf_counter() - t0
                for state in states:
                    target.rollback(state, base)
                if rnd:  # the first round warms up
                    samples.setdefault((q, lazy, wide), []).append(dt)
    return samples


def _draft(tokens: list[int], wide: bool) -> DraftTree:
    """A chain of ``tokens``, or (``wide``) a tree of them: four interleaved branches below
    the root (:func:`ragspec.tree.interleaved_tree`)."""
    if not tokens:
        return DraftTree.empty()
    return interleaved_tree(tokens, 4, "calibration") if wide else DraftTree.chain(tokens)


def _slowest(samples: dict, q: int, lazy: bool, shapes: tuple[bool, ...]) -> float:
    """The median seconds of q's slowest draft shape (chain or tree)."""
    return max(statistics.median_high(samples[(q, lazy, wide)]) for wide in shapes)


def _monotone(table: dict[int, float]) -> dict[int, float]:
    """Cap each q's seconds by every larger q's: {1: 0.080, 2: 0.063, 4: 0.070} ->
    {1: 0.063, 2: 0.063, 4: 0.070}."""
    out: dict[int, float] = {}
    cap = float("inf")
    for q in sorted(table, reverse=True):
        cap = min(cap, table[q])
        out[q] = cap
    return dict(sorted(out.items()))
