"""The transformers backend: a :class:`~ragspec.backend.base.Target` over a transformers
causal LM. With :mod:`ragspec.models`, the only module that touches transformers internals.

It runs the prefill and the verification forward pass (root + draft tree in one pass, with
a 4-D tree attention mask and tree position ids), and compacts the KV cache to the accepted
path. Per-request state (the KV cache) lives in a :class:`KVState`, never on the model.
Its CPU fast paths (compiled kernels, GGUF blocks, pre-packed weights) are in
:mod:`ragspec.backend.fastpaths`, installed by :meth:`HFTarget.speed_up`.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from ..config import NUMERICS
from ..errors import ConfigError
from ..tree import tree_attention_mask, tree_position_ids
from ..types import DraftTree
from .base import Capability, DecoderLayout, Embeddings, FastLinear, ForwardOutput, VerifyItem
from .fastpaths import (
    ATTENTION_BATCH_KW,
    ATTENTION_KERNEL_KW,
    GQA_SDPA,
    PACKED_MAX_ROWS,
    GGUFLinear,
    KernelScope,
    bind_gguf_linear,
    can_pack,
    pack_linear_forwards,
    pack_weight,
    packed_linear,
    register_gqa_attention,
    skinny_linear,
)
from .kernels import SKINNY_MAX_ROWS
from .native import NativeDecoder, NativeKVState, native_step_enabled, native_step_unsupported

if TYPE_CHECKING:
    from .kernels import FewQueryAttention, QuantLinear, SkinnyLinear
    from .quant import GGUFWeight

logger = logging.getLogger(__name__)

__all__ = ["KVState", "HFTarget", "RowLogits"]


# a filled native state extended by more rows than this (a later prefill chunk) goes through
# transformers' forward (GEMMs) over the state's buffer; fewer: the native step, 16 rows a call
NATIVE_EXTEND_GEMM_ROWS = 64


def _growable_cache():
    """A new transformers ``DynamicCache`` whose layers grow in place (see ``_GrowableLayer``)."""
    return _growable_cache_class()()


@functools.lru_cache(maxsize=None)
def _growable_cache_class() -> type:
    """The cache class, defined on first use (transformers is imported lazily)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class _GrowableLayer(DynamicLayer):
        """A dynamic cache layer over a pre-allocated buffer: new keys/values are written in
        place and ``keys``/``values`` are views ``[1, H_kv, T, d]`` of it.

        transformers' ``DynamicLayer`` concatenates on every update, copying the whole cache
        (30 layers x 2 x T x 192 floats for the default model: ~13 ms per step at 700
        tokens on the 2-core CPU, a fifth of a plain step). Here an update copies only the
        new entries; the buffer doubles when full. Rolling back is slicing the views; the
        attention reads the same values, so outputs are unchanged.
        """

        _kbuf: Optional[torch.Tensor] = None
        _vbuf: Optional[torch.Tensor] = None

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            past = self.get_seq_length()
            q = key_states.shape[-2]
            if self._kbuf is None or past + q > self._kbuf.shape[-2] or not self._owns_views():
                self._grow(past, past + q, key_states)
            self._kbuf[..., past : past + q, :] = key_states
            self._vbuf[..., past : past + q, :] = value_states
            self.keys = self._kbuf[..., : past + q, :]
            self.values = self._vbuf[..., : past + q, :]
            return self.keys, self.values

        def _owns_views(self) -> bool:
            # keys replaced from outside (not a view of the buffer): re-seat them
            return self.keys.numel() == 0 or self.keys.data_ptr() == self._kbuf.data_ptr()

        def _grow(self, past: int, need: int, like: torch.Tensor) -> None:
            old = 0 if self._kbuf is None else self._kbuf.shape[-2]
            cap = max(need + 256, 2 * old if need > old else old)
            shape = (*like.shape[:-2], cap, like.shape[-1])
            kbuf = torch.empty(shape, dtype=like.dtype, device=like.device)
            vbuf = torch.empty(shape, dtype=like.dtype, device=like.device)
            if past:
                kbuf[..., :past, :] = self.keys
                vbuf[..., :past, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf

        def select_tail(self, start: int, idx: torch.Tensor) -> None:
            """Keep entries ``[:start]`` and then the entries at ``idx`` (>= start), in place."""
            n = int(idx.numel())
            if self._kbuf is None or not self._owns_views():
                length = self.get_seq_length()
                self._grow(length, length, self.keys)  # re-seat keys set from outside
            self._kbuf[..., start : start + n, :] = self._kbuf[..., idx, :]
            self._vbuf[..., start : start + n, :] = self._vbuf[..., idx, :]
            self.keys = self._kbuf[..., : start + n, :]
            self.values = self._vbuf[..., : start + n, :]

    class _GrowableCache(DynamicCache):
        def __init__(self) -> None:
            super().__init__()
            self.layer_class_to_replicate = _GrowableLayer

    return _GrowableCache


def _buffer_cache(buffer: torch.Tensor, length: int):
    """A transformers ``DynamicCache`` over a native KV buffer ``[L, 2, H_kv, C, d]``
    (:class:`~ragspec.backend.native.NativeKVState`) holding ``length`` positions: each
    layer's ``update`` writes the new keys/values into the buffer at their positions and
    returns views ``[1, H_kv, T, d]`` of it, so transformers' forward extends a native state
    in place (no copy of the cached entries). The caller makes room first (``reserve``)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class _BufferLayer(DynamicLayer):
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


# decoders whose forward verify's batched path knows: attention layers only, masks built by
# create_causal_mask (and create_sliding_window_causal_mask for local layers), rotary
# position embeddings from position_ids, the cache updated once per layer in order
_BATCHED_MODEL_TYPES = frozenset({"llama", "gemma3_text"})


class _BatchCache:
    """The cache a batched verification forward hands to the decoder (see
    :meth:`HFTarget.verify`): each layer's ``update`` appends each request's new keys/values
    (its rows ``start:stop`` of the flat batch) to that request's own cache layer, in place,
    and keeps that request's whole keys/values for the layer's attention
    (:meth:`segments`, through ``ATTENTION_BATCH_KW``). No past entry is copied.

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


@dataclass
class KVState:
    """The KV cache of one request.

    Attributes:
        cache: a transformers ``DynamicCache`` (keys/values [1, H_kv, T, d] per layer).
        length: tokens whose keys/values are in the cache (T).
    """

    cache: object
    length: int = 0


class RowLogits:
    """The target's logits over N + 1 verified rows, computed on demand.

    Greedy verification only needs the rows on the accepted path: after a rejection at the
    first draft token (the common case) one row of the output layer suffices instead of
    N + 1. On the 2-core CPU the output layer (49152 x 576) costs ~7 ms for one row and
    ~30 ms for 8 rows, so a rejected 8-token draft saves ~20 ms of a ~90 ms step.

    Args:
        target: the :class:`HFTarget` whose output layer is applied.
        hidden: float [N + 1, H] final hidden states of the verification forward.

    Rows are computed in groups (:meth:`argmax` takes the rows to compute together); a
    group's logits equal the same rows of the full ``[N + 1, V]`` matrix up to GEMM
    rounding, exactly so for a single row (the plain-decoding kernel).
    """

    def __init__(self, target: "HFTarget", hidden: torch.Tensor) -> None:
        self._target = target
        self._hidden = hidden
        self._pred: dict[int, int] = {}
        self.rows_computed = 0

    def __len__(self) -> int:
        return int(self._hidden.shape[0])

    def _know(self, row: int, token: int) -> None:
        """Record the argmax of ``row``, computed by the caller with the same kernel (a
        batched verification computes row 0 of every request in one call)."""
        self._pred[row] = int(token)
        self.rows_computed += 1

    def argmax(self, row: int, group: Sequence[int] = ()) -> int:
        """Argmax token of ``row``; when it is not known yet, computes it together with the
        rows in ``group`` (one GEMM)."""
        if row not in self._pred:
            rows = [row] + [r for r in group if r != row and r not in self._pred]
            logits = self._target._logits(self._hidden[rows])  # [len(rows), V]
            self.rows_computed += len(rows)
            for r, t in zip(rows, logits.argmax(dim=-1).tolist()):
                self._pred[r] = int(t)
        return self._pred[row]

    def full(self) -> torch.Tensor:
        """All rows: float32 [N + 1, V]."""
        self.rows_computed += len(self)
        return self._target._logits(self._hidden)


class HFTarget:
    """Wraps a transformers causal LM for speculative verification.

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM (eval mode, on its device).
        pack_lm_head: multi-row output layer through a pre-packed oneDNN weight (default:
            on for CPU fp32/bf16; see :meth:`_packed_lm_head`).
        min_logit_rows: the output layer is applied to at least this many rows (padding
            with copies): on CPU, a 4-row GEMM is cheaper than a 2- or 3-row one
            (measured: 7.0 / 14.5 / 21.8 / 11.5 ms for 1 / 2 / 3 / 4 rows of 49152 x 576).
            Padding rows do not change any real row's logits.
    """

    def __init__(self, model: torch.nn.Module, *, min_logit_rows: int = 4, pack_lm_head: Optional[bool] = None) -> None:
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.min_logit_rows = min_logit_rows
        if pack_lm_head is None:
            pack_lm_head = can_pack(self.device, self.dtype)
        self.pack_lm_head = bool(pack_lm_head)
        self._packed: Optional[torch.Tensor] = None
        self._packed_bias: Optional[torch.Tensor] = None
        self.packed_linears = 0
        self._gguf: dict[int, GGUFLinear] = {}  # weight data_ptr -> GGUF-block twin, see use_gguf_weights
        self._gguf_weights: dict[int, "GGUFWeight"] = {}  # the same twins' blocks (for the native step)
        self._native: Optional[NativeDecoder] = None  # the fused decoder step, see use_native_step
        self.numerics = "exact"  # "fast": GGUF-block linears with int8 activations, see use_gguf_weights
        # prompts of more tokens than this on an empty state prefill through transformers'
        # forward (multi-row GEMMs: 700 tokens of the default model in ~0.8 s on the 2-core
        # CPU, natively in chunks of 16 ~1.5 s), shorter ones and extensions of a filled
        # state natively in chunks; 0: every first prefill through transformers, so that
        # every value is the transformers path's bit for bit
        self.native_prefill_rows = 0
        self._skinny: Optional["SkinnyLinear"] = None  # compiled few-row kernel, see prepack_linears
        self._attention_kernel: Optional["FewQueryAttention"] = None  # see use_attention_kernel
        self._scope = KernelScope()  # fast linear kernels apply inside our own forwards only
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        self._softcap = getattr(text_cfg, "final_logit_softcapping", None)
        self.vocab_size = int(self._lm_head.weight.shape[0])
        self.max_length = int(getattr(text_cfg, "max_position_embeddings", 0) or 0) or None
        self._attn_impl = getattr(self.config, "_attn_implementation", "sdpa") or "sdpa"
        layer_types = getattr(text_cfg, "layer_types", None) or ()
        # models with local (sliding-window) layers take one mask per layer type
        self._sliding_window = (
            int(text_cfg.sliding_window)
            if "sliding_attention" in layer_types and getattr(text_cfg, "sliding_window", None)
            else None
        )
        import inspect

        # transformers >= 5.2x names the cache argument `cache`; earlier ones `past_key_values`
        params = inspect.signature(self._decoder.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ state
    def new_state(self) -> Union[KVState, NativeKVState]:
        """A fresh, empty KV cache for one request (a :class:`NativeKVState` once
        :meth:`use_native_step` is on)."""
        if self._native is not None:
            return self._native.new_state()
        # Full (non-sliding) layers on purpose: rollback by crop/index-select is exact on them;
        # sliding-window attention is still applied through the attention mask.
        return KVState(cache=_growable_cache(), length=0)

    def state_length(self, state: Union[KVState, NativeKVState]) -> int:
        """Tokens whose keys/values are in ``state``."""
        return state.length

    # ------------------------------------------------------------------ capabilities
    def capability(self, name: str) -> Any:
        """The optional capabilities of this backend (:class:`~ragspec.backend.base.Capability`):
        hidden states, lazy output rows, the embeddings, the decoder layout (for decoders with
        ``layers`` and ``rotary_emb``: Llama-like architectures) and, once :meth:`speed_up`
        routed this model's linears, its fast few-row linear kernels."""
        if name in (Capability.HIDDEN_STATES, Capability.LAZY_ROWS, Capability.PREFIX_KV):
            return True
        if name == Capability.CONFIG:
            return self.config
        if name == Capability.EMBEDDINGS:
            decoder = self._decoder
            emb = decoder.get_input_embeddings() if hasattr(decoder, "get_input_embeddings") else decoder.embed_tokens
            return Embeddings(emb, self._lm_head, self._softcap)
        if name == Capability.DECODER_LAYOUT:
            layers = getattr(self._decoder, "layers", None)
            rotary = getattr(self._decoder, "rotary_emb", None)
            if not layers or rotary is None:
                return None
            from transformers import DynamicCache

            return DecoderLayout(self.config, type(layers[0]), type(rotary), DynamicCache)
        if name == Capability.FAST_LINEAR:
            if not self.packed_linears:
                return None
            return FastLinear(
                route=self._route_linears,
                linear=self._fast_linear,
                attention=register_gqa_attention(),
                layer_step=self._layer_step if self._native is not None else None,
                int8_linear=self._int8_linear,
            )
        return None

    def _layer_step(
        self, layers: Sequence[torch.nn.Module], config: Any, rotary_emb: Any, int8: bool = False
    ) -> Optional[NativeDecoder]:
        """A drafter's decoder layers (an EAGLE head's) through the fused C++ step this
        model's decoding uses, no final norm, float32 KV, the weights float32 or (``int8``)
        Q8_0 blocks; None where the step cannot run them (the reason at debug level)."""
        if self._native is None:
            return None
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

    def _int8_linear(
        self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """A drafter's linear over a Q8_0 copy of ``weight`` through the block kernel (see
        ``FastLinear.int8_linear``); None without the kernel or for in-features not a
        multiple of 32."""
        from .kernels import load_quant_linear
        from .quant import quantize_q8_0

        if self.device.type != "cpu" or weight.dim() != 2 or int(weight.shape[1]) % 32:
            return None
        kernel = load_quant_linear()
        if kernel is None:
            return None
        q = quantize_q8_0(weight)
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()

        def linear(x: torch.Tensor) -> torch.Tensor:
            shape = x.shape
            y = kernel(x.reshape(-1, shape[-1]).to(torch.float32).contiguous(), q.qs, q.scales, q.fmt, b)
            return y.reshape(*shape[:-1], y.shape[-1])

        return linear

    def _route_linears(self, module: torch.nn.Module) -> int:
        """A drafter's linears through this model's few-row kernels (one row included)."""
        return pack_linear_forwards(module, min_rows=1, skinny=self._skinny)

    def _fast_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> Optional[torch.Tensor]:
        return skinny_linear(self._skinny, x, weight, bias)

    # ------------------------------------------------------------------ speed-ups
    def speed_up(
        self,
        cpu_kernels: Optional[bool] = None,
        cache: Optional[Union[str, os.PathLike]] = None,
        gguf: Optional[Union[str, os.PathLike]] = None,
        numerics: str = "exact",
    ) -> None:
        """Make this model's own forwards fast (the model is ragspec's from here on): few-row
        linear layers (decoding, verification) through the compiled kernel or pre-packed
        weights, grouped-query attention without key/value head copies, and on CPU the
        compiled few-query attention.

        With the compiled kernels on a Llama-architecture model, decoding and verification
        run every decoder layer in one C++ call (:meth:`use_native_step`), unless
        ``RAGSPEC_NATIVE_STEP=0``.

        Args:
            cpu_kernels: route few-row linears and attention through ragspec's compiled CPU
                kernels (:mod:`ragspec.backend.kernels`: built on first use, ~45 s, then
                cached); None: on unless ``RAGSPEC_CPU_KERNELS=0``; where they cannot be
                built, torch's kernels are used. Only on CPU with float32 weights.
            cache: ragspec's cache folder (default: ``$RAGSPEC_CACHE`` or ``~/.cache/ragspec``).
            gguf: the GGUF file the model was loaded from: with the compiled kernel, the
                linear weights it holds exactly are read from its blocks
                (:meth:`use_gguf_weights`; the same output bit for bit, fewer bytes per step).
            numerics: ``"exact"`` (default: float32 arithmetic, the values above) or
                ``"fast"`` (opt-in: the GGUF-block linears with int8 activations, see
                :meth:`use_gguf_weights`, and the native step's KV cache in float16, see
                :class:`~ragspec.backend.native.NativeDecoder`).

        Raises:
            ConfigError: ``numerics`` is unknown, or ``"fast"`` cannot be served here (no
                GGUF file, no compiled kernel, a CPU without AVX-512 VNNI).
        """
        from .kernels import (
            cpu_kernels_enabled,
            load_decoder_step,
            load_few_query_attention,
            load_quant_linear,
            load_skinny_linear,
        )

        cache_dir = Path(cache) if cache else None
        skinny = None
        wanted = cpu_kernels if cpu_kernels is not None else cpu_kernels_enabled()
        if self.device.type == "cpu" and self.dtype == torch.float32 and wanted:
            skinny = load_skinny_linear(cache_dir)
        if numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        if numerics == "fast" and (skinny is None or gguf is None):
            raise ConfigError(
                "--numerics fast needs a GGUF model and ragspec's compiled CPU kernels on a float32 CPU model"
            )
        if skinny is not None and gguf is not None:
            self.use_gguf_weights(gguf, load_quant_linear(cache_dir), numerics=numerics)
        self.prepack_linears(skinny)
        self.route_gqa_attention()
        if skinny is not None:
            # the same compiled library: already built and imported above
            self.use_attention_kernel(load_few_query_attention(cache_dir))
            if native_step_enabled():
                self.use_native_step(load_decoder_step(cache_dir))

    def use_native_step(self, step_cls: Optional[type]) -> bool:
        """Run decoding, verification and short prefills through the fused C++ decoder step
        (:mod:`ragspec.backend.native`; ``step_cls`` from
        :func:`ragspec.backend.kernels.load_decoder_step`, None: off again). States made
        from here on are :class:`NativeKVState` (states made before keep transformers'
        path). The values are those of this object's transformers forward with the compiled
        kernels, bit for bit; where a step is ~20-25 ms (one row of the default model on the
        2-core CPU) it saves the per-module Python of its 30 layers. Needs the compiled
        few-row kernel in use (:meth:`prepack_linears`) and a decoder that
        :func:`~ragspec.backend.native.native_step_unsupported` accepts; otherwise a no-op
        (logged at debug level).

        Returns:
            whether the native step is in use.
        """
        if step_cls is None:
            self._native = None
            return False
        if self._skinny is None or self.device.type != "cpu" or self.dtype != torch.float32:
            logger.debug("native decoder step off: needs the compiled kernel, float32 on CPU")
            return False
        reason = native_step_unsupported(self._decoder)
        if reason is not None:
            logger.debug("native decoder step off: %s", reason)
            return False
        # fast numerics keep the KV cache in float16 (as llama.cpp's default), exact float32
        kv_dtype = torch.float16 if self.numerics == "fast" else torch.float32
        self._native = NativeDecoder(step_cls, self._decoder, self._gguf_weights, kv_dtype=kv_dtype)
        logger.debug("native decoder step on (%d layers)", self._native.num_layers)
        return True

    @property
    def native_step(self) -> Optional[NativeDecoder]:
        """The fused decoder step in use (:meth:`use_native_step`), or None."""
        return self._native

    # ------------------------------------------------------------------ forwards
    def _packed_lm_head(self) -> Optional[torch.Tensor]:
        """The output layer's weight re-laid out once for oneDNN (CPU only), or None.

        For a few rows (verification: 2-17) MKL's sgemm re-packs the whole 49152 x 576
        weight on every call; a pre-packed oneDNN weight avoids that (measured on the
        2-core CPU, one thread: 63 ms -> 27 ms for 4 rows, 67 -> 34 ms for 8; two threads:
        24 -> 6 ms for 4 rows). It also streams the weight faster for one row (plain
        decoding: 9.9 -> 5.1 ms at two threads, a plain step 56 -> 52 ms), so every step
        uses it; its logits equal the ordinary linear's up to float rounding (~1e-4), which
        can flip an argmax only between near-equal logits. Costs one extra copy of the
        output weight.
        """
        if not self.pack_lm_head:
            return None
        if self._packed is None:
            w = self._lm_head.weight
            self._packed = pack_weight(w)
            self._packed_bias = None if getattr(self._lm_head, "bias", None) is None else self._lm_head.bias.detach()
        return self._packed

    def prepack_linears(self, skinny: Optional["SkinnyLinear"] = None) -> int:
        """Route the decoder's few-row linear layers through faster kernels than MKL's.

        Verification runs every linear layer on 2-17 rows; for such shapes MKL's sgemm
        re-packs the weight on every call, so a 4-8-row forward costs ~1.5x a one-row one on
        a CPU. After this call each ``nn.Linear`` of the decoder computes inputs of 2-64 rows
        with a weight packed once for oneDNN (measured on the 2-core CPU, 2 threads, 512
        tokens of context: 8 new tokens 124 -> 87 ms). With ``skinny`` (the compiled kernel
        from :func:`ragspec.backend.kernels.load_skinny_linear`), inputs of 1-16 rows, plain
        decoding included, go through it instead (decoder linears for one row 36-47 -> 25
        ms, for 8 rows 49 -> 36 ms) and so does the output layer. Either way only inside
        this object's own forwards: ``model.generate`` and other callers of the model keep
        transformers' kernels. Values change by float32 rounding only (summation order), so
        greedy output equals ``model.generate``'s except where two logits tie to ~1e-5.
        Modifies the model in place (each layer's ``forward``), costs one extra copy of the
        decoder's linear weights, and is a no-op off CPU or without oneDNN.

        Returns:
            the number of linear layers routed (0 where not applicable).
        """
        if self.packed_linears or not can_pack(self.device, self.dtype):
            return self.packed_linears
        self._skinny = skinny if self.dtype == torch.float32 else None
        n = pack_linear_forwards(
            self._decoder, min_rows=2, skinny=self._skinny, scope=self._scope, gguf=self._gguf if self._skinny else None
        )
        self.packed_linears = n
        logger.debug(
            "routed %d decoder linear layers through %s",
            n,
            "the compiled few-row kernel" if self._skinny is not None else "pre-packed oneDNN weights",
        )
        return n

    def use_gguf_weights(self, path: "str | Path", kernel: Optional["QuantLinear"], numerics: str = "exact") -> int:
        """Keep the decoder's linear weights and the output layer's in the GGUF file's own
        block formats (:mod:`ragspec.backend.quant`: Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) for
        ragspec's few-row forwards, through the compiled ``quant_linear`` kernel: the same output bit for bit as the
        float32 kernel, a fifth of the bytes streamed per step (default model, 2-core CPU:
        decoder linears for one row 22-25 -> 14 ms, the output layer 5.3 -> 2.9 ms). Each
        weight is matched to the file by content and checked for exact equality; weights
        without an exact twin keep float32. Call before :meth:`prepack_linears`, with
        ``path`` the GGUF the model was loaded from. Costs ~0.75-1.25 bytes of memory per
        weight; the matches are cached beside the converted model (``<stem>.hf/``: the
        first load ~7 s, later ones well under a second). A no-op without ``kernel``, off
        CPU or for other dtypes than float32.

        ``numerics="fast"`` (opt-in, ``--numerics fast``) keeps the Q4_1 and Q8_0 weights in
        the kernel's fast formats (:meth:`~ragspec.backend.quant.GGUFWeight.to_fast`): their
        linears quantize each activation row to int8 per block of 32 and sum integer dot
        products (AVX-512 VNNI), as llama.cpp does, but every row alone, so a verification
        forward still gives each row what a one-row step gives it (speculative == plain
        decoding within the mode, bit for bit); its values differ from float32 by the
        activations' rounding (~0.5% of a linear's output), so greedy output can differ from
        transformers'. Other formats (Q6_K) keep float32 arithmetic.

        Returns:
            the number of weights served from GGUF blocks (0 where the file cannot be read:
            a warning says why, the float32 weights serve).

        Raises:
            ConfigError: ``numerics="fast"`` on a CPU without AVX-512 VNNI (or with AVX-512
                masked off), or where the file cannot be read.
        """
        if kernel is None or self.device.type != "cpu" or self.dtype != torch.float32 or self.packed_linears:
            return len(self._gguf)
        from ..models import converted_model_dir
        from .quant import load_gguf_weights

        weights = {
            name: module.weight for name, module in self._decoder.named_modules() if type(module) is torch.nn.Linear
        }
        weights["lm_head"] = self._lm_head.weight
        cache = converted_model_dir(Path(path)).parent / "gguf_blocks.safetensors"
        try:
            matched = load_gguf_weights(path, weights, cache)
        except Exception as e:  # gguf-py raises many types on a file it cannot parse
            if numerics == "fast":
                raise ConfigError(f"--numerics fast: cannot read GGUF blocks from {path} ({type(e).__name__}: {e})")
            logger.warning(
                "cannot read GGUF blocks from %s (%s: %s); float32 weights are used", path, type(e).__name__, e
            )
            return 0
        if numerics == "fast":
            from .kernels import fast_numerics_supported

            if not fast_numerics_supported():
                raise ConfigError(
                    "--numerics fast needs AVX-512 VNNI (and AVX-512 not masked off by RAGSPEC_CPU_ISA=avx2); "
                    "this CPU runs --numerics exact only"
                )
            matched = {name: q.to_fast() for name, q in matched.items()}
            self.numerics = "fast"
        self._gguf = {weights[name].data_ptr(): bind_gguf_linear(kernel, q) for name, q in matched.items()}
        self._gguf_weights = {weights[name].data_ptr(): q for name, q in matched.items()}
        logger.debug("%d of %d linear weights served from GGUF blocks of %s", len(matched), len(weights), path)
        return len(self._gguf)

    @property
    def gguf_weights(self) -> int:
        """How many linear weights ragspec's forwards read from GGUF blocks
        (:meth:`use_gguf_weights`)."""
        return len(self._gguf) if self._skinny is not None else 0

    @property
    def skinny(self) -> Optional["SkinnyLinear"]:
        """The compiled few-row linear kernel this model's forwards use, or None."""
        return self._skinny

    @property
    def attention_kernel(self) -> Optional["FewQueryAttention"]:
        """The compiled few-query attention in use (:meth:`use_attention_kernel`), or None."""
        return self._attention_kernel

    def use_attention_kernel(self, kernel: Optional["FewQueryAttention"]) -> bool:
        """Compute the attention of ragspec's own decoding and verification forwards (at most
        ``SKINNY_MAX_ROWS`` new tokens, float32 on CPU) with the compiled few-query kernel of
        :mod:`ragspec.backend.kernels` (None: torch's SDPA again). It splits the cached keys in
        blocks over the threads where torch's CPU SDPA splits only heads and query blocks:
        per layer at 790 cached tokens on the 2-core CPU, 1 query 0.13 -> 0.05 ms, 4
        queries 0.31 -> 0.16 ms. Other calls (``model.generate``, prefill) keep torch's.
        Needs the attention routed through ragspec's function (:meth:`route_gqa_attention`).

        Returns:
            whether the kernel is in use.
        """
        self._attention_kernel = kernel if self.device.type == "cpu" else None
        return self._attention_kernel is not None and self._attn_impl == GQA_SDPA

    def route_gqa_attention(self) -> bool:
        """Run the model's attention through :func:`_gqa_sdpa_attention` (registered with
        transformers' ``AttentionInterface`` as ``"ragspec_sdpa"``): masked verification
        forwards then skip the key/value head copies of grouped-query attention (~10 ms of
        a ~90 ms 8-token step at 700 tokens of context on the 2-core CPU). Same values;
        modifies the model in place (its attention implementation, also for
        ``model.generate``, whose prefill and one-token steps take transformers' own path).
        A no-op unless the model uses ``"sdpa"`` with grouped-query attention.

        Returns:
            whether the attention was routed.
        """
        if self._attn_impl == GQA_SDPA:
            return True
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        heads = int(getattr(text_cfg, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(text_cfg, "num_key_value_heads", 0) or heads)
        if (
            self._attn_impl != "sdpa"
            or not heads
            or kv_heads == heads
            or not hasattr(self.model, "set_attn_implementation")
        ):
            return False
        self.model.set_attn_implementation(register_gqa_attention())
        self._attn_impl = getattr(self.config, "_attn_implementation", GQA_SDPA)
        logger.debug("attention routed through %s (%d query / %d key-value heads)", self._attn_impl, heads, kv_heads)
        return self._attn_impl == GQA_SDPA

    def _logits(self, hidden: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """hidden: [R, H] -> logits float32 [R, V] (``chunked``: more than
        ``SKINNY_MAX_ROWS`` rows also through the compiled kernel, see :func:`skinny_linear`)."""
        rows = hidden.shape[0]
        bias = getattr(self._lm_head, "bias", None)
        weight = self._lm_head.weight
        logits = skinny_linear(
            self._skinny,
            hidden,
            weight,
            None if bias is None else bias.detach(),
            self._gguf.get(weight.data_ptr()),
            chunked=chunked,
        )
        if logits is None:
            packed = self._packed_lm_head() if rows <= PACKED_MAX_ROWS else None
            if packed is not None:
                logits = packed_linear(hidden, packed, self._packed_bias)
            else:
                if 1 < rows < self.min_logit_rows:
                    pad = hidden[-1:].expand(self.min_logit_rows - rows, -1)
                    hidden = torch.cat([hidden, pad], dim=0)  # [min_rows, H]
                logits = self._lm_head(hidden)[:rows]  # [R, V]
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()

    def _run(
        self,
        state: KVState,
        input_ids: torch.Tensor,
        position_ids: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """input_ids: int64 [1, Q] -> last hidden states [Q, H]; appends Q entries to the cache."""
        extra = {self._cache_kw: state.cache}
        if self._attention_kernel is not None and self._attn_impl == GQA_SDPA:
            extra[ATTENTION_KERNEL_KW] = self._attention_kernel
        self._scope.active = True
        try:
            out = self._decoder(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **extra,
            )
        finally:
            self._scope.active = False
        state.length += int(input_ids.shape[1])
        return out.last_hidden_state[0]  # [Q, H]

    def prefill(
        self, state: Union[KVState, NativeKVState], input_ids: Sequence[int], *, return_hidden: bool = False
    ) -> ForwardOutput:
        """Run the prompt through the model.

        Args:
            state: an empty (or partially filled) KV state; extended by len(input_ids).
            input_ids: prompt token ids (T >= 1).

        Returns:
            logits float32 [1, V] of the last position (and hidden [T, H] if asked).
        """
        ids = torch.as_tensor(list(input_ids), dtype=torch.long, device=self.device)[None]  # [1, T]
        if isinstance(state, NativeKVState):
            hidden = self._native_prefill(state, ids[0])
        else:
            hidden = self._run(state, ids, None, None)  # [T, H]
        return ForwardOutput(self._logits(hidden[-1:]), hidden if return_hidden else None)

    def _native_decoder(self) -> NativeDecoder:
        if self._native is None:
            raise ConfigError("a native KV state needs the native decoder step (use_native_step)")
        return self._native

    def _native_prefill(self, state: NativeKVState, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [T] -> hidden [T, H]. An empty state and more than
        ``native_prefill_rows`` tokens: transformers' forward (multi-row GEMMs) into a
        transformers cache whose entries are then copied into the state's buffer; else the
        native step over chunks of at most ``SKINNY_MAX_ROWS`` tokens (causal). A filled state
        and more than ``NATIVE_EXTEND_GEMM_ROWS`` tokens (a later chunk of a chunked prefill):
        transformers' forward over a cache of views of the state's buffer
        (:func:`_buffer_cache`), the same multi-row GEMMs as the first chunk."""
        native = self._native_decoder()
        t = int(ids.shape[0])
        if state.length == 0 and t > self.native_prefill_rows:
            tmp = KVState(cache=_growable_cache(), length=0)
            hidden = self._run(tmp, ids[None], None, None)  # [T, H]
            native.load_cache(state, tmp.cache, tmp.length)
            return hidden
        if state.length > 0 and t > max(self.native_prefill_rows, NATIVE_EXTEND_GEMM_ROWS):
            # a later chunk of a chunked prefill: transformers' forward (multi-row GEMMs, as
            # the first chunk) writing straight into the state's buffer, not 16-row steps
            past = state.length
            native.reserve(state, past + t)
            tmp = KVState(cache=_buffer_cache(state.buffer, past), length=past)
            pos = torch.arange(past, past + t, device=ids.device)[None]
            hidden = self._run(tmp, ids[None], pos, None)  # [T, H]
            state.length = past + t
            return hidden
        parts = []
        for a in range(0, t, SKINNY_MAX_ROWS):
            chunk = ids[a : a + SKINNY_MAX_ROWS]
            q = int(chunk.shape[0])
            pos = torch.arange(state.length, state.length + q)
            parts.append(native.forward([state], chunk, pos, [0, q], [None]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def _native_rows(self, item: VerifyItem) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
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

    def _native_verify(self, items: Sequence[VerifyItem]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """One native step over the rows of all ``items`` -> (hidden [R, H], each item's
        rows ``(start, stop)``); each state grew by its rows."""
        ids, pos, masks, bounds = [], [], [], [0]
        for it in items:
            i, p, m = self._native_rows(it)
            ids.append(i)
            pos.append(p)
            masks.append(m)
            bounds.append(bounds[-1] + int(i.shape[0]))
        hidden = self._native_decoder().forward(
            [it.state for it in items],
            ids[0] if len(ids) == 1 else torch.cat(ids),
            pos[0] if len(pos) == 1 else torch.cat(pos),
            bounds,
            masks,
        )
        return hidden, list(zip(bounds[:-1], bounds[1:]))

    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """The verification forward of every item (see :meth:`verify_one`; each request
        attends to its own KV cache only).

        Two or more items run as one forward over their concatenated rows (a flat batch:
        request i's root and draft nodes at rows ``cu[i]:cu[i + 1]``, each row with its own
        position id), the linear layers over all rows at once and the attention of each
        request over its own cache, where that gives every request exactly the output of
        its own forward (:meth:`batches`): the compiled few-row kernel in use, the attention
        routed through ragspec's function, a Llama or Gemma-3 text decoder, items of at
        most ``SKINNY_MAX_ROWS`` rows. Other items (and every item elsewhere) run one after
        another through :meth:`verify_one`. A single item always takes :meth:`verify_one`.
        Items over native KV states (:meth:`use_native_step`) of at most ``SKINNY_MAX_ROWS``
        rows share one native step the same way (each request attends to its own buffer;
        the kernels compute every row on its own, so each gets exactly its solo values).

        Returns:
            one :class:`ForwardOutput` per item, in order; each state grew by its N + 1 rows.

        Raises:
            ConfigError: the same state appears in two items.
        """
        items = list(items)
        outs: list[Optional[ForwardOutput]] = [None] * len(items)
        if len(items) > 1:
            if len({id(it.state) for it in items}) != len(items):
                raise ConfigError("verify: the same KV state appears in two items")
            native = [
                i
                for i, it in enumerate(items)
                if isinstance(it.state, NativeKVState) and it.tree.num_nodes + 1 <= SKINNY_MAX_ROWS
            ]
            if len(native) > 1:
                batch = [items[i] for i in native]
                hidden, bounds = self._native_verify(batch)
                for i, out in zip(native, self._batch_outputs(batch, bounds, hidden)):
                    outs[i] = out
            group = [i for i, it in enumerate(items) if self._batchable(it)] if self.batches else []
            if len(group) > 1:
                for i, out in zip(group, self._verify_batch([items[i] for i in group])):
                    outs[i] = out
        return [
            out
            if out is not None
            else self.verify_one(it.state, it.root_token, it.tree, return_hidden=it.hidden, lazy_logits=it.lazy_logits)
            for it, out in zip(items, outs)
        ]

    @property
    def batches(self) -> bool:
        """Whether :meth:`verify` runs several requests' rows in one forward.

        Only where each request's output is then bit for bit that of its own forward:
        float32 on CPU with the compiled few-row kernel (it computes each row on its own,
        so the linear layers and the output layer give every row the values of a solo
        forward; without it, BLAS may sum differently for other row counts), the attention
        through ragspec's function (:meth:`route_gqa_attention`: each request's rows attend
        to its own keys through the call its solo forward makes), a decoder whose forward
        ragspec knows (Llama, Gemma-3 text: masks built as transformers builds them), and
        head size, hidden and intermediate sizes multiples of 32 (element-wise functions
        such as SiLU and the rotary cos/sin take ATen's vector path for every element of
        such rows, whatever the number of rows; a scalar tail may round differently).
        """
        if self._skinny is None or self._attn_impl != GQA_SDPA or self.device.type != "cpu":
            return False
        cfg = getattr(self._decoder, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in _BATCHED_MODEL_TYPES:
            return False
        if getattr(cfg, "use_bidirectional_attention", False):
            return False
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        head_dim = int(getattr(cfg, "head_dim", 0) or (hidden // heads if heads else 0))
        inter = int(getattr(cfg, "intermediate_size", 0) or 0)
        if not (head_dim and hidden and inter) or head_dim % 32 or hidden % 32 or inter % 32:
            return False
        w = self._lm_head.weight
        return w.dtype == torch.float32 and w.is_contiguous()

    def _batchable(self, item: VerifyItem) -> bool:
        """Whether ``item`` can share a batched forward: at most ``SKINNY_MAX_ROWS`` rows (its
        solo forward then runs every linear layer through the compiled kernel) and a cache
        of this backend."""
        return item.tree.num_nodes + 1 <= SKINNY_MAX_ROWS and isinstance(
            getattr(item.state, "cache", None), _growable_cache_class()
        )

    def _causal_masks(self, state: KVState, rows: int) -> Any:
        """The attention mask(s) transformers' own forward builds for ``rows`` new tokens of
        plain causal decoding over ``state`` (None where it lets SDPA mask by itself; a dict
        per layer type for models with local layers)."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(
            config=self._decoder.config,
            inputs_embeds=torch.empty((1, rows, 0), dtype=self.dtype, device=self.device),  # shape/dtype only
            attention_mask=None,
            cache=state.cache,
            position_ids=(torch.arange(rows, device=self.device) + state.length)[None],
        )
        full = create_causal_mask(**kwargs)
        if self._sliding_window is None:
            return full
        return {"full_attention": full, "sliding_attention": create_sliding_window_causal_mask(**kwargs)}

    def _verify_batch(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """One forward over the rows of all ``items`` (see :meth:`verify`)."""
        bounds: list[tuple[int, int]] = []
        tokens: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        masks: list[Any] = []
        start = 0
        for it in items:
            tree, past = it.tree, it.state.length
            n = tree.num_nodes
            tokens.append(torch.tensor([it.root_token], dtype=torch.long))
            if n:
                tokens.append(tree.tokens.to(torch.long))
            if n == 0 or tree.is_chain:
                # plain causal attention: the mask transformers would build for it alone
                positions.append(torch.arange(past, past + n + 1, device=self.device))
                masks.append(self._causal_masks(it.state, n + 1))
            else:
                pos, attn = self._tree_masks(tree, past)
                positions.append(pos[0])
                masks.append(attn)
            bounds.append((start, start + n + 1))
            start += n + 1
        ids = torch.cat(tokens).to(self.device)[None]  # [1, R]
        pos_ids = torch.cat(positions)[None]  # [1, R]
        layer_types = tuple(getattr(self._decoder.config, "layer_types", None) or ())
        batch = _BatchCache([it.state for it in items], bounds, masks, layer_types)
        extra = {self._cache_kw: batch, ATTENTION_BATCH_KW: batch}
        if self._attention_kernel is not None:
            extra[ATTENTION_KERNEL_KW] = self._attention_kernel
        # a prepared 4-D mask stops transformers from building one over the flat batch; the
        # attention reads each request's own mask from the batch instead
        unused = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        attn_arg: Any = unused
        if self._sliding_window is not None:
            attn_arg = {"full_attention": unused, "sliding_attention": unused}
        self._scope.active = True
        self._scope.chunked = True
        try:
            out = self._decoder(input_ids=ids, position_ids=pos_ids, attention_mask=attn_arg, use_cache=True, **extra)
        finally:
            self._scope.active = False
            self._scope.chunked = False
        for it, (a, b) in zip(items, bounds):
            it.state.length += b - a
        return self._batch_outputs(items, bounds, out.last_hidden_state[0])

    def _batch_outputs(
        self, items: Sequence[VerifyItem], bounds: Sequence[tuple[int, int]], hidden: torch.Tensor
    ) -> list[ForwardOutput]:
        """The outputs of a batched verification from its hidden states [R, H] (item i's
        rows ``bounds[i]``)."""
        # the output layer over every row needed now, all requests at once: all rows of a
        # request verified with full logits, row 0 of a lazy one (greedy always reads it)
        rows: list[int] = []
        for it, (a, b) in zip(items, bounds):
            rows.extend([a] if it.lazy_logits else range(a, b))
        logits = self._logits(hidden[rows], chunked=True)  # [len(rows), V]
        outs: list[ForwardOutput] = []
        at = 0
        for it, (a, b) in zip(items, bounds):
            h = hidden[a:b]  # [N+1, H]
            if it.lazy_logits:
                row_logits = RowLogits(self, h)
                row_logits._know(0, int(logits[at].argmax()))
                at += 1
                outs.append(ForwardOutput(None, h if it.hidden else None, row_logits))
            else:
                outs.append(ForwardOutput(logits[at : at + b - a], h if it.hidden else None))
                at += b - a
        return outs

    def verify_one(
        self,
        state: Union[KVState, NativeKVState],
        root_token: int,
        tree: DraftTree,
        *,
        return_hidden: bool = False,
        lazy_logits: bool = False,
    ) -> ForwardOutput:
        """One forward over the root (last committed token) and the N draft nodes.

        The cache grows by N + 1 entries; call :meth:`commit` afterwards to keep only the
        root and the accepted path.

        Args:
            lazy_logits: leave ``logits`` None and return :class:`RowLogits` in
                ``row_logits`` instead (for greedy verification, which needs only the rows
                on the accepted path).

        Returns:
            logits float32 [N + 1, V] (and hidden [N + 1, H] if asked).
        """
        if isinstance(state, NativeKVState):
            hidden, _ = self._native_verify([VerifyItem(state, root_token, tree)])
        else:
            hidden = self._verify_hf(state, root_token, tree)
        if lazy_logits:
            return ForwardOutput(None, hidden if return_hidden else None, RowLogits(self, hidden))
        return ForwardOutput(self._logits(hidden), hidden if return_hidden else None)

    def _verify_hf(self, state: KVState, root_token: int, tree: DraftTree) -> torch.Tensor:
        """:meth:`verify_one`'s forward through transformers -> hidden [N + 1, H]."""
        n = tree.num_nodes
        ids = torch.empty(1, n + 1, dtype=torch.long)
        ids[0, 0] = root_token
        if n:
            ids[0, 1:] = tree.tokens
        ids = ids.to(self.device)
        past = state.length
        if n == 0 or tree.is_chain:
            # plain causal attention: transformers builds the mask itself
            hidden = self._run(state, ids, None, None)
        else:
            pos, attn = self._tree_masks(tree, past)
            hidden = self._run(state, ids, pos, attn)
        return hidden

    def _tree_masks(self, tree: DraftTree, past: int) -> tuple[torch.Tensor, Any]:
        """Position ids int64 [1, N + 1] and the attention mask(s) of a tree's verification
        forward: [1, 1, N + 1, past + N + 1] in the attention implementation's form, or for
        models with local layers a dict of one such mask per layer type."""
        mask = tree_attention_mask(tree, past, device=self.device)  # [1, 1, N+1, past+N+1]
        pos = tree_position_ids(tree, past, device=self.device)  # [1, N+1]
        attn = self._mask_for_model(mask)
        if self._sliding_window is not None:
            # local layers: also hide keys more than `window` positions behind the query
            kv_pos = torch.cat([torch.arange(past, device=self.device), pos[0]])  # [past+N+1]
            near = kv_pos[None, :] > pos[0][:, None] - self._sliding_window  # [N+1, past+N+1]
            attn = {
                "full_attention": attn,
                "sliding_attention": self._mask_for_model(mask & near[None, None]),
            }
        return pos, attn

    def _mask_for_model(self, mask: torch.Tensor) -> torch.Tensor:
        """bool mask (True = attend) in the form the attention implementation expects."""
        if self._attn_impl in ("sdpa", GQA_SDPA, "flash_attention_2", "flex_attention"):
            return mask
        # eager attention adds the mask: 0 where allowed, dtype-min elsewhere
        neg = torch.finfo(self.dtype).min
        return torch.zeros(mask.shape, dtype=self.dtype, device=self.device).masked_fill(~mask, neg)

    def commit(self, state: Union[KVState, NativeKVState], past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Roll the cache back to ``past_len`` + root + the accepted nodes.

        Args:
            past_len: cache length before the verification forward.
            accepted_nodes: indices of accepted draft nodes, root to leaf.
        """
        if isinstance(state, NativeKVState):
            self._native_decoder().commit(state, past_len, accepted_nodes)
            return
        keep = past_len + 1 + len(accepted_nodes)
        if list(accepted_nodes) == list(range(len(accepted_nodes))):
            # accepted path is a prefix of the forward's rows: a crop suffices
            self.rollback(state, keep)
            return
        idx = torch.tensor([past_len + 1 + i for i in accepted_nodes], dtype=torch.long, device=self.device)
        for layer in state.cache.layers:
            if hasattr(layer, "select_tail"):
                layer.select_tail(past_len + 1, idx)
            else:
                full = torch.cat([torch.arange(past_len + 1, device=self.device), idx])
                layer.keys = layer.keys.index_select(-2, full)
                layer.values = layer.values.index_select(-2, full)
        state.length = keep

    def export_kv(
        self, state: Union[KVState, NativeKVState], start: int, stop: int, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """A copy of the KV entries of positions ``start .. stop - 1`` of ``state``, for a
        prefix cache (:class:`~ragspec.prefix_cache.PrefixCache`): ``[L, 2, H_kv, stop -
        start, d]`` in the cache's dtype (float16 in fast numerics), written into ``out``
        where that has this shape, dtype and device (an evicted entry's memory), else new.

        Raises:
            ConfigError: the positions are not all in ``state``.
        """
        if not 0 <= start <= stop <= state.length:
            raise ConfigError(f"export_kv: positions {start}..{stop} not in a state of {state.length}")
        if isinstance(state, NativeKVState):
            src = state.buffer[:, :, :, start:stop]  # [L, 2, H_kv, n, d]
            shape, dtype, device = tuple(src.shape), src.dtype, src.device
        else:
            layers = state.cache.layers
            k0 = layers[0].keys  # [1, H_kv, T, d]
            shape = (len(layers), 2, int(k0.shape[1]), stop - start, int(k0.shape[3]))
            dtype, device = k0.dtype, k0.device
        if out is None or tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
            out = torch.empty(shape, dtype=dtype, device=device)
        if isinstance(state, NativeKVState):
            out.copy_(src)
        else:
            for i, layer in enumerate(layers):
                out[i, 0].copy_(layer.keys[0, :, start:stop])
                out[i, 1].copy_(layer.values[0, :, start:stop])
        return out

    def import_kv(self, state: Union[KVState, NativeKVState], blocks: Sequence[torch.Tensor]) -> None:
        """Append exported KV entries (:meth:`export_kv` of this target, in order) to
        ``state``: afterwards it holds exactly what prefilling their tokens would have written
        where the exports came from the same positions (a prefix cache's chunks).

        Raises:
            ConfigError: an export of another shape or dtype than this target's cache.
        """
        if not blocks:
            return
        kv = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=3)
        past, n = state.length, int(kv.shape[3])
        if isinstance(state, NativeKVState):
            want = (*state.buffer.shape[:3], state.buffer.shape[4])
            if (*kv.shape[:3], kv.shape[4]) != want or kv.dtype != state.buffer.dtype:
                raise ConfigError(f"import_kv: entries of shape {tuple(kv.shape)} do not fit this model's cache")
            self._native_decoder().reserve(state, past + n)
            state.buffer[:, :, :, past : past + n].copy_(kv)
            state.length = past + n
            return
        layers = int(kv.shape[0])
        text_cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        if layers != int(getattr(text_cfg, "num_hidden_layers", layers)) or kv.dtype != self.dtype:
            raise ConfigError(f"import_kv: entries of shape {tuple(kv.shape)} do not fit this model's cache")
        for i in range(layers):
            state.cache.update(kv[i, 0][None].to(self.device), kv[i, 1][None].to(self.device), i)
        state.length = past + n

    def rollback(self, state: Union[KVState, NativeKVState], length: int) -> None:
        """Drop every cache entry from position ``length`` on (keys/values are views, so
        this copies nothing)."""
        if isinstance(state, NativeKVState):
            NativeDecoder.rollback(state, length)
            return
        if state.length > length:
            for layer in state.cache.layers:
                if layer.keys is not None and layer.keys.numel():
                    layer.keys = layer.keys[..., :length, :]
                    layer.values = layer.values[..., :length, :]
        state.length = min(state.length, length)
