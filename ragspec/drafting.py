"""Deprecated: the drafters moved to :mod:`ragspec.drafters` (this module goes in the next
release). Each name of the old module is looked up there, with a ``DeprecationWarning``."""

from __future__ import annotations

from .deprecation import moved_names

__all__: list[str] = []

__getattr__ = moved_names(
    "ragspec.drafting",
    dict.fromkeys(
        ("Drafter", "DraftSession", "ngram_match", "NgramIndex", "PromptLookupDrafter", "CompositeDrafter"),
        "ragspec.drafters",
    ),
)
