"""What an engine drafts with: the parts its drafter is composed of (:class:`DrafterParts`),
the composition itself (:func:`compose_drafter`), and the drafter of each datastore a
request may name (:class:`DraftSources`).

A datastore is a request's drafting input, not another engine: one engine holds every
configured datastore, and :meth:`Engine.start <ragspec.engine.Engine.start>` starts each
request's draft session from the drafter of the datastore its
:attr:`~ragspec.params.RequestParams.datastore` names (the default one when it names none),
all of them composed the same way from the same parts (prompt lookup, the EAGLE head, the
drafting mode, the response cache). Documents added to a datastore while serving come in as
a new :class:`DraftSources` with that datastore reopened (:meth:`DraftSources.replacing`);
requests already started keep the sessions they drafted from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional, Sequence

from .config import DRAFTING_MODES, PLDConfig
from .drafters.base import CompositeDrafter, Drafter
from .drafters.merged import MergedDrafter
from .drafters.prompt_lookup import PromptLookupDrafter
from .drafters.response_cache import ResponseCache, ResponseCacheDrafter
from .drafters.selecting import SelectingDrafter
from .errors import ConfigError, DatastoreNotFoundError

if TYPE_CHECKING:
    from .datastore import Datastore
    from .eagle import EagleDrafter

__all__ = ["DrafterParts", "DraftSources", "compose_drafter"]


@dataclass(frozen=True)
class DrafterParts:
    """What an engine's drafter was composed of (:mod:`ragspec.loading` composes it), so
    that the drafter of another datastore is composed the same way.

    Attributes:
        pld: prompt-lookup settings of the retrieval drafter (None: no prompt lookup).
        datastore: the datastore requests naming none draft from, or None.
        eagle: the EAGLE head's drafter, or None.
        eagle_path: folder the head was loaded from, or None.
        response_cache: the cache of this model's earlier responses drafted from
            (:mod:`ragspec.drafters.response_cache`), or None.
        drafting: how retrieval and the head share a step (:data:`~ragspec.config.DRAFTING_MODES`:
            "merged", one tree from all sources; "select", one source per step; "retrieval",
            retrieval only).
    """

    pld: Optional[PLDConfig] = None
    datastore: Optional["Datastore"] = None
    eagle: Optional["EagleDrafter"] = None
    eagle_path: Optional[str] = None
    response_cache: Optional[ResponseCache] = None
    drafting: str = "merged"

    @property
    def composed(self) -> bool:
        """Whether these parts compose a drafter (False: a drafter built by the caller)."""
        return not (self.pld is None and self.eagle is None and self.datastore is None and self.response_cache is None)

    def drafter_with(self, datastore: Optional["Datastore"]) -> Optional[Drafter]:
        """The drafter these parts compose with ``datastore`` in place of their own."""
        stores = [datastore] if datastore is not None else []
        return compose_drafter(self.pld, stores, self.eagle, self.response_cache, self.drafting)


def compose_drafter(
    pld: Optional[PLDConfig],
    datastores: Sequence["Datastore"] = (),
    eagle: Optional["EagleDrafter"] = None,
    response_cache: Optional[ResponseCache] = None,
    drafting: str = "merged",
) -> Optional[Drafter]:
    """Retrieval (prompt lookup, then each datastore, then the response cache: the longest
    suffix match wins) and, with a head, retrieval and the head together as ``drafting``
    says (:data:`~ragspec.config.DRAFTING_MODES`). None when there is nothing to draft with.

    Raises:
        ConfigError: an unknown ``drafting``.
    """
    if drafting not in DRAFTING_MODES:
        raise ConfigError(f"unknown drafting mode {drafting!r}: use one of {', '.join(DRAFTING_MODES)}")
    retrieval: list[Drafter] = [PromptLookupDrafter(pld)] if pld is not None else []
    if datastores:
        from .datastore import DatastoreDrafter

        retrieval.extend(DatastoreDrafter(ds) for ds in datastores)
    if response_cache is not None:
        retrieval.append(ResponseCacheDrafter(response_cache))
    base: Optional[Drafter] = None
    if len(retrieval) == 1:
        base = retrieval[0]
    elif retrieval:
        base = CompositeDrafter(retrieval)
    if eagle is None or drafting == "retrieval":
        return base
    if base is None:
        return eagle
    if drafting == "select":
        # retrieval when its match is worth more than the head's draft (calibrated per
        # request), the head otherwise
        return SelectingDrafter(base, eagle)
    # one tree: retrieval's, the head's, and retrieval's copies after the head's tokens
    return MergedDrafter(base, eagle)


class DraftSources:
    """The drafters of one engine, by the datastore a request names: ``drafter`` for
    requests naming none (composed with ``parts.datastore``, if any), and for each named
    datastore the drafter ``parts`` compose with it (:meth:`DrafterParts.drafter_with`; the
    default datastore's is ``drafter`` itself). Immutable: :meth:`replacing` gives the
    sources with one datastore replaced. Constructing does no I/O.

    Args:
        drafter: the drafter of requests naming no datastore (None: plain decoding).
        parts: what ``drafter`` was composed of.
        datastores: name -> datastore requests may name, in order.

    Raises:
        ConfigError: named datastores with parts that compose nothing (a drafter built by
            the caller: no recipe to compose the others with).
    """

    def __init__(
        self,
        drafter: Optional[Drafter],
        parts: DrafterParts = DrafterParts(),
        datastores: Optional[Mapping[str, "Datastore"]] = None,
    ) -> None:
        named = dict(datastores or {})
        if named and not parts.composed:
            raise ConfigError(
                "named datastores need a drafter composed by ragspec.loading (prompt lookup, a head, ...): "
                "this engine's drafter was built by its caller"
            )
        self.drafter = drafter
        self.parts = parts
        self.datastores: Mapping[str, "Datastore"] = MappingProxyType(named)
        self._drafters = {
            name: drafter if ds is parts.datastore else parts.drafter_with(ds) for name, ds in named.items()
        }
        self.default_name: Optional[str] = next((n for n, ds in named.items() if ds is parts.datastore), None)
        """The name of the datastore of requests naming none (None: not a named one)."""

    def drafter_for(self, name: Optional[str]) -> Optional[Drafter]:
        """The drafter of requests naming the datastore ``name`` (None: the default).

        Raises:
            DatastoreNotFoundError: no datastore of that name.
        """
        if name is None:
            return self.drafter
        if name not in self._drafters:
            raise DatastoreNotFoundError(name, tuple(self.datastores))
        return self._drafters[name]

    def replacing(self, name: str, datastore: "Datastore") -> "DraftSources":
        """These sources with the datastore ``name`` replaced by ``datastore`` (e.g. reopened
        after an addition), its drafter composed again; the default drafter too when it is
        the default datastore.

        Raises:
            DatastoreNotFoundError: no datastore of that name.
        """
        if name not in self.datastores:
            raise DatastoreNotFoundError(name, tuple(self.datastores))
        datastores = dict(self.datastores)
        datastores[name] = datastore
        if name != self.default_name:
            return DraftSources(self.drafter, self.parts, datastores)
        parts = dataclasses.replace(self.parts, datastore=datastore)
        return DraftSources(parts.drafter_with(datastore), parts, datastores)
