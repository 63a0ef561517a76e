"""One prompt's benchmark record and how its tokens compare with the baseline's.

Shared by the bench runner (:mod:`ragspec.bench.runner`) and the comparison with other
decoders (:mod:`ragspec.bench.compare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["BenchRecord", "first_diff", "format_identity"]


@dataclass
class BenchRecord:
    """One prompt's bench results: the baseline's (plain ``model.generate`` greedy) and
    ragspec's tokens and seconds, identity (``first_diff``: the first differing token index,
    -1 when identical), draft statistics, and the other methods' runs when timed."""

    question_id: object
    category: str
    prompt_tokens: int
    baseline_tokens: int
    baseline_s: float
    ragspec_s: float
    ragspec_tokens: int
    identical: bool
    first_diff: int
    mean_accepted: float
    acceptance_rate: float
    drafted: int
    accepted: int
    forward_passes: int
    hf_pld_s: Optional[float] = None
    hf_pld_tokens: Optional[int] = None
    hf_pld_identical: Optional[bool] = None
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    accepted_histogram: dict = field(default_factory=dict)
    steps: list = field(default_factory=list)
    static_s: Optional[float] = None
    static_tokens: Optional[int] = None
    static_identical: Optional[bool] = None
    max_draft_tokens: Optional[int] = None
    more_budgets: dict = field(default_factory=dict)
    """Runs of ragspec at other draft budgets: str(budget) -> {"s", "tokens", "identical",
    "first_diff", "mean_accepted", "forward_passes"}."""
    compare: dict = field(default_factory=dict)
    """Runs of ``--compare`` runners: name -> :func:`ragspec.bench.compare.compare_entry`."""
    variants: dict = field(default_factory=dict)
    """Runs of other ragspec engines (``--also-drafting``): name -> the same fields as
    ``more_budgets``' entries."""
    plain_step_s: float = 0.0
    plain_steps: int = 0
    """Seconds of ragspec's forwards in steps that verified no draft, and how many (0 when
    its per-step figures were not recorded)."""


def first_diff(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index where token ids ``a`` and ``b`` differ: -1 when they are equal, the
    shorter one's length when one is a prefix of the other."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1 if len(a) == len(b) else min(len(a), len(b))


def format_identity(identical: int, prompts: int, first_diffs: Sequence[int]) -> str:
    """``"3/4"``, or ``"1/4 @12"`` when some outputs differ (@: the earliest token index
    where one first differs from the baseline)."""
    text = f"{identical}/{prompts}"
    return text + (f" @{min(first_diffs)}" if first_diffs else "")
