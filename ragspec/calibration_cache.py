"""Measured latency tables kept across starts, so a restart on a known machine skips the
start-up calibration (a few seconds on a quiet machine, minutes on a loaded one, where a
table measured under load would also misprice every later draft).

A table is cached under a :class:`CalibrationKey`: everything its seconds depend on, the
machine (CPU model and flags, GPU name), the model's files (path, size and modification
time, or its checksum), the device and dtype, the torch threads, the kernel build (the
compiled kernels' cache key and the switches that choose them) and ragspec's cache format.
Any change is another key, so a changed machine, model, thread count or kernel is measured
anew; ``recalibrate`` measures even where a table fits. One JSON file per key under
``<ragspec cache>/calibration/`` (written atomically); a file that cannot be read or does not
hold a table is ignored with a warning and measured over.

    >>> cache = CalibrationCache(Path("~/.cache/ragspec/calibration").expanduser())
    >>> latency = cached_latency(lambda: measure_latency_model(target), key, cache)

Only core modules are imported here: :mod:`ragspec.loading` builds the key (it knows the
model and the kernels) and gives the folder.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from .policy import LatencyModel

logger = logging.getLogger(__name__)

__all__ = [
    "CalibrationKey",
    "CalibrationCache",
    "cached_latency",
    "machine_fingerprint",
    "files_fingerprint",
    "FORMAT",
]

FORMAT = 1
"""Version of the cached files' layout (part of every key: a new layout measures anew)."""

_MAX_FILES = 4096  # files of a model folder fingerprinted (a model folder holds a few dozen)


@dataclass(frozen=True)
class CalibrationKey:
    """What a measured latency table depends on (strings compared whole).

    Attributes:
        machine: the CPU (model name, flags) and GPU (:func:`machine_fingerprint`).
        model: the model's files (:func:`files_fingerprint`, or a checksum).
        device: the torch device, e.g. ``"cpu"``, ``"cuda:0"``.
        dtype: the weights' dtype, e.g. ``"torch.float32"``.
        threads: torch intra-op threads.
        kernels: the kernel build and the switches choosing the forward's code paths.
    """

    machine: str
    model: str
    device: str
    dtype: str
    threads: int
    kernels: str
    format: int = FORMAT

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """A hex digest of every field (the cache file's name)."""
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def machine_fingerprint(cpuinfo: Union[str, os.PathLike] = "/proc/cpuinfo", gpu: str = "") -> str:
    """The machine a table is measured on: architecture, the CPU's model name and a digest
    of its flags (from ``cpuinfo`` where it exists), the number of CPUs, and ``gpu`` (a
    CUDA device's name, "" on CPU)."""
    model = flags = ""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                name = name.strip()
                if name == "model name" and not model:
                    model = value.strip()
                elif name in ("flags", "Features") and not flags:
                    flags = " ".join(sorted(value.split()))
                if model and flags:
                    break
    except OSError:
        pass
    model = model or platform.processor()
    digest = hashlib.sha256(flags.encode()).hexdigest()[:16]
    return f"{platform.machine()}|{model}|flags:{digest}|cpus:{os.cpu_count()}|gpu:{gpu}"


def files_fingerprint(path: Union[str, os.PathLike]) -> str:
    """A model's identity on disk: its resolved path and, for a file or each file of a folder
    (sorted, at most 4096), its relative name, size and modification time, digested.
    A missing path is its name alone."""
    root = Path(path).expanduser()
    try:
        root = root.resolve()
        if root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file())[:_MAX_FILES]
        else:
            files = [root]
        h = hashlib.sha256()
        for p in files:
            st = p.stat()
            h.update(f"{p.relative_to(root) if p != root else p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        return f"{root}|{h.hexdigest()[:32]}"
    except OSError:
        return str(root)


class CalibrationCache:
    """Latency tables on disk, one JSON file per :class:`CalibrationKey` in ``directory``
    (created on the first :meth:`put`). No I/O until :meth:`get` or :meth:`put`."""

    def __init__(self, directory: Union[str, os.PathLike]) -> None:
        self.directory = Path(directory)

    def path(self, key: CalibrationKey) -> Path:
        """The file of ``key``'s table."""
        return self.directory / f"latency-{key.digest()[:32]}.json"

    def get(self, key: CalibrationKey) -> Optional[LatencyModel]:
        """The latency model cached for ``key``, or None (none cached; a file that cannot
        be read, is not JSON, holds another key or no valid table: logged as a warning)."""
        path = self.path(key)
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            logger.warning("ignoring the cached latency table %s: cannot read it (%s); measuring again", path, e)
            return None
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("key") != key.to_dict():
                raise ValueError("it was measured for another machine, model or build")
            table = {int(q): float(s) for q, s in data["table"].items()}
            early = data.get("early")
            early = {int(q): float(s) for q, s in early.items()} if early else None
            if not all(s > 0 for s in [*table.values(), *(early or {}).values()]):
                raise ValueError("a latency that is not a positive number")
            return LatencyModel(table, early=early)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            logger.warning("ignoring the cached latency table %s: %s; measuring again", path, e)
            return None

    def put(self, key: CalibrationKey, latency: LatencyModel) -> None:
        """Keep ``latency``'s measured tables for ``key`` (atomically: a temporary file
        renamed into place). A cache that cannot be written is logged, never raised."""
        path = self.path(key)
        early = latency.early_table
        data = {
            "key": key.to_dict(),
            "table": {str(q): s for q, s in latency.table.items()},
            "early": {str(q): s for q, s in early.items()} if early else None,
        }
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
            os.replace(tmp, path)
        except OSError as e:
            logger.warning("cannot cache the latency table in %s: %s", self.directory, e)
            try:
                tmp.unlink()
            except OSError:
                pass


def cached_latency(
    measure: Callable[[], LatencyModel],
    key: CalibrationKey,
    cache: Optional[CalibrationCache],
    recalibrate: bool = False,
) -> LatencyModel:
    """The latency model cached for ``key``, else ``measure()``'s (then cached).
    ``recalibrate``: measure (and cache) even where a table is cached; ``cache`` None:
    always measure, nothing kept."""
    if cache is not None and not recalibrate:
        found = cache.get(key)
        if found is not None:
            logger.info("latency table from %s (--recalibrate measures it again)", cache.path(key))
            return found
    latency = measure()
    if cache is not None:
        cache.put(key, latency)
    return latency
