"""The backend's attention function for transformers models, on any device: grouped-query
attention without key/value head copies, the per-request attention of a batched
verification forward, and a hook through which a backend hands its own few-query kernel to
its own forwards.

Registered with transformers' ``AttentionInterface`` as ``"ragspec_sdpa"``
(:func:`register_gqa_attention`); an :class:`~ragspec.backend.hf.HFTarget` built with
``route_attention=True`` switches its model to it. Other callers of
the model (``model.generate``, training) pass none of the keywords below and get
transformers' SDPA values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

__all__ = [
    "ATTENTION_BATCH_KW",
    "ATTENTION_KERNEL_KW",
    "AttentionBatch",
    "AttentionKernel",
    "GQA_SDPA",
    "register_gqa_attention",
]

GQA_SDPA = "ragspec_sdpa"  # name of the attention function registered by register_gqa_attention

# keyword under which a backend's own forwards hand their AttentionKernel to
# _gqa_sdpa_attention (transformers passes a forward's extra keywords on to the attention
# function): other callers of the model (model.generate, training) never set it
ATTENTION_KERNEL_KW = "ragspec_attention_kernel"

# keyword under which a batched verification forward hands its AttentionBatch (the rows of
# each request and that request's keys, values and mask) to _gqa_sdpa_attention
ATTENTION_BATCH_KW = "ragspec_attention_batch"


@dataclass(frozen=True)
class AttentionKernel:
    """A backend's own attention kernel for few query rows, handed to the attention function
    of its own forwards (under ``ATTENTION_KERNEL_KW``), e.g. the compiled CPU kernel of
    :mod:`ragspec.backend.cpu.kernels`.

    Attributes:
        applies: ``applies(query, key, attention_mask, dropout, kwargs) -> bool``: whether
            ``run`` computes this call (shapes as transformers' attention functions: query
            [B, Hq, Q, d], key [B, Hkv, S, d]); elsewhere the call takes SDPA.
        run: ``run(query [1, Hq, Q, d], key [1, Hkv, S, d], value, mask bool [1, 1, Q, S] |
            None, scale) -> [1, Q, Hq, d]``.
    """

    applies: Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], float, dict], bool]
    run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], float], torch.Tensor]


class AttentionBatch(Protocol):
    """What the attention of a batched verification forward needs to know about its rows:
    the forward's rows are the concatenated rows of several requests, each attending only
    to its own KV cache (no padding, no copy of past keys)."""

    def segments(self, layer_idx: int) -> Sequence[tuple[int, int, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """For decoder layer ``layer_idx``, after its cache update: one ``(start, stop, key,
        value, mask)`` per request, in row order: its rows ``start:stop`` of the forward,
        its keys/values [1, H_kv, S_i, d] (its whole cache, the new rows included) and its
        attention mask for that layer ([1, 1, stop - start, S_i], or None), exactly as a
        forward over that request alone would have them."""


def _gqa_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, except that masked multi-token queries (verification)
    use SDPA's grouped-query mode instead of copying the key/value heads (``repeat_kv``).

    Shapes as transformers' ``sdpa_attention_forward``: query [B, Hq, Q, d], key/value
    [B, Hkv, S, d], attention_mask bool [B, 1, Q, S] -> ([B, Q, Hq, d], None). The values
    are the same (the same kernel reads the shared head instead of its copy; checked bit
    for bit in tests/unit/test_target_fastpaths.py); everything else (prefill without a
    mask, one-token decoding, float masks, position biases) goes to transformers' function.
    Measured on the 2-core CPU: 8 queries over 708 keys, 9 query / 3 key-value heads:
    1.7 ms -> 0.26 ms per layer.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch = kwargs.pop(ATTENTION_BATCH_KW, None)
    if batch is not None:
        return _batched_attention(batch, module, query, dropout, scaling, is_causal, kwargs), None
    kernel: Optional[AttentionKernel] = kwargs.pop(ATTENTION_KERNEL_KW, None)
    if kernel is not None and kernel.applies(query, key, attention_mask, dropout, kwargs):
        # the backend's own kernel (the compiled CPU kernel: ragspec.backend.cpu.kernels)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return kernel.run(query, key, value, attention_mask, float(scale)), None
    if (
        getattr(module, "num_key_value_groups", 1) > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and attention_mask.dtype == torch.bool
        and not dropout
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )  # [B, Hq, Q, d]
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
    )


def _batched_attention(
    batch: AttentionBatch, module, query, dropout, scaling, is_causal, kwargs: dict[str, Any]
) -> torch.Tensor:
    """query [1, Hq, R, d] of all requests' rows -> [1, R, Hq, d]: each request's rows
    attend to its own keys through the same call its forward alone would make (the
    backend's kernel or SDPA, whichever applies to it), so each request's output is that
    of its own forward, bit for bit."""
    position_ids = kwargs.get("position_ids")
    outs = []
    for start, stop, key, value, mask in batch.segments(module.layer_idx):
        seg_kwargs = dict(kwargs)
        if position_ids is not None:
            seg_kwargs["position_ids"] = position_ids[:, start:stop]
        out, _ = _gqa_sdpa_attention(
            module,
            query[:, :, start:stop],
            key,
            value,
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **seg_kwargs,
        )
        outs.append(out)  # [1, stop - start, Hq, d]
    return torch.cat(outs, dim=1)  # [1, R, Hq, d]


def register_gqa_attention() -> str:
    """Register :func:`_gqa_sdpa_attention` (and transformers' SDPA mask builder) with
    transformers' attention registries under ``"ragspec_sdpa"`` and return that name.
    The registries are keyed by name: registering again replaces the entry by itself."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    return GQA_SDPA
