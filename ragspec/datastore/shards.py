"""Shards written and merged: what keeps a datastore that grows by additions bounded.

Every build and add writes one shard (:func:`flatten`, :func:`write_shard`). Left alone, a datastore grown
by many small additions (a server's ``POST /v1/datastores/{name}/documents``) holds one
shard per addition: every lookup searches every shard, and an open datastore holds two
files per mapped shard. So shards are merged, by the logarithmic method (Bentley and Saxe
1980; what LSM trees do): the last shards are merged into one while the shard before them
holds no more than :data:`MERGE_FACTOR` times their tokens together (:func:`plan_merge`).
At rest every shard then holds more than ``MERGE_FACTOR`` times the tokens of the next
one, so a datastore of ``N`` tokens has at most ``log_4(N) + 1`` shards (16 at 2^31 tokens)
and each token is merged O(log N) times over the datastore's life, whatever the number of
additions. When additions pause, a writer also merges the trailing shards up to
:data:`IDLE_MERGE_TOKENS` into one (:func:`plan_idle_merge`): a datastore of up to that
size then searches one index, as one built at once. :data:`MAX_SHARDS` caps the shards an addition may find (more wait for the
merging: :class:`~ragspec.errors.DatastoreBusyError`).

A merge (:func:`merge_shards`) concatenates the shards' token arrays (the documents keep
their order and numbers), sorts the index anew and writes the merged shard into a
temporary directory made and locked under ``DIR/.lock`` (:func:`~.format.held_shard_tmp`; the cleanup of
adds leaves it alone). It is committed (:func:`commit_merge`) under ``DIR/.lock``: renamed
into place and listed in the manifest where the shards it replaces were, only if they
are all still listed (another merge may have replaced them meanwhile: then it is
dropped), the manifest replaced atomically, and the replaced shards' directories removed,
still under the lock. A crash leaves the old manifest (the merged directory a leftover the
next add removes) or the new one (the replaced directories leftovers, removed by the next
add as shards a merge replaced). Processes that have the
replaced shards open keep reading them (an unlinked file stays readable while mapped);
one opening the datastore meanwhile reads the manifest again
(:meth:`~ragspec.datastore.Datastore.open`).

An addition made with an idempotency key writes its record (digests only) into its own
shard's ``additions.json``, which a merge carries into the merged shard (the latest
:data:`IDEMPOTENCY_KEYS` of the shards it merges): the record is listed exactly when the
documents are, and the manifest does not grow with the number of additions.

``ragspec datastore compact DIR`` merges every shard into one (:func:`compact_datastore`).
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from .format import (
    ADDITIONS_FILE,
    DOCS_DTYPE,
    DOCS_FILE,
    SA_FILE,
    SEPARATOR_ID,
    SOURCES_FILE,
    TOKEN_DTYPE,
    TOKENS_FILE,
    Manifest,
    ShardEntry,
    fsync_dir,
    held_shard_tmp,
    locked,
    read_manifest,
    set_default_mode,
    write_array,
    write_json_file,
    write_manifest,
)
from .store import Datastore, DatastoreInfo
from .suffix import reverse_prefix_order

logger = logging.getLogger(__name__)

__all__ = [
    "MERGE_FACTOR",
    "MAX_SHARDS",
    "IDLE_MERGE_TOKENS",
    "IDEMPOTENCY_KEYS",
    "read_additions",
    "plan_idle_merge",
    "flatten",
    "write_shard",
    "next_shard_name",
    "install_shard",
    "remove_shards",
    "plan_merge",
    "merge_shards",
    "commit_merge",
    "compact_datastore",
    "MergeStopped",
]

MERGE_FACTOR = 4
"""The last shards are merged while the shard before them holds at most this many times
their tokens together (:func:`plan_merge`)."""
MAX_SHARDS = 32
"""Most shards an addition may find in a datastore: one more waits for the merging
(:class:`~ragspec.errors.DatastoreBusyError`). With two files per mapped shard, an open
datastore holds at most 64 files (shards under ``MAP_FROM_BYTES`` hold none)."""
IDLE_MERGE_TOKENS = 1 << 24
"""Most tokens the merge made when additions pause rewrites (:func:`plan_idle_merge`; 16M
tokens, seconds of sorting): a datastore of up to this many tokens ends in one shard."""
IDEMPOTENCY_KEYS = 1024
"""Idempotency records a merge keeps of the shards it merges (the latest additions'): a
retry with an older key adds its documents again."""


class MergeStopped(Exception):
    """A merge was asked to stop (its writer closes); nothing of it was listed."""


def now() -> str:
    """The current UTC time, ISO-8601 to the second (what manifests record)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def flatten(docs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The documents ``docs`` (int32 token ids each; the list is emptied, its pieces freed)
    as a shard's arrays: (flat int32 [T + D], each document followed by the separator -1;
    offsets int64 [D + 1], each document's start, then the length)."""
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))  # [D]
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)  # [D + 1]
    np.cumsum(lengths + 1, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), dtype=np.int32)  # [T + D]
    for d, start in zip(docs, offsets[:-1].tolist()):
        flat[start : start + len(d)] = d
    flat[offsets[1:] - 1] = SEPARATOR_ID
    docs.clear()
    return flat, offsets


