"""Loading a model into transformers, offline: device and dtype choice, the de-quantization
of a GGUF (saved once, see :mod:`ragspec.models.conversion`), and what a loaded model
says of itself (:func:`model_info`, :func:`eos_token_ids`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

import torch

from ..errors import ConfigError, ModelLoadError, ModelNotFoundError
from ..progress import step
from .conversion import (
    _SOURCE_JSON,
    _check_gguf_digest,
    _is_converted,
    _load_failure,
    _source_record,
    converted_model_dir,
)
from .files import _atomic_dir, _write_json_atomic
from .registry import ModelSpec
from .tokenizer import _load_gguf_tokenizer, _load_hf_tokenizer

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "resolve_device",
    "resolve_dtype",
    "load_model",
    "model_info",
    "eos_token_ids",
    "quiet_transformers",
]


# --------------------------------------------------------------------------- device and dtype
def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """The torch device to run on: None -> ``cuda`` if available, else ``cpu``.

    Raises:
        ConfigError: an unparsable device string, or CUDA asked for but not available.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"invalid device {device!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} asked for but CUDA is not available")
    return dev


_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
)


def resolve_dtype(dtype: Union[str, torch.dtype, None], device: Union[str, torch.device, None]) -> torch.dtype:
    """The weight dtype: None -> bfloat16 on CUDA, float32 elsewhere.

    Args:
        dtype: None, a torch floating dtype, or one of ``fp32 float32 bf16 bfloat16 fp16
            float16`` (case-insensitive).
        device: the device the model will run on (string or torch.device; None = CPU).

    Raises:
        ConfigError: any other value.
    """
    if dtype is None:
        dev_type = torch.device(device).type if device is not None else "cpu"
        return torch.bfloat16 if dev_type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {dtype}; use one of {', '.join(_DTYPES)}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ConfigError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")


# --------------------------------------------------------------------------- model
def _convert_gguf(spec: ModelSpec, digest: str) -> Optional["PreTrainedModel"]:
    """De-quantize a GGUF and save it to :func:`converted_model_dir` (float32 safetensors).

    Returns:
        None when saved (load the folder), else the in-memory float32 model (the folder was
        not writable).

    Raises:
        ModelLoadError: the GGUF is broken or its architecture is not supported.
    """
    from transformers import AutoModelForCausalLM, GgufConfig

    try:
        # dequantize=True: a plain dense model, serializable (no GGUF quantizer attached),
        # whatever kernels are installed.
        with step(f"de-quantizing {spec.path.name}", "first load only, ~15 s for the default model"):
            model = AutoModelForCausalLM.from_pretrained(
                str(spec.path.parent),
                gguf_file=spec.path.name,
                dtype=torch.float32,
                quantization_config=GgufConfig(dequantize=True),
                local_files_only=True,
            )
    except Exception as e:  # transformers raises many types on a bad file; re-raised typed
        raise _load_failure(spec, "weights", e) from e
    folder = converted_model_dir(spec.path)
    t1 = time.perf_counter()
    try:
        with _atomic_dir(folder) as tmp:
            model.save_pretrained(str(tmp))
            _write_json_atomic(tmp / _SOURCE_JSON, _source_record(spec, digest))
    except OSError as e:
        logger.warning("cannot save the converted model to %s (%s); it is converted at every load", folder, e)
        return model
    logger.info("saved the converted model to %s in %.1f s", folder, time.perf_counter() - t1)
    return None


def _load_hf_model(folder: Path, dtype: torch.dtype) -> "PreTrainedModel":
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
        raise ModelLoadError(f"cannot load a causal LM from {folder}: {type(e).__name__}: {e}") from e


