"""Drafters: who proposes the tokens the target verifies.

* :mod:`ragspec.drafters.base`: the :class:`Drafter` / :class:`DraftSession` protocols and
  :class:`CompositeDrafter`;
* :mod:`ragspec.drafters.prompt_lookup`: n-gram matching over the prompt, documents and
  output;
* :mod:`ragspec.drafters.selecting`: retrieval first, the EAGLE head otherwise.

Datastore drafts are :mod:`ragspec.datastore`; the EAGLE head's :mod:`ragspec.eagle`.
"""

from .base import CompositeDrafter, Drafter, DraftSession, reproducible_drafter
from .prompt_lookup import NgramIndex, PromptLookupDrafter, ngram_match
from .selecting import SelectingDrafter

__all__ = [
    "CompositeDrafter",
    "Drafter",
    "DraftSession",
    "NgramIndex",
    "PromptLookupDrafter",
    "SelectingDrafter",
    "ngram_match",
    "reproducible_drafter",
]
