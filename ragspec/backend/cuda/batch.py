"""Flat-batch packing: every request's root and draft-tree rows in one forward.

Request i's rows are ``cu_rows[i] .. cu_rows[i + 1] - 1`` of the batch (vLLM's
``cu_num_draft_tokens`` contract, with the root counted): row 0 of a request is its root,
row j + 1 its draft node j. Each row carries what the step needs to run without looking at
any other row:

* ``tokens``, ``positions``: the token and its rotary position (root at ``past``, a node at
  ``past + 1 + depth``);
* ``slots``, ``write_pos``: where its key/value entry goes in the KV pool (row j of a
  request at position ``past + j`` of its slot: the tree's rows in tree order);
* ``ctx_len``, ``path``, ``path_len``, ``path_base``: the keys it attends to, in logical
  order: positions ``0 .. ctx_len - 1`` of its slot, then ``path_base + path[:path_len]``
  (its draft-tree ancestors, root to itself: the row of the tree attention mask,
  :func:`ragspec.tree.tree_attention_mask`, as a list). A causal row (prefill, plain
  decoding, a chain draft) has ``path_len`` 0 and ``ctx_len = write_pos + 1``.

Every field is int32 and lives in one flat buffer (:attr:`FlatBatch.buffer`: the seven
per-row fields, then the path table), so a step's inputs reach the device in one copy
(from a pinned staging buffer on CUDA). Packing is vectorised with numpy: per request a
handful of array operations and the tree's ancestor lists, never Python per row per field.

Padding rows (``rows`` above the requests' rows, a CUDA graph's bucket) write to the pool's
scratch slot and attend only to it, so a padding row never changes a real row.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np
import torch

from ...errors import ConfigError
from ...types import DraftTree

__all__ = [
    "FIELDS",
    "FlatBatch",
    "RequestRows",
    "batch_views",
    "buffer_size",
    "pack_rows",
    "pad_batch",
    "tree_paths",
    "widen",
]

FIELDS = ("tokens", "positions", "slots", "write_pos", "ctx_len", "path_len", "path_base")
"""The per-row fields, in the order they sit in the buffer (the path table follows)."""
_PAD = {"tokens": 0, "positions": 0, "write_pos": 0, "ctx_len": 1, "path_len": 0, "path_base": 0}


@dataclass(frozen=True)
class RequestRows:
    """One request's part of a step.

    Attributes:
        slot: its KV pool slot.
        past: positions already held (the root goes at ``past``).
        tokens: the root (or the prefill chunk's first token) and the rest.
        tree: the draft tree below the root (None: causal rows, a prefill chunk or a chain).
    """

    slot: int
    past: int
    tokens: Sequence[int]
    tree: Optional[DraftTree] = None


@dataclass(frozen=True)
class FlatBatch:
    """The rows of one step (R rows, padding included; P the path width), every tensor
    int32 on the same device.

    Attributes:
        tokens: [R] token ids.
        positions: [R] rotary positions.
        slots: [R] KV pool slot.
        write_pos: [R] pool position of the row's own key/value entry.
        ctx_len: [R] leading positions of the slot the row attends to.
        path: [R, P] tree-row indices of its ancestors, root to itself.
        path_len: [R] entries of ``path`` in use.
        path_base: [R] pool position of tree row 0 (the root).
        cu_rows: request i's rows are ``cu_rows[i] .. cu_rows[i + 1] - 1`` (host ints);
            rows from ``cu_rows[-1]`` on are padding.
        buffer: the flat int32 buffer every field is a view of (None for a batch put
            together from separate tensors).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    write_pos: torch.Tensor
    ctx_len: torch.Tensor
    path: torch.Tensor
    path_len: torch.Tensor
    path_base: torch.Tensor
    cu_rows: tuple[int, ...]
    buffer: Optional[torch.Tensor] = None

    @property
    def rows(self) -> int:
        """R, rows of the batch (padding included)."""
        return int(self.tokens.shape[0])

    @property
    def real_rows(self) -> int:
        """Rows that belong to a request (``cu_rows[-1]``); the rest is padding."""
        return int(self.cu_rows[-1])

    @property
    def path_width(self) -> int:
        """P, the width of ``path``."""
        return int(self.path.shape[1])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "FlatBatch":
        """The same batch on ``device``: one copy of the buffer (or one per field)."""
        device = torch.device(device)
        if self.buffer is not None:
            if self.buffer.device == device:
                return self
            return batch_views(
                self.buffer.to(device, non_blocking=non_blocking), self.rows, self.path_width, self.cu_rows
            )
        names = (*FIELDS, "path")
        return replace(self, **{n: getattr(self, n).to(device) for n in names})


def _stride(rows: int) -> int:
    """Elements between two fields: ``rows`` rounded up to 4, so that every field starts
    16-byte aligned whatever the row count (a kernel then compiles the same way for every
    bucket: Triton specialises a pointer on its alignment)."""
    return -(-int(rows) // 4) * 4


def buffer_size(rows: int, width: int) -> int:
    """int32 elements of a batch buffer of ``rows`` rows and path width ``width``."""
    return _stride(rows) * len(FIELDS) + int(rows) * int(width)


def batch_views(buffer: torch.Tensor, rows: int, width: int, cu_rows: tuple[int, ...]) -> FlatBatch:
    """The fields of a batch as views of its flat ``buffer``."""
    stride = _stride(rows)
    n = len(FIELDS) * stride
    parts = {name: buffer[i * stride : i * stride + rows] for i, name in enumerate(FIELDS)}
    path = buffer[n : n + rows * width].view(rows, width)
    return FlatBatch(path=path, cu_rows=tuple(cu_rows), buffer=buffer, **parts)


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """Each tree row's ancestors in tree-row indices, root to itself: row 0 (the root)
    ``[0]``, row j + 1 (node j) its parent row's path and ``j + 1``."""
    paths = [[0]]
    for j, p in enumerate(tree.parents.tolist()):
        paths.append(paths[int(p) + 1] + [j + 1])
    return paths


def _tree_rows(tree: DraftTree) -> tuple[np.ndarray, list[list[int]]]:
    """(depth of each tree row: root 0, node j ``depth[j] + 1``; each row's ancestor list)."""
    depth = np.empty(tree.num_nodes + 1, dtype=np.int32)
    depth[0] = 0
    depth[1:] = tree.depth.numpy() + 1
    return depth, tree_paths(tree)


def pack_rows(
    requests: Sequence[RequestRows],
    *,
    path_width: int = 0,
    device: torch.device | str = "cpu",
    rows: int = 0,
    scratch_slot: int = 0,
    out: Optional[torch.Tensor] = None,
) -> FlatBatch:
    """The flat batch of ``requests``' rows, in order (then padding rows up to ``rows``).

    A request with a branching tree gets tree rows (``ctx_len = past`` and its path); a
    chain or no tree gets causal rows. Either form gives a row the same keys in the same
    order, so the same values.

    Args:
        path_width: at least this width of ``path`` (a graph's static buffer); 0: the
            longest path of the batch (at least 1).
        device: where the batch's tensors go (one copy of the buffer).
        rows: pad to this many rows (0: no padding), the padding on ``scratch_slot``.
        out: a host int32 tensor of at least :func:`buffer_size` elements to pack into (a
            pinned staging buffer); default a new one.

    Raises:
        ConfigError: a request without tokens, a tree whose node count does not match
            its tokens, a path longer than ``path_width``, or more rows than ``rows``.
    """
    counts, pasts, slots, rels, trees = [], [], [], [], []
    for req in requests:
        n = len(req.tokens)
        if not n:
            raise ConfigError("pack_rows: a request without rows")
        tree = req.tree
        if tree is not None and tree.num_nodes + 1 != n:
            raise ConfigError(f"pack_rows: {n} tokens for a tree of {tree.num_nodes} nodes and its root")
        if tree is not None and tree.num_nodes > 0 and not tree.is_chain:
            depth, paths = _tree_rows(tree)
            rels.append(depth)
            trees.append((len(rels) - 1, depth, paths))
        else:
            rels.append(np.arange(n, dtype=np.int32))
        counts.append(n)
        pasts.append(int(req.past))
        slots.append(int(req.slot))
    real = int(sum(counts))
    total = max(real, int(rows))
    if rows and real > rows:
        raise ConfigError(f"pack_rows: {real} rows do not fit a bucket of {rows}")
    longest = max((int(d.max()) + 1 for _, d, _ in trees), default=0)
    width = max(1, longest) if path_width <= 0 else int(path_width)
    if longest > width:
        raise ConfigError(f"pack_rows: a draft-tree path of {longest} rows exceeds the path width {width}")
    size = buffer_size(total, width)
    if out is None:
        out = torch.empty(size, dtype=torch.int32)
    elif out.numel() < size or out.dtype != torch.int32 or out.device.type != "cpu":
        raise ConfigError(f"pack_rows: the staging buffer holds {out.numel()} int32 elements, {size} needed")
    buf = out[:size]
    a = buf.numpy()
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    stride = _stride(total)
    f = {name: a[i * stride : i * stride + real] for i, name in enumerate(FIELDS)}
    if real:
        cnt = np.asarray(counts)
        rep_past = np.repeat(np.asarray(pasts, dtype=np.int32), cnt)
        offs = np.arange(real, dtype=np.int32) - np.repeat(cu[:-1].astype(np.int32), cnt)
        rel = np.concatenate(rels)
        f["tokens"][:] = np.concatenate([np.asarray(r.tokens, dtype=np.int64) for r in requests])
        f["slots"][:] = np.repeat(np.asarray(slots, dtype=np.int32), cnt)
        np.add(rep_past, offs, out=f["write_pos"])
        np.add(rep_past, rel, out=f["positions"])
        np.add(f["write_pos"], 1, out=f["ctx_len"])
        f["path_len"][:] = 0
        f["path_base"][:] = rep_past
    table = a[len(FIELDS) * stride :].reshape(total, width)
    table[:] = 0
    for i, depth, paths in trees:
        start, stop = int(cu[i]), int(cu[i + 1])
        lens = depth + 1
        f["ctx_len"][start:stop] = pasts[i]
        f["path_len"][start:stop] = lens
        flat = np.fromiter(itertools.chain.from_iterable(paths), dtype=np.int32, count=int(lens.sum()))
        first = np.repeat(np.cumsum(lens) - lens, lens)
        table[np.repeat(np.arange(start, stop), lens), np.arange(flat.size) - first] = flat
    for i, name in enumerate(FIELDS):  # padding rows: the scratch slot only
        a[i * stride + real : i * stride + total] = scratch_slot if name == "slots" else _PAD[name]
    batch = batch_views(buf, total, width, tuple(int(c) for c in cu))
    return batch.to(device)


def pad_batch(batch: FlatBatch, rows: int, scratch_slot: int) -> FlatBatch:
    """``batch`` with padding rows up to ``rows``: token 0 at position 0, written to and
    attending to position 0 of ``scratch_slot`` only. ``cu_rows`` is unchanged (the
    padding belongs to no request).

    Raises:
        ConfigError: ``rows`` below the batch's rows.
    """
    return widen(batch, rows, batch.path_width, scratch_slot)


def widen(batch: FlatBatch, rows: int, width: int, scratch_slot: int) -> FlatBatch:
    """``batch`` padded to ``rows`` rows (padding as :func:`pad_batch`) and its path to
    ``width`` columns, in one new buffer on the batch's device (the batch itself when it
    has that shape already).

    Raises:
        ConfigError: ``rows`` or ``width`` below the batch's.
    """
    if rows < batch.rows or width < batch.path_width:
        raise ConfigError(f"pad_batch: {batch.rows} rows x {batch.path_width} do not fit {rows} x {width}")
    if rows == batch.rows and width == batch.path_width:
        return batch
    dev = batch.tokens.device
    buf = torch.zeros(buffer_size(rows, width), dtype=torch.int32, device=dev)
    out = batch_views(buf, rows, width, batch.cu_rows)
    n = batch.rows
    for name in FIELDS:
        dst = getattr(out, name)
        dst[:n] = getattr(batch, name)
        dst[n:] = scratch_slot if name == "slots" else _PAD[name]
    out.path[:n, : batch.path_width] = batch.path
    return out
