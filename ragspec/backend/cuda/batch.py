"""Flat-batch packing: every request's root and draft-tree rows in one forward.

Request i's rows are ``cu_rows[i] .. cu_rows[i + 1] - 1`` of the batch (vLLM's
``cu_num_draft_tokens`` contract, with the root counted): row 0 of a request is its root,
row j + 1 its draft node j. Each row carries what the step needs to run without looking at
any other row:

* ``tokens``, ``positions``: the token and its rotary position (root at ``past``, a node at
  ``past + 1 + depth``);
* ``slots``, ``write_pos``: where its key/value entry goes in the KV pool (its request's
  slot, position ``past + j`` for tree row j: the tree's rows in order, compacted by the
  pool's commit);
* ``ctx_len``, ``path``, ``path_len``, ``path_base``: the keys it attends to, in logical
  order: positions ``0 .. ctx_len - 1`` of its slot, then ``path_base + path[:path_len]``
  (its draft-tree ancestors, root to itself: the row of the tree attention mask,
  :func:`ragspec.tree.tree_attention_mask`, as a list). A causal row (prefill, plain
  decoding, a chain draft) has ``path_len`` 0 and ``ctx_len = write_pos + 1``.

:func:`pad_batch` pads a batch to a CUDA graph's bucket with rows that write to the pool's
scratch slot and attend only to it, so a padding row never changes a real row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from ...errors import ConfigError
from ...types import DraftTree

__all__ = ["FlatBatch", "RequestRows", "pack_rows", "pad_batch", "tree_paths"]


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
    """The rows of one step (R rows; P the path width). Every tensor on the same device.

    Attributes:
        tokens: int64 [R].
        positions: int64 [R] rotary positions.
        slots: int32 [R] KV pool slot.
        write_pos: int64 [R] pool position of the row's own key/value entry.
        ctx_len: int32 [R] leading positions of the slot the row attends to.
        path: int32 [R, P] tree-row indices of its ancestors, root to itself.
        path_len: int32 [R] entries of ``path`` in use.
        path_base: int32 [R] pool position of tree row 0 (the root).
        cu_rows: request i's rows are ``cu_rows[i] .. cu_rows[i + 1] - 1`` (host ints).
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

    @property
    def rows(self) -> int:
        """R, rows of the batch (padding included)."""
        return int(self.tokens.shape[0])

    @property
    def path_width(self) -> int:
        """P, the width of ``path``."""
        return int(self.path.shape[1])

    def to(self, device: torch.device | str) -> "FlatBatch":
        """The same batch on ``device``."""
        names = ("tokens", "positions", "slots", "write_pos", "ctx_len", "path", "path_len", "path_base")
        return replace(self, **{n: getattr(self, n).to(device) for n in names})


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """Each tree row's ancestors in tree-row indices, root to itself: row 0 (the root)
    ``[0]``, row j + 1 (node j) its parent row's path and ``j + 1``."""
    paths = [[0]]
    for j, p in enumerate(tree.parents.tolist()):
        paths.append(paths[int(p) + 1] + [j + 1])
    return paths


def pack_rows(requests: Sequence[RequestRows], *, path_width: int = 0, device: torch.device | str = "cpu") -> FlatBatch:
    """The flat batch of ``requests``' rows, in order.

    A request with a branching tree gets tree rows (``ctx_len = past`` and its path); a
    chain or no tree gets causal rows. Either form gives a row the same keys in the same
    order, so the same values.

    Args:
        path_width: at least this width of ``path`` (a graph's static buffer); 0: the
            longest path of the batch (at least 1).

    Raises:
        ConfigError: a request without tokens, a tree whose node count does not match
            its tokens, or a path longer than ``path_width``.
    """
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    write_pos: list[int] = []
    ctx_len: list[int] = []
    paths: list[list[int]] = []
    path_base: list[int] = []
    cu = [0]
    for req in requests:
        toks = [int(t) for t in req.tokens]
        if not toks:
            raise ConfigError("pack_rows: a request without rows")
        past = int(req.past)
        tree = req.tree
        if tree is not None and tree.num_nodes + 1 != len(toks):
            raise ConfigError(f"pack_rows: {len(toks)} tokens for a tree of {tree.num_nodes} nodes and its root")
        if tree is not None and tree.num_nodes > 0 and not tree.is_chain:
            depth = [0] + [int(d) + 1 for d in tree.depth.tolist()]
            for j, ancestors in enumerate(tree_paths(tree)):
                positions.append(past + depth[j])
                ctx_len.append(past)
                paths.append(ancestors)
        else:
            for j in range(len(toks)):
                positions.append(past + j)
                ctx_len.append(past + j + 1)
                paths.append([])
        tokens.extend(toks)
        slots.extend([int(req.slot)] * len(toks))
        write_pos.extend(range(past, past + len(toks)))
        path_base.extend([past] * len(toks))
        cu.append(cu[-1] + len(toks))
    longest = max((len(p) for p in paths), default=0)
    width = max(1, longest) if path_width <= 0 else int(path_width)
    if longest > width:
        raise ConfigError(f"pack_rows: a draft-tree path of {longest} rows exceeds the path width {width}")
    path = torch.zeros((len(paths), width), dtype=torch.int32)
    for i, p in enumerate(paths):
        if p:
            path[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    i64 = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return FlatBatch(
        tokens=i64(tokens),
        positions=i64(positions),
        slots=i32(slots),
        write_pos=i64(write_pos),
        ctx_len=i32(ctx_len),
        path=path.to(device),
        path_len=i32([len(p) for p in paths]),
        path_base=i32(path_base),
        cu_rows=tuple(cu),
    )


def pad_batch(batch: FlatBatch, rows: int, scratch_slot: int) -> FlatBatch:
    """``batch`` with padding rows up to ``rows``: token 0 at position 0, written to and
    attending to position 0 of ``scratch_slot`` only. ``cu_rows`` is unchanged (the
    padding belongs to no request).

    Raises:
        ConfigError: ``rows`` below the batch's rows.
    """
    extra = int(rows) - batch.rows
    if extra < 0:
        raise ConfigError(f"pad_batch: {batch.rows} rows do not fit a bucket of {rows}")
    if extra == 0:
        return batch
    dev = batch.tokens.device

    def cat(t: torch.Tensor, value: int) -> torch.Tensor:
        pad = torch.full((extra, *t.shape[1:]), value, dtype=t.dtype, device=dev)
        return torch.cat([t, pad])

    return replace(
        batch,
        tokens=cat(batch.tokens, 0),
        positions=cat(batch.positions, 0),
        slots=cat(batch.slots, scratch_slot),
        write_pos=cat(batch.write_pos, 0),
        ctx_len=cat(batch.ctx_len, 1),
        path=cat(batch.path, 0),
        path_len=cat(batch.path_len, 0),
        path_base=cat(batch.path_base, 0),
    )
