"""The native decoder step of the transformers backend: every decoder layer of a
Llama-architecture model (llama, SmolLM2) for a step's rows in one C++ call
(``csrc/decoder_step.cpp``), with a per-request KV buffer indexed by position.

transformers' forward of a decoding step runs ~40 modules per layer in Python; with
ragspec's compiled kernels doing the arithmetic, that Python (module calls, views, the
cache's bookkeeping) is about a third of a one-row step of SmolLM2-135M on the 2-core CPU.
Here the per-step Python is the embedding lookup, the rotary cos/sin (the model's own
``rotary_emb``, so transformers' values), the masks, and the output layer (unchanged, the
kernel-routed target's: :class:`~ragspec.backend.cpu.native_target.NativeTarget` is built on
:class:`~ragspec.backend.cpu.target.CPUTarget`).

Numerics: the step computes what ragspec's transformers path with the compiled kernels
computes, bit for bit (the same linear and attention kernels on the same inputs; RMSNorm's
mean and SiLU by ATen; the other element-wise operations in transformers' order, each
rounded once): tests/unit/test_native_step.py checks ``torch.equal`` against that path and
closeness to transformers' plain forward.

KV layout: one float32 buffer per request, ``[L, 2, H_kv, capacity, d]`` (layer, key /
value, head, position, dimension), grown geometrically; a step writes its new rows' keys
and values at their cache positions in place, ``commit`` copies the accepted entries of a
tree into place, ``rollback`` only lowers the length.

Chosen when the CPU backend is built (:func:`ragspec.backend.cpu.build.load_cpu_target`)
where :func:`native_step_unsupported` finds nothing against it; ``RAGSPEC_NATIVE_STEP=0``
keeps transformers' forward (:func:`native_step_enabled`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch

if TYPE_CHECKING:
    from .quant import GGUFWeight

logger = logging.getLogger(__name__)

__all__ = [
    "NATIVE_MODEL_TYPES",
    "NativeDecoder",
    "NativeKVState",
    "native_step_enabled",
    "native_step_unsupported",
]

# decoders whose layers the C++ step reproduces: Llama's (RMSNorm, q/k/v/o, RoPE, SiLU MLP)
NATIVE_MODEL_TYPES = frozenset({"llama"})

_GROW_MIN = 256  # positions added to a buffer at least when it grows


def native_step_enabled(value: Optional[str] = None) -> bool:
    """Whether the native decoder step is wanted: ``value`` (default: the environment
    variable ``RAGSPEC_NATIVE_STEP``) unset, empty or anything but ``0``/``false``/``no``/``off``."""
    if value is None:
        value = os.environ.get("RAGSPEC_NATIVE_STEP", "")
    return value.strip().lower() not in ("0", "false", "no", "off")


@dataclass
class NativeKVState:
    """The KV cache of one request on the native path.

    Attributes:
        buffer: float32 [L, 2, H_kv, capacity, d] (layer, key/value, head, position, dim);
            positions ``0 .. length - 1`` hold the cached entries.
        length: tokens whose keys/values are in the buffer.
    """

    buffer: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        """Positions the buffer holds before it must grow."""
        return int(self.buffer.shape[3])


def _linear_modules(layer: Any) -> dict[str, Any]:
    """A transformers decoder layer's seven linears by role (its submodules are dynamic
    attributes, hence ``Any``)."""
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "q": attn.q_proj,
        "k": attn.k_proj,
        "v": attn.v_proj,
        "o": attn.o_proj,
        "gate": mlp.gate_proj,
        "up": mlp.up_proj,
        "down": mlp.down_proj,
    }


def native_step_unsupported(decoder: Any, final_norm: bool = True) -> Optional[str]:
    """Why the native step cannot run ``decoder`` (a transformers base model, e.g.
    ``LlamaModel``), or None when it can: a Llama decoder in float32 on CPU, every layer of
    the standard structure (RMSNorm, bias-consistent q/k/v, SiLU MLP), ``nn.Linear`` weights
    contiguous, head size 32/64/128, hidden and intermediate sizes multiples of 32 (the
    element-wise ATen calls then take their vector path for every element, as in the
    transformers forward), no sliding window, no bidirectional attention. ``final_norm``
    False: ``decoder`` needs no final ``norm`` (a layer stack whose output is taken before
    any norm, as an EAGLE head's layer: :meth:`NativeDecoder.for_layers`)."""
    cfg = getattr(decoder, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in NATIVE_MODEL_TYPES:
        return f"model type {getattr(cfg, 'model_type', None)!r} is not one of {sorted(NATIVE_MODEL_TYPES)}"
    if getattr(cfg, "use_bidirectional_attention", False) or getattr(cfg, "sliding_window", None):
        return "bidirectional or sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act!r}"
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    layers = getattr(decoder, "layers", None)
    if not layers or getattr(decoder, "rotary_emb", None) is None:
        return "no layers / rotary_emb"
    if final_norm and getattr(decoder, "norm", None) is None:
        return "no final norm"
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    hidden = int(cfg.hidden_size)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    inter = int(cfg.intermediate_size)
    if head_dim not in (32, 64, 128) or hidden % 32 or inter % 32 or heads % kv_heads:
        return f"sizes (hidden {hidden}, intermediate {inter}, head_dim {head_dim}, heads {heads}/{kv_heads})"
    eps = None
    for layer in list(layers) + ([None] if final_norm else []):
        norms = [decoder.norm] if layer is None else [layer.input_layernorm, layer.post_attention_layernorm]
        for norm in norms:
            if type(norm).__name__ != "LlamaRMSNorm" or not hasattr(norm, "variance_epsilon"):
                return f"norm {type(norm).__name__}"
            if norm.weight.dtype != torch.float32 or norm.weight.device.type != "cpu":
                return "norm weight not float32 on CPU"
            if eps is not None and norm.variance_epsilon != eps:
                return "norms with different eps"
            eps = norm.variance_epsilon
        if layer is None:
            break
        if type(layer).__name__ != "LlamaDecoderLayer":
            return f"layer {type(layer).__name__}"
        try:
            mods = _linear_modules(layer)
        except AttributeError:
            return "layer without the Llama attention/MLP structure"
        for m in mods.values():
            if type(m) is not torch.nn.Linear:
                return f"linear {type(m).__name__}"
            w = m.weight
            if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
                return "linear weight not float32 contiguous on CPU"
        if float(layer.self_attn.scaling) != head_dim**-0.5:
            return "attention scaling other than head_dim ** -0.5"
    return None


def _spec(module: torch.nn.Linear, gguf: Optional["GGUFWeight"]) -> tuple:
    """One linear as the C++ step takes it: (weight, qs, scales, fmt, bias, out, in)."""
    out, inp = module.weight.shape
    bias = None if module.bias is None else module.bias.detach().contiguous()
    if gguf is not None:
        return (None, gguf.qs, gguf.scales, int(gguf.fmt), bias, int(out), int(inp))
    return (module.weight.detach(), None, None, -1, bias, int(out), int(inp))


def _packed_spec(module: torch.nn.Linear, packed: torch.Tensor) -> tuple:
    """One linear's packed weight as the C++ step takes it: (packed, bias, out, in)."""
    out, inp = module.weight.shape
    bias = None if module.bias is None else module.bias.detach().contiguous()
    return (packed, bias, int(out), int(inp))


def _group(modules: Sequence[torch.nn.Linear], gguf: Mapping[int, "GGUFWeight"]) -> list[tuple]:
    """Linears over the same input as one C++ group: fused into one weight where they are
    all GGUF blocks of one format with consistent biases (a few MB: one kernel call instead
    of several, the same values row for row), else one entry each (float32 weights are not
    copied)."""
    twins = [gguf.get(m.weight.data_ptr()) for m in modules]
    blocks = [t for t in twins if t is not None]
    biased = {m.bias is not None for m in modules}
    if len(blocks) == len(twins) and len({t.fmt for t in blocks}) == 1 and len(biased) == 1:
        qs = torch.cat([t.qs for t in blocks], dim=0).contiguous()
        scales = torch.cat([t.scales for t in blocks], dim=0).contiguous()
        bias = torch.cat([m.bias.detach() for m in modules]).contiguous() if biased == {True} else None
        out = sum(int(m.weight.shape[0]) for m in modules)
        return [(None, qs, scales, int(blocks[0].fmt), bias, out, int(modules[0].weight.shape[1]))]
    return [_spec(m, t) for m, t in zip(modules, twins)]


class NativeDecoder:
    """A decoder's layers as one C++ ``DecoderStep`` and the KV buffers it runs over.

    Args:
        step_cls: the ``DecoderStep`` class of the compiled library
            (:func:`ragspec.backend.cpu.kernels.load_decoder_step`).
        decoder: the transformers base model (checked by :func:`native_step_unsupported`).
        gguf: weight ``data_ptr()`` -> its GGUF-block twin (served by ``quant_linear``);
            other weights through ``skinny_linear`` in float32.
        kv_dtype: the KV buffers' dtype: ``torch.float32`` (default, exact), or
            ``torch.float16`` (``--numerics fast``: half the bytes a step's attention reads;
            keys and values rounded to nearest when written, widened exactly when read, so
            a verified row still equals the one-row step at its position bit for bit).

    Raises:
        ValueError: the decoder is not supported (the reason).
    """

    def __init__(
        self,
        step_cls: type,
        decoder: Any,
        gguf: Optional[Mapping[int, "GGUFWeight"]] = None,
        kv_dtype: torch.dtype = torch.float32,
        *,
        final_norm: bool = True,
    ):
        reason = native_step_unsupported(decoder, final_norm)
        if reason is not None:
            raise ValueError(f"native decoder step unsupported: {reason}")
        if kv_dtype not in (torch.float32, torch.float16):
            raise ValueError(f"native KV buffers are float32 or float16, not {kv_dtype}")
        self.kv_dtype = kv_dtype
        cfg = decoder.config
        gguf = dict(gguf or {})
        self.decoder = decoder
        self.num_layers = len(decoder.layers)
        heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        self.hidden = int(cfg.hidden_size)
        self.head_dim = int(getattr(cfg, "head_dim", None) or self.hidden // heads)
        first = decoder.layers[0]
        step = step_cls(
            self.hidden,
            heads,
            self.kv_heads,
            self.head_dim,
            int(cfg.intermediate_size),
            float(first.input_layernorm.variance_epsilon),
            float(first.self_attn.scaling),
            decoder.norm.weight.detach() if final_norm else torch.empty(0),
        )
        served = 0
        for layer in decoder.layers:
            m = _linear_modules(layer)
            served += sum(m[k].weight.data_ptr() in gguf for k in m)
            step.add_layer(
                layer.input_layernorm.weight.detach(),
                _group([m["q"], m["k"], m["v"]], gguf),
                _spec(m["o"], gguf.get(m["o"].weight.data_ptr())),
                layer.post_attention_layernorm.weight.detach(),
                _group([m["gate"], m["up"]], gguf),
                _spec(m["down"], gguf.get(m["down"].weight.data_ptr())),
            )
        self.step = step
        self.gguf_linears = served
        logger.debug(
            "native decoder step: %d layers, %d of %d linears from GGUF blocks",
            self.num_layers,
            served,
            7 * self.num_layers,
        )

    def pack(self, packed: Mapping[int, torch.Tensor]) -> bool:
        """Run prompt chunks (more than ``SKINNY_MAX_ROWS`` rows of a request) through
        ``packed`` (weight ``data_ptr()`` -> its oneDNN-packed copy,
        :attr:`~ragspec.backend.cpu.target.CPUTarget.packed_weights`): the same packed GEMMs
        as transformers' forward of the chunk in ragspec's own forwards, and with the
        prompt-chunk attention kernel where it runs, the same values bit for bit without a
        Python module call per layer. Returns whether every linear had its packed weight (else
        nothing changes)."""
        layers = []
        for layer in self.decoder.layers:
            m = _linear_modules(layer)
            if any(m[k].weight.data_ptr() not in packed for k in m):
                return False
            layers.append({k: _packed_spec(m[k], packed[m[k].weight.data_ptr()]) for k in m})
        for i, p in enumerate(layers):
            self.step.pack_layer(i, [p["q"], p["k"], p["v"]], p["o"], [p["gate"], p["up"]], p["down"])
        return True

    @property
    def packed(self) -> bool:
        """Whether prompt chunks run through packed weights (:meth:`pack`)."""
        return bool(self.step.packed())

    # ------------------------------------------------------------------ KV buffers
    @classmethod
    def for_layers(
        cls,
        step_cls: type,
        layers: Sequence[torch.nn.Module],
        config: Any,
        rotary_emb: Any,
        gguf: Optional[Mapping[int, "GGUFWeight"]] = None,
    ) -> "NativeDecoder":
        """The C++ step over a bare stack of Llama decoder layers without embedding or final
        norm (an EAGLE head's layer: its output is the predicted feature), float32 KV, the
        weights float32 or their ``gguf`` block twins (weight ``data_ptr()`` -> blocks); run
        it with :meth:`forward_embeds`.

        Raises:
            ValueError: the layers are not supported (the reason).
        """
        import types

        view = types.SimpleNamespace(
            config=config, layers=list(layers), rotary_emb=rotary_emb, norm=None, embed_tokens=None
        )
        return cls(step_cls, view, gguf, final_norm=False)

    def new_state(self, capacity: int = 0) -> NativeKVState:
        """An empty KV state (a buffer of ``capacity`` positions; 0: allocated on first use)."""
        return NativeKVState(self._buffer(capacity), 0)

    def _buffer(self, capacity: int) -> torch.Tensor:
        return torch.empty((self.num_layers, 2, self.kv_heads, capacity, self.head_dim), dtype=self.kv_dtype)

    def reserve(self, state: NativeKVState, need: int) -> None:
        """Make room for ``need`` positions: a new buffer of max(need + 256, 2 x capacity)
        positions holding the cached entries, when the current one is too small."""
        if need <= state.capacity:
            return
        buf = self._buffer(max(need + _GROW_MIN, 2 * state.capacity))
        if state.length:
            buf[:, :, :, : state.length].copy_(state.buffer[:, :, :, : state.length])
        state.buffer = buf

    def load_cache(self, state: NativeKVState, cache: Any, length: int) -> None:
        """Copy the ``length`` entries of a transformers cache (keys/values [1, H_kv, T, d]
        per layer, e.g. after transformers' prefill) to positions ``0 .. length - 1`` of
        ``state`` (which then holds exactly them)."""
        self.reserve(state, length)
        for i, layer in enumerate(cache.layers):
            state.buffer[i, 0, :, :length].copy_(layer.keys[0, :, :length])
            state.buffer[i, 1, :, :length].copy_(layer.values[0, :, :length])
        state.length = length

    def commit(self, state: NativeKVState, past_len: int, accepted_nodes: Sequence[int]) -> None:
        """Keep the root (position ``past_len``) and the accepted nodes (draft node i at
        position ``past_len + 1 + i``), moved to the positions after the root."""
        keep = past_len + 1 + len(accepted_nodes)
        nodes = list(accepted_nodes)
        if nodes != list(range(len(nodes))):
            idx = torch.tensor([past_len + 1 + i for i in nodes], dtype=torch.long)
            state.buffer[:, :, :, past_len + 1 : keep].copy_(state.buffer.index_select(3, idx))
        state.length = min(state.length, keep)

    @staticmethod
    def rollback(state: NativeKVState, length: int) -> None:
        """Drop the entries from position ``length`` on (the length only)."""
        state.length = min(state.length, max(0, int(length)))

    # ------------------------------------------------------------------ the step
    def forward(
        self,
        states: Sequence[NativeKVState],
        ids: torch.Tensor,
        positions: torch.Tensor,
        bounds: Sequence[int],
        masks: Sequence[Optional[torch.Tensor]],
        *,
        prompt: bool = False,
    ) -> torch.Tensor:
        """All decoder layers for the rows of several requests.

        Args:
            states: the requests' KV states; request i's new rows are written at positions
                ``states[i].length ..`` and its length grows by its number of rows.
            ids: int64 [R] the rows' tokens (request i: rows ``bounds[i]:bounds[i + 1]``).
            positions: int64 [R] each row's position id (its RoPE position).
            bounds: n + 1 row offsets, 0 first, R last.
            masks: per request bool [Q_i, past_i + Q_i] (True = attend) or None (causal).
            prompt: the rows are prompt chunks: a request's more than ``SKINNY_MAX_ROWS``
                causal rows take the packed weights (:meth:`pack`) and the prompt-chunk
                attention; a verification's rows (False) always the few-row kernels, so
                each gets the bits of the one-row step at its position.

        Returns:
            float32 [R, H], the hidden states after the final norm.
        """
        x = self.decoder.embed_tokens(ids[None])  # [1, R, H]
        return self.forward_embeds(states, x[0], positions, bounds, masks, prompt=prompt)

    def forward_embeds(
        self,
        states: Sequence[NativeKVState],
        x: torch.Tensor,
        positions: torch.Tensor,
        bounds: Sequence[int],
        masks: Sequence[Optional[torch.Tensor]],
        *,
        prompt: bool = False,
    ) -> torch.Tensor:
        """:meth:`forward` from the rows' input vectors ``x`` float32 [R, H] instead of
        their tokens (an EAGLE head's fused token-and-feature inputs)."""
        cos, sin = self.decoder.rotary_emb(x[None], positions[None])  # [1, R, d] each
        pasts = []
        for s, a, b in zip(states, bounds[:-1], bounds[1:]):
            self.reserve(s, s.length + (b - a))
            pasts.append(s.length)
        hidden = self.step.forward(
            x, cos[0], sin[0], [s.buffer for s in states], list(bounds), pasts, list(masks), prompt
        )
        for s, a, b in zip(states, bounds[:-1], bounds[1:]):
            s.length += b - a
        return hidden