def write_shard(
    sdir: Path,
    name: str,
    flat: np.ndarray,
    offsets: np.ndarray,
    sources: list[dict[str, Any]],
    *,
    min_id: int,
    max_id: int,
    skipped_files: int = 0,
    skipped_lines: int = 0,
    t0: float,
    progress: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
    additions: Sequence[dict[str, Any]] = (),
) -> ShardEntry:
    """Sort the index of ``flat`` and write tokens.bin, sa.bin, docs.bin, sources.json
    and, when ``additions`` holds records, additions.json of one shard into ``sdir`` (each
    fsynced).

    Args:
        flat: int32 [T + D]: the documents, each followed by the separator -1.
        offsets: int64 [D + 1]: each document's start in ``flat``, then its length.
        sources: the shard's source records (sources.json).
        min_id, max_id: the smallest and largest token id (separators excluded).
        t0: ``time.perf_counter()`` when the work on this shard began (for ``build_s``).
        progress: a tqdm bar on stderr.
        should_stop: asked between the stages; True raises :class:`MergeStopped`.
        additions: the idempotency records of the additions the shard holds (see
            :mod:`ragspec.datastore.live`).

    Returns:
        The shard's manifest entry.
    """
    n = int(flat.shape[0])
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=2, desc=f"indexing {n:,} tokens", unit="stage", file=sys.stderr, dynamic_ncols=True)
    try:
        logger.info("sorting %d reversed prefixes", n)
        t_sort = time.perf_counter()
        sa = reverse_prefix_order(flat)
        logger.info("index built in %.1f s", time.perf_counter() - t_sort)
        if bar is not None:
            bar.update(1)
        if should_stop():
            raise MergeStopped()
        files = {
            TOKENS_FILE: write_array(sdir / TOKENS_FILE, flat.astype(TOKEN_DTYPE, copy=False)),
            SA_FILE: write_array(sdir / SA_FILE, sa),
            DOCS_FILE: write_array(sdir / DOCS_FILE, offsets.astype(DOCS_DTYPE)),
            SOURCES_FILE: write_json_file(sdir / SOURCES_FILE, sources),
        }
        if additions:
            files[ADDITIONS_FILE] = write_json_file(sdir / ADDITIONS_FILE, list(additions))
        fsync_dir(sdir)
        if bar is not None:
            bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    num_docs = int(offsets.shape[0]) - 1
    return ShardEntry(
        name=name,
        num_tokens=n - num_docs,
        num_documents=num_docs,
        sa_dtype=sa.dtype.str,
        created=now(),
        build_s=round(time.perf_counter() - t0, 3),
        files=files,
        min_id=min_id,
        max_id=max_id,
        skipped_files=skipped_files,
        skipped_lines=skipped_lines,
    )


