"""Which requests work in one :meth:`Engine.step <ragspec.engine.Engine.step>`: without a
plan, every request (prefilling ones the earliest first); with a
:class:`~ragspec.scheduling.StepPlan`, the ones it names, checked (:func:`select_work`).
Requests the step finishes without a forward (finished, cancelled) end in it either way."""

from __future__ import annotations

import time
from typing import Optional, Sequence

from .errors import ConfigError
from .request import Request
from .scheduling import StepPlan

__all__ = ["select_work", "check_plan"]


def select_work(
    requests: Sequence[Request], plan: Optional[StepPlan]
) -> tuple[list[Request], list[tuple[int, Request]]]:
    """The step's prefilling requests (in the order their chunks run) and decoding requests
    ``(index, request)``: with no ``plan`` every request, the earliest prefills first; else
    the plan's. Cancelled requests are marked finished; a request is started
    (``started_s``, its queue time recorded) at its first step with work (without a plan:
    its first step).

    Raises:
        ConfigError: the plan names a request out of range, twice, or in the wrong list
            (:func:`check_plan`).
    """
    if plan is not None:
        check_plan(requests, plan)
    chosen = None if plan is None else set(plan.indices)
    prefilling: dict[int, Request] = {}
    decoding: list[tuple[int, Request]] = []
    for i, req in enumerate(requests):
        ends = bool(req.finish_reason or req.cancel_requested)
        if not req.started_s and (chosen is None or i in chosen or ends):
            req.started_s = time.perf_counter()
            req.stats.queue_s = req.started_s - req.created_s
        if req.finish_reason:
            continue
        if req.cancel_requested:
            req.finish_reason = "cancelled"
        elif chosen is not None and i not in chosen:
            continue
        elif req.root is None:
            prefilling[i] = req
        else:
            decoding.append((i, req))
    if plan is None:  # earliest first
        return [prefilling[i] for i in sorted(prefilling, key=lambda i: (prefilling[i].created_s, i))], decoding
    return [prefilling[i] for i in plan.prefill if i in prefilling], decoding


def check_plan(requests: Sequence[Request], plan: StepPlan) -> None:
    """Raise ConfigError when ``plan`` names a request out of range, twice, or in the wrong
    list (``prefill``: not prefilling; ``decode``: not prefilled yet); finished and
    cancelled requests may be named (they end in the step)."""
    named = plan.indices
    if len(set(named)) != len(named) or any(not 0 <= i < len(requests) for i in named):
        raise ConfigError(f"step plan names requests {list(named)}: each at most once, of {len(requests)} requests")
    wrong = [i for i in plan.prefill if requests[i].root is not None]
    wrong += [i for i in plan.decode if requests[i].root is None]
    wrong = [i for i in wrong if not (requests[i].finish_reason or requests[i].cancel_requested)]
    if wrong:
        raise ConfigError(f"step plan names requests {sorted(wrong)} that are not prefilling or decoding as it says")
