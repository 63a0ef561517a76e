"""Deprecated: the server's worker is :class:`ragspec.integrations.stepper.Stepper`, the one
stepper of the server and the LangChain classes (it steps one engine: ``Stepper(engine,
max_active=..., ...)``). ``Scheduler``, ``Job`` and ``Ticket`` here are its names for one
release, with a DeprecationWarning."""

from __future__ import annotations

import warnings
from typing import Any

from . import stepper as _stepper

__all__: list[str] = []  # the deprecated names come from __getattr__

_RENAMED = {"Scheduler": "Stepper", "Job": "Job", "Ticket": "Ticket", "READY": "READY", "CHUNK": "CHUNK"}
_RENAMED.update({"ERROR": "ERROR", "GONE": "GONE"})


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warnings.warn(
            f"ragspec.integrations.scheduler.{name} is deprecated: ragspec.integrations.stepper.{new} "
            "(one stepper for the server and LangChain; it takes the engine it steps)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_stepper, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