def next_shard_name(d: Path, manifest: Manifest) -> str:
    """A shard name neither listed in ``manifest`` nor present in ``d``: one past the
    highest number of either, so a name is never reused while a process may still read an
    older shard of that name."""
    numbers = [-1]
    for name in [s.name for s in manifest.shards] + [p.name for p in d.iterdir()]:
        if name.startswith("shard-") and name[6:].isdigit():
            numbers.append(int(name[6:]))
    return f"shard-{max(numbers) + 1:05d}"


def install_shard(d: Path, tmp: Path, name: str) -> None:
    """Rename the finished shard directory ``tmp`` (inside ``d``) into place as ``name``
    (call under ``DIR/.lock``; the manifest does not list it yet)."""
    set_default_mode(tmp)
    os.rename(tmp, d / name)
    fsync_dir(d)


def remove_shards(d: Path, names: Sequence[str]) -> None:
    """Remove the directories of shards no manifest lists any more."""
    for name in names:
        shutil.rmtree(d / name, ignore_errors=True)


def read_additions(d: Path, entry: ShardEntry) -> list[dict[str, Any]]:
    """The idempotency records of the shard ``entry`` of the datastore ``d`` (oldest first;
    [] when it has none, or its file cannot be read: logged, its keys are then forgotten)."""
    if ADDITIONS_FILE not in entry.files:
        return []
    path = d / entry.name / ADDITIONS_FILE
    try:
        records = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        logger.warning("%s: cannot read the idempotency records (%s); their keys are forgotten", path, e)
        return []
    return [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []


def plan_merge(lengths: Sequence[int], factor: int = MERGE_FACTOR) -> Optional[tuple[int, int]]:
    """The shards to merge next, as the range ``[start, stop)`` of the shard list (``stop``
    is its end), or None: the last shards, for as long as the shard before them holds at
    most ``factor`` times their tokens together (the pairwise cascade of the logarithmic
    method, done in one merge).

    Example: lengths [1000, 20, 5, 2] -> (1, 4): 5 <= 4*2, 20 <= 4*7, and 1000 > 4*27.
    """
    i = len(lengths) - 1
    if i < 1:
        return None
    total = lengths[i]
    while i > 0 and lengths[i - 1] <= factor * total:
        i -= 1
        total += lengths[i]
    return (i, len(lengths)) if len(lengths) - i >= 2 else None


def plan_idle_merge(lengths: Sequence[int], max_tokens: int = IDLE_MERGE_TOKENS) -> Optional[tuple[int, int]]:
    """The shards to merge while additions pause, as ``[start, stop)`` (``stop`` is the
    list's end), or None: the longest run of last shards holding at most ``max_tokens``
    entries together, when it has two shards or more. A datastore of up to ``max_tokens``
    then ends in one shard; a bigger one keeps the shards before the run (which the cascade
    of :func:`plan_merge` keeps few).

    Example: lengths [1000, 20, 5, 2], max_tokens 100 -> (1, 4); 2000 -> (0, 4).
    """
    i, total = len(lengths), 0
    while i > 0 and total + lengths[i - 1] <= max_tokens:
        i -= 1
        total += lengths[i]
    return (i, len(lengths)) if len(lengths) - i >= 2 else None


def merge_shards(
    ds: Datastore,
    start: int,
    stop: int,
    sdir: Path,
    *,
    progress: bool = False,
    should_stop: Callable[[], bool] = lambda: False,
) -> ShardEntry:
    """Write the shards ``[start, stop)`` of the open datastore ``ds`` as one shard into
    the directory ``sdir`` (its documents in their order; named when committed).

    Memory: the merged token array (4 bytes a token) and its index being sorted, as a
    build of the same tokens.

    Raises:
        MergeStopped: ``should_stop()`` became True.
    """
    t0 = time.perf_counter()
    entries = ds.manifest.shards[start:stop]
    flat = np.concatenate([np.asarray(ds.shard_tokens(i)) for i in range(start, stop)]).astype(np.int32, copy=False)
    # flat: int32 [T + D]
    parts, base = [], 0
    for i in range(start, stop):
        docs = ds.shard_documents(i)  # [D_i + 1]
        parts.append(np.asarray(docs[:-1], dtype=np.int64) + base)
        base += int(docs[-1])
    offsets = np.concatenate(parts + [np.array([base], dtype=np.int64)])  # [D + 1]
    sources = [record for i in range(start, stop) for record in ds.sources(i)]
    additions = [r for e in entries for r in read_additions(ds.path, e)][-IDEMPOTENCY_KEYS:]
    if all(e.min_id is not None and e.max_id is not None for e in entries):
        lo = min(int(e.min_id) for e in entries)  # type: ignore[arg-type]
        hi = max(int(e.max_id) for e in entries)  # type: ignore[arg-type]
    else:  # a shard of an older build: the ids' range from the tokens
        ids = flat[flat != SEPARATOR_ID]
        lo, hi = (int(ids.min()), int(ids.max())) if ids.size else (0, 0)
    if should_stop():
        raise MergeStopped()
    entry = write_shard(
        sdir,
        "",
        flat,
        offsets,
        sources,
        min_id=lo,
        max_id=hi,
        skipped_files=sum(e.skipped_files for e in entries),
        skipped_lines=sum(e.skipped_lines for e in entries),
        t0=t0,
        progress=progress,
        should_stop=should_stop,
        additions=additions,
    )
    return replace(entry, build_s=round(entry.build_s + sum(e.build_s for e in entries), 3))


def commit_merge(
    d: Path,
    tmp: Path,
    entry: ShardEntry,
    replaces: Sequence[ShardEntry],
    then: Optional[Callable[[Manifest, Manifest], None]] = None,
) -> Optional[Manifest]:
    """List the merged shard written in ``tmp`` where the shards ``replaces`` are listed,
    under ``DIR/.lock`` (call it while holding the writer's own lock too, if any), then
    call ``then(manifest before, manifest now)`` still under it; if that raises, the
    manifest before is put back and the merged shard removed. Then, still under the lock,
    the replaced shards' directories are removed (processes reading them keep their open
    files): another process's add, which cleans up under that lock, never finds them
    unlisted and mistakes them for an interrupted add's.

    Returns:
        The manifest now, or None when ``replaces`` is no longer listed as one run of
        shards (another merge came first): nothing was changed then, ``then`` was not
        called, and ``tmp`` is the caller's to remove.
    """
    with locked(d / ".lock"):
        manifest = read_manifest(d)
        names = [s.name for s in manifest.shards]
        if not replaces or replaces[0].name not in names:
            return None
        k = names.index(replaces[0].name)
        if tuple(manifest.shards[k : k + len(replaces)]) != tuple(replaces):
            return None
        name = next_shard_name(d, manifest)
        install_shard(d, tmp, name)
        shards = manifest.shards[:k] + (replace(entry, name=name),) + manifest.shards[k + len(replaces) :]
        new = replace(manifest, shards=shards, updated=now())
        try:
            write_manifest(d, new)
        except BaseException:
            remove_shards(d, [name])
            raise
        if then is not None:
            try:
                then(manifest, new)
            except BaseException:
                try:
                    write_manifest(d, manifest)
                except OSError as e:
                    logger.error("datastore %s: cannot undo a merge (%s)", d, e)
                else:
                    remove_shards(d, [name])
                raise
        remove_shards(d, [s.name for s in replaces])
        return new


def compact_datastore(directory: str | os.PathLike, *, progress: bool = False) -> DatastoreInfo:
    """Merge every shard of the datastore ``directory`` into one (``ragspec datastore
    compact``): lookups then search one index, as in a datastore built at once. Safe while
    servers serve (and add to) it: see the module docstring; an addition that lands while
    the merge runs stays a shard of its own after it.

    Returns:
        The datastore's new info.

    Raises:
        DatastoreError / DatastoreFormatError: no datastore there, or a damaged one.
    """
    d = Path(directory)
    with Datastore.open(d) as ds:
        n = ds.num_shards
        if n > 1:
            with held_shard_tmp(d) as tmp:
                entry = merge_shards(ds, 0, n, tmp, progress=progress)
                done = commit_merge(d, tmp, entry, ds.manifest.shards[:n])
            if done is None:
                logger.warning("%s changed while it was merged: left as it is", d)
    with Datastore.open(d) as ds:
        return ds.info()
