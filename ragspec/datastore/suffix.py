"""The index of a token array, and its search kernels (pure functions).

The index is a suffix array of the *reversed* token array, stored as forward end
positions: ``sa`` lists every end position e (1..n) ordered by the reversed prefix
``tokens[e-1], tokens[e-2], ..., tokens[0]``. Matching the context's suffixes is then
matching prefixes of the reversed context, and prefixes are what a sorted array answers in
one binary search: the longest suffix of the context that occurs in the corpus is the
longest common prefix of the reversed context with its two neighbours in ``sa`` (REST
tries the lengths one by one, He et al. 2024, section 3.1). The occurrences of that suffix
are a contiguous range of ``sa`` around the insertion point, and each entry e is where a
continuation starts.

Order: token ids compare as unsigned 32-bit numbers, so the separator -1 (0xFFFFFFFF)
sorts after every token; a sequence sorts before every longer sequence it is a prefix of.

Why little-endian bytes: the searches compare ``bytes``. Reversing the bytes of a slice of
little-endian int32 reverses the token order *and* makes each token big-endian, and
big-endian bytes compare like unsigned numbers, so one slice, one reversal and one memcmp
compare a reversed prefix against the key.

Worked example (tokens, separator written as |)::

    tokens  = [5, 6, 5, 7, |]            n = 5
    reversed prefixes: e=1 [5]; e=2 [6,5]; e=3 [5,6,5]; e=4 [7,5,6,5]; e=5 [|,7,5,6,5]
    sorted: [5] < [5,6,5] < [6,5] < [7,5,6,5] < [|,...]   ->   sa = [1, 3, 2, 4, 5]
    context [9, 5] (reversed key [5, 9]): insertion point 2, neighbours e=3 ([5,6,5]) and
    e=2 ([6,5]); longest common prefix 1 token -> the suffix [5] occurs, range sa[0:2] =
    e in {1, 3}, continuations tokens[1:] = [6, 5, 7] and tokens[3:] = [7].
"""

from __future__ import annotations

import logging
import mmap
import sys
from typing import Sequence, cast

import numpy as np

from .format import SEPARATOR_ID, TOKEN_DTYPE

logger = logging.getLogger(__name__)

__all__ = [
    "build_suffix_array",
    "reverse_prefix_order",
    "suffix_array_numpy",
    "dense_ranks",
    "encode_reversed_key",
    "reversed_bytes",
    "common_tokens",
    "lower_bound",
    "upper_bound",
    "lower_bound_from",
    "upper_bound_from",
    "longest_match",
    "sa_view",
]


def dense_ranks(tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """Map token ids to a dense alphabet 0..K-1 that keeps their order (separator last).

    Args:
        tokens: int [T] token ids, with SEPARATOR_ID (-1) between documents.

    Returns:
        (ranks, K): ranks as the smallest unsigned dtype holding K symbols, K distinct
        symbols. Order-preserving, so a suffix array of the ranks is one of the tokens.
    """
    ids = np.asarray(tokens)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint8), 0
    is_sep = ids == SEPARATOR_ID
    max_id = int(ids.max()) if not is_sep.all() else -1
    if bool(np.any((ids < 0) & ~is_sep)):
        raise ValueError("token ids must be >= 0 (only the separator is negative)")
    sep_slot = max_id + 1
    work = np.int32 if sep_slot < 2**31 else np.int64  # int32 keeps the peak memory of a build low
    slots = np.where(is_sep, sep_slot, ids).astype(work, copy=False)  # [T] separator after every token
    del is_sep
    present = np.zeros(sep_slot + 1, dtype=bool)
    present[slots] = True
    rank_of_slot = (np.cumsum(present, dtype=np.int64) - 1).astype(work)  # [max_id + 2]
    k = int(present.sum())
    dtype = np.uint8 if k <= 1 << 8 else np.uint16 if k <= 1 << 16 else np.uint32
    return rank_of_slot[slots].astype(dtype), k


