"""Drafters: who proposes the tokens the target verifies.

* :mod:`ragspec.drafters.base`: the :class:`Drafter` / :class:`DraftSession` protocols and
  :class:`CompositeDrafter`;
* :mod:`ragspec.drafters.prompt_lookup`: n-gram matching over the prompt, documents and
  output;
* :mod:`ragspec.drafters.selecting`: retrieval first, the EAGLE head otherwise (one source
  per step);
* :mod:`ragspec.drafters.merged`: retrieval, the head and retrieval seeded by the head's
  tokens in one tree (the default with a head).

Datastore drafts are :mod:`ragspec.datastore`; the EAGLE head's :mod:`ragspec.eagle`.
"""

from .base import (
    CompositeDrafter,
    Drafter,
    DraftSession,
    SessionCapability,
    TenantIsolation,
    reproducible_drafter,
    salted_drafter,
    session_capabilities,
)
from .merged import MergedDrafter
from .prompt_lookup import NgramIndex, PromptLookupDrafter, ngram_match
from .selecting import SelectingDrafter

__all__ = [
    "CompositeDrafter",
    "Drafter",
    "DraftSession",
    "MergedDrafter",
    "NgramIndex",
    "PromptLookupDrafter",
    "SelectingDrafter",
    "SessionCapability",
    "TenantIsolation",
    "ngram_match",
    "reproducible_drafter",
    "salted_drafter",
    "session_capabilities",
]
