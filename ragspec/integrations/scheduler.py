"""Deprecated: the server's worker is :class:`ragspec.integrations.stepper.Stepper`, the one
stepper of the server and the LangChain classes (it steps one engine: ``Stepper(engine,
max_active=..., ...)``). ``Scheduler``, ``Job`` and ``Ticket`` here are its names for one
release, with a DeprecationWarning."""

from __future__ import annotations

from typing import Any

from ragspec.deprecation import warn_deprecated

from . import stepper as _stepper

__all__: list[str] = []  # the deprecated names come from __getattr__

_RENAMED = {"Scheduler": "Stepper", "Job": "Job", "Ticket": "Ticket", "READY": "READY", "CHUNK": "CHUNK"}
_RENAMED.update({"ERROR": "ERROR", "GONE": "GONE"})


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        new = _RENAMED[name]
        warn_deprecated(
            f"ragspec.integrations.scheduler.{name}",
            f"ragspec.integrations.stepper.{new} (one stepper for the server and LangChain; it takes the engine)",
        )
        return getattr(_stepper, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