def suffix_array_numpy(ranks: np.ndarray) -> np.ndarray:
    """Suffix array by prefix doubling in numpy, O(T log^2 T): the fallback when
    pydivsufsort is not installed, and the reference in tests.

    Args:
        ranks: unsigned [T] symbols.

    Returns:
        int64 [T]: start positions of the suffixes in lexicographic order (a suffix that is
        a prefix of another sorts first).
    """
    n = int(ranks.shape[0])
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = ranks.astype(np.int64) + 1  # 0 is reserved for "past the end"
    k = 1
    sa = np.argsort(rank, kind="stable")
    while True:
        second = np.zeros(n, dtype=np.int64)
        if k < n:
            second[: n - k] = rank[k:]
        sa = np.lexsort((second, rank))  # by rank, then by rank k further on
        key_r, key_s = rank[sa], second[sa]
        new_group = np.ones(n, dtype=bool)
        new_group[1:] = (key_r[1:] != key_r[:-1]) | (key_s[1:] != key_s[:-1])
        new_rank = np.empty(n, dtype=np.int64)
        new_rank[sa] = np.cumsum(new_group)
        rank = new_rank
        if bool(new_group.all()) or 2 * k >= n:
            return sa
        k *= 2


_NUMPY_BELOW = 1 << 14
"""Below this many symbols numpy's prefix doubling sorts faster than pydivsufsort, whose
every call costs ~12 ms however short the input (a runtime addition is often tiny)."""


def build_suffix_array(symbols: np.ndarray) -> np.ndarray:
    """Suffix array (start positions, int32 or int64 [T]) of an array of token ids, in the unsigned
    order of the module docstring. pydivsufsort (libdivsufsort, O(T log T)) when installed,
    numpy prefix doubling otherwise and below :data:`_NUMPY_BELOW` symbols (the same array:
    the order is total)."""
    ranks, _k = dense_ranks(symbols)
    if ranks.shape[0] < _NUMPY_BELOW:
        return suffix_array_numpy(ranks)
    try:
        import pydivsufsort
    except ImportError:
        logger.warning("pydivsufsort is not installed (pip install pydivsufsort); using the slower numpy suffix sort")
        return suffix_array_numpy(ranks)
    # for 2- and 4-byte symbols pydivsufsort sorts their big-endian bytes and keeps the
    # aligned positions, which is the same order
    return np.asarray(pydivsufsort.divsufsort(ranks))  # int32 (int64 past 2^31 bytes)


def reverse_prefix_order(tokens: np.ndarray) -> np.ndarray:
    """The datastore index: end positions e (1..T) sorted by reversed prefix (see the module
    docstring).

    Args:
        tokens: int32 [T] token ids with separators.

    Returns:
        int32 [T] (int64 when T >= 2^31) little-endian.
    """
    n = int(np.asarray(tokens).shape[0])
    out_dtype = np.dtype("<i4") if n < 2**31 else np.dtype("<i8")
    sa = build_suffix_array(np.ascontiguousarray(np.asarray(tokens)[::-1]))  # starts j in the reversed array
    sa = sa.astype(out_dtype, copy=False)
    np.subtract(n, sa, out=sa)  # reversed suffix at j reads forward tokens n-1-j, n-2-j, ...: end n - j
    return sa


def encode_reversed_key(token_ids: Sequence[int]) -> bytes:
    """The context's tokens, last first, as big-endian int32 bytes (what searches compare)."""
    return np.asarray(token_ids, dtype=np.int64)[::-1].astype(">i4").tobytes()


def reversed_bytes(tok: bytes | mmap.mmap, end: int, nbytes: int) -> bytes:
    """Up to ``nbytes`` bytes of the reversed prefix ending at token ``end`` of ``tok``
    (little-endian int32 bytes), as big-endian tokens, last token first."""
    stop = end << 2
    start = stop - nbytes
    return tok[start if start > 0 else 0 : stop][::-1]


