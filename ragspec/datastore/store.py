"""A datastore opened for lookup: memory-mapped shards and the REST continuation search.

Lookup (REST, He et al. 2024, section 3.1): take the longest suffix of the context (at most
``max_match`` tokens, at least ``min_match``) that occurs in the corpus, find all its
occurrences, and return the tokens that follow them, identical continuations counted
together. The index (see :mod:`.suffix`) finds the longest suffix and its occurrences with
one binary search plus two short gallops per shard.

Glossary:
    context suffix / key: the last L tokens of the live context, searched for.
    occurrence: a corpus position where the key occurs (a range of the index).
    continuation: up to ``max_len`` tokens following an occurrence, never past the end of
        its document.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from ragspec.errors import DatastoreFormatError

from .format import (
    DOCS_DTYPE,
    DOCS_FILE,
    MANIFEST_NAME,
    SA_FILE,
    SEPARATOR_ID,
    SOURCES_FILE,
    TOKEN_DTYPE,
    TOKENS_FILE,
    Manifest,
    ShardEntry,
    check_files,
    check_tokenizer,
    find_leftovers,
    read_manifest,
)
from .suffix import encode_reversed_key, longest_match, sa_view

logger = logging.getLogger(__name__)

__all__ = ["Continuation", "Lookup", "Datastore", "DatastoreInfo", "PositionFilter"]

_SEP_U32 = 0xFFFFFFFF
_FEW = 24  # occurrences below which counting runs in plain Python
_ID_LIMIT = 2**31 - 1
_END = (_SEP_U32,)  # sorts after every token id
_SCAN_UNRECORDED = 1 << 24  # shards of older builds (no id range recorded) up to 64 MiB of ids are scanned at open
MAP_FROM_BYTES = 1 << 22
"""A shard whose tokens and index files hold at least this many bytes together (4 MiB,
~0.5M tokens) is memory-mapped: two open files while the datastore is open; a smaller one
is read into memory and holds no file open."""
_OPEN_TRIES = 3  # a shard merged away between reading the manifest and opening it: read it again


class Continuation(NamedTuple):
    """Tokens that followed a context suffix in the corpus (a named tuple: cheap to make).

    Attributes:
        tokens: the continuation's token ids (1 to ``max_len`` of them).
        count: how many occurrences of the suffix it followed (an estimate, scaled from an
            evenly spaced sample, when the suffix occurs more than ``max_samples`` times).
        match_len: length in tokens of the matched context suffix.
    """

    tokens: tuple[int, ...]
    count: int  # type: ignore[assignment]  # shadows tuple.count on purpose: the public field name
    match_len: int


@runtime_checkable
class Lookup(Protocol):
    """Anything that answers continuation queries (a datastore, a per-request index)."""

    def continuations(
        self, suffix_ids: Sequence[int], max_len: int = 10, max_candidates: int = 64
    ) -> list[Continuation]:
        """Continuations of the longest matching suffix of ``suffix_ids``, most frequent
        first (ties by token ids); empty when no suffix of at least the minimum length matches."""


class PositionFilter(Protocol):
    """Selects corpus positions a lookup should prefer (see :mod:`.semantic`)."""

    def contains(self, shard: int, positions: np.ndarray) -> np.ndarray:
        """bool [M]: whether each position (int64 [M], offsets in the shard's tokens) is preferred."""


@dataclass(frozen=True)
class DatastoreInfo:
    """Summary of a datastore on disk (what ``ragspec datastore info`` prints)."""

    path: str
    format_version: int
    tokenizer_name: str
    tokenizer_fingerprint: str
    vocab_size: int
    num_documents: int
    num_tokens: int
    num_shards: int
    bytes_on_disk: int
    created: str
    updated: str
    build_s: float
    """Seconds spent tokenizing, indexing and writing all shards (each build's and add's
    own time; loading the tokenizer or a model is not counted)."""
    skipped_files: int = 0
    """Input files skipped as binary, over all builds and adds."""
    skipped_lines: int = 0
    """JSONL lines skipped as malformed, over all builds and adds."""
    leftovers: tuple[str, ...] = ()
    """What interrupted builds and adds left (see :func:`~ragspec.datastore.format.find_leftovers`):
    removed by the next build of this directory (the ones next to it) or add to it (inside)."""

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_on_disk / self.num_tokens if self.num_tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format_version": self.format_version,
            "tokenizer_name": self.tokenizer_name,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "vocab_size": self.vocab_size,
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "num_shards": self.num_shards,
            "bytes_on_disk": self.bytes_on_disk,
            "bytes_per_token": round(self.bytes_per_token, 3),
            "created": self.created,
            "updated": self.updated,
            "build_s": round(self.build_s, 3),
            "skipped_files": self.skipped_files,
            "skipped_lines": self.skipped_lines,
            "leftovers": list(self.leftovers),
        }


