"""Prefix caching: the KV entries of prompt chunks kept across requests.

A request whose prompt starts with the same tokens as an earlier one (the same system prompt,
the same retrieved documents, a follow-up turn) skips those tokens' prefill: its KV cache is
filled with the stored entries and prefill resumes after them. This is vLLM's automatic
prefix caching (Kwon et al. 2023, "Efficient Memory Management for Large Language Model
Serving with PagedAttention", section 4.4, shared prefixes; vLLM's hash-per-block design) at
the granularity of ragspec's prefill chunks (:attr:`~ragspec.config.PolicyConfig.prefill_chunk_tokens`).

**Exact.** A prompt's chunks always start at multiples of the chunk size, and chunk ``j``'s
keys and values are computed from tokens ``0 .. (j + 1) C - 1`` only (the same forward, the
same shapes, over the same earlier entries), so a stored chunk holds bit for bit what the
request's own prefill would have written: outputs with and without the cache are identical
(greedy and seeded sampling), which the tests check. Whole chunks serve every prompt that
begins with them; a prompt's final part (its last, possibly partial, chunk) is stored with the
last position's logits and serves only an identical prompt, which then runs no prefill forward.

Entries are keyed by a chained BLAKE2b digest of the token ids up to the chunk's end (and the
chunk's own tokens are compared on a hit), the chain rooted in the request's ``cache_salt``
(vLLM's: the salt enters the first block's hash), so requests of different salts (tenants)
never reach each other's entries: no hit, no saved time, no cached-token count tells one
tenant what another sent. Entries are evicted least recently used beyond a budget of
cached tokens, a prompt's deeper entries before the ones leading to them. Not thread-safe: owned by one :class:`~ragspec.engine.Engine`, used from its
stepping thread.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .errors import ConfigError

__all__ = ["PrefixCache", "PrefixBlock", "PrefixCacheStats"]


@dataclass(frozen=True)
class PrefixBlock:
    """One stored chunk, or a prompt's final part.

    Attributes:
        tokens: int64 [n] its token ids (n = C for a whole chunk, 1 to C for a final part).
        kv: the backend's export of the chunk's KV entries (:meth:`Target.export_kv`; the
            transformers backend: ``[L, 2, H_kv, C, d]`` in the cache's dtype).
        hidden: float32 [C, H] the chunk's last hidden states (for feature-level drafters,
            e.g. EAGLE), or None when the request that stored it did not compute them.
    """

    tokens: torch.Tensor
    kv: torch.Tensor
    hidden: Optional[torch.Tensor]
    logits: Optional[torch.Tensor] = None
    """float32 [1, V]: for a prompt's final part (its last, possibly partial, chunk), the
    last position's logits, so that an identical prompt needs no forward at all; None for a
    whole chunk that other prompts may continue."""


@dataclass
class PrefixCacheStats:
    """Counters since the cache was made (tokens).

    Attributes:
        queried_tokens: prompt tokens of the requests looked up.
        hit_tokens: prompt tokens served from the cache (not prefilled).
        stored_tokens: tokens of the entries stored.
        evicted_tokens: tokens of the entries evicted.
    """

    queried_tokens: int = 0
    hit_tokens: int = 0
    stored_tokens: int = 0
    evicted_tokens: int = 0


_ROOT = b"ragspec-prefix-v1"
_FINAL = b"final"


def _digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _root(salt: str) -> bytes:
    """The chain's root of a salt's partition ("" : the shared one)."""
    if not salt:
        return _ROOT
    return hashlib.blake2b(_ROOT + b"\0salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class PrefixCache:
    """KV entries of whole prefill chunks, shared by the requests of one engine.

    Args:
        max_tokens: most cached tokens (LRU eviction beyond; each entry costs its tokens,
            a whole chunk ``chunk_tokens``).
        chunk_tokens: the engine's prefill chunk size C (tokens per block).

    Raises:
        ConfigError: ``max_tokens`` < 0 or ``chunk_tokens`` < 1.
    """

    def __init__(self, max_tokens: int, chunk_tokens: int) -> None:
        if isinstance(max_tokens, bool) or int(max_tokens) < 0:
            raise ConfigError(f"prefix cache size must be >= 0 tokens, got {max_tokens}")
        if isinstance(chunk_tokens, bool) or int(chunk_tokens) < 1:
            raise ConfigError(f"prefix cache chunks must be >= 1 token, got {chunk_tokens}")
        self.max_tokens = int(max_tokens)
        self.chunk_tokens = int(chunk_tokens)
        self._blocks: OrderedDict[bytes, PrefixBlock] = OrderedDict()
        # KV tensors of evicted or cleared entries, written over by later stores: a fresh
        # 12 MB tensor (a default-model chunk) cost ~20 ms of page faults on the 2-core VM,
        # a copy into a used one ~2 ms. Held + free never exceed the budget's blocks.
        self._free: list[torch.Tensor] = []
        self._tokens = 0  # tokens of the entries held
        self.stats = PrefixCacheStats()

    @property
    def cached_tokens(self) -> int:
        """Tokens held now."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        """Drop every entry (the counters stay; their memory is kept for later stores)."""
        held = list(self._blocks.values())
        self._blocks.clear()
        self._tokens = 0
        for block in held:
            self._recycle(block)

    def _recycle(self, block: PrefixBlock) -> None:
        # a whole chunk's memory (a final part's is of another size)
        if block.logits is None and len(self._free) + len(self._blocks) < self.max_tokens // self.chunk_tokens:
            self._free.append(block.kv)

    def snapshot(self) -> "OrderedDict[bytes, PrefixBlock]":
        """The entries now, in LRU order (the stored tensors shared, not copied): for
        :meth:`restore`, e.g. a benchmark running several methods from the same cache state."""
        return OrderedDict(self._blocks)

    def restore(self, snapshot: "OrderedDict[bytes, PrefixBlock]") -> None:
        """Hold exactly the entries of ``snapshot`` (from :meth:`snapshot`) again."""
        self._blocks = OrderedDict(snapshot)
        self._tokens = sum(int(b.tokens.numel()) for b in self._blocks.values())

    def _pop(self, key: bytes) -> PrefixBlock:
        block = self._blocks.pop(key)
        self._tokens -= int(block.tokens.numel())
        return block

    def _evict(self, key: bytes) -> PrefixBlock:
        block = self._pop(key)
        self.stats.evicted_tokens += int(block.tokens.numel())
        return block

    def digests(self, prompt_ids: Sequence[int], chunks: int, salt: str = "") -> list[bytes]:
        """The keys of the first ``chunks`` whole chunks of ``prompt_ids`` in ``salt``'s
        partition."""
        out, parent, c = [], _root(salt), self.chunk_tokens
        for j in range(chunks):
            parent = _digest(parent, prompt_ids[j * c : (j + 1) * c])
            out.append(parent)
        return out

    def final_chain(self, prompt_ids: Sequence[int], salt: str = "") -> list[bytes]:
        """The keys of the whole prompt: its whole chunks before its last chunk (the first
        ``(len - 1) // C``), then the key of its final part (the rest, 1 to C tokens, and
        the last logits): an entry that only an identical prompt (of the same ``salt``)
        reaches."""
        k = (len(prompt_ids) - 1) // self.chunk_tokens
        chain = self.digests(prompt_ids, k, salt)
        tail = prompt_ids[k * self.chunk_tokens :]
        return chain + [_digest((chain[-1] if chain else _root(salt)) + _FINAL, tail)]

    def _touch(self, keys: Sequence[bytes]) -> None:
        """Mark a chain of held chunks recently used, its first chunk the most recent: the
        deepest chunks of a prompt are evicted before the ones that lead to them, so what
        stays is always reachable from a prompt's start (a prompt longer than the budget
        keeps its first chunks, not its last)."""
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def lookup(self, prompt_ids: Sequence[int], need_hidden: bool = False, salt: str = "") -> list[PrefixBlock]:
        """The stored chunks of ``salt``'s partition that begin ``prompt_ids``, in order: the longest run of whole
        chunks found, leaving at least the prompt's last token to prefill (and, with
        ``need_hidden``, only chunks stored with their hidden states); when all of those are
        found and an identical prompt stored its final part, that part last (its ``logits``
        set: the whole prompt is cached). Marks them recently used; counts the lookup."""
        c = self.chunk_tokens
        self.stats.queried_tokens += len(prompt_ids)
        chain = self.final_chain(prompt_ids, salt)
        found: list[PrefixBlock] = []
        keys: list[bytes] = []
        for j, key in enumerate(chain):
            block = self._blocks.get(key)
            if block is None or (need_hidden and block.hidden is None):
                break
            if block.tokens.tolist() != list(prompt_ids[j * c : (j + 1) * c]):  # a digest collision
                break
            found.append(block)
            keys.append(key)
        self._touch(keys)
        self.stats.hit_tokens += sum(int(b.tokens.numel()) for b in found)
        return found

    def _victim(self, chain: Sequence[bytes], finals_only: bool = False) -> Optional[bytes]:
        """The least recently used entry outside ``chain`` (with ``finals_only``: a prompt's
        final part, never a whole chunk that other prompts may continue), or None."""
        protect = set(chain)
        return next(
            (k for k, b in self._blocks.items() if k not in protect and (b.logits is not None or not finals_only)),
            None,
        )

    def wants(self, chain: Sequence[bytes], need_hidden: bool = False, tokens: Optional[int] = None) -> bool:
        """Whether storing the last chunk of ``chain`` (the keys of a prompt's chunks 0 .. j,
        from :meth:`digests`) would add something: it is not held (or held without hidden
        states that this request has), the chunks before it are held (a chunk is only ever
        reached through them), and there is room, or an entry outside the chain to evict
        (``tokens``: the entry's size, default a whole chunk; a final part of fewer tokens may
        only evict other final parts)."""
        if self.max_tokens < self.chunk_tokens or not chain:
            return False
        block = self._blocks.get(chain[-1])
        if block is not None and not (need_hidden and block.hidden is None):
            return False
        if any(key not in self._blocks for key in chain[:-1]):
            return False
        size = self.chunk_tokens if tokens is None else int(tokens)
        full = block is None and self._tokens + size > self.max_tokens
        return not full or self._victim(chain, finals_only=tokens is not None) is not None

    def reusable(self, chain: Sequence[bytes] = ()) -> Optional[torch.Tensor]:
        """Memory for the next store's export to write into (``Target.export_kv``'s
        ``out``): an evicted or cleared entry's KV tensor, or, with the cache full, that of
        the least recently used entry outside ``chain``, evicted now; None while the cache
        has room."""
        if self._free:
            return self._free.pop()
        while self._blocks and self._tokens + self.chunk_tokens > self.max_tokens:
            victim = self._victim(chain)
            if victim is None:
                break
            evicted = self._evict(victim)
            if evicted.logits is None:
                return evicted.kv
        return None

    def store(
        self,
        chain: Sequence[bytes],
        tokens: Sequence[int],
        kv: torch.Tensor,
        hidden: Optional[torch.Tensor],
        logits: Optional[torch.Tensor] = None,
    ) -> None:
        """Keep one chunk (``tokens`` C ids, its KV export and optional hidden [C, H]) under
        the last key of ``chain`` (see :meth:`wants`), or with ``logits`` a prompt's final
        part (1 to C tokens, the last key of :meth:`final_chain`), evicting least recently
        used entries outside the chain beyond the budget (a final part only other final
        parts; none left: nothing is kept). Entries cost their tokens."""
        if not chain or not (
            len(tokens) == self.chunk_tokens or (logits is not None and 0 < len(tokens) <= self.chunk_tokens)
        ):
            return
        key = chain[-1]
        entry = PrefixBlock(torch.tensor(list(tokens), dtype=torch.long), kv, hidden, logits)
        if key in self._blocks:
            self._recycle(self._pop(key))
        while self._tokens + len(tokens) > self.max_tokens:
            victim = self._victim(chain, finals_only=logits is not None)
            if victim is None:
                self._recycle(entry)
                return
            self._recycle(self._evict(victim))
        self.stats.stored_tokens += len(tokens)
        self._blocks[key] = entry
        self._tokens += len(tokens)
        self._touch([k for k in chain if k in self._blocks])
