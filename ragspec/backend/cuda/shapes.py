"""A transformers Llama of the default model's shapes, built without its weights (on the
``meta`` device: no memory, no arithmetic), for counting and compiling the CUDA step
(:mod:`ragspec.bench.cuda_static`). Imports torch and transformers only."""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["DEFAULT_SHAPES", "default_shapes_model"]

DEFAULT_SHAPES: dict[str, Any] = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
"""The default model's decoder shapes (SmolLM2-135M-Instruct's config)."""


def default_shapes_model(layers: Optional[int] = None, dtype: torch.dtype = torch.bfloat16, device: str = "meta"):
    """A transformers Llama of the default model's shapes (``layers`` decoder layers, default
    30), on ``device`` (``meta``: no memory, no arithmetic; the weights are not read)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = dict(DEFAULT_SHAPES, num_hidden_layers=int(layers or DEFAULT_SHAPES["num_hidden_layers"]))
    cfg = LlamaConfig(**shapes)
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    for p in model.parameters():  # (the model's own .to() is typed for other uses)
        p.data = p.data.to(dtype)
    return model.eval()
