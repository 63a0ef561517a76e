"""The CPU backend's kernel-routed transformers target: :class:`CPUTarget`, the transformers
target (:class:`~ragspec.backend.hf.HFTarget`) whose own forwards run ragspec's CPU kernels,
built whole with the speed-ups chosen for it (:func:`ragspec.backend.cpu.build.load_cpu_target`
chooses and loads them; nothing is installed afterwards):

* few-row linear layers (decoding, verification) through the compiled kernel
  (:mod:`ragspec.backend.cpu.kernels`) or pre-packed oneDNN weights, the output layer too
  (:mod:`ragspec.backend.cpu.fastpaths`);
* the linear weights read from the GGUF file's own blocks (:class:`GGUFBlocks`,
  :mod:`ragspec.backend.cpu.quant`; the same values bit for bit, fewer bytes a step), and
  opt-in fast numerics;
* the compiled few-query attention in ragspec's own forwards;
* the verification of several requests in one forward over their concatenated rows (a flat
  batch, :mod:`ragspec.backend.cpu.batch`) where each keeps its solo values bit for bit.

Every speed-up applies inside this object's own forwards only (``model.generate`` and
training keep transformers' kernels) and changes values by float32 summation order at
most; the reference values are :class:`~ragspec.backend.hf.HFTarget`'s. The fused C++
decoder step is a sibling target built on this one
(:class:`~ragspec.backend.cpu.native_target.NativeTarget`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch

from ...errors import ConfigError
from ..attention import ATTENTION_BATCH_KW, ATTENTION_KERNEL_KW, GQA_SDPA, register_gqa_attention
from ..base import Capability, FastLinear, ForwardOutput, SpeedUps, VerifyItem, check_distinct_states
from ..hf import HFTarget, KVState, is_growable_cache
from .batch import BATCHED_MODEL_TYPES, BatchCache, batch_outputs
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

if TYPE_CHECKING:
    from .kernels import FewQueryAttention, PrefillAttention, QuantLinear, SkinnyLinear
    from .quant import GGUFWeight

logger = logging.getLogger(__name__)

__all__ = ["CPUTarget", "GGUFBlocks"]


@dataclass(frozen=True)
class GGUFBlocks:
    """A model's linear weights in the GGUF file's own block formats, matched to the
    model's float32 weights exactly (:func:`ragspec.backend.cpu.build.read_gguf_blocks`).

    Attributes:
        kernel: the compiled ``quant_linear`` kernel that computes a linear from blocks.
        weights: a float32 weight's ``data_ptr()`` -> its blocks (in the kernel's fast
            formats for ``numerics="fast"``: :meth:`~ragspec.backend.cpu.quant.GGUFWeight.to_fast`).
        numerics: ``"exact"`` (the same values bit for bit as the float32 kernel) or
            ``"fast"`` (int8 activations in the Q4_1/Q8_0 linears).
    """

    kernel: "QuantLinear"
    weights: Mapping[int, "GGUFWeight"]
    numerics: str = "exact"


class CPUTarget(HFTarget):
    """The transformers target with ragspec's CPU kernels in its own forwards (see the
    module docstring), built with its speed-ups; without any, the output layer's
    pre-packed weight only.

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM on the CPU (eval mode). Its
            linear layers' ``forward`` (``pack_linears``) and its attention implementation
            (``route_attention``) are modified in place.
        pack_linears: route the decoder's few-row linear layers through faster kernels than
            MKL's. Verification runs every linear layer on 2-17 rows; for such shapes MKL's
            sgemm re-packs the weight on every call, so a 4-8-row forward costs ~1.5x a
            one-row one. Each ``nn.Linear`` of the decoder then computes inputs of 2-64 rows
            with a weight packed once for oneDNN (2-core CPU, 2 threads, 512 tokens of
            context: 8 new tokens 124 -> 87 ms), and float32 inputs of more than
            ``PACKED_MAX_ROWS`` rows (prefill chunks) too (prefill of the default model
            12-15% faster; a 256-token chunk within ~4% of a whole prompt's cost per token).
            Only inside this object's own forwards; one extra copy of the decoder's linear
            weights; a no-op without oneDNN or for other dtypes than float32 and bfloat16.
        skinny: the compiled few-row kernel
            (:func:`ragspec.backend.cpu.kernels.load_skinny_linear`; float32 models only,
            implies ``pack_linears``): inputs of 1-16 rows, plain decoding included, and the
            output layer go through it (decoder linears for one row 36-47 -> 25 ms, for 8
            rows 49 -> 36 ms). It computes each row on its own, so several requests' rows
            verify in one forward (:attr:`batches`).
        attention_kernel: the compiled few-query attention
            (:func:`ragspec.backend.cpu.kernels.load_few_query_attention`) for ragspec's own
            decoding and verification forwards (at most ``SKINNY_MAX_ROWS`` new tokens,
            float32; needs ``route_attention``): it splits the cached keys in blocks over the
            threads where torch's CPU SDPA splits only heads and query blocks (per layer at
            790 cached tokens on the 2-core CPU, 1 query 0.13 -> 0.05 ms, 4 queries 0.31 ->
            0.16 ms), and prompt chunks while its partial results fit the cache
            (:data:`~ragspec.backend.cpu.fastpaths.PREFILL_ATTENTION_PARTS_BYTES`).
            ``model.generate`` keeps torch's.
        prefill_attention: the compiled prompt-chunk attention
            (:func:`ragspec.backend.cpu.kernels.load_prefill_attention`; with
            ``attention_kernel``): a prompt chunk's causal attention at any number of keys
            (a 256-row chunk of the default model over 768 keys 1.7 -> 0.96 ms a layer).
        gguf: the weights in the GGUF file's blocks (with ``skinny``): the same output bit
            for bit as the float32 kernel, a fifth of the bytes streamed per step (default
            model, 2-core CPU: decoder linears for one row 22-25 -> 14 ms, the output layer
            5.3 -> 2.9 ms); ``gguf.numerics`` is this target's :attr:`numerics`.
        route_attention: as :class:`~ragspec.backend.hf.HFTarget`'s.
        native_step_off: why this target is not the fused C++ step's (the builder's words,
            reported by ``ragspec doctor``).
        min_logit_rows: as :class:`~ragspec.backend.hf.HFTarget`'s.
        pack_lm_head: multi-row output layer through a pre-packed oneDNN weight (default:
            on for fp32/bf16 where oneDNN packs them; see :meth:`_packed_lm_head`).

    Raises:
        ConfigError: the model is not on the CPU (:func:`ragspec.loading.select_target`
            picks the backend for a device).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        pack_linears: bool = False,
        skinny: Optional["SkinnyLinear"] = None,
        attention_kernel: Optional["FewQueryAttention"] = None,
        prefill_attention: Optional["PrefillAttention"] = None,
        gguf: Optional[GGUFBlocks] = None,
        route_attention: bool = False,
        native_step_off: str = "built without the CPU speed-ups",
        min_logit_rows: int = 4,
        pack_lm_head: Optional[bool] = None,
    ) -> None:
        super().__init__(model, route_attention=route_attention, min_logit_rows=min_logit_rows)
        if self.device.type != "cpu":
            raise ConfigError(f"CPUTarget runs models on the CPU, this one is on {self.device} (use HFTarget)")
        if pack_lm_head is None:
            pack_lm_head = can_pack(self.device, self.dtype)
        self.pack_lm_head = bool(pack_lm_head)
        self._packed: Optional[torch.Tensor] = None
        self._packed_bias: Optional[torch.Tensor] = None
        self.native_step_off = native_step_off
        self._scope = KernelScope()  # fast linear kernels apply inside our own forwards only
        # the GGUF-block twins (float32 models only): weight data_ptr -> bound kernel / blocks
        twins = gguf if gguf is not None and self.dtype == torch.float32 else None
        self._gguf_weights: dict[int, "GGUFWeight"] = dict(twins.weights) if twins is not None else {}
        self._gguf: dict[int, GGUFLinear] = (
            {ptr: bind_gguf_linear(twins.kernel, q) for ptr, q in twins.weights.items()} if twins is not None else {}
        )
        self.numerics = twins.numerics if twins is not None else "exact"
        self._skinny: Optional["SkinnyLinear"] = None
        self._packed_linears: dict[int, torch.Tensor] = {}  # weight data_ptr -> its oneDNN-packed copy
        self.packed_linears = self._pack_linears(skinny) if pack_linears or skinny is not None else 0
        self._attention_kernel = attention_kernel
        self._prefill_attention = prefill_attention
        self._extras: dict[str, Any] = {}
        self._prompt_extras: dict[str, Any] = {}  # prompt forwards': the prompt-chunk kernel too
        if attention_kernel is not None and self._attn_impl == GQA_SDPA:
            self._extras = {ATTENTION_KERNEL_KW: compiled_attention(attention_kernel)}
            self._prompt_extras = (
                {ATTENTION_KERNEL_KW: compiled_attention(attention_kernel, prefill_attention)}
                if prefill_attention is not None
                else self._extras
            )
        self._batches = self._batch_exact()

    def _pack_linears(self, skinny: Optional["SkinnyLinear"]) -> int:
        """The decoder's linears through the packed weights / ``skinny`` (see ``pack_linears``);
        returns the number of layers routed."""
        if not can_pack(self.device, self.dtype):
            return 0
        self._skinny = skinny if self.dtype == torch.float32 else None
        gguf = self._gguf if self._skinny else None
        # --numerics fast: prefill rows through the int8 twins too (each row alone)
        many = {ptr: f for ptr, f in (gguf or {}).items() if self._gguf_weights[ptr].fast}
        n = pack_linear_forwards(
            self._decoder,
            min_rows=2,
            skinny=self._skinny,
            scope=self._scope,
            gguf=gguf,
            prefill_gguf=many or None,
            packed_out=self._packed_linears,
        )
        logger.debug(
            "routed %d decoder linear layers through %s",
            n,
            "the compiled few-row kernel" if self._skinny is not None else "pre-packed oneDNN weights",
        )
        return n

    def _batch_exact(self) -> bool:
        """Whether several requests' rows verify in one forward (:attr:`batches`)."""
        if self._skinny is None or self._attn_impl != GQA_SDPA:
            return False
        cfg = getattr(self._decoder, "config", None)
        if cfg is None or getattr(cfg, "model_type", None) not in BATCHED_MODEL_TYPES:
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

    # ------------------------------------------------------------------ what it was built with
    @property
    def skinny(self) -> Optional["SkinnyLinear"]:
        """The compiled few-row linear kernel this model's forwards use, or None."""
        return self._skinny

    @property
    def packed_weights(self) -> Mapping[int, torch.Tensor]:
        """The decoder linears' weights packed for oneDNN (weight ``data_ptr()`` -> packed
        copy; empty where nothing is packed): what prompt chunks (more than
        ``PACKED_MAX_ROWS`` float32 rows) multiply with."""
        return self._packed_linears

    @property
    def prefill_attention(self) -> Optional["PrefillAttention"]:
        """The compiled prompt-chunk attention this target's forwards use, or None."""
        return self._prefill_attention

    @property
    def attention_kernel(self) -> Optional["FewQueryAttention"]:
        """The compiled few-query attention it was built with, or None."""
        return self._attention_kernel

    @property
    def gguf_weights(self) -> int:
        """How many linear weights ragspec's forwards read from GGUF blocks."""
        return len(self._gguf) if self._skinny is not None else 0

    @property
    def gguf_blocks(self) -> Mapping[int, "GGUFWeight"]:
        """The GGUF-block twins: a float32 weight's ``data_ptr()`` -> its blocks (empty
        without)."""
        return self._gguf_weights

    # ------------------------------------------------------------------ capabilities
    def capability(self, name: str) -> Any:
        """:class:`~ragspec.backend.hf.HFTarget`'s capabilities, what it was built with
        (``SPEED_UPS``) and, where its linears are routed, its fast few-row linear kernels
        (``FAST_LINEAR``)."""
        if name == Capability.FAST_LINEAR:
            if not self.packed_linears:
                return None
            return FastLinear(
                route=self._route_linears,
                linear=self._fast_linear,
                attention=register_gqa_attention(),
                int8_linear=self._int8_linear,
            )
        if name == Capability.SPEED_UPS:
            return SpeedUps(
                compiled_kernel=self._skinny is not None,
                gguf_weights=self.gguf_weights,
                batched_verify=self.batches,
                native_step_off=self.native_step_off,
            )
        return super().capability(name)

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

    # ------------------------------------------------------------------ the output layer
    def _packed_lm_head(self) -> Optional[torch.Tensor]:
        """The output layer's weight re-laid out once for oneDNN (CPU only), or None.

        For a few rows (verification: 2-17) MKL's sgemm re-packs the whole 49152 x 576
        weight on every call; a pre-packed oneDNN weight avoids that (measured on the
        2-core CPU, one thread: 63 ms -> 27 ms for 4 rows, 67 -> 34 ms for 8; two threads:
        24 -> 6 ms for 4 rows). It also streams the weight faster for one row (plain
        decoding: 9.9 -> 5.1 ms at two threads, a plain step 56 -> 52 ms), so every step
        uses it; its logits equal the ordinary linear's up to float rounding (~1e-4), which
        can flip an argmax only between near-equal logits. Costs one extra copy of the
        output weight, made on first use.
        """
        if not self.pack_lm_head:
            return None
        if self._packed is None:
            w = self._lm_head.weight
            self._packed = pack_weight(w)
            self._packed_bias = None if getattr(self._lm_head, "bias", None) is None else self._lm_head.bias.detach()
        return self._packed

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

    def _attention_extras(self, prompt: bool = False) -> dict[str, Any]:
        """The compiled attention for ragspec's own forwards, where in use: with ``prompt``
        (a prompt chunk's forward) the prompt-chunk kernel too; a verification's rows never
        take it (a verified row must get the bits of the one-row step at its position,
        which the few-query kernel gives whatever the number of rows)."""
        return self._prompt_extras if prompt else self._extras

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

    # ------------------------------------------------------------------ batched verification
    def verify(self, items: Sequence[VerifyItem]) -> list[ForwardOutput]:
        """The verification forward of every item (see
        :meth:`~ragspec.backend.hf.HFTarget.verify_one`; each request attends to its own KV
        cache only).

        Two or more items of at most ``SKINNY_MAX_ROWS`` rows each run as one forward over
        their concatenated rows (a flat batch: request i's root and draft nodes at rows
        ``bounds[i]``, each row with its own position id), the linear layers over all rows
        at once and the attention of each request over its own cache, where that gives
        every request exactly the output of its own forward (:attr:`batches`). Other items
        run one after another through ``verify_one``, as does a single item.

        Returns:
            one :class:`~ragspec.backend.base.ForwardOutput` per item, in order; each state
            grew by its N + 1 rows.

        Raises:
            ConfigError: the same state appears in two items.
        """
        items = list(items)
        outs: list[Optional[ForwardOutput]] = [None] * len(items)
        if len(items) > 1:
            check_distinct_states(items)
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

    @staticmethod
    def _batchable(item: VerifyItem) -> bool:
        """At most ``SKINNY_MAX_ROWS`` rows (its solo forward then runs every linear layer
        through the compiled kernel) and a cache of this backend."""
        return item.tree.num_nodes + 1 <= SKINNY_MAX_ROWS and is_growable_cache(getattr(item.state, "cache", None))

    @property
    def batches(self) -> bool:
        """Whether :meth:`verify` runs several requests' rows in one forward.

        Only where each request's output is then bit for bit that of its own forward:
        linear layers and output layer computing each row on its own (the compiled few-row
        kernel, float32; BLAS may sum differently for other row counts), the attention
        through ragspec's function (``route_attention``: each request's rows attend to its
        own keys through the call its solo forward makes), a decoder whose forward ragspec
        knows (Llama, Gemma-3 text: masks built as transformers builds them), and head
        size, hidden and intermediate sizes multiples of 32 (element-wise functions such as
        SiLU and the rotary cos/sin take ATen's vector path for every element of such rows,
        whatever the number of rows; a scalar tail may round differently). Decided when the
        target is built.
        """
        return self._batches

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
        batch = BatchCache([it.state for it in items], bounds, masks, layer_types)
        extra = {self._cache_kw: batch, ATTENTION_BATCH_KW: batch, **self._attention_extras()}
        # a prepared 4-D mask stops transformers from building one over the flat batch; the
        # attention reads each request's own mask from the batch instead
        unused = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        attn_arg: Any = unused
        if self._sliding_window is not None:
            attn_arg = {"full_attention": unused, "sliding_attention": unused}
        out = self._decoder_forward(
            chunked=True, input_ids=ids, position_ids=pos_ids, attention_mask=attn_arg, use_cache=True, **extra
        )
        for it, (a, b) in zip(items, bounds):
            it.state.length += b - a
        return batch_outputs(items, bounds, out.last_hidden_state[0], self.logits)
