"""A static, preallocated, position-indexed KV pool shared by all active requests.

Each request owns one *slot*: ``capacity`` positions of keys and values for every layer,
allocated once with the pool. A request's entry for position p lives at position p of its
slot, so a forward writes its new rows' entries in place (no reallocation, no
concatenation), a rejection is "do not advance" (:meth:`KVPool.rollback`), and accepting a
draft-tree path copies only the accepted nodes' entries into place behind the root
(:meth:`KVPool.commit`). One extra slot (:attr:`KVPool.scratch_slot`) takes the entries of
padding rows (a CUDA graph's bucket), so they never touch a request's slot.

Layout: ``keys`` and ``values`` are [L, S + 1, C, H_kv, d] (layer, slot, position, head,
head size), one contiguous tensor each; ``keys[layer]`` is what the attention kernel reads
(:func:`ragspec.backend.cuda.kernels.tree_attention`).
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ...errors import CapacityError, ConfigError

__all__ = ["KVPool", "PoolState", "SlotOverflowError"]


class SlotOverflowError(CapacityError):
    """A request needs more positions than its slot of the KV pool holds."""


@dataclass(eq=False)
class PoolState:
    """One request's KV state: its slot of the pool (the engine hands it back to the
    target, never looks inside). The slot returns to the pool when the state is released
    (:meth:`KVPool.release`) or garbage-collected.

    Attributes:
        pool: the pool.
        slot: the slot index.
    """

    pool: "KVPool"
    slot: int
    _finalizer: Optional[weakref.finalize] = field(default=None, repr=False)

    @property
    def length(self) -> int:
        """Positions of this request held in its slot."""
        return self.pool.length(self.slot)


class KVPool:
    """Keys and values of every request, in slots of ``capacity`` positions.

    Args:
        num_layers: L, decoder layers.
        num_slots: S, most requests at once.
        capacity: C, positions per slot (a request's prompt + generated tokens + the rows of
            its largest verification).
        kv_heads: H_kv.
        head_dim: d.
        dtype, device: of the entries.

    Allocates ``2 * L * (S + 1) * C * H_kv * d`` elements at construction (no I/O).

    Raises:
        ConfigError: a size below 1.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        sizes = dict(
            num_layers=num_layers, num_slots=num_slots, capacity=capacity, kv_heads=kv_heads, head_dim=head_dim
        )
        bad = [k for k, v in sizes.items() if int(v) < 1]
        if bad:
            raise ConfigError(f"KV pool: {', '.join(bad)} must be at least 1 ({sizes})")
        self.num_layers, self.num_slots, self.capacity = int(num_layers), int(num_slots), int(capacity)
        shape = (self.num_layers, self.num_slots + 1, self.capacity, int(kv_heads), int(head_dim))
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self._lengths = [0] * (self.num_slots + 1)
        self._free = list(range(self.num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def scratch_slot(self) -> int:
        """The slot padding rows write to (never allocated to a request)."""
        return self.num_slots

    @property
    def free_slots(self) -> int:
        """Slots not allocated."""
        return len(self._free)

    def nbytes(self) -> int:
        """Bytes of the keys and values."""
        return 2 * self.keys.numel() * self.keys.element_size()

    # ------------------------------------------------------------------ slots
    def allocate(self) -> PoolState:
        """A slot for a new request (empty), released when the state is garbage-collected.

        Raises:
            CapacityError: every slot is in use.
        """
        if not self._free:
            gc.collect()  # states dropped in a reference cycle return their slots
        if not self._free:
            raise CapacityError(f"KV pool full: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._lengths[slot] = 0
        state = PoolState(self, slot)
        state._finalizer = weakref.finalize(state, KVPool._release_slot, weakref.ref(self), slot)
        return state

    @staticmethod
    def _release_slot(pool_ref: "weakref.ref[KVPool]", slot: int) -> None:
        pool = pool_ref()
        if pool is not None and slot not in pool._free:
            pool._lengths[slot] = 0
            pool._free.append(slot)

    def release(self, state: PoolState) -> None:
        """Return ``state``'s slot to the pool now (the state must not be used again)."""
        if state._finalizer is not None:
            state._finalizer()  # runs once

    def length(self, slot: int) -> int:
        """Positions held in ``slot``."""
        return self._lengths[slot]

    # ------------------------------------------------------------------ positions
    def check_room(self, slot: int, rows: int) -> None:
        """Raise :class:`SlotOverflowError` unless ``rows`` more positions fit in ``slot``."""
        need = self._lengths[slot] + int(rows)
        if need > self.capacity:
            raise SlotOverflowError(
                f"a request needs {need} positions of the KV pool; its slot holds {self.capacity} "
                "(raise the backend's context length)"
            )

    def advance(self, slot: int, rows: int) -> None:
        """Count ``rows`` more positions of ``slot`` as held (their entries written at
        positions ``length .. length + rows - 1`` by a forward).

        Raises:
            SlotOverflowError: past the slot's capacity.
        """
        self.check_room(slot, rows)
        self._lengths[slot] += int(rows)

    def rollback(self, slot: int, length: int) -> None:
        """Drop the positions from ``length`` on ("do not advance": nothing is copied)."""
        self._lengths[slot] = min(self._lengths[slot], max(0, int(length)))

    def commit(self, slot: int, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Keep, of a verification written at ``past_len`` (the root at ``past_len``, draft
        node i at ``past_len + 1 + i``), the root and the ``accepted_nodes`` (root to
        leaf): their entries are copied to ``past_len + 1 ..`` in every layer, and the slot
        then holds ``past_len + 1 + len(accepted_nodes)`` positions.

        Raises:
            ConfigError: an accepted node outside the verified rows.
        """
        nodes = [int(n) for n in accepted_nodes]
        keep = past_len + 1 + len(nodes)
        held = self._lengths[slot]
        if any(n < 0 or past_len + 1 + n >= held for n in nodes) or past_len + 1 > held:
            raise ConfigError(f"commit: accepted nodes {nodes} outside the {held - past_len} verified rows")
        if nodes != list(range(len(nodes))):  # a prefix of the rows is already in place
            dev = self.keys.device
            src = torch.tensor([past_len + 1 + n for n in nodes], dtype=torch.long, device=dev)
            dst = torch.arange(past_len + 1, keep, dtype=torch.long, device=dev)
            self.keys[:, slot, dst] = self.keys[:, slot, src]
            self.values[:, slot, dst] = self.values[:, slot, src]
        self._lengths[slot] = keep

    # ------------------------------------------------------------------ prefix cache
    def export(self, slot: int, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Entries of positions ``start .. stop - 1``: [L, 2, H_kv, n, d] (into ``out``
        when it has that shape, dtype and device).

        Raises:
            ConfigError: positions not held.
        """
        if not 0 <= start <= stop <= self._lengths[slot]:
            raise ConfigError(f"export_kv: positions {start}..{stop} not in a state of {self._lengths[slot]}")
        k = self.keys[:, slot, start:stop].transpose(1, 2)  # [L, H_kv, n, d]
        v = self.values[:, slot, start:stop].transpose(1, 2)
        shape = (self.num_layers, 2, *k.shape[1:])
        if out is None or tuple(out.shape) != shape or out.dtype != k.dtype or out.device != k.device:
            out = torch.empty(shape, dtype=k.dtype, device=k.device)
        out[:, 0].copy_(k)
        out[:, 1].copy_(v)
        return out

    def import_(self, slot: int, blocks: Sequence[torch.Tensor]) -> None:
        """Append exported entries (:meth:`export`, in order) to ``slot``.

        Raises:
            ConfigError: entries of another shape or dtype than the pool's.
            SlotOverflowError: they do not fit.
        """
        if not blocks:
            return
        kv = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=3)
        want = (self.num_layers, 2, self.keys.shape[3], self.keys.shape[4])
        if (*kv.shape[:3], kv.shape[4]) != want or kv.dtype != self.keys.dtype:
            raise ConfigError(f"import_kv: entries of shape {tuple(kv.shape)} do not fit this pool")
        n = int(kv.shape[3])
        past = self._lengths[slot]
        self.check_room(slot, n)
        kv = kv.to(self.keys.device)
        self.keys[:, slot, past : past + n] = kv[:, 0].transpose(1, 2)
        self.values[:, slot, past : past + n] = kv[:, 1].transpose(1, 2)
        self._lengths[slot] = past + n
