"""The decoder's weights, read from a transformers model, laid out for the CUDA step.

Supports the Llama (SmolLM2) and Gemma-3 text decoders: the per-layer projections are read
from the transformers modules (q/k/v concatenated into one weight, gate/up into another:
each output column is still summed on its own, so the values are those of the separate
projections), the rotary tables computed once by the model's own rotary module for every
position of a slot (the same cos/sin values transformers computes per call). The
transformers model stays the reference: nothing here changes it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...errors import ConfigError
from ...models.load import text_config

__all__ = ["SUPPORTED_MODEL_TYPES", "DecoderWeights", "LayerWeights", "read_decoder_weights"]

SUPPORTED_MODEL_TYPES = ("llama", "gemma3_text")


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer (shapes with H hidden, Hq / Hkv heads of d, I intermediate).

    Attributes:
        qkv: [(Hq + 2 Hkv) d, H]; qkv_bias the same rows or None.
        o: [H, Hq d].
        gate_up: [2 I, H]; down: [H, I].
        norms: the layer's RMSNorm weights by transformers' name (``input_layernorm``,
            ``post_attention_layernorm``; Gemma-3 also ``pre_feedforward_layernorm``,
            ``post_feedforward_layernorm``, ``q_norm``, ``k_norm``).
        window: local attention window (Gemma-3's sliding layers), 0 for global layers.
        rope: which rotary table (the layer type).
    """

    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    norms: dict[str, torch.Tensor]
    window: int
    rope: str


@dataclass(frozen=True)
class DecoderWeights:
    """The whole decoder.

    Attributes:
        model_type: ``"llama"`` or ``"gemma3_text"``.
        embed: [V, H] input embedding; embed_scale Gemma's ``sqrt(H)`` (in the model's
            dtype) or None.
        layers: one :class:`LayerWeights` per layer.
        final_norm: [H].
        lm_head: [V, H] output layer; lm_head_bias [V] or None.
        rope: rotary tables by layer type: (cos, sin) [C, d] each, in the model's dtype.
        heads, kv_heads, head_dim, hidden, intermediate: sizes.
        eps: the RMSNorm epsilon; norm_offset: Gemma's ``(1 + w)`` norms.
        scale: the attention score scale.
        activation: ``"silu"`` or ``"gelu_tanh"``.
        logit_softcap: final logit soft-capping, or None.
    """

    model_type: str
    embed: torch.Tensor
    embed_scale: Optional[torch.Tensor]
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    lm_head_bias: Optional[torch.Tensor]
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    eps: float
    norm_offset: bool
    scale: float
    activation: str
    logit_softcap: Optional[float]


def unsupported_reason(model: Any) -> Optional[str]:
    """Why the CUDA step cannot run ``model``'s decoder, or None."""
    cfg = text_config(model.config)
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model type {kind!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    if act not in ("silu", "gelu_pytorch_tanh"):
        return f"activation {act!r}"
    decoder = model.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "rotary_emb"):
        return "a decoder without layers and a rotary embedding"
    return None


def _rope_tables(decoder: Any, layer_types: list[str], length: int, dtype: torch.dtype, device: torch.device):
    """(cos, sin) [length, d] per layer type, from the model's rotary module."""
    rotary = decoder.rotary_emb
    takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
    pos = torch.arange(length, device=device)[None]
    dummy = torch.zeros(1, dtype=dtype, device=device)
    tables = {}
    with torch.no_grad():
        for kind in sorted(set(layer_types)):
            cos, sin = rotary(dummy, pos, kind) if takes_type else rotary(dummy, pos)
            tables[kind] = (cos[0].to(dtype).contiguous(), sin[0].to(dtype).contiguous())
    return tables


def _cat_bias(mods: list[Any]) -> Optional[torch.Tensor]:
    biases = [getattr(m, "bias", None) for m in mods]
    if all(b is None for b in biases):
        return None
    return torch.cat(
        [b.detach() if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, mods)]
    )


def read_decoder_weights(model: Any, context: int) -> DecoderWeights:
    """The decoder's weights of ``model`` (a transformers causal LM) for positions
    ``0 .. context - 1``.

    Raises:
        ConfigError: an architecture the CUDA step does not run (the reason named).
    """
    reason = unsupported_reason(model)
    if reason is not None:
        raise ConfigError(f"the CUDA backend cannot run this model: {reason}")
    cfg = text_config(model.config)
    decoder = model.get_decoder()
    embed_mod = decoder.embed_tokens
    embed = embed_mod.weight.detach()
    dtype, device = embed.dtype, embed.device
    gemma = cfg.model_type == "gemma3_text"
    n_layers = len(decoder.layers)
    layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n_layers)
    layers = []
    scale = None
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        proj = [attn.q_proj, attn.k_proj, attn.v_proj]
        norms = {"input_layernorm": layer.input_layernorm.weight.detach()}
        names = ["post_attention_layernorm"]
        if gemma:
            names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            norms["q_norm"] = attn.q_norm.weight.detach()
            norms["k_norm"] = attn.k_norm.weight.detach()
        for n in names:
            norms[n] = getattr(layer, n).weight.detach()
        window = int(getattr(attn, "sliding_window", None) or 0) if layer_types[i] == "sliding_attention" else 0
        if getattr(mlp.gate_proj, "bias", None) is not None or getattr(mlp.down_proj, "bias", None) is not None:
            raise ConfigError("the CUDA backend cannot run this model: MLP biases")
        if getattr(attn.o_proj, "bias", None) is not None:
            raise ConfigError("the CUDA backend cannot run this model: an output projection bias")
        layers.append(
            LayerWeights(
                qkv=torch.cat([m.weight.detach() for m in proj]).contiguous(),
                qkv_bias=_cat_bias(proj),
                o=attn.o_proj.weight.detach(),
                gate_up=torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous(),
                down=mlp.down_proj.weight.detach(),
                norms=norms,
                window=window,
                rope=layer_types[i],
            )
        )
        scale = float(attn.scaling)
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    lm = model.get_output_embeddings()
    scale_buf = getattr(embed_mod, "embed_scale", None)
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
    return DecoderWeights(
        model_type=cfg.model_type,
        embed=embed,
        embed_scale=None if scale_buf is None else scale_buf.to(dtype),
        layers=layers,
        final_norm=decoder.norm.weight.detach(),
        lm_head=lm.weight.detach(),
        lm_head_bias=None if getattr(lm, "bias", None) is None else lm.bias.detach(),
        rope=_rope_tables(decoder, layer_types, context, dtype, device),
        heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        hidden=int(cfg.hidden_size),
        intermediate=int(cfg.intermediate_size),
        eps=float(cfg.rms_norm_eps),
        norm_offset=gemma,
        scale=scale if scale is not None else head_dim**-0.5,
        activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
        logit_softcap=getattr(cfg, "final_logit_softcapping", None),
    )
