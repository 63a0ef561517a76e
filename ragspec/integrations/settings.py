"""Settings of the REST service (``ragspec serve``), from arguments or environment variables.

Importing this module is cheap (no FastAPI, no torch): the CLI reads it at every start.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

from ragspec.config import check_drafting
from ragspec.errors import ConfigError, ResponseLogError
from ragspec.jsonl import check_log_path

if TYPE_CHECKING:
    from ragspec.serving import ServingConfig

__all__ = ["ServerSettings", "RequestLimits", "parse_datastore", "ENV_VARS"]

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
    "RAGSPEC_NUMERICS": "numerics",
    "RAGSPEC_DRAFTING": "drafting",
    "RAGSPEC_API_KEY": "api_key",
    "RAGSPEC_ADMIN_KEY": "admin_key",
    "RAGSPEC_MAX_QUEUE": "max_queue",
    "RAGSPEC_MAX_ACTIVE": "max_active",
    "RAGSPEC_MAX_STEP_TOKENS": "max_step_tokens",
    "RAGSPEC_THROUGHPUT_SLACK": "throughput_slack",
    "RAGSPEC_PREFILL_CHUNK_TOKENS": "prefill_chunk_tokens",
    "RAGSPEC_PREFIX_CACHE_TOKENS": "prefix_cache_tokens",
    "RAGSPEC_MAX_BODY_BYTES": "max_body_bytes",
    "RAGSPEC_MAX_PROMPT_CHARS": "max_prompt_chars",
    "RAGSPEC_MAX_DOCUMENT_CHARS": "max_document_chars",
    "RAGSPEC_MAX_ADD_BYTES": "max_add_bytes",
    "RAGSPEC_DOCS": "docs",
    "RAGSPEC_RESPONSE_CACHE_TOKENS": "response_cache_tokens",
    "RAGSPEC_RESPONSE_LOG": "response_log",
    "RAGSPEC_READ_TIMEOUT": "read_timeout_s",
    "RAGSPEC_MIN_READ_RATE": "min_read_rate",
    "RAGSPEC_MAX_READING": "max_reading",
    "RAGSPEC_MAX_CLIENT_REQUESTS": "max_client_requests",
    "RAGSPEC_PUBLIC_METRICS": "public_metrics",
    "RAGSPEC_RECALIBRATE": "recalibrate",
    "RAGSPEC_MAX_N": "max_n",
    "RAGSPEC_MAX_CHOICE_TOKENS": "max_choice_tokens",
    "RAGSPEC_SMOOTH_STREAMING": "smooth_streaming",
}
_INT_VARS = (
    "port",
    "max_queue",
    "max_active",
    "max_step_tokens",
    "prefill_chunk_tokens",
    "prefix_cache_tokens",
    "max_body_bytes",
    "max_prompt_chars",
    "max_document_chars",
    "max_add_bytes",
    "response_cache_tokens",
    "min_read_rate",
    "max_reading",
    "max_client_requests",
    "max_n",
    "max_choice_tokens",
)
_FLOAT_VARS = ("read_timeout_s", "throughput_slack")
_BOOL_VARS = ("docs", "public_metrics", "recalibrate", "smooth_streaming")
_MIB = 1 << 20
_CHARS_PER_TOKEN = 32
"""Prompt characters allowed per token of context: real text has 3-5 per token, so a text
longer than this cannot fit the context and is refused without being tokenized."""
_DOCUMENT_CHARS_PER_TOKEN = 16
_NO_CONTEXT_TOKENS = 32768  # the limits of a model that declares no context length


@dataclass(frozen=True)
class RequestLimits:
    """What one request may cost, fixed at start-up from the settings and the model's
    context length (see :meth:`ServerSettings.limits`). Sizes in bytes and characters."""

    body_bytes: int
    """Largest request body; more gets 413 before being read."""
    prompt_chars: int
    """Most characters of prompt text; more gets 400 before being tokenized."""
    document_chars: int
    """Most characters of a request's ``documents`` together; more gets 400."""
    json_values: int
    """Most JSON values (numbers, strings, ...) in a body; more gets 400 before parsing."""


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
    numerics: str = "exact"
    """The target's arithmetic: "exact" (float32, greedy output token-identical to
    transformers') or "fast" (opt-in: int8 activations, AVX-512 VNNI; see
    :data:`ragspec.config.NUMERICS`)."""
    drafting: str = "auto"
    """How retrieval and the EAGLE head share a step: "auto" (merged on CUDA, retrieval on a
    CPU), "merged", "select" or "retrieval" (:func:`ragspec.loading.resolve_drafting`)."""
    api_key: Optional[str] = None
    """When set, ``/v1/*`` requests (and ``/metrics`` unless ``public_metrics``) need
    ``Authorization: Bearer <key>``: one key, or several separated by commas, one per
    tenant (each key its own cache partition and its own share of the queue)."""
    admin_key: Optional[str] = None
    """Keys that may also write: add documents to the served datastores (``POST
    /v1/datastores/{name}/documents``) and see their sizes (``GET /v1/datastores``); one,
    or several separated by commas. They are API keys too (tenants of their own). When the
    server has keys, a key not given here cannot write (403); a server without any key
    lets every client write."""
    max_active: int = 8
    """Generations interleaved step by step by the worker."""
    max_queue: int = 32
    """Requests waiting beyond the active ones; more get 429 with ``Retry-After``."""
    max_step_tokens: int = 512
    """Token budget of one worker step (prefill chunk tokens + verification rows of all
    active generations): a waiting request starts only while it fits (one always runs)."""
    throughput_slack: float = 0.05
    """How much throughput the scheduler may give up for latency under load: the decode
    groups (:mod:`ragspec.grouping`) may end up to this share of the busy period later than
    starting every waiting request at once (0.05: at least ~95% of that throughput; 0: the
    soonest-ending schedule; larger: less waiting, counted as the sum of squared times from
    arrival to completion, for less throughput; the median can rise). The composer's default
    (:attr:`~ragspec.scheduling.ComposerConfig.throughput_slack`). Never changes an output."""
    prefill_chunk_tokens: int = 256
    """Prompt tokens prefilled per step (chunked prefill; 0 = whole prompts at once)."""
    prefix_cache_tokens: int = 4096
    """Prefix caching: KV entries of up to this many prompt tokens (whole chunks) kept across
    requests, so prompts that begin alike (the same documents, system prompt or earlier
    turns) skip that prefill, output unchanged (:mod:`ragspec.prefix_cache`; 0 = off)."""
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
    max_body_bytes: Optional[int] = None
    """Largest request body in bytes; a larger one gets 413 before it is read (by its
    ``Content-Length``, or as soon as that much arrived). None: sized to the context length,
    4 bytes (UTF-8's longest character) per allowed prompt or document character, at least
    1 MiB: 1.5 MiB for an 8192-token context."""
    max_prompt_chars: Optional[int] = None
    """Most characters of a prompt's text: a completion prompt, a chat's message contents
    together, a summary's documents and instruction. More cannot fit the context (real text
    has 3-5 characters per token) and gets 400 without being tokenized. None: 32 per token
    of context (262,144 for 8192 tokens)."""
    max_document_chars: Optional[int] = None
    """Most characters of a completion's or chat's ``documents`` (texts the drafter may copy
    from) together; they are tokenized and indexed for every request. None: 16 per token of
    context (131,072 for 8192 tokens)."""
    max_add_bytes: int = 8 * _MIB
    """Largest body of a ``POST /v1/datastores/{name}/documents`` call (the documents it
    adds to a served datastore); more gets 413 before it is read. 0: runtime additions
    off (403)."""
    docs: bool = True
    """Serve ``/docs``, ``/redoc`` and ``/openapi.json`` (behind the API key when one is
    set); False: not at all."""
    response_cache_tokens: int = 1_000_000
    """Tokens of the server's own earlier responses kept to draft from
    (:mod:`ragspec.drafters.response_cache`: repeated and similar questions copy earlier
    answers; least recently used evicted); 0: no response cache."""
    response_log: Optional[str] = None
    """A JSON-lines file the response cache is loaded from at start (when it exists; bad
    lines skipped with a warning) and appended to as answers finish (fsynced at least every
    second: a crash loses at most the last second), compacted at start and at shutdown
    (``ragspec datastore add --from-log`` makes it a datastore shard)."""
    prepare_threads: int = 2
    """Threads that parse, validate and tokenize requests, off the event loop and the
    worker (a request's cost there is bounded by the limits above)."""
    read_timeout_s: float = 10.0
    """Seconds a request's body may take to arrive, plus one second per ``min_read_rate``
    bytes received (Apache's mod_reqtimeout rule); a body still arriving past that gets 408
    and the connection is closed, so a client trickling bytes holds nothing for long."""
    min_read_rate: int = 1024
    """Bytes per second a body must average beyond ``read_timeout_s`` (see there)."""
    max_reading: int = 64
    """Requests whose body is being read at once, apart from the queue: a request takes
    its place in the queue (``max_active + max_queue``) only once its body is read and
    parsed; more readers get 429. Memory: at most this many bodies of ``max_body_bytes``."""
    max_client_requests: Optional[int] = None
    """Requests one client (its API key when keys are set, else its address) may have in
    the server at once, being read, queued or generated; more get 429. None: three
    quarters of ``max_active + max_queue`` (no limit below 4 places: too few to share), so
    one client never takes every place; 0: no per-client limit (e.g. behind a proxy that
    hides the clients' addresses)."""
    public_metrics: bool = False
    """Serve ``/metrics`` without the API key (it counts every tenant's traffic)."""
    recalibrate: bool = False
    """Measure the latency table even where one measured on this machine, model, dtype,
    threads and kernel build is cached (:mod:`ragspec.calibration_cache`)."""

    max_n: int = 8
    """Most choices (``n``) of one request; each takes a place among ``max_active +
    max_queue``. More gets 400 naming ``n``."""
    max_choice_tokens: int = 32768
    """Most tokens one request may ask for over all its choices (``n`` x ``max_tokens``);
    more gets 400 naming ``n``."""
    smooth_streaming: bool = False
    """Default of a request's ``smooth_streaming``: stream one token per event (each step
    commits a run of accepted tokens; its events then come one token at a time) instead
    of one event per step."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.numerics not in ("exact", "fast"):
            raise ConfigError(f"numerics must be 'exact' or 'fast', got {self.numerics!r}")
        check_drafting(self.drafting)
        if self.max_active < 1:
            raise ConfigError(f"max_active must be >= 1, got {self.max_active}")
        if self.max_step_tokens < 1:
            raise ConfigError(f"max_step_tokens must be >= 1, got {self.max_step_tokens}")
        if not 0 <= self.throughput_slack <= 10:
            raise ConfigError(
                f"throughput_slack (--throughput-slack, RAGSPEC_THROUGHPUT_SLACK) must be a number from 0 to 10, "
                f"got {self.throughput_slack}"
            )
        if self.prefill_chunk_tokens < 0:
            raise ConfigError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        if self.prefix_cache_tokens < 0:
            raise ConfigError(f"prefix_cache_tokens must be >= 0, got {self.prefix_cache_tokens}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key is empty")
        for name in ("max_body_bytes", "max_prompt_chars", "max_document_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if self.max_add_bytes < 0:
            raise ConfigError(f"max_add_bytes must be >= 0, got {self.max_add_bytes}")
        if self.response_cache_tokens < 0:
            raise ConfigError(f"response_cache_tokens must be >= 0, got {self.response_cache_tokens}")
        if self.prepare_threads < 1:
            raise ConfigError(f"prepare_threads must be >= 1, got {self.prepare_threads}")
        if not self.read_timeout_s > 0:
            raise ConfigError(f"read_timeout_s must be > 0, got {self.read_timeout_s}")
        if self.min_read_rate < 1:
            raise ConfigError(f"min_read_rate must be >= 1 byte/s, got {self.min_read_rate}")
        if self.max_reading < 1:
            raise ConfigError(f"max_reading must be >= 1, got {self.max_reading}")
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_choice_tokens < 1:
            raise ConfigError(f"max_choice_tokens must be >= 1, got {self.max_choice_tokens}")
        if self.max_client_requests is not None and self.max_client_requests < 0:
            raise ConfigError(f"max_client_requests must be >= 0, got {self.max_client_requests}")
        for name in ("api_key", "admin_key"):
            value = getattr(self, name)
            if value is not None and not all(k.strip() for k in value.split(",")):
                raise ConfigError(f"{name} holds an empty key (several keys are separated by commas)")
        names = [n for n, _ in self.datastores]
        if len(set(names)) != len(names):
            raise ConfigError(f"datastore names must be unique, got {names}")
        for n, d in self.datastores:
            parse_datastore(f"{n}={d}")

    def check_files(self) -> None:
        """Check the files the service will write, before the (slow) model load: the
        ``response_log`` path must be usable (:func:`ragspec.jsonl.check_log_path`). Cheap
        (creates and removes a probe file beside the log).

        Raises:
            ResponseLogHeldError: another live process writes the response log (one line
                naming it: one server per log).
            ResponseLogError: the response log is a directory, not a regular file, in a
                missing or unwritable folder (one line naming it).
        """
        if self.response_log and self.response_cache_tokens > 0:
            check_log_path(self.response_log, ResponseLogError, "--response-log")
            from ragspec.drafters.response_journal import check_log_free

            check_log_free(self.response_log)

    def check_inputs(self) -> None:
        """Check every path and option the service loads or writes, in seconds and before
        the (slow) model load: the files it writes (:meth:`check_files`), then what it
        loads (the model, device, dtype, numerics, EAGLE head and every datastore:
        :func:`ragspec.serving.check_config`). Imports torch.

        Raises:
            ResponseLogError, ModelNotFoundError, ModelLoadError, DatastoreError, ConfigError:
                as those two say (one line naming the option or datastore).
        """
        self.check_files()
        from ragspec.serving import check_config

        check_config(self.serving_config())

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys, the admin keys included (none: no key needed)."""
        keys = tuple(k.strip() for k in self.api_key.split(",")) if self.api_key is not None else ()
        return keys + tuple(k for k in self.admin_keys if k not in keys)

    @property
    def admin_keys(self) -> tuple[str, ...]:
        """The keys that may write to the served datastores (``admin_key``)."""
        return tuple(k.strip() for k in self.admin_key.split(",")) if self.admin_key is not None else ()

    @property
    def client_limit(self) -> int:
        """Requests one client may have in the server at once (0: no limit); see
        ``max_client_requests``."""
        if self.max_client_requests is not None:
            return self.max_client_requests
        places = self.max_active + self.max_queue
        return places * 3 // 4 if places >= 4 else 0

    def replace(self, **changes) -> "ServerSettings":
        return dataclasses.replace(self, **changes)

    def serving_config(self) -> "ServingConfig":
        """What this service loads (model, engine settings, datastores, response cache), for
        :mod:`ragspec.serving`."""
        from ragspec.config import PolicyConfig
        from ragspec.serving import ServingConfig

        return ServingConfig(
            model=self.model,
            device=self.device,
            dtype=self.dtype,
            eagle=self.eagle,
            numerics=self.numerics,
            drafting=self.drafting,
            policy=PolicyConfig(
                max_draft_tokens=self.max_draft_tokens,
                adaptive=self.adaptive,
                prefill_chunk_tokens=self.prefill_chunk_tokens,
                prefix_cache_tokens=self.prefix_cache_tokens,
            ),
            calibrate=self.calibrate,
            recalibrate=self.recalibrate,
            datastores=self.datastores,
            response_cache_tokens=self.response_cache_tokens,
            response_log=self.response_log,
        )

    def limits(self, context_length: Optional[int]) -> RequestLimits:
        """The request limits for a model of ``context_length`` tokens (None: unknown, taken
        as 32768): the settings where given, else sized to the context (see the fields)."""
        tokens = context_length or _NO_CONTEXT_TOKENS
        prompt = self.max_prompt_chars or _CHARS_PER_TOKEN * tokens
        documents = self.max_document_chars or _DOCUMENT_CHARS_PER_TOKEN * tokens
        body = self.max_body_bytes or max(_MIB, 4 * (prompt + documents))
        # a prompt of token ids needs one value per token; nothing else needs many
        values = max(1 << 16, 2 * tokens)
        return RequestLimits(body_bytes=body, prompt_chars=prompt, document_chars=documents, json_values=values)

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
            if name in _INT_VARS:
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ConfigError(f"{var} must be an integer, got {raw!r}") from None
            elif name in _FLOAT_VARS:
                try:
                    values[name] = float(raw)
                except ValueError:
                    raise ConfigError(f"{var} must be a number, got {raw!r}") from None
            elif name in _BOOL_VARS:
                if raw.strip().lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ConfigError(f"{var} must be true or false, got {raw!r}")
                values[name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif name == "datastores":
                values[name] = tuple(parse_datastore(s.strip()) for s in raw.split(",") if s.strip())
            else:
                values[name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "datastores" in values:
            values["datastores"] = tuple(tuple(x) for x in values["datastores"])
        return cls(**values)
