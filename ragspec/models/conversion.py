"""Where the conversions of a GGUF are saved, what they record, and the checks of the GGUF.

The first load of a GGUF saves the de-quantized model and the tokenizer as plain Hugging
Face folders beside it (:func:`converted_model_dir`, :func:`converted_tokenizer_dir`),
each with a ``ragspec_source.json`` naming the sha256 of the GGUF it was made from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..errors import ModelLoadError, ModelNotFoundError
from .files import _FORMAT_VERSION, _read_json, _sha256_file
from .registry import KNOWN_MODELS, ModelSpec

__all__ = [
    "converted_model_dir",
    "converted_tokenizer_dir",
]

_SOURCE_JSON = "ragspec_source.json"
_GGUF_MAGIC = b"GGUF"


# --------------------------------------------------------------------------- saved conversions
def converted_model_dir(gguf_path: Path) -> Path:
    """Folder of the saved de-quantized model of a GGUF: ``<gguf_dir>/<stem>.hf/model/``."""
    gguf_path = Path(gguf_path)
    return gguf_path.with_name(gguf_path.stem + ".hf") / "model"


def converted_tokenizer_dir(gguf_path: Path) -> Path:
    """Folder of the saved tokenizer of a GGUF: ``<gguf_dir>/<stem>.hf/tokenizer/``."""
    gguf_path = Path(gguf_path)
    return gguf_path.with_name(gguf_path.stem + ".hf") / "tokenizer"


def _source_record(spec: ModelSpec, digest: str) -> dict:
    import transformers

    return {
        "format": _FORMAT_VERSION,
        "gguf_file": spec.path.name,
        "gguf_sha256": digest,
        "transformers_version": transformers.__version__,
    }


def _is_converted(folder: Path, digest: str) -> bool:
    """Whether ``folder`` holds a conversion of the GGUF whose sha256 is ``digest``."""
    record = _read_json(folder / _SOURCE_JSON)
    if record is None or record.get("format") != _FORMAT_VERSION:
        return False
    return record.get("gguf_sha256") == digest


# --------------------------------------------------------------------------- GGUF checks
def _broken_gguf_error(spec: ModelSpec, detail: str) -> ModelLoadError:
    if spec.name in KNOWN_MODELS:
        hint = f"re-run: ragspec model fetch --force {spec.name}"
    else:
        hint = "if it is a fetched model, re-run: ragspec model fetch --force <name>"
    return ModelLoadError(f"the GGUF file {spec.path} is broken ({detail}); {hint}")


def _check_gguf_digest(spec: ModelSpec) -> str:
    """Hex sha256 of the spec's GGUF, checked against the digest recorded at fetch.

    Raises:
        ModelNotFoundError: the file is gone.
        ModelLoadError: the file does not start like a GGUF, or its digest is not the
            recorded one (truncated or altered).
    """
    path = spec.path
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_GGUF_MAGIC))
    except FileNotFoundError:
        raise ModelNotFoundError(f"GGUF file {path} does not exist") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if magic != _GGUF_MAGIC:
        raise _broken_gguf_error(spec, f"it starts with {magic!r}, not {_GGUF_MAGIC!r}")
    digest = _sha256_file(path)
    if spec.sha256 is not None and digest != spec.sha256:
        raise _broken_gguf_error(spec, f"sha256 is {digest}, fetched as {spec.sha256}")
    return digest


def _gguf_structure_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a complete GGUF file, or None if its structure is sound.

    Parses the header with the ``gguf`` package (~2.5 s for the default model, so only used
    to explain a failed load) and checks that all tensor data lies inside the file.
    """
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a dependency
        return None
    try:
        reader = gguf.GGUFReader(path)
        file_size = path.stat().st_size
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        return f"{type(e).__name__}: {e}"
    if end > file_size:
        return f"tensor data ends at byte {end} but the file has {file_size} bytes"
    return None


def _load_failure(spec: ModelSpec, what: str, err: Exception) -> ModelLoadError:
    """The error to raise when transformers fails on a GGUF: broken file or unsupported."""
    problem = _gguf_structure_problem(spec.path)
    if problem is not None:
        return _broken_gguf_error(spec, f"{problem}; transformers said: {type(err).__name__}: {err}")
    return ModelLoadError(f"transformers cannot load the {what} of {spec.path}: {type(err).__name__}: {err}")
