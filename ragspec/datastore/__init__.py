"""Retrieval datastores for drafting (REST, He et al. 2024) and per-request document indexes.

* :func:`build_datastore` / :func:`add_to_datastore` - text to an on-disk datastore
  (manifest + memory-mapped token ids and suffix array per shard, see :mod:`.format`);
  :func:`add_texts_to_datastore` - texts given whole (a server's runtime additions).
* :class:`Datastore` - opened datastore; ``continuations(suffix_ids, ...)`` answers the
  :class:`Lookup` protocol.
* :class:`DatastoreDrafter` - the engine's ``Drafter`` over a datastore.
* :class:`DocumentDrafter` - drafts from the documents sent with a request (:mod:`.docindex`).
* :mod:`.semantic` - optional faiss chunk selection (imported on use).
"""

from .builder import add_texts_to_datastore, add_to_datastore, build_datastore
from .docindex import DocumentDrafter, TextMatch, TextMatcher
from .drafter import DatastoreDrafter
from .format import FORMAT_VERSION, tokenizer_identity, vocab_fingerprint
from .store import Continuation, Datastore, DatastoreInfo, Lookup

__all__ = [
    "build_datastore",
    "add_to_datastore",
    "add_texts_to_datastore",
    "Datastore",
    "DatastoreInfo",
    "Continuation",
    "Lookup",
    "DatastoreDrafter",
    "DocumentDrafter",
    "TextMatch",
    "TextMatcher",
    "FORMAT_VERSION",
    "tokenizer_identity",
    "vocab_fingerprint",
]
