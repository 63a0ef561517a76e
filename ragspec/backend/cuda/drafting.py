"""GPU-sized drafting: the draft budget and the step's row budget from the CUDA step's own
latency table.

On the reference CPU a verification row costs nearly as much as a plain step's (the engine
drafts 8 nodes at most); on a GPU a step of 1 to ~64 rows costs about the same (the weights
are read once; the arithmetic hides under it), so a draft tree of 16-64 nodes is nearly
free to verify and the budget should follow the measured table, not the CPU's.

:func:`gpu_draft_policy` reads a latency table (seconds per step against rows, as
:func:`ragspec.policy.measure_latency` measures it with synchronisation) and returns the
policy: the largest row count whose step costs at most ``slack`` more than a one-row step
becomes the per-request draft budget (within ``min_budget`` .. ``max_budget``), and the
step's row budget the largest measured row count (the engine shares it between the
requests of a batched step).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from ...config import PolicyConfig
from ...errors import ConfigError

__all__ = ["GPU_BUDGETS", "gpu_draft_policy", "nearly_free_rows"]

GPU_BUDGETS = (16, 64)
"""The range of per-request draft budgets on a GPU (nodes)."""


def nearly_free_rows(table: Mapping[int, float], slack: float = 0.15) -> int:
    """The largest row count whose step costs at most ``(1 + slack)`` times one row's.

    Args:
        table: seconds per step by rows (must hold 1).

    Raises:
        ConfigError: no one-row entry, a non-positive time, or a negative slack.
    """
    if 1 not in table:
        raise ConfigError("a latency table needs the one-row step (q = 1)")
    if slack < 0 or any(float(v) <= 0 for v in table.values()):
        raise ConfigError(f"latency table entries must be positive and slack >= 0 (got slack {slack})")
    limit = float(table[1]) * (1.0 + slack)
    return max(int(q) for q, s in table.items() if float(s) <= limit)


def gpu_draft_policy(
    table: Mapping[int, float],
    base: PolicyConfig = PolicyConfig(),
    *,
    slack: float = 0.15,
    min_budget: int = GPU_BUDGETS[0],
    max_budget: int = GPU_BUDGETS[1],
) -> PolicyConfig:
    """``base`` with GPU-sized draft budgets from the step's latency ``table`` (see the
    module docstring): ``max_draft_tokens`` = the nearly free rows less the root, within
    ``min_budget .. max_budget``; ``max_step_rows`` = the table's largest row count (unless
    ``base`` sets one).

    Raises:
        ConfigError: as :func:`nearly_free_rows`, or ``min_budget`` above ``max_budget``.
    """
    if not 1 <= min_budget <= max_budget:
        raise ConfigError(f"need 1 <= min_budget <= max_budget, got {min_budget}, {max_budget}")
    free = nearly_free_rows(table, slack)
    budget = max(min_budget, min(max_budget, free - 1))
    rows = base.max_step_rows if base.max_step_rows is not None else max(int(q) for q in table)
    return dataclasses.replace(base, max_draft_tokens=budget, max_step_rows=max(rows, budget + 1))