def _map(path: Path, small: bool = False) -> mmap.mmap | bytes:
    """The file's bytes: mapped (the map keeps a duplicate of the file descriptor open), or
    read into memory when ``small`` (no file kept open)."""
    with open(path, "rb") as f:
        if small:
            return f.read()
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)  # binary searches touch pages at random: no read-ahead
    return mm


class _Shard:
    """One opened shard: memory maps and array views over them (read-only).

    Attributes:
        tok: the tokens file mapped (or read, for a shard under :data:`MAP_FROM_BYTES`),
            bytes-like (little-endian int32, what the searches slice).
        tokens: ``<i4 [n]`` view of it (separator = -1).
        sa: the index ``[n]`` (end positions); sa_seq: the same, indexable as Python ints.
        docs: int64 [D + 1] document starts.
    """

    def __init__(self, entry: ShardEntry, tok: mmap.mmap | bytes, sa_mm: mmap.mmap | bytes, docs: np.ndarray) -> None:
        self.entry = entry
        self.length = entry.length
        self.tok = tok
        self.tokens = np.frombuffer(tok, dtype=TOKEN_DTYPE)  # [n]
        self.sa_mm = sa_mm
        self.sa = np.frombuffer(sa_mm, dtype=np.dtype(entry.sa_dtype))  # [n]
        self.sa_seq = sa_view(self.sa)
        self.docs = docs

    @classmethod
    def map(cls, directory: Path, entry: ShardEntry) -> "_Shard":
        """Map a shard's files (read them, under :data:`MAP_FROM_BYTES`) and check their
        lengths and document offsets."""
        sdir = directory / entry.name
        small = entry.files[TOKENS_FILE].bytes + entry.files[SA_FILE].bytes < MAP_FROM_BYTES
        tok = _map(sdir / TOKENS_FILE, small)
        shard = cls(entry, tok, _map(sdir / SA_FILE, small), np.fromfile(sdir / DOCS_FILE, dtype=DOCS_DTYPE))
        n, docs = shard.length, shard.docs
        if shard.tokens.shape[0] != n or shard.sa.shape[0] != n or docs.shape[0] != entry.num_documents + 1:
            raise DatastoreFormatError(f"{str(sdir)!r}: array lengths do not match the manifest")
        if n and (int(docs[0]) != 0 or int(docs[-1]) != n or int(shard.tokens[n - 1]) != SEPARATOR_ID):
            raise DatastoreFormatError(f"{str(sdir)!r}: document offsets or separators are damaged")
        return shard


def _check_id_range(directory: Path, shard: _Shard, vocab_size: int, *, scan: bool) -> None:
    """Token ids of ``shard`` within ``[0, vocab_size)``: the range its manifest entry
    records, and with ``scan`` (or for an older shard without a range, when small) every id.

    Raises:
        DatastoreFormatError: naming the shard, the ids found and the vocabulary size.
    """
    e = shard.entry
    where = str(directory / e.name)
    if e.min_id is not None and e.max_id is not None and (e.min_id < 0 or e.max_id >= vocab_size):
        raise DatastoreFormatError(
            f"{where!r}: token ids {e.min_id}..{e.max_id} (manifest) are outside the vocabulary of "
            f"{vocab_size} tokens (built for another tokenizer, or a damaged manifest)"
        )
    unrecorded = e.min_id is None or e.max_id is None
    if not (scan or (unrecorded and shard.length <= _SCAN_UNRECORDED)):
        if unrecorded:
            logger.info("%s: no id range recorded (older build); its ids are checked by --verify", where)
        return
    if shard.length == 0:
        return
    tokens = shard.tokens
    lo, hi = int(tokens.min()), int(tokens.max())  # separators are -1
    if lo < SEPARATOR_ID or hi >= vocab_size:
        bad = np.flatnonzero((tokens < SEPARATOR_ID) | (tokens >= vocab_size))  # [B] (the error path only)
        raise DatastoreFormatError(
            f"{str(directory / e.name / TOKENS_FILE)!r} holds {len(bad)} token id(s) outside the vocabulary of "
            f"{vocab_size} tokens (the first: {int(tokens[bad[0]])} at position {int(bad[0])}; damaged file: "
            "rebuild the datastore)"
        )


