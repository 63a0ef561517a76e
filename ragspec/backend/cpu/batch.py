"""The flat batch of the CPU backend's verification: several requests' root and draft-tree
rows in one forward, request i's rows ``bounds[i] = (start, stop)`` of it (vLLM's
``cu_num_draft_tokens`` contract, the root counted, as :mod:`ragspec.backend.cuda.batch`).

* :class:`BatchCache`: the cache the kernel-routed transformers forward
  (:class:`~ragspec.backend.cpu.target.CPUTarget`) takes for a flat batch: each request's
  keys and values go to its own KV cache, and its rows attend to that cache only;
* :func:`batch_outputs`: the per-request outputs of a flat batch's hidden states, the output
  layer applied to every row needed now in one call (both CPU targets).

A request's outputs equal its solo forward's bit for bit where every kernel computes each
row on its own (the compiled few-row kernels, the fused C++ step); the targets batch only
there.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..base import ForwardOutput, VerifyItem
from ..hf import KVState, RowLogits

__all__ = ["BATCHED_MODEL_TYPES", "BatchCache", "batch_outputs"]

# decoders whose forward the batched transformers path knows: attention layers only, masks
# built by create_causal_mask (and create_sliding_window_causal_mask for local layers),
# rotary position embeddings from position_ids, the cache updated once per layer in order
BATCHED_MODEL_TYPES = frozenset({"llama", "gemma3_text"})


class BatchCache:
    """The cache a batched verification forward hands to the decoder
    (:meth:`~ragspec.backend.cpu.target.CPUTarget.verify`): each layer's ``update`` appends
    each request's new keys/values (its rows ``start:stop`` of the flat batch) to that
    request's own cache layer, in place, and keeps that request's whole keys/values for the
    layer's attention (:meth:`segments`, through ``ATTENTION_BATCH_KW``). No past entry is
    copied.

    Args:
        states: the requests' KV states, in row order.
        bounds: each request's rows ``(start, stop)`` of the forward.
        masks: each request's attention mask as its solo forward gets it (a tensor, None, or
            a dict per layer type).
        layer_types: the decoder's layer types (``config.layer_types``), or empty.
    """

    def __init__(
        self,
        states: Sequence[KVState],
        bounds: Sequence[tuple[int, int]],
        masks: Sequence[Any],
        layer_types: Sequence[str],
    ) -> None:
        self._states = list(states)
        self._bounds = list(bounds)
        self._masks = list(masks)
        self._layer_types = tuple(layer_types)
        self._layer = -1
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """key_states, value_states [1, H_kv, R, d] of all rows -> the same tensors (the
        attention reads each request's own keys from :meth:`segments`)."""
        self._kv = [
            state.cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx, *args, **kwargs)
            for state, (a, b) in zip(self._states, self._bounds)
        ]
        self._layer = layer_idx
        return key_states, value_states

    def segments(self, layer_idx: int) -> list[tuple[int, int, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """``(start, stop, key, value, mask)`` of each request for layer ``layer_idx``
        (after its update): keys/values [1, H_kv, S_i, d], mask [1, 1, stop - start, S_i]
        or None."""
        assert layer_idx == self._layer, f"attention of layer {layer_idx} before its cache update"
        kind = self._layer_types[layer_idx] if layer_idx < len(self._layer_types) else "full_attention"
        out = []
        for (a, b), (k, v), m in zip(self._bounds, self._kv, self._masks):
            out.append((a, b, k, v, m[kind] if isinstance(m, dict) else m))
        return out


def batch_outputs(
    items: Sequence[VerifyItem],
    bounds: Sequence[tuple[int, int]],
    hidden: torch.Tensor,
    logits: Callable[..., torch.Tensor],
) -> list[ForwardOutput]:
    """The outputs of a batched verification from its hidden states [R, H] (item i's rows
    ``bounds[i]``): the output layer ``logits(hidden [K, H], chunked=True) -> float32 [K,
    V]`` over every row needed now, all requests at once: all rows of a request verified
    with full logits, row 0 of a lazy one (greedy verification always reads it; the others
    on demand, :class:`~ragspec.backend.hf.RowLogits`)."""
    rows: list[int] = []
    for it, (a, b) in zip(items, bounds):
        rows.extend([a] if it.lazy_logits else range(a, b))
    computed = logits(hidden[rows], chunked=True)  # [len(rows), V]
    outs: list[ForwardOutput] = []
    at = 0
    for it, (a, b) in zip(items, bounds):
        h = hidden[a:b]  # [N+1, H]
        if it.lazy_logits:
            row_logits = RowLogits(logits, h)
            row_logits.know(0, int(computed[at].argmax()), computed[at])
            at += 1
            outs.append(ForwardOutput(None, h if it.hidden else None, row_logits))
        else:
            outs.append(ForwardOutput(computed[at : at + b - a], h if it.hidden else None))
            at += b - a
    return outs