def load_model(
    spec: ModelSpec,
    device: Union[str, torch.device, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
) -> tuple["PreTrainedModel", "PreTrainedTokenizerBase"]:
    """Load a resolved model and its tokenizer, offline, in eval mode on ``device``.

    A GGUF is de-quantized once (~15 s for the default model on CPU) and saved as float32
    safetensors in :func:`converted_model_dir`; later loads read that folder (~0.1 s) and
    cast to ``dtype``. A conversion made from a GGUF with another sha256 is made again.
    ``model.generation_config`` is the one of the model (EOS, pad ids).

    Args:
        spec: from :func:`resolve_model`.
        device: see :func:`resolve_device` (None = CUDA if available, else CPU).
        dtype: see :func:`resolve_dtype` (None = bfloat16 on CUDA, float32 on CPU).

    Returns:
        (model, tokenizer).

    Raises:
        ConfigError: bad ``device`` or ``dtype``.
        ModelNotFoundError: the file or folder is gone.
        ModelLoadError: the GGUF is broken (truncated, altered: re-run ``ragspec model
            fetch --force``) or not supported, or the folder holds no loadable causal LM.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    t0 = time.perf_counter()
    if spec.kind == "gguf":
        digest = _check_gguf_digest(spec)
        tokenizer = _load_gguf_tokenizer(spec, digest)
        folder = converted_model_dir(spec.path)
        model = None
        if _is_converted(folder, digest):
            try:
                model = _load_hf_model(folder, torch_dtype)
            except ModelLoadError as e:
                logger.warning("converted model %s is unreadable (%s); converting again", folder, e)
        if model is None:
            in_memory = _convert_gguf(spec, digest)
            if in_memory is None:
                model = _load_hf_model(folder, torch_dtype)
            else:
                model = in_memory.to(dtype=torch_dtype)  # type: ignore[call-arg]  # transformers' wrapped .to
    elif spec.kind == "hf":
        if not spec.path.is_dir():
            raise ModelNotFoundError(f"model folder {spec.path} does not exist")
        tokenizer = _load_hf_tokenizer(spec.path)
        model = _load_hf_model(spec.path, torch_dtype)
    else:
        raise ConfigError(f"unknown model kind {spec.kind!r} (expected 'gguf' or 'hf')")
    model.eval()
    model.to(dev)  # type: ignore[arg-type]  # transformers' wrapped .to takes a device
    logger.info("loaded %s (%s, %s on %s) in %.2f s", spec.name, spec.kind, torch_dtype, dev, time.perf_counter() - t0)
    return model, tokenizer


# --------------------------------------------------------------------------- info
def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(value)]


def text_config(config: Any) -> Any:
    """The text decoder's part of a transformers config: ``config.get_text_config()`` where
    the config has one (multimodal configs hold the text model's settings there), else
    ``config`` itself."""
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def eos_token_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """All end-of-sequence token ids of a model, deduplicated, in this order of sources:
    ``model.generation_config.eos_token_id`` (int or list), ``model.config.eos_token_id``
    (and its text config's, for multimodal configs), then ``tokenizer.eos_token_id``.

    Returns:
        A list of ints; empty when no source names one.
    """
    sources: list[Any] = []
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        sources.append(getattr(gen, "eos_token_id", None))
    config = getattr(model, "config", None)
    if config is not None:
        sources.append(getattr(config, "eos_token_id", None))
        text = text_config(config)
        if text is not config:
            sources.append(getattr(text, "eos_token_id", None))
    if tokenizer is not None:
        sources.append(getattr(tokenizer, "eos_token_id", None))
    ids: list[int] = []
    for source in sources:
        for i in _as_id_list(source):
            if i not in ids:
                ids.append(i)
    return ids


def model_info(
    spec: ModelSpec,
    model: Optional["PreTrainedModel"] = None,
    tokenizer: Optional["PreTrainedTokenizerBase"] = None,
) -> dict[str, Any]:
    """A JSON-able summary of a model (for ``ragspec model info`` and ``/v1/models``).

    Args:
        spec: the resolved model.
        model, tokenizer: the loaded model and tokenizer; when ``model`` is None both are
            loaded on the CPU with :func:`load_model` (fast once converted).

    Returns:
        ``name, kind, path, sha256, architecture, num_parameters, vocab_size,
        tokenizer_vocab_size, max_position_embeddings, dtype, device, eos_token_ids``.

    Raises:
        the errors of :func:`load_model` when ``model`` is None.
    """
    if model is None:
        model, tokenizer = load_model(spec, device="cpu")
    config = model.config
    text = text_config(config)
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    param = next(model.parameters(), None)
    return {
        "name": spec.name,
        "kind": spec.kind,
        "path": str(spec.path),
        "sha256": spec.sha256,
        "architecture": architectures[0],
        "num_parameters": int(model.num_parameters()),
        "vocab_size": int(getattr(text, "vocab_size", None) or model.get_input_embeddings().num_embeddings),  # type: ignore[arg-type]  # nn.Embedding
        "tokenizer_vocab_size": len(tokenizer) if tokenizer is not None else None,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
        "dtype": str(param.dtype).removeprefix("torch.") if param is not None else None,
        "device": str(param.device) if param is not None else None,
        "eos_token_ids": eos_token_ids(model, tokenizer),
    }


def quiet_transformers() -> None:
    """Silence transformers' de-quantization progress bars, FutureWarnings and its
    UserWarnings (noise on a command line; ``--verbose`` keeps them)."""
    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    hf_logging.disable_progress_bar()
