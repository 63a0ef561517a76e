"""GPU-sized drafting: the draft budget and the step's row budget from the CUDA step's own
latency table, and the drafting (the EAGLE head merged with retrieval, or retrieval alone)
measured faster on a GPU.

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

The EAGLE head drafts level by level, each level an eager forward with a host
synchronisation (a few milliseconds a step on a GPU, against a step of about one), so
whether it pays beside retrieval on a GPU is measured, not assumed: the GPU check times both
and :func:`record_drafting` keeps the faster per GPU model, which ``--drafting auto`` reads
(:func:`recorded_drafting`; ``"merged"`` where nothing is recorded).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from ...config import PolicyConfig
from ...errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "DRAFTING_FILE",
    "GPU_BUDGETS",
    "gpu_draft_policy",
    "nearly_free_rows",
    "record_drafting",
    "recorded_drafting",
]

DRAFTING_FILE = "cuda-drafting.json"
"""Under ragspec's cache folder's ``calibration/``: the drafting measured fastest per GPU."""
_CHOICES = ("merged", "retrieval")

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


def _drafting_path(cache: Path) -> Path:
    return Path(cache) / "calibration" / DRAFTING_FILE


def recorded_drafting(gpu: str, cache: Path) -> Optional[str]:
    """The drafting (``"merged"`` or ``"retrieval"``) a measurement on this GPU model found
    faster for the CUDA backend (:func:`record_drafting`), or None when none is recorded (or
    the record cannot be read: logged)."""
    path = _drafting_path(cache)
    try:
        entry = json.loads(path.read_text(encoding="utf-8")).get(gpu)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError) as e:
        logger.warning("ignoring the recorded CUDA drafting choice in %s: %s", path, e)
        return None
    choice = entry.get("choice") if isinstance(entry, dict) else None
    return choice if choice in _CHOICES else None


def record_drafting(gpu: str, choice: str, measured: Mapping[str, Any], cache: Path) -> Path:
    """Record ``choice`` (``"merged"`` or ``"retrieval"``, with what was ``measured``:
    tokens/s and drafting milliseconds per step of each) as the faster drafting of the CUDA
    backend on ``gpu`` (``torch.cuda.get_device_name()``); ``--drafting auto`` then picks it
    on that GPU. Returns the file written (atomically).

    Raises:
        ConfigError: an unknown choice.
    """
    if choice not in _CHOICES:
        raise ConfigError(f"drafting choice must be one of {', '.join(_CHOICES)}, got {choice!r}")
    path = _drafting_path(cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data[gpu] = {"choice": choice, "measured": dict(measured)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