def _open_shards(
    d: Path, manifest: Manifest, held: dict[str, "_Shard"], vocab_size: int, verify: bool
) -> list["_Shard"]:
    """The shards ``manifest`` lists: those of ``held`` (by name) whose entry is the same
    reused, the others checked and opened.

    Raises:
        DatastoreFormatError: a shard's files are missing, of the wrong size, cannot be
            opened, or hold ids outside the vocabulary.
    """
    shards = []
    for entry in manifest.shards:
        old = held.get(entry.name)
        if old is not None and old.entry == entry:
            shards.append(old)
            continue
        check_files(d, entry, verify_checksums=verify)
        try:
            shards.append(_Shard.map(d, entry))
        except (OSError, ValueError) as e:
            raise DatastoreFormatError(f"{str(d / entry.name)!r}: cannot map shard files ({e})") from e
        _check_id_range(d, shards[-1], vocab_size, scan=verify)
    return shards


class Datastore:
    """A read-only datastore: shards of token ids with their indexes, searched in place.

    Open with :meth:`open`; build with :func:`ragspec.datastore.build_datastore`. Lookups
    do not mutate anything, so one datastore may serve many threads (do not ``close`` it
    while lookups run).

    Args (of the constructor, used by :meth:`open`): see the attributes.

    Attributes:
        path: the datastore directory.
        manifest: its parsed manifest.
        min_match: shortest context suffix searched (tokens).
        max_match: longest context suffix searched (tokens).
        max_samples: most occurrences read per lookup; beyond, an evenly spaced sample of
            the index range (ordered by the tokens before the match, i.e. unrelated to the
            continuations), whose counts are scaled up to estimates.
    """

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        shards: Sequence[_Shard],
        *,
        min_match: int = 2,
        max_match: int = 16,
        max_samples: int = 64,
    ) -> None:
        if not (1 <= min_match <= max_match):
            raise ValueError(f"need 1 <= min_match <= max_match, got {min_match}, {max_match}")
        if max_samples < 1:
            raise ValueError(f"max_samples must be >= 1, got {max_samples}")
        self.path = path
        self.manifest = manifest
        self._shards = tuple(shards)
        self.min_match = min_match
        self.max_match = max_match
        self.max_samples = max_samples
        self._doc_starts = np.cumsum([0] + [s.entry.num_documents for s in self._shards])  # [S + 1]

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        tokenizer: Any = None,
        *,
        verify: bool = False,
        warm: bool = False,
        min_match: int = 2,
        max_match: int = 16,
        max_samples: int = 64,
    ) -> "Datastore":
        """Open a datastore directory.

        Args:
            path: the directory written by ``build_datastore``.
            tokenizer: if given, its vocabulary fingerprint must equal the one the datastore
                was built with.
            verify: also check the sha256 of every file and scan every token id against the
                vocabulary (reads the whole datastore); sizes are always checked, and so is
                the id range the manifest recorded at build (no file read).
            warm: fault every page in now (see :meth:`warm`), for steady lookup latency.
            min_match, max_match, max_samples: see the class attributes.

        Raises:
            DatastoreError: no datastore there.
            DatastoreFormatError: unknown format version, missing, truncated or (with
                ``verify``) damaged files; token ids outside the vocabulary (recorded in the
                manifest, or found by the scan).
            TokenizerMismatchError: ``tokenizer`` is not the one the datastore was built with.

        Token ids: the range each shard's manifest entry recorded at build is checked against
        the vocabulary (of ``tokenizer``, else the one recorded). A shard of an older build
        (no range recorded) is scanned when it holds at most 2^24 ids (64 MiB, tens of
        milliseconds), else only with ``verify``. A ``tokens.bin`` damaged in place (same
        size) passes without ``verify``; the engine then drops every draft id outside the
        vocabulary (see :func:`ragspec.tree.drop_invalid_nodes`), so generations stay
        correct.
        """
        d = Path(path)
        manifest = read_manifest(d)
        vocab_size = manifest.tokenizer.vocab_size
        if tokenizer is not None:
            vocab_size = check_tokenizer(manifest.tokenizer, tokenizer, f"datastore {str(d)!r}").vocab_size
        for attempt in range(_OPEN_TRIES):
            try:
                shards = _open_shards(d, manifest, {}, vocab_size, verify)
                break
            except DatastoreFormatError:
                # a merge may have replaced the shards since the manifest was read
                again = read_manifest(d)
                if again == manifest or attempt == _OPEN_TRIES - 1:
                    raise
                manifest = again
        ds = cls(d, manifest, shards, min_match=min_match, max_match=max_match, max_samples=max_samples)
        if warm:
            ds.warm()
        return ds

    def reopen(self, manifest: Optional[Manifest] = None) -> "Datastore":
        """This datastore as ``manifest`` lists it (None: as its manifest on disk says now),
        with the same lookup settings: the shards this copy holds and the manifest still
        lists unchanged (same name, sizes and checksums) are shared, not opened again; only
        the others are mapped or read. This copy is left as it is (requests using it go
        on), and no shard is opened twice, so a copy after an addition holds the files of
        one more shard at most.

        Raises:
            DatastoreFormatError: a new shard's files are missing, damaged or cannot be
                opened (too many open files, say).
        """
        m = manifest if manifest is not None else read_manifest(self.path)
        held = {sh.entry.name: sh for sh in self._shards}
        shards = _open_shards(self.path, m, held, m.tokenizer.vocab_size, False)
        return Datastore(
            self.path, m, shards, min_match=self.min_match, max_match=self.max_match, max_samples=self.max_samples
        )

    # ------------------------------------------------------------------ properties

    @property
    def num_shards(self) -> int:
        return len(self._shards)

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def num_documents(self) -> int:
        return self.manifest.num_documents

    def info(self) -> DatastoreInfo:
        """Summary: format, tokenizer, counts, bytes on disk, build times."""
        size = (self.path / MANIFEST_NAME).stat().st_size
        size += sum(f.bytes for s in self.manifest.shards for f in s.files.values())
        m = self.manifest
        leftovers = tuple(str(p) for p in find_leftovers(self.path, m))
        return DatastoreInfo(
            path=str(self.path),
            format_version=m.format_version,
            tokenizer_name=m.tokenizer.name,
            tokenizer_fingerprint=m.tokenizer.fingerprint,
            vocab_size=m.tokenizer.vocab_size,
            num_documents=m.num_documents,
            num_tokens=m.num_tokens,
            num_shards=len(m.shards),
            bytes_on_disk=size,
            created=m.created,
            updated=m.updated,
            build_s=m.build_s,
            skipped_files=sum(s.skipped_files for s in m.shards),
            skipped_lines=sum(s.skipped_lines for s in m.shards),
            leftovers=leftovers,
        )

    def document(self, index: int) -> np.ndarray:
        """Token ids int32 [T_doc] of document ``index`` (0-based, over all shards in order)."""
        if not 0 <= index < self.num_documents:
            raise IndexError(f"document {index} out of range (datastore has {self.num_documents})")
        s = int(np.searchsorted(self._doc_starts, index, side="right")) - 1
        shard = self._shards[s]
        j = index - int(self._doc_starts[s])
        start, end = int(shard.docs[j]), int(shard.docs[j + 1]) - 1  # drop the separator
        return np.array(shard.tokens[start:end], dtype=np.int32)

    def sources(self, shard: int) -> list[dict[str, Any]]:
        """Input files of a shard: path, sha256, bytes, num_documents."""
        import json

        path = self.path / self._shards[shard].entry.name / SOURCES_FILE
        return json.loads(path.read_text(encoding="utf-8"))

    def shard_tokens(self, shard: int) -> np.ndarray:
        """Token ids int32 [T + D] of a shard, separators (-1) included (read-only view)."""
        return self._shards[shard].tokens

    def shard_documents(self, shard: int) -> np.ndarray:
        """int64 [D + 1]: start of each document of a shard in :meth:`shard_tokens`, then its length."""
        return self._shards[shard].docs

    def warm(self) -> float:
        """Read every page of the memory maps now and map it into this process.

        The first touch of a page costs a page fault (~2 us when the file is in the page
        cache, a disk read otherwise); a binary search touches ~30 scattered pages, so a cold
        datastore answers in milliseconds, a warm one in tens of microseconds. Serving
        processes should call this once after :meth:`open` (it reads the whole datastore:
        ~0.3 s per GB from the page cache).

        Returns:
            Seconds spent.
        """
        t0 = time.perf_counter()
        page = mmap.PAGESIZE
        for shard in self._shards:
            for mm in (shard.tok, shard.sa_mm):
                if hasattr(mm, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
                    mm.madvise(mmap.MADV_WILLNEED)  # read ahead asynchronously
                view = np.frombuffer(mm, dtype=np.uint8)
                int(view[::page].max())  # touch one byte per page: fault it in
        return time.perf_counter() - t0

    def close(self) -> None:
        """Drop the memory maps (they are unmapped once no array view refers to them)."""
        self._shards = ()

    def __enter__(self) -> "Datastore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Datastore({str(self.path)!r}, shards={self.num_shards}, tokens={self.num_tokens})"

    # ------------------------------------------------------------------ lookup

    def match(self, suffix_ids: Sequence[int]) -> tuple[int, list[tuple[int, int, int]]]:
        """Longest matching context suffix: (L, [(shard, lo, hi), ...]) with the index range
        [lo, hi) of each shard holding it; (0, []) when nothing of at least ``min_match``
        tokens matches."""
        q = [int(t) for t in list(suffix_ids)[-self.max_match :]]
        bad = [i for i, t in enumerate(q) if not 0 <= t < _ID_LIMIT]
        if bad:
            q = q[bad[-1] + 1 :]  # an id no document holds (e.g. -1) cannot be part of a match
        if len(q) < self.min_match:
            return 0, []
        key = encode_reversed_key(q)
        best, ranges = 0, []
        for si, shard in enumerate(self._shards):
            length, lo, hi = longest_match(shard.tok, shard.sa_seq, shard.length, key, max(best, self.min_match))
            if length > best:
                best, ranges = length, [(si, lo, hi)]
            elif length and length == best:
                ranges.append((si, lo, hi))
        return best, ranges

    def continuations(
        self,
        suffix_ids: Sequence[int],
        max_len: int = 10,
        max_candidates: int = 64,
        *,
        prefer: Optional[PositionFilter] = None,
    ) -> list[Continuation]:
        """Continuations of the longest matching suffix of ``suffix_ids``.

        Example: a corpus of one document [1, 2, 3, 1, 2, 4, 1, 2, 3]; suffix_ids [9, 1, 2]
        matches on [1, 2] (L = 2; [9, 1, 2] does not occur) at positions 0, 3 and 6, followed
        (max_len 5, cut at the document end) by [3, 1, 2, 4, 1], [4, 1, 2, 3] and [3] ->
        [(3, 1, 2, 4, 1), (3,), (4, 1, 2, 3)], each with count 1 and match_len 2 (equal
        counts: by token ids, the document end sorting after every token).

        Args:
            suffix_ids: the context (its last ``max_match`` tokens are used).
            max_len: most tokens per continuation.
            max_candidates: most distinct continuations returned.
            prefer: keep only occurrences inside the preferred positions when at least one
                is (see :class:`ragspec.datastore.semantic.SemanticSelector`).

        Returns:
            Distinct continuations, most frequent first, ties by token ids with the document
            end sorting after every token (the suffix array's order; deterministic); [] when
            no suffix of at least ``min_match`` tokens matches. Over several shards, each
            shard's ``max_candidates`` most frequent continuations are merged.
        """
        if max_len <= 0 or max_candidates <= 0:
            return []
        length, ranges = self.match(suffix_ids)
        if not length:
            return []
        counts: dict[tuple[int, ...], float] = {}
        if prefer is None and sum(hi - lo for _, lo, hi in ranges) <= _FEW:
            self._count_few(ranges, max_len, counts)
        else:
            self._count_many(self._sample(ranges, prefer, length), max_len, max_candidates, counts)
        # ties in suffix-array order: by token ids, a continuation cut by its document's end
        # after the longer ones it is a prefix of
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0] + _END))[:max_candidates]
        return [Continuation(tokens, max(1, int(round(c))), length) for tokens, c in ranked]

    def _count_few(
        self, ranges: list[tuple[int, int, int]], max_len: int, counts: dict[tuple[int, ...], float]
    ) -> None:
        """Count the continuations of a few occurrences in plain Python (numpy's per-call
        overhead dominates below a few dozen rows)."""
        fmt = struct.Struct(f"<{max_len}i")
        for si, lo, hi in ranges:
            shard = self._shards[si]
            tok, sa = shard.tok, shard.sa_seq
            for i in range(lo, hi):
                p = sa[i] << 2  # the continuation starts at the match's end
                raw = tok[p : p + 4 * max_len]
                vals = fmt.unpack(raw) if len(raw) == fmt.size else struct.unpack(f"<{len(raw) // 4}i", raw)
                try:
                    vals = vals[: vals.index(SEPARATOR_ID)]  # stop at the document end
                except ValueError:
                    pass
                if vals:
                    counts[vals] = counts.get(vals, 0.0) + 1.0

    def _count_many(
        self,
        picks: list[tuple[int, np.ndarray, float]],
        max_len: int,
        max_candidates: int,
        counts: dict[tuple[int, ...], float],
    ) -> None:
        """Count the continuations of sampled occurrences, vectorised; only the
        ``max_candidates`` most frequent of each shard become Python tuples."""
        steps = np.arange(max_len, dtype=np.int64)
        width = 4 * max_len
        for si, idx, weight in picks:
            shard = self._shards[si]
            pos = shard.sa[idx].astype(np.int64)  # [M] first continuation token (the match's end)
            win = np.minimum(pos[:, None] + steps, shard.length - 1)  # [M, max_len]
            rows = shard.tokens[win].view(np.uint32)  # [M, max_len], separator = 0xFFFFFFFF
            # everything from a separator on is padding: continuations stop at the document end
            rows[np.logical_or.accumulate(rows == _SEP_U32, axis=1)] = _SEP_U32
            # one byte string per row, big-endian: bytes order = token order (separator last),
            # so a single np.unique sorts, groups and counts the rows
            keys = rows.astype(">u4").view(f"S{width}").ravel()  # [M] (equal lengths: NUL padding is harmless)
            uniq, sizes = np.unique(keys, return_counts=True)  # [G] sorted
            if len(uniq) > max_candidates:
                top = np.argsort(-sizes, kind="stable")[:max_candidates]  # ties: by tokens
                uniq, sizes = uniq[top], sizes[top]
            table = np.frombuffer(uniq.astype(f"S{width}").tobytes(), dtype=">u4").reshape(-1, max_len)  # [G, max_len]
            for row, size in zip(table.tolist(), sizes.tolist()):
                try:
                    row = row[: row.index(_SEP_U32)]
                except ValueError:
                    pass
                if row:  # empty: the match ends its document, nothing follows
                    cont = tuple(row)
                    counts[cont] = counts.get(cont, 0.0) + size * weight

    def _sample(
        self, ranges: list[tuple[int, int, int]], prefer: Optional[PositionFilter], length: int
    ) -> list[tuple[int, np.ndarray, float]]:
        """Index entries to read per shard, with the number of occurrences each stands for.

        Evenly spaced over each range (which is ordered by the tokens *before* the match, so
        this is a spread-out sample of the occurrences); shards get samples in proportion to
        their number of occurrences.
        """
        cap = self.max_samples
        if prefer is not None:
            kept = []
            scan_cap = 64 * cap
            for si, lo, hi in ranges:
                size = hi - lo
                scan = min(size, scan_cap)
                idx = lo + (np.arange(scan, dtype=np.int64) * size) // scan  # [scan]
                starts = self._shards[si].sa[idx].astype(np.int64) - length  # [scan] match starts
                inside = prefer.contains(si, starts)
                if inside.any():
                    kept.append((si, idx[inside], size / scan))
            if kept:
                total = sum(len(idx) for _, idx, _ in kept)
                out = []
                for si, idx, weight in kept:
                    m = len(idx) if total <= cap else max(1, (cap * len(idx)) // total)
                    sel = (np.arange(m, dtype=np.int64) * len(idx)) // m
                    out.append((si, idx[sel], weight * len(idx) / m))
                return out
        total = sum(hi - lo for _, lo, hi in ranges)
        out = []
        for si, lo, hi in ranges:
            size = hi - lo
            m = size if total <= cap else max(1, min(size, (cap * size) // total))
            idx = lo + (np.arange(m, dtype=np.int64) * size) // m  # [m] evenly spaced, distinct
            out.append((si, idx, size / m))
        return out
