"""The CPU backend: the transformers target (:class:`~ragspec.backend.hf.HFTarget`) with
ragspec's CPU speed-ups, installed by :meth:`CPUTarget.speed_up`.

* few-row linear layers (decoding, verification) through the compiled kernel
  (:mod:`ragspec.backend.cpu.kernels`) or pre-packed oneDNN weights, the output layer too
  (:mod:`ragspec.backend.cpu.fastpaths`);
* the linear weights read from the GGUF file's own blocks (:mod:`ragspec.backend.cpu.quant`;
  the same values bit for bit, fewer bytes a step), and opt-in fast numerics;
* the compiled few-query attention in ragspec's own forwards;
* the fused C++ decoder step (:mod:`ragspec.backend.cpu.native`): decoding, verification
  and short prefills of a Llama-architecture model in one call over a per-request KV
  buffer (:class:`~ragspec.backend.cpu.native.NativeKVState`), several requests' rows in
  one call (the native verify path).

Every speed-up applies inside this object's own forwards only (``model.generate`` and
training keep transformers' kernels) and changes values by float32 summation order at
most (the native step: none against this backend's own transformers path); the reference
values are :class:`~ragspec.backend.hf.HFTarget`'s. :func:`ragspec.loading.select_target`
chooses this backend for models on the CPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch

from ...config import NUMERICS
from ...errors import ConfigError
from ...tree import tree_attention_mask, tree_position_ids
from ...types import DraftTree
from ..attention import ATTENTION_KERNEL_KW, GQA_SDPA, AttentionKernel, register_gqa_attention
from ..base import Capability, FastLinear, ForwardOutput, VerifyItem
from ..hf import HFTarget, KVState, growable_cache
from .fastpaths import (
    PACKED_MAX_ROWS,
    GGUFLinear,
    KernelScope,
    bind_gguf_linear,
    can_pack,
    compiled_attention,
    pack_linear_forwards,
    pack_weight,
    packed_linear,
    skinny_linear,
)
from .kernels import SKINNY_MAX_ROWS
from .native import NativeDecoder, NativeKVState, native_step_enabled, native_step_unsupported

if TYPE_CHECKING:
    from .kernels import FewQueryAttention, QuantLinear, SkinnyLinear
    from .quant import GGUFWeight

logger = logging.getLogger(__name__)

__all__ = ["CPUTarget", "NATIVE_EXTEND_GEMM_ROWS"]


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


class CPUTarget(HFTarget):
    """The transformers target with ragspec's CPU speed-ups (see the module docstring),
    installed by :meth:`speed_up` (or one by one: :meth:`use_gguf_weights`,
    :meth:`prepack_linears`, :meth:`route_gqa_attention`, :meth:`use_attention_kernel`,
    :meth:`use_native_step`); without them, the output layer's pre-packed weight only.

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM on the CPU (eval mode).
        pack_lm_head: multi-row output layer through a pre-packed oneDNN weight (default:
            on for fp32/bf16 where oneDNN packs them; see :meth:`_packed_lm_head`).
        min_logit_rows: as :class:`~ragspec.backend.hf.HFTarget`'s.

    Raises:
        ConfigError: the model is not on the CPU (:func:`ragspec.loading.select_target`
            picks the backend for a device).
    """

    def __init__(self, model: torch.nn.Module, *, min_logit_rows: int = 4, pack_lm_head: Optional[bool] = None) -> None:
        super().__init__(model, min_logit_rows=min_logit_rows)
        if self.device.type != "cpu":
            raise ConfigError(f"CPUTarget runs models on the CPU, this one is on {self.device} (use HFTarget)")
        if pack_lm_head is None:
            pack_lm_head = can_pack(self.device, self.dtype)
        self.pack_lm_head = bool(pack_lm_head)
        self._packed: Optional[torch.Tensor] = None
        self._packed_bias: Optional[torch.Tensor] = None
        self.packed_linears = 0
        self._gguf: dict[int, GGUFLinear] = {}  # weight data_ptr -> GGUF-block twin, see use_gguf_weights
        self._gguf_weights: dict[int, "GGUFWeight"] = {}  # the same twins' blocks (for the native step)
        self._native: Optional[NativeDecoder] = None  # the fused decoder step, see use_native_step
        self._native_off: Optional[str] = "the CPU speed-ups are not installed (speed_up)"  # see native_step_off
        self.numerics = "exact"  # "fast": GGUF-block linears with int8 activations, see use_gguf_weights
        # prompts of more tokens than this on an empty state prefill through transformers'
        # forward (multi-row GEMMs: 700 tokens of the default model in ~0.8 s on the 2-core
        # CPU, natively in chunks of 16 ~1.5 s), shorter ones and extensions of a filled
        # state natively in chunks; 0: every first prefill through transformers' forward
        # (its linears on the pre-packed weights, see prepack_linears)
        self.native_prefill_rows = 0
        self._skinny: Optional["SkinnyLinear"] = None  # compiled few-row kernel, see prepack_linears
        self._attention_kernel: Optional["FewQueryAttention"] = None  # see use_attention_kernel
        self._attention: Optional[AttentionKernel] = None  # the same, as the attention function takes it
        self._scope = KernelScope()  # fast linear kernels apply inside our own forwards only

    # ------------------------------------------------------------------ state
    def new_state(self) -> Union[KVState, NativeKVState]:  # type: ignore[override]
        """A fresh, empty KV cache for one request (a :class:`NativeKVState` once
        :meth:`use_native_step` is on)."""
        if self._native is not None:
            return self._native.new_state()
        return super().new_state()

    # ------------------------------------------------------------------ capabilities
    def capability(self, name: str) -> Any:
        """:class:`~ragspec.backend.hf.HFTarget`'s capabilities and, once :meth:`speed_up`
        routed this model's linears, its fast few-row linear kernels (``FAST_LINEAR``)."""
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
        return super().capability(name)

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

        if weight.dim() != 2 or int(weight.shape[1]) % 32:
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
                kernels (:mod:`ragspec.backend.cpu.kernels`: built on first use, ~45 s, then
                cached); None: on unless ``RAGSPEC_CPU_KERNELS=0``; where they cannot be
                built, torch's kernels are used. Only with float32 weights.
            cache: ragspec's cache folder (default: ``$RAGSPEC_CACHE`` or ``~/.cache/ragspec``).
            gguf: the GGUF file the model was loaded from: with the compiled kernel, the
                linear weights it holds exactly are read from its blocks
                (:meth:`use_gguf_weights`; the same output bit for bit, fewer bytes per step).
            numerics: ``"exact"`` (default: float32 arithmetic, the values above) or
                ``"fast"`` (opt-in: the GGUF-block linears with int8 activations, see
                :meth:`use_gguf_weights`, and the native step's KV cache in float16, see
                :class:`~ragspec.backend.cpu.native.NativeDecoder`).

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
        if self.dtype == torch.float32 and wanted:
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
            else:
                self._native_off = "switched off: RAGSPEC_NATIVE_STEP=0"
        elif self.dtype != torch.float32:
            self._native_off = f"needs float32 weights, the model's are {str(self.dtype).removeprefix('torch.')}"
        elif not wanted:
            self._native_off = "the compiled CPU kernels are switched off (RAGSPEC_CPU_KERNELS=0)"
        else:
            self._native_off = "the compiled CPU kernels are not available (ragspec doctor says why)"

    def use_native_step(self, step_cls: Optional[type]) -> bool:
        """Run decoding, verification and short prefills through the fused C++ decoder step
        (:mod:`ragspec.backend.cpu.native`; ``step_cls`` from
        :func:`ragspec.backend.cpu.kernels.load_decoder_step`, None: off again). States made
        from here on are :class:`NativeKVState` (states made before keep transformers'
        path). The values are those of this object's transformers forward with the compiled
        kernels, bit for bit; where a step is ~20-25 ms (one row of the default model on the
        2-core CPU) it saves the per-module Python of its 30 layers. Needs the compiled
        few-row kernel in use (:meth:`prepack_linears`) and a decoder that
        :func:`~ragspec.backend.cpu.native.native_step_unsupported` accepts; otherwise a no-op
        (logged at debug level).

        Returns:
            whether the native step is in use.
        """
        if step_cls is None:
            self._native = None
            self._native_off = "the compiled library holds no decoder step"
            return False
        if self._skinny is None or self.dtype != torch.float32:
            logger.debug("native decoder step off: needs the compiled kernel and float32 weights")
            self._native_off = "needs the compiled few-row kernel in use and float32 weights"
            return False
        reason = native_step_unsupported(self._decoder)
        if reason is not None:
            logger.debug("native decoder step off: %s", reason)
            self._native_off = f"the model is not one it runs: {reason}"
            return False
        # fast numerics keep the KV cache in float16 (as llama.cpp's default), exact float32
        kv_dtype = torch.float16 if self.numerics == "fast" else torch.float32
        self._native = NativeDecoder(step_cls, self._decoder, self._gguf_weights, kv_dtype=kv_dtype)
        logger.debug("native decoder step on (%d layers)", self._native.num_layers)
        self._native_off = None
        return True

    @property
    def native_step(self) -> Optional[NativeDecoder]:
        """The fused decoder step in use (:meth:`use_native_step`), or None."""
        return self._native

    @property
    def native_step_off(self) -> Optional[str]:
        """Why the fused decoder step is not in use (:meth:`speed_up`,
        :meth:`use_native_step`), in words; None when it is."""
        return None if self._native is not None else self._native_off

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
        from :func:`ragspec.backend.cpu.kernels.load_skinny_linear`), inputs of 1-16 rows, plain
        decoding included, go through it instead (decoder linears for one row 36-47 -> 25
        ms, for 8 rows 49 -> 36 ms) and so does the output layer. Float32 inputs of more
        than ``PACKED_MAX_ROWS`` rows (prefill chunks) take the packed weight too: MKL
        re-packs it on every call, so its cost per row grows as chunks shrink (prefill of
        the default model 12-15% faster, and a 256-token chunk within ~4% of a whole
        prompt's cost per token). Either way only inside
        this object's own forwards: ``model.generate`` and other callers of the model keep
        transformers' kernels. Values change by float32 rounding only (summation order), so
        greedy output equals ``model.generate``'s except where two logits tie to ~1e-5.
        Modifies the model in place (each layer's ``forward``), costs one extra copy of the
        decoder's linear weights, and is a no-op without oneDNN or for other dtypes than
        float32 and bfloat16.

        Returns:
            the number of linear layers routed (0 where not applicable).
        """
        if self.packed_linears or not can_pack(self.device, self.dtype):
            return self.packed_linears
        self._skinny = skinny if self.dtype == torch.float32 else None
        gguf = self._gguf if self._skinny else None
        # --numerics fast: prefill rows through the int8 twins too (each row alone)
        many = {ptr: f for ptr, f in (gguf or {}).items() if self._gguf_weights[ptr].fast}
        n = pack_linear_forwards(
            self._decoder, min_rows=2, skinny=self._skinny, scope=self._scope, gguf=gguf, prefill_gguf=many or None
        )
        self.packed_linears = n
        logger.debug(
            "routed %d decoder linear layers through %s",
            n,
            "the compiled few-row kernel" if self._skinny is not None else "pre-packed oneDNN weights",
        )
        return n

    def use_gguf_weights(
        self, path: "str | os.PathLike", kernel: Optional["QuantLinear"], numerics: str = "exact"
    ) -> int:
        """Keep the decoder's linear weights and the output layer's in the GGUF file's own
        block formats (:mod:`ragspec.backend.cpu.quant`: Q4_1, Q8_0, Q5_0, Q4_K, Q6_K) for
        ragspec's few-row forwards, through the compiled ``quant_linear`` kernel: the same output bit for bit as the
        float32 kernel, a fifth of the bytes streamed per step (default model, 2-core CPU:
        decoder linears for one row 22-25 -> 14 ms, the output layer 5.3 -> 2.9 ms). Each
        weight is matched to the file by content and checked for exact equality; weights
        without an exact twin keep float32. Call before :meth:`prepack_linears`, with
        ``path`` the GGUF the model was loaded from. Costs ~0.75-1.25 bytes of memory per
        weight; the matches are cached beside the converted model (``<stem>.hf/``: the
        first load ~7 s, later ones well under a second). A no-op without ``kernel``, off
        for other dtypes than float32.

        ``numerics="fast"`` (opt-in, ``--numerics fast``) keeps the Q4_1 and Q8_0 weights in
        the kernel's fast formats (:meth:`~ragspec.backend.cpu.quant.GGUFWeight.to_fast`): their
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
        if kernel is None or self.dtype != torch.float32 or self.packed_linears:
            return len(self._gguf)
        from ...models import converted_model_dir
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
        ``SKINNY_MAX_ROWS`` new tokens, float32) with the compiled few-query kernel of
        :mod:`ragspec.backend.cpu.kernels` (None: torch's SDPA again). It splits the cached keys in
        blocks over the threads where torch's CPU SDPA splits only heads and query blocks:
        per layer at 790 cached tokens on the 2-core CPU, 1 query 0.13 -> 0.05 ms, 4
        queries 0.31 -> 0.16 ms. Other calls (``model.generate``, prefill) keep torch's.
        Needs the attention routed through ragspec's function (:meth:`route_gqa_attention`).

        Returns:
            whether the kernel is in use.
        """
        self._attention_kernel = kernel
        self._attention = None if kernel is None else compiled_attention(kernel)
        return self._attention_kernel is not None and self._attn_impl == GQA_SDPA

    # ------------------------------------------------------------------ hooks of HFTarget
    def _decoder_forward(self, chunked: bool = False, **kwargs: Any) -> Any:
        """transformers' forward with this model's fast linear kernels active (a
        :class:`~ragspec.backend.cpu.fastpaths.KernelScope`); ``chunked``: inputs of more
        than ``SKINNY_MAX_ROWS`` rows also through the compiled kernel, in chunks."""
        self._scope.active = True
        self._scope.chunked = chunked
        try:
            return self._decoder(**kwargs)
        finally:
            self._scope.active = False
            self._scope.chunked = False

    def _attention_extras(self) -> dict[str, Any]:
        """The compiled few-query attention for ragspec's own forwards, where in use."""
        if self._attention is not None and self._attn_impl == GQA_SDPA:
            return {ATTENTION_KERNEL_KW: self._attention}
        return {}

    def _rows_independent(self) -> bool:
        """The compiled few-row kernel computes every row on its own (csrc/linear.cpp)."""
        return self._skinny is not None

    def _batchable(self, item: VerifyItem) -> bool:
        """At most ``SKINNY_MAX_ROWS`` rows (its solo forward then runs every linear layer
        through the compiled kernel) and a cache of transformers' path."""
        return item.tree.num_nodes + 1 <= SKINNY_MAX_ROWS and super()._batchable(item)

    def _output_rows(self, hidden: torch.Tensor, chunked: bool = False) -> torch.Tensor:
        """hidden: [R, H] -> the output layer's rows [R, V]: through the compiled kernel
        (``chunked``: more than ``SKINNY_MAX_ROWS`` rows too, see :func:`skinny_linear`), the
        output weight's GGUF blocks where it has them, else the pre-packed oneDNN weight for
        up to ``PACKED_MAX_ROWS`` rows, else transformers' linear."""
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
        if logits is not None:
            return logits
        packed = self._packed_lm_head() if rows <= PACKED_MAX_ROWS else None
        if packed is not None:
            return packed_linear(hidden, packed, self._packed_bias)
        return super()._output_rows(hidden, chunked)

    # ------------------------------------------------------------------ the native step
    def _prefill_hidden(self, state: Any, ids: torch.Tensor) -> torch.Tensor:
        """ids int64 [1, T] -> hidden [T, H] (a native state: :meth:`_native_prefill`)."""
        if isinstance(state, NativeKVState):
            return self._native_prefill(state, ids[0])
        return super()._prefill_hidden(state, ids)

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
            tmp = KVState(cache=growable_cache(), length=0)
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

    def _verify_together(self, items: Sequence[VerifyItem], outs: list[Optional[ForwardOutput]]) -> None:
        """Items over native KV states (:meth:`use_native_step`) of at most
        ``SKINNY_MAX_ROWS`` rows share one native step (each request attends to its own
        buffer; the kernels compute every row on its own, so each gets exactly its solo
        values); then transformers' batched forward for the others (:attr:`batches`)."""
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
        super()._verify_together(items, outs)

    def _verify_hidden(self, state: Any, root_token: int, tree: DraftTree) -> torch.Tensor:
        """:meth:`verify_one`'s forward -> hidden [N + 1, H] (a native state: the native step)."""
        if isinstance(state, NativeKVState):
            hidden, _ = self._native_verify([VerifyItem(state, root_token, tree)])
            return hidden
        return super()._verify_hidden(state, root_token, tree)

    def commit(self, state: Any, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """As :meth:`HFTarget.commit <ragspec.backend.hf.HFTarget.commit>`, native states too."""
        if isinstance(state, NativeKVState):
            self._native_decoder().commit(state, past_len, accepted_nodes)
            return
        super().commit(state, past_len, accepted_nodes)

    def rollback(self, state: Any, length: int) -> None:
        """As :meth:`HFTarget.rollback <ragspec.backend.hf.HFTarget.rollback>`, native states
        too (only the length drops)."""
        if isinstance(state, NativeKVState):
            NativeDecoder.rollback(state, length)
            return
        super().rollback(state, length)

    def export_kv(self, state: Any, start: int, stop: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """As :meth:`HFTarget.export_kv <ragspec.backend.hf.HFTarget.export_kv>`, native
        states too (their buffer's dtype: float16 in fast numerics).

        Raises:
            ConfigError: the positions are not all in ``state``.
        """
        if not isinstance(state, NativeKVState):
            return super().export_kv(state, start, stop, out)
        if not 0 <= start <= stop <= state.length:
            raise ConfigError(f"export_kv: positions {start}..{stop} not in a state of {state.length}")
        src = state.buffer[:, :, :, start:stop]  # [L, 2, H_kv, n, d]
        if out is None or out.shape != src.shape or out.dtype != src.dtype or out.device != src.device:
            out = torch.empty(tuple(src.shape), dtype=src.dtype, device=src.device)
        out.copy_(src)
        return out

    def import_kv(self, state: Any, blocks: Sequence[torch.Tensor]) -> None:
        """As :meth:`HFTarget.import_kv <ragspec.backend.hf.HFTarget.import_kv>`, native states too.

        Raises:
            ConfigError: an export of another shape or dtype than this target's cache.
        """
        if not isinstance(state, NativeKVState):
            super().import_kv(state, blocks)
            return
        if not blocks:
            return
        kv = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=3)
        past, n = state.length, int(kv.shape[3])
        want = (*state.buffer.shape[:3], state.buffer.shape[4])
        if (*kv.shape[:3], kv.shape[4]) != want or kv.dtype != state.buffer.dtype:
            raise ConfigError(f"import_kv: entries of shape {tuple(kv.shape)} do not fit this model's cache")
        self._native_decoder().reserve(state, past + n)
        state.buffer[:, :, :, past : past + n].copy_(kv)
        state.length = past + n
