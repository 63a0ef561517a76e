"""The CPU backend's fused-step target: :class:`NativeTarget`, every decoder layer of a
Llama-architecture model for a step's rows in one C++ call
(:class:`~ragspec.backend.cpu.native.NativeDecoder`), over KV buffers it owns (a
:class:`~ragspec.backend.cpu.native.NativeKVState` per request).

It is built by composition: the fused step over the model's layers, and the kernel-routed
transformers target (:class:`~ragspec.backend.cpu.target.CPUTarget`) it was built from for
what the step does not do (the output layer, and the multi-row GEMMs of long prefills,
written into its buffers). One step verifies every request's root and draft-tree rows in
one call, a flat batch with per-request bounds (as :mod:`ragspec.backend.cuda.batch`); the
step computes every row on its own, so each request gets exactly its solo values, and its
values are the kernel-routed target's bit for bit (tests/unit/test_native_step.py).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Sequence

import torch

from ...errors import ConfigError
from ...tree import tree_attention_mask, tree_position_ids
from ...types import DraftTree
from ..base import Capability, ForwardOutput, FusedStep, VerifyItem, check_distinct_states
from ..hf import KVState, RowLogits, growable_cache
from .batch import batch_outputs
from .fastpaths import prefill_runs
from .kernels import SKINNY_MAX_ROWS
from .native import NativeDecoder, NativeKVState, native_step_unsupported
from .target import CPUTarget

logger = logging.getLogger(__name__)

__all__ = ["NATIVE_EXTEND_GEMM_ROWS", "NativeTarget"]


# a filled native state extended by more rows than this (a later prefill chunk) goes through
# transformers' forward (GEMMs) over the state's buffer; fewer: the native step, 16 rows a call
NATIVE_EXTEND_GEMM_ROWS = 64


def _buffer_cache(buffer: torch.Tensor, length: int):
    """A transformers ``DynamicCache`` over a native KV buffer ``[L, 2, H_kv, C, d]``
    (:class:`~ragspec.backend.cpu.native.NativeKVState`) holding ``length`` positions: each
    layer's ``update`` writes the new keys/values into the buffer at their positions and
    returns views ``[1, H_kv, T, d]`` of it, so transformers' forward extends a native state
    in place (no copy of the cached entries). The caller makes room first (``reserve``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
        keys: torch.Tensor  # views of the buffer from __init__ on (never None)
        values: torch.Tensor

        def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor) -> None:
            super().__init__()
            self._kbuf, self._vbuf = kbuf, vbuf  # [H_kv, C, d] each
            self.device, self.dtype = kbuf.device, torch.float32
            self.keys, self.values = self._view(length)
            self.is_initialized = True

        def _view(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
            # a float16 buffer (fast numerics) is read widened to float32, as the native
            # step reads it: the forward attends to the rounded keys/values, new ones too
            k, v = self._kbuf[None, :, :n], self._vbuf[None, :, :n]
            return (k, v) if k.dtype == torch.float32 else (k.float(), v.float())

        def get_seq_length(self) -> int:
            return int(self.keys.shape[-2])

        def update(self, key_states, value_states, *args, **kwargs):
            past, q = int(self.keys.shape[-2]), int(key_states.shape[-2])
            if past + q > self._kbuf.shape[-2]:
                raise RuntimeError("native KV buffer too small for the new entries")
            self._kbuf[:, past : past + q] = key_states[0]
            self._vbuf[:, past : past + q] = value_states[0]
            self.keys, self.values = self._view(past + q)
            return self.keys, self.values

    cache = DynamicCache()
    cache.layers = [_BufferLayer(buffer[i, 0], buffer[i, 1]) for i in range(int(buffer.shape[0]))]
    return cache


class NativeTarget:
    """Decoding, verification and short prefills of a Llama-architecture model through the
    fused C++ decoder step (see the module docstring). Where a step is ~20-25 ms (one row of
    the default model on the 2-core CPU through transformers' forward) it saves the
    per-module Python of its 30 layers.

    Args:
        kernels: the kernel-routed target of the model, built with the compiled few-row
            kernel (``skinny``): the step reads its weights (and their GGUF blocks), its
            output layer computes the logits, its forward the long prefills. Its numerics
            are this target's: ``"fast"`` keeps the KV buffers in float16.
        step_cls: the compiled library's ``DecoderStep`` class
            (:func:`ragspec.backend.cpu.kernels.load_decoder_step`).
        native_prefill_rows: prompts of more tokens than this on an empty state prefill
            through transformers' forward (multi-row GEMMs: 700 tokens of the default model
            in ~0.8 s on the 2-core CPU, natively in chunks of 16 ~1.5 s), whose entries are
            then copied into the state's buffer; shorter ones natively in chunks of at most
            ``SKINNY_MAX_ROWS``. 0 (default): every first prefill through transformers'
            forward. Where ``native_chunks`` holds, those prefills (and later chunks of more
            than ``NATIVE_EXTEND_GEMM_ROWS`` tokens) run instead as one call of the step over
            the chunk: the same packed GEMMs and prompt-chunk attention, the same values bit
            for bit, without transformers' per-module Python and element-wise passes (the
            serve bench's prompts 0.91x the time, measured on the 2-core CPU).
        native_chunks: run those prompt chunks through the step where it can: exact numerics,
            the compiled prompt-chunk attention (AVX-512) and every linear's packed weight
            (:attr:`CPUTarget.packed_weights`); False: transformers' forward.

    Raises:
        ConfigError: ``kernels`` has no compiled few-row kernel, or its model is not one the
            step runs (:func:`~ragspec.backend.cpu.native.native_step_unsupported` says why).
    """

    def __init__(
        self, kernels: CPUTarget, step_cls: type, *, native_prefill_rows: int = 0, native_chunks: bool = True
    ) -> None:
        if kernels.skinny is None or kernels.dtype != torch.float32:
            raise ConfigError("the native decoder step needs the compiled few-row kernel in use and float32 weights")
        decoder = kernels.model.get_decoder()
        reason = native_step_unsupported(decoder)
        if reason is not None:
            raise ConfigError(f"the native decoder step cannot run this model: {reason}")
        self._kernels = kernels
        # fast numerics keep the KV cache in float16 (as llama.cpp's default), exact float32
        kv_dtype = torch.float16 if kernels.numerics == "fast" else torch.float32
        self._native = NativeDecoder(step_cls, decoder, kernels.gguf_blocks, kv_dtype=kv_dtype)
        self.model = kernels.model
        self.device = kernels.device
        self.dtype = kernels.dtype
        self.vocab_size = kernels.vocab_size
        self.max_length = kernels.max_length
        self.numerics = kernels.numerics
        self._prefill_rows = int(native_prefill_rows)
        # prompt chunks through the step too (packed GEMMs, the prompt-chunk attention):
        # exact numerics (float32 KV) where that attention kernel runs
        self._chunks = (
            native_chunks
            and kernels.numerics == "exact"
            and prefill_runs(kernels.prefill_attention, self._native.head_dim)
            and self._native.pack(kernels.packed_weights)
        )
        logger.debug(
            "native decoder step on (%d layers; prompt chunks %s)",
            self._native.num_layers,
            "through it" if self._chunks else "through transformers' forward",
        )

    @property
    def native_step(self) -> NativeDecoder:
        """The fused decoder step and the KV buffers it runs over."""
        return self._native

    @property
    def native_prefill_rows(self) -> int:
        """Prompts of more tokens than this on an empty state prefill through transformers'
        forward (see the constructor)."""
        return self._prefill_rows

    @property
    def kernel_path(self) -> CPUTarget:
        """The kernel-routed transformers target this one was built from."""
        return self._kernels

    # ------------------------------------------------------------------ state
    def new_state(self) -> NativeKVState:
        """A fresh, empty KV buffer for one request (allocated on first use)."""
        return self._native.new_state()

    def state_length(self, state: NativeKVState) -> int:
        """Tokens whose keys/values are in ``state``."""
        return state.length

    # ------------------------------------------------------------------ capabilities
    def capability(self, name: str) -> Any:
        """The kernel-routed target's capabilities, its fast linear kernels with the fused
        step for a drafter's own layers (``FAST_LINEAR.layer_step``), the speed-ups with the
        step on, and the step itself (``FUSED_STEP``)."""
        if name == Capability.FAST_LINEAR:
            fast = self._kernels.capability(name)
            return None if fast is None else dataclasses.replace(fast, layer_step=self._layer_step)
        if name == Capability.SPEED_UPS:
            return dataclasses.replace(self._kernels.capability(name), batched_verify=True, native_step_off=None)
        if name == Capability.FUSED_STEP:
            return FusedStep(self._native, self._kernels.logits)
        return self._kernels.capability(name)

    def _layer_step(
        self, layers: Sequence[torch.nn.Module], config: Any, rotary_emb: Any, int8: bool = False
    ) -> Optional[NativeDecoder]:
        """A drafter's decoder layers (an EAGLE head's) through the fused C++ step this
        model's decoding uses, no final norm, float32 KV, the weights float32 or (``int8``)
        Q8_0 blocks; None where the step cannot run them (the reason at debug level)."""
        blocks = None
        if int8:
            from .native import _linear_modules
            from .quant import quantize_q8_0

            blocks = {}
            for layer in layers:
                for m in _linear_modules(layer).values():
                    if int(m.weight.shape[1]) % 32 == 0:
                        blocks[m.weight.data_ptr()] = quantize_q8_0(m.weight)
        try:
            return NativeDecoder.for_layers(type(self._native.step), layers, config, rotary_emb, gguf=blocks)
        except ValueError as e:
            logger.debug("drafter layers stay on transformers' forward: %s", e)
            return None

    # ------------------------------------------------------------------ prefill
    def prefill(self, state: Any, input_ids: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        """Run ``input_ids`` (T >= 1 tokens) into ``state`` (see ``native_prefill_rows``): an
        empty state and more than ``native_prefill_rows`` tokens through transformers'
        forward into a transformers cache whose entries are then copied into the buffer;
        else the native step over chunks of at most ``SKINNY_MAX_ROWS`` tokens (causal). A
        filled state and more than ``NATIVE_EXTEND_GEMM_ROWS`` tokens (a later chunk of a
        chunked prefill): transformers' forward over a cache of views of the state's buffer
        (:func:`_buffer_cache`), the same multi-row GEMMs as the first chunk.

        Returns:
            logits float32 [1, V] of the last position (and hidden [T, H] if asked).

        Raises:
            ConfigError: ``state`` is not one of this target's.
        """
        if not isinstance(state, NativeKVState):
            raise ConfigError(f"prefill: a {type(state).__name__} is not a KV state of the native decoder step")
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)  # [T]
        hidden = self._prefill_hidden(state, ids)  # [T, H]
        return ForwardOutput(self._kernels.logits(hidden[-1:]), hidden if return_hidden else None)

    def _prefill_hidden(self, state: NativeKVState, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> hidden [T, H]; ``state`` grew by T (see :meth:`prefill`)."""
        native = self._native
        t = int(ids.shape[0])
        gemm = t > self._prefill_rows if state.length == 0 else t > max(self._prefill_rows, NATIVE_EXTEND_GEMM_ROWS)
        if gemm and self._chunks:
            # the whole chunk in one call of the step: its packed GEMMs and the prompt-chunk
            # attention, the values of transformers' forward below bit for bit
            pos = torch.arange(state.length, state.length + t)
            return native.forward([state], ids, pos, [0, t], [None], prompt=True)
        if state.length == 0 and t > self._prefill_rows:
            tmp = KVState(cache=growable_cache(), length=0)
            hidden = self._kernels.forward(tmp, ids[None], prompt=True)  # [T, H]
            native.load_cache(state, tmp.cache, tmp.length)
            return hidden
        if state.length > 0 and t > max(self._prefill_rows, NATIVE_EXTEND_GEMM_ROWS):
            # a later chunk of a chunked prefill: transformers' forward (multi-row GEMMs, as
            # the first chunk) writing straight into the state's buffer, not 16-row steps
            past = state.length
            native.reserve(state, past + t)
            tmp = KVState(cache=_buffer_cache(state.buffer, past), length=past)
            pos = torch.arange(past, past + t, device=ids.device)[None]
            hidden = self._kernels.forward(tmp, ids[None], pos, None, prompt=True)  # [T, H]
            state.length = past + t
            return hidden
        parts = []
        for a in range(0, t, SKINNY_MAX_ROWS):
            chunk = ids[a : a + SKINNY_MAX_ROWS]
            q = int(chunk.shape[0])
            pos = torch.arange(state.length, state.length + q)
            parts.append(native.forward([state], chunk, pos, [0, q], [None]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    # ------------------------------------------------------------------ verification
    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """Every item's root and draft tree (tree attention; each request attends to its
        own buffer): two or more items of at most ``SKINNY_MAX_ROWS`` rows each in one call
        of the step over their concatenated rows (request i's rows ``bounds[i]``), the
        output layer over every row needed now in one call; other items, and a single one,
        each in its own call. Every request gets exactly its solo values.

        Returns:
            one :class:`~ragspec.backend.base.ForwardOutput` per item, in order; each state
            grew by its N + 1 rows.

        Raises:
            ConfigError: the same state appears in two items.
        """
        items = list(items)
        if len(items) == 1:
            return [self._verify_alone(items[0])]
        check_distinct_states(items)
        outs: list[Optional[ForwardOutput]] = [None] * len(items)
        together = [i for i, it in enumerate(items) if it.tree.num_nodes + 1 <= SKINNY_MAX_ROWS]
        if len(together) > 1:
            batch = [items[i] for i in together]
            hidden, bounds = self._forward_rows(batch)
            for i, out in zip(together, batch_outputs(batch, bounds, hidden, self._kernels.logits)):
                outs[i] = out
        return [out if out is not None else self._verify_alone(it) for it, out in zip(items, outs)]

    def verify_one(
        self,
        state: NativeKVState,
        root_token: int,
        tree: DraftTree,
        *,
        return_hidden: bool = False,
        lazy_logits: bool = False,
    ) -> ForwardOutput:
        """One request's verification in its own call of the step: logits float32 [N + 1,
        V] (or :class:`~ragspec.backend.hf.RowLogits` with ``lazy_logits``), hidden [N + 1,
        H] if asked; the state grew by N + 1 entries (:meth:`commit` keeps the accepted
        path)."""
        return self._verify_alone(VerifyItem(state, root_token, tree, return_hidden, lazy_logits))

    def _verify_alone(self, item: VerifyItem) -> ForwardOutput:
        hidden, _ = self._forward_rows([item])  # [N + 1, H]
        if item.lazy_logits:
            return ForwardOutput(None, hidden if item.hidden else None, RowLogits(self._kernels.logits, hidden))
        return ForwardOutput(self._kernels.logits(hidden), hidden if item.hidden else None)

    @staticmethod
    def _rows(item: VerifyItem) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """An item's tokens int64 [N + 1], position ids int64 [N + 1] and attention mask
        (bool [N + 1, past + N + 1] for a branching tree; None: causal)."""
        tree, past = item.tree, item.state.length
        n = tree.num_nodes
        ids = torch.empty(n + 1, dtype=torch.long)
        ids[0] = item.root_token
        if n:
            ids[1:] = tree.tokens
        if n == 0 or tree.is_chain:
            return ids, torch.arange(past, past + n + 1), None
        mask = tree_attention_mask(tree, past)[0, 0]  # [N+1, past+N+1]
        return ids, tree_position_ids(tree, past)[0], mask

    def _forward_rows(self, items: Sequence[VerifyItem]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One call of the step over the rows of all ``items`` -> (hidden [R, H], each
        item's rows ``(start, stop)``); each state grew by its rows."""
        ids, pos, masks, bounds = [], [], [], [0]
        for it in items:
            i, p, m = self._rows(it)
            ids.append(i)
            pos.append(p)
            masks.append(m)
            bounds.append(bounds[-1] + int(i.shape[0]))
        hidden = self._native.forward(
            [it.state for it in items],
            ids[0] if len(ids) == 1 else torch.cat(ids),
            pos[0] if len(pos) == 1 else torch.cat(pos),
            bounds,
            masks,
        )
        return hidden, list(zip(bounds[:-1], bounds[1:]))

    # ------------------------------------------------------------------ commit and KV copies
    def commit(self, state: NativeKVState, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Keep the root and the accepted nodes of the last verification, copied into place
        behind the root: the state then holds ``past_len + 1 + len(accepted_nodes)`` entries."""
        self._native.commit(state, past_len, accepted_nodes)

    def rollback(self, state: NativeKVState, length: int) -> None:
        """Drop every entry from position ``length`` on (only the length drops)."""
        NativeDecoder.rollback(state, length)

    def export_kv(
        self, state: NativeKVState, start: int, stop: int, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """A copy of the KV entries of positions ``start .. stop - 1`` of ``state``, for a
        prefix cache: ``[L, 2, H_kv, stop - start, d]`` in the buffer's dtype (float16 in
        fast numerics), written into ``out`` where that has this shape, dtype and device.

        Raises:
            ConfigError: the positions are not all in ``state``.
        """
        if not 0 <= start <= stop <= state.length:
            raise ConfigError(f"export_kv: positions {start}..{stop} not in a state of {state.length}")
        src = state.buffer[:, :, :, start:stop]  # [L, 2, H_kv, n, d]
        if out is None or out.shape != src.shape or out.dtype != src.dtype or out.device != src.device:
            out = torch.empty(tuple(src.shape), dtype=src.dtype, device=src.device)
        out.copy_(src)
        return out

    def import_kv(self, state: NativeKVState, blocks: Sequence[torch.Tensor]) -> None:
        """Append exported KV entries (:meth:`export_kv` of this target, in order) to
        ``state``, bit for bit.

        Raises:
            ConfigError: an export of another shape or dtype than this target's buffers.
        """
        if not blocks:
            return
        kv = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=3)
        past, n = state.length, int(kv.shape[3])
        want = (*state.buffer.shape[:3], state.buffer.shape[4])
        if (*kv.shape[:3], kv.shape[4]) != want or kv.dtype != state.buffer.dtype:
            raise ConfigError(f"import_kv: entries of shape {tuple(kv.shape)} do not fit this model's cache")
        self._native.reserve(state, past + n)
        state.buffer[:, :, :, past : past + n].copy_(kv)
        state.length = past + n
