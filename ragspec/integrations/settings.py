"""Settings of the REST service (``ragspec serve``), from arguments or environment variables.

Importing this module is cheap (no FastAPI, no torch): the CLI reads it at every start.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from ragspec.errors import ConfigError

__all__ = ["ServerSettings", "parse_datastore", "ENV_VARS"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# environment variable -> settings field (strings converted by the field's type)
ENV_VARS = {
    "RAGSPEC_HOST": "host",
    "RAGSPEC_PORT": "port",
    "RAGSPEC_MODEL": "model",
    "RAGSPEC_DEVICE": "device",
    "RAGSPEC_DTYPE": "dtype",
    "RAGSPEC_DATASTORES": "datastores",
    "RAGSPEC_EAGLE": "eagle",
    "RAGSPEC_API_KEY": "api_key",
    "RAGSPEC_MAX_QUEUE": "max_queue",
    "RAGSPEC_MAX_ACTIVE": "max_active",
}


def parse_datastore(spec: str) -> tuple[str, str]:
    """``NAME=DIR`` (or a bare ``DIR``, named after its last path component) as (name, dir).

    Names are what requests may use; they are letters, digits, ``.``, ``_``, ``-``.

    Raises:
        ConfigError: empty directory or a name that is not a plain identifier.
    """
    name, sep, directory = spec.partition("=")
    if not sep:
        directory, name = spec, Path(spec.rstrip("/")).name
    if not directory:
        raise ConfigError(f"--datastore wants NAME=DIR, got {spec!r}")
    if not _NAME.match(name) or name in (".", ".."):
        raise ConfigError(f"datastore name must be letters, digits, '.', '_' or '-', got {name!r}")
    return name, directory


@dataclass(frozen=True)
class ServerSettings:
    """How the service runs. Times in seconds."""

    host: str = "127.0.0.1"
    """Address to bind: loopback unless told otherwise (0.0.0.0 inside a container)."""
    port: int = 8000
    """TCP port."""
    model: Optional[str] = None
    """Model to load at start-up: registry name, GGUF file or HF folder (None = default)."""
    device: Optional[str] = None
    """Torch device (None: cuda when present, else cpu)."""
    dtype: Optional[str] = None
    """fp32, bf16, fp16 (None: the model loader's default)."""
    datastores: tuple[tuple[str, str], ...] = ()
    """(name, directory) of each datastore; requests name one by ``datastore``, never by
    path. The first is the default of requests that name none."""
    eagle: Optional[str] = "auto"
    """EAGLE draft head directory; "auto": the head shipped for the model, if any; "none": no head."""
    api_key: Optional[str] = None
    """When set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>``."""
    max_active: int = 8
    """Generations interleaved step by step by the worker."""
    max_queue: int = 32
    """Requests waiting beyond the active ones; more get 429 with ``Retry-After``."""
    retry_after_s: int = 1
    """The ``Retry-After`` of a 429."""
    max_draft_tokens: int = 8
    """Most draft tokens verified per step."""
    adaptive: bool = True
    """Cost-aware draft sizing (False: verify every proposed draft)."""
    speculative: bool = True
    """Default of a request's ``speculative`` field (False: plain decoding unless asked)."""
    default_max_tokens: int = 256
    """``max_tokens`` of a request that gives none (completions: OpenAI's 16)."""
    default_temperature: float = 0.0
    """``temperature`` of a request that gives none: greedy, so answers are reproducible
    (OpenAI's own default is 1.0)."""
    calibrate: bool = True
    """Measure the forward latency table at start-up (a few seconds)."""
    served_model_name: Optional[str] = None
    """Name in ``/v1/models`` and responses (None: the engine's model name)."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.max_active < 1:
            raise ConfigError(f"max_active must be >= 1, got {self.max_active}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty")
        names = [n for n, _ in self.datastores]
        if len(set(names)) != len(names):
            raise ConfigError(f"datastore names must be unique, got {names}")
        for n, d in self.datastores:
            parse_datastore(f"{n}={d}")

    def replace(self, **changes) -> "ServerSettings":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None, **overrides) -> "ServerSettings":
        """Settings from ``RAGSPEC_*`` variables (see :data:`ENV_VARS`; ``RAGSPEC_DATASTORES``
        is ``NAME=DIR,NAME=DIR``), then ``overrides`` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for var, name in ENV_VARS.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            if name in ("port", "max_queue", "max_active"):
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{var} must be an integer, got {raw!r}") from None
            elif name == "datastores":
                values[name] = tuple(parse_datastore(s.strip()) for s in raw.split(",") if s.strip())
            else:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "datastores" in values:
            values["datastores"] = tuple(tuple(x) for x in values["datastores"])
        return cls(**values)
