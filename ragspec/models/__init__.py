"""Model fetching, caching and loading; fully offline except the explicit fetch.

See :mod:`ragspec.models.registry`.
"""

from .registry import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    ModelSpec,
    WheelPart,
    cache_dir,
    converted_model_dir,
    converted_tokenizer_dir,
    eos_token_ids,
    fetch_model,
    load_model,
    load_tokenizer,
    model_dir,
    model_info,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
    resolve_model,
)

__all__ = [
    "WheelPart",
    "quiet_transformers",
    "KnownModel",
    "KNOWN_MODELS",
    "DEFAULT_MODEL",
    "ModelSpec",
    "cache_dir",
    "model_dir",
    "fetch_model",
    "resolve_model",
    "resolve_device",
    "resolve_dtype",
    "converted_model_dir",
    "converted_tokenizer_dir",
    "load_tokenizer",
    "load_model",
    "model_info",
    "eos_token_ids",
]