def common_tokens(a: bytes, b: bytes) -> int:
    """Number of leading whole tokens (4 bytes each) two byte strings share."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    same = n if x == 0 else n - (x.bit_length() + 7) // 8
    return same >> 2


def lower_bound(tok: bytes | mmap.mmap, sa: Sequence[int], key: bytes, lo: int, hi: int) -> int:
    """First index i in [lo, hi) whose reversed prefix (first len(key) bytes) is >= key, or hi.

    Args:
        tok: the shard's tokens as little-endian int32 bytes (an mmap or bytes).
        sa: the index (see :func:`sa_view`).
        key: from :func:`encode_reversed_key`.
    """
    kb = len(key)
    while lo < hi:
        mid = (lo + hi) >> 1
        stop = sa[mid] << 2
        start = stop - kb
        if tok[start if start > 0 else 0 : stop][::-1] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def upper_bound(tok: bytes | mmap.mmap, sa: Sequence[int], key: bytes, lo: int, hi: int) -> int:
    """First index i in [lo, hi) whose reversed prefix (first len(key) bytes) is > key, or hi."""
    kb = len(key)
    while lo < hi:
        mid = (lo + hi) >> 1
        stop = sa[mid] << 2
        start = stop - kb
        if tok[start if start > 0 else 0 : stop][::-1] <= key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def upper_bound_from(tok: bytes | mmap.mmap, sa: Sequence[int], key: bytes, anchor: int, hi: int) -> int:
    """:func:`upper_bound` by galloping up from ``anchor`` (an index whose reversed prefix
    starts with ``key``): O(log r) for a range of r occurrences instead of O(log n)."""
    kb = len(key)
    step, prev = 1, anchor
    while True:
        probe = anchor + step
        if probe >= hi:
            break
        if reversed_bytes(tok, sa[probe], kb) > key:
            hi = probe
            break
        prev = probe
        step <<= 1
    return upper_bound(tok, sa, key, prev + 1, hi)


def lower_bound_from(tok: bytes | mmap.mmap, sa: Sequence[int], key: bytes, anchor: int, lo: int = 0) -> int:
    """:func:`lower_bound` by galloping down from ``anchor`` (an index whose reversed prefix
    starts with ``key``)."""
    kb = len(key)
    step, prev = 1, anchor
    while True:
        probe = anchor - step
        if probe < lo:
            break
        if reversed_bytes(tok, sa[probe], kb) < key:
            lo = probe + 1
            break
        prev = probe
        step <<= 1
    return lower_bound(tok, sa, key, lo, prev)


def longest_match(tok: bytes | mmap.mmap, sa: Sequence[int], n: int, key: bytes, min_len: int) -> tuple[int, int, int]:
    """The longest prefix of ``key`` (a reversed context) that some entry starts with.

    Example: see the module docstring (key [5, 9] -> length 1, range (0, 2)).

    Returns:
        (L, lo, hi): L tokens matched and the range [lo, hi) of entries that start with
        them; (0, 0, 0) when fewer than ``min_len`` tokens match.
    """
    kb = len(key)
    ins = lower_bound(tok, sa, key, 0, n)
    best, anchor = 0, -1
    for idx in (ins - 1, ins):
        if 0 <= idx < n:
            length = common_tokens(key, reversed_bytes(tok, sa[idx], kb))
            if length > best:
                best, anchor = length, idx
    if best < min_len:
        return 0, 0, 0
    sub = key[: 4 * best]
    return best, lower_bound_from(tok, sa, sub, anchor), upper_bound_from(tok, sa, sub, anchor, n)


def sa_view(sa: np.ndarray) -> Sequence[int]:
    """A sequence whose ``[i]`` is the Python int ``sa[i]``, as cheap as possible.

    A memoryview cast to native ints indexes ~5x faster than a numpy array; used when the
    array is native-endian and contiguous, numpy otherwise.
    """
    native = (sa.dtype.byteorder == "=") or (sa.dtype.byteorder == "<" and sys.byteorder == "little")
    if native and sa.flags["C_CONTIGUOUS"] and sa.dtype.itemsize in (4, 8):
        return sa.data.cast("B").cast("i" if sa.dtype.itemsize == 4 else "q")
    return cast(Sequence[int], sa)  # indexes like one (numpy ints)


assert TOKEN_DTYPE == np.dtype("<i4"), "the searches rely on little-endian int32 tokens"
