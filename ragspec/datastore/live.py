"""A datastore that takes additions while it is served: all or nothing, idempotent, its
shards merged in the background.

:class:`DatastoreWriter` owns the additions to one datastore in one process (a server's
``POST /v1/datastores/{name}/documents``) and the copy of it that process serves. An
addition (:meth:`DatastoreWriter.add`) runs under the writer's lock and ``DIR/.lock``:

1. its idempotency key, if any, is looked up in the listed shards' records: a key already
   used with the same documents answers what that addition answered and changes nothing (a
   retry after a timeout, an error, a restart); used with other documents, the addition is
   refused (:class:`~ragspec.errors.IdempotencyKeyError`);
2. its shard (with its key's record) is written into a temporary directory and renamed
   into place (not listed);
3. the next copy of the datastore is opened (:meth:`~ragspec.datastore.Datastore.reopen`:
   only the new shard is opened, every other one is shared with the copy served now);
4. the manifest is replaced (the commit), listing the shard (and so the key);
5. the next copy is published (``publish(datastore)``: served from then on).

A failure at 2 to 4 removes the shard; at 5 the manifest is put back first. Either way the
documents are neither on disk nor served, and the error reaches the caller; once 5 has
returned they are both. A datastore holding :data:`~.shards.MAX_SHARDS` shards refuses
additions (:class:`~ragspec.errors.DatastoreBusyError`) until the merging catches up.

Merging (:mod:`.shards`): after each addition a background thread merges the last shards
as :func:`~.shards.plan_merge` says, commits the merged shard (only if the shards it
replaces are still listed) and publishes the copy that reads it, under the same lock as the
additions (only the commit: the merge's sorting and writing run outside it). When no
addition came for ``idle_merge_s`` seconds, the thread also merges the trailing shards
(:func:`~.shards.plan_idle_merge`: all of them in a datastore of up to
:data:`~.shards.IDLE_MERGE_TOKENS` tokens), so lookups search one index, as in a datastore
built at once; an addition arriving meanwhile abandons that merge (tried again at the next
pause) and never waits for it. An addition's cost thus stays that of writing and opening
its own shard, however many came before; the shards stay few, and an open datastore holds
at most ``2 * MAX_SHARDS`` files. The copy
served before a publish is not closed by the writer: requests that started with it finish
with it, and the files only it held are closed once the last of them lets it go.

Idempotency keys are kept as digests (sha256: the key's, the documents' and what the
addition added) in the ``additions.json`` of the shard holding the addition's documents,
carried into merged shards (the latest :data:`IDEMPOTENCY_KEYS` of the shards merged), so
a key is known exactly while its documents are listed, and the manifest an addition reads
and rewrites does not grow with the keys. The writer keeps the records of the shards it
has read in memory (a shard's files never change).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ragspec.errors import DatastoreBusyError, DatastoreError, IdempotencyKeyError, TokenizerMismatchError

from .builder import check_texts, tokenize_texts, write_tokenized_shard
from .format import (
    Manifest,
    ShardEntry,
    held_shard_tmp,
    locked,
    read_manifest,
    remove_leftovers,
    tokenizer_identity,
    write_manifest,
)
from .shards import (
    IDEMPOTENCY_KEYS,
    IDLE_MERGE_TOKENS,
    MAX_SHARDS,
    MERGE_FACTOR,
    MergeStopped,
    commit_merge,
    install_shard,
    merge_shards,
    next_shard_name,
    now,
    plan_idle_merge,
    plan_merge,
    read_additions,
    remove_shards,
)
from .store import Datastore, DatastoreInfo

logger = logging.getLogger(__name__)

__all__ = ["DatastoreWriter", "Addition", "IDEMPOTENCY_KEYS", "IDLE_MERGE_S"]

IDLE_MERGE_S = 2.0
"""Seconds without an addition after which a writer merges the trailing shards (see the
module docstring)."""
_RETRY_MERGE_S = 10.0  # a failed merge is tried again after this long


@dataclass(frozen=True)
class Addition:
    """What an addition added, and the datastore's size after it."""

    num_documents: int
    num_tokens: int
    """Tokens added (separators not counted)."""
    info: DatastoreInfo
    """The datastore as served after the addition."""
    replayed: bool = False
    """True when an earlier addition with the same idempotency key and documents is what
    this one answers (nothing was written)."""


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        raw = part.encode("utf-8", "surrogatepass")
        h.update(len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()


class DatastoreWriter:
    """The additions to one served datastore (see the module docstring).

    Args:
        datastore: the copy served now (the writer's first; it serves what it publishes).
        tokenizer: the datastore's tokenizer (the model's).
        publish: called with each new copy (after an addition, after a merge), under the
            writer's lock; what it raises undoes the addition (or merge).
        merge: merge shards in the background after additions (False: never; tests and
            callers that merge themselves with :meth:`merge_once`).
        merge_factor: see :func:`~.shards.plan_merge`.
        max_shards: an addition finding this many shards is refused until merges catch up.
        idle_merge_s: seconds without an addition after which the background thread merges
            the trailing shards (None: never; with ``merge``).
        idle_merge_tokens: most tokens that merge rewrites (:func:`~.shards.plan_idle_merge`).

    Constructing it does no I/O and starts no thread (the first addition does).
    """

    def __init__(
        self,
        datastore: Datastore,
        tokenizer: Any,
        publish: Callable[[Datastore], None],
        *,
        merge: bool = True,
        merge_factor: int = MERGE_FACTOR,
        max_shards: int = MAX_SHARDS,
        idle_merge_s: Optional[float] = IDLE_MERGE_S,
        idle_merge_tokens: int = IDLE_MERGE_TOKENS,
    ) -> None:
        self.path = datastore.path
        self._current = datastore
        self._tokenizer = tokenizer
        self._publish = publish
        self._merge = merge
        self.merge_factor = merge_factor
        self.max_shards = max_shards
        self.idle_merge_s = idle_merge_s
        self.idle_merge_tokens = idle_merge_tokens
        self._keys: dict[str, tuple[ShardEntry, dict[str, dict]]] = {}  # shard name -> its records by key
        self._adds = 0  # additions begun (an idle merge stops when it changes)
        self._last_add = 0.0  # time.monotonic() when the last addition began or ended
        self._fingerprint: Optional[str] = None
        self._lock = threading.Lock()  # additions, merge commits and publishing, one at a time
        self._cond = threading.Condition()
        self._wanted = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self.merges = 0
        """Merges committed."""
        self.merge_failures = 0
        """Merges that failed (logged; tried again later)."""

    @property
    def datastore(self) -> Datastore:
        """The copy published last (the one served)."""
        return self._current

    # ------------------------------------------------------------------ additions
    def add(self, texts: Sequence[str], *, source: str = "api", idempotency_key: Optional[str] = None) -> Addition:
        """Add ``texts``, one document each, all or nothing (see the module docstring).

        Args:
            source: the shard's source record's path.
            idempotency_key: makes a retry of this addition (the same key, documents and
                source) a no-op that answers the same.

        Raises:
            EmptyCorpusError, DatastoreInputError: no text, or a bad one (empty, binary,
                not valid Unicode; :func:`~.builder.check_texts`).
            IdempotencyKeyError: the key was used by an addition of other documents.
            DatastoreBusyError: the datastore holds ``max_shards`` shards (retry shortly).
            TokenizerMismatchError: the datastore on disk has another tokenizer now.
            DatastoreError: the disk write, the opening of the new shard (too many open
                files, say) or the publish failed; nothing was added.
        """
        check_texts(texts)
        request = _digest(source, *texts)
        key = _digest("idempotency", idempotency_key) if idempotency_key is not None else None
        t0 = time.perf_counter()
        with self._cond:
            self._adds += 1
            self._last_add = time.monotonic()
        if self._fingerprint is None:
            self._fingerprint = tokenizer_identity(self._tokenizer).fingerprint
        read = tokenize_texts(texts, self._tokenizer, source)
        try:
            with self._lock:
                result = self._add(read, t0, key, request)
        except OSError as e:
            raise DatastoreError(
                f"cannot add documents to {str(self.path)!r} ({e.strerror or e}); nothing was added"
            ) from e
        finally:
            with self._cond:
                self._last_add = time.monotonic()
        if not result.replayed:
            self._want_merge()
        return result

    def _add(self, read: Any, t0: float, key: Optional[str], request: str) -> Addition:
        d = self.path
        with locked(d / ".lock"):
            manifest = read_manifest(d)
            if manifest.tokenizer.fingerprint != self._fingerprint:
                raise TokenizerMismatchError(f"datastore {str(d)!r} has another tokenizer than this server's model")
            seen = self._find_key(manifest, key)
            if seen is not None:
                if seen.get("request") != request:
                    raise IdempotencyKeyError("this idempotency key was used by an addition of other documents")
                n, t = int(seen["num_documents"]), int(seen["num_tokens"])
                return Addition(n, t, self._current.info(), replayed=True)
            if len(manifest.shards) >= self.max_shards:
                raise DatastoreBusyError(
                    f"datastore {str(d)!r} holds {len(manifest.shards)} shards, the most an addition may find: "
                    "retry once the merging running now has finished"
                )
            remove_leftovers(d, manifest)
            name = next_shard_name(d, manifest)
            tmp = Path(tempfile.mkdtemp(prefix=".shard-tmp-", dir=d))
            records: list[dict[str, Any]] = []  # the key's record, written into the shard
            if key is not None:
                n, t = len(read.docs), sum(len(doc) for doc in read.docs)
                records.append({"key": key, "request": request, "num_documents": n, "num_tokens": t, "at": now()})
            try:
                entry = write_tokenized_shard(tmp, name, read, t0, additions=records)
                install_shard(d, tmp, name)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            self._keys[name] = (entry, {str(r["key"]): r for r in records})
            after = replace(manifest, shards=manifest.shards + (entry,), updated=now())
            try:
                new = self._current.reopen(after)
                write_manifest(d, after)  # the commit
            except BaseException:
                remove_shards(d, [name])
                raise
            self._publish_or_restore(new, manifest, [name])
        return Addition(entry.num_documents, entry.num_tokens, new.info())

    def _publish_or_restore(self, new: Datastore, before: Manifest, added: list[str]) -> None:
        """Publish ``new`` (committed); if that fails, put the manifest ``before`` back and
        remove the shards ``added`` (call under the writer's lock and ``DIR/.lock``)."""
        try:
            self._publish(new)
        except BaseException:
            try:
                write_manifest(self.path, before)
            except OSError as e:
                logger.error("datastore %s: cannot undo a change whose publishing failed (%s)", self.path, e)
            else:
                remove_shards(self.path, added)
            raise
        self._current = new

    def _find_key(self, manifest: Manifest, key: Optional[str]) -> Optional[dict]:
        """The idempotency record of ``key`` among the shards ``manifest`` lists, the newest
        first (None: no key, or not there). Reads the records of shards not seen before
        (another process's, a merge's) once; forgets those of shards no longer listed."""
        listed = {s.name for s in manifest.shards}
        for name in [n for n in self._keys if n not in listed]:
            del self._keys[name]
        if key is None:
            return None
        for entry in reversed(manifest.shards):
            held = self._keys.get(entry.name)
            if held is None or held[0] != entry:
                held = (entry, {str(r.get("key")): r for r in read_additions(self.path, entry)})
                self._keys[entry.name] = held
            if key in held[1]:
                return held[1][key]
        for record in manifest.extra.get("idempotency", ()):  # kept in the manifest by the previous version
            if isinstance(record, dict) and record.get("key") == key:
                return record
        return None

    # ------------------------------------------------------------------ merging
    def merge_once(self, *, idle: bool = False) -> bool:
        """Run the next planned merge now, in this thread (the background thread calls it).

        Args:
            idle: when the cascade plans nothing, merge the trailing shards as when
                additions pause (:func:`~.shards.plan_idle_merge`).

        Returns:
            True when a merge was committed, or found obsolete (the copy served was
            refreshed from the disk instead); False when none is planned.

        Raises:
            DatastoreError, OSError: the merge could not be written or opened (nothing was
                listed, or the listing was undone).
        """
        return self._merge_once(lambda: False, idle=idle)

    def _merge_once(self, should_stop: Callable[[], bool], *, idle: bool = False) -> bool:
        """:meth:`merge_once`; ``should_stop()`` True abandons it (:class:`MergeStopped`)."""
        snap = self._current
        lengths = [s.length for s in snap.manifest.shards]
        plan = plan_merge(lengths, self.merge_factor)
        if plan is None and idle:
            plan = plan_idle_merge(lengths, self.idle_merge_tokens)
        if plan is None:
            return False
        start, stop = plan
        replaces = snap.manifest.shards[start:stop]
        d = self.path
        with held_shard_tmp(d) as tmp:  # never an add's leftover, not even before it is held
            try:
                entry = merge_shards(snap, start, stop, tmp, should_stop=should_stop)
            except (OSError, DatastoreError):
                if _listed(read_manifest(d), replaces):
                    raise
                self._refresh()  # another process merged them first (and removed their files)
                return True
            with self._lock:
                self._commit_merge(tmp, entry, replaces)
        return True

    def _refresh(self) -> None:
        """Serve the datastore as its manifest on disk says now."""
        with self._lock, locked(self.path / ".lock"):
            new = self._current.reopen()
            self._publish(new)
            self._current = new

    def _commit_merge(self, tmp: Path, entry: Any, replaces: Sequence[Any]) -> None:
        """List the merged shard and publish the copy that reads it (undone if that fails),
        or, when the shards were changed by another process first, publish what is on disk."""
        d = self.path

        def publish(before: Manifest, after: Manifest) -> None:
            new = self._current.reopen(after)
            self._publish(new)
            self._current = new

        if commit_merge(d, tmp, entry, replaces, then=publish) is None:
            with locked(d / ".lock"):  # another process changed the shards first: serve what is there
                new = self._current.reopen()
                self._publish(new)
                self._current = new
            return
        self.merges += 1
        logger.info("datastore %s: %d shards merged into one", d, len(replaces))

    def _want_merge(self) -> None:
        if not self._merge:
            return
        with self._cond:
            if self._closed:
                return
            self._wanted = True
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ragspec-datastore-merge", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._wanted and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._wanted = False
            try:
                while not self._closed and self._merge_once(lambda: self._closed):
                    pass
                self._merge_when_idle()
            except MergeStopped:
                if self._closed:
                    return
                with self._cond:
                    self._wanted = True  # an addition came: merge again at the next pause
            except Exception as e:  # logged; the next addition (or the retry) tries again
                self.merge_failures += 1
                logger.error(
                    "datastore %s: merging shards failed (%s); retrying in %.0f s", self.path, e, _RETRY_MERGE_S
                )
                with self._cond:
                    self._cond.wait_for(lambda: self._closed, timeout=_RETRY_MERGE_S)
                    self._wanted = True

    def _merge_when_idle(self) -> None:
        """Once no addition came for ``idle_merge_s`` seconds, merge the trailing shards
        (:func:`~.shards.plan_idle_merge`) until none are planned; return early when an
        addition is wanted or the writer closes. An addition beginning meanwhile abandons
        the merge running (:class:`MergeStopped`)."""
        if self.idle_merge_s is None:
            return
        while True:
            with self._cond:
                while True:
                    if self._closed or self._wanted:
                        return
                    left = self._last_add + self.idle_merge_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                adds = self._adds
            if not self._merge_once(lambda: self._closed or self._adds != adds, idle=True):
                return

    def close(self, timeout: Optional[float] = 30.0) -> None:
        """Stop the merging (a merge running is abandoned at its next stage: nothing of it
        is listed, its temporary files are removed). Idempotent; additions after it still
        work, without merging."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)


def _listed(manifest: Manifest, shards: Sequence[Any]) -> bool:
    """Whether ``manifest`` lists every one of ``shards`` (the same entries)."""
    return all(s in manifest.shards for s in shards)
