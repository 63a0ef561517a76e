"""Serving's engine assembly: the engine a server serves (one engine for every named
datastore over the same model, and the cache of the server's own responses), and the
datastore additions it serves from.

The REST service (``ragspec serve``, :func:`ragspec.integrations.server.create_app`) and
each Ray Serve replica (:mod:`ragspec.integrations.ray`) build what they serve here, from a
:class:`ServingConfig` (:meth:`ragspec.integrations.settings.ServerSettings.serving_config`
makes one from the service's settings). Engines come from :mod:`ragspec.loading`, the one
builder of engines: a request names the datastore it drafts from
(``RequestParams.datastore``); documents added to a datastore are served through
:func:`serve_datastore`, the one place a datastore is swapped in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

from .config import AUTO_DRAFTING, PolicyConfig
from .datastore import Datastore, DatastoreInfo, add_texts_to_datastore
from .deprecation import warn_deprecated
from .drafters.response_cache import ResponseCache
from .engine import Engine
from .errors import ConfigError, DatastoreError, DatastoreNotFoundError, ResponseLogHeldError
from .loading import engine_over, load_engine, open_datastores

logger = logging.getLogger(__name__)

__all__ = [
    "ServingConfig",
    "ServingEngines",
    "load_serving_engine",
    "serve_engine",
    "add_to_datastore",
    "serve_datastore",
    "open_response_cache",
    "close_response_log",
    "load_serving",
    "datastore_engines",
    "add_documents",
    "check_config",
]


@dataclass(frozen=True)
class ServingConfig:
    """What a serving process loads: the model and its engine's settings, the named
    datastores, the response cache. The fields mean what the same fields of
    :class:`ragspec.integrations.settings.ServerSettings` mean."""

    model: Optional[str] = None
    """Registry name, GGUF file or HF folder (None = the default model)."""
    device: Optional[str] = None
    """Torch device (None: cuda when present, else cpu)."""
    dtype: Optional[str] = None
    """fp32, bf16, fp16 (None: the model loader's default)."""
    eagle: Optional[str] = "auto"
    """EAGLE head directory; "auto": the head shipped for the model, if any; "none": none."""
    numerics: str = "exact"
    """The target's arithmetic, "exact" or "fast" (:data:`ragspec.config.NUMERICS`)."""
    drafting: str = AUTO_DRAFTING
    """How retrieval and the head share a step (:func:`ragspec.loading.resolve_drafting`)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Draft sizes, prefill chunks, prefix caching."""
    calibrate: bool = True
    """Measure the forward latency table at start-up (a few seconds; a table measured on
    the same machine, model, dtype, threads and kernel build is reused from the cache)."""
    recalibrate: bool = False
    """Measure it even where a cached table fits (:mod:`ragspec.calibration_cache`)."""
    datastores: tuple[tuple[str, str], ...] = ()
    """(name, directory) of each datastore requests may name."""
    response_cache_tokens: int = 1_000_000
    """Tokens of earlier responses kept to draft from (0: no response cache)."""
    response_log: Optional[str] = None
    """JSON-lines file the response cache is loaded from at start, when it exists."""
    response_log_spread: bool = False
    """Several processes of one service share ``response_log`` (Ray Serve replicas): each
    journals to the first of ``LOG``, ``LOG.1``, ``LOG.2``, ... that no live process holds
    (one writer per log)."""


@dataclass(frozen=True)
class ServingEngines:
    """What a serving process serves: the engine (every named datastore, the response
    cache among its drafters) and the response cache (None: none), which the server
    journals and saves."""

    engine: Engine
    response_cache: Optional[ResponseCache]

    @property
    def datastore_engines(self) -> dict[str, Engine]:
        """Deprecated: one engine serves every datastore (a request names it); this maps
        each datastore's name to that one engine."""
        warn_deprecated("ServingEngines.datastore_engines", "engine.datastores (one engine serves every datastore)")
        return {name: self.engine for name in self.engine.datastores}


def check_config(config: ServingConfig) -> None:
    """Check, in seconds and before any model loads, what :func:`load_serving` would only
    find wrong after the load: the model names something loadable, the device and dtype
    parse (and CUDA is there when asked for), ``numerics="fast"`` has a GGUF model where it
    needs one, an EAGLE head folder is a head folder, every datastore opens (sizes and the
    manifest; the tokenizer is checked at load). Nothing is loaded or kept open.

    Raises:
        ModelNotFoundError: the model is not fetched, or no such path.
        ConfigError: a bad device or dtype, or ``numerics="fast"`` on a CPU without a GGUF model.
        ModelLoadError: ``eagle`` names a folder that is not an EAGLE head.
        DatastoreError: a datastore directory is missing or not a datastore (the message
            names the datastore).
    """
    from .eagle.head import read_head_config
    from .models import resolve_device, resolve_dtype, resolve_model

    spec = resolve_model(config.model)
    device = resolve_device(config.device)
    resolve_dtype(config.dtype, device)
    if config.numerics == "fast" and device.type == "cpu" and spec.kind != "gguf":
        raise ConfigError(f"--numerics fast needs a GGUF model on a CPU; {spec.path} is a transformers folder")
    if config.eagle and str(config.eagle).lower() not in ("auto", "none"):
        read_head_config(config.eagle)
    for name, directory in config.datastores:
        try:
            Datastore.open(directory).close()
        except DatastoreError as e:
            if name == directory:  # a datastore named by its folder: the message names it
                raise
            raise type(e)(f"datastore {name!r}: {e}") from e


def load_serving_engine(config: ServingConfig) -> Engine:
    """The served engine: ``config``'s model with its EAGLE head, drafting, policy and
    calibration and its named datastores (the first the default of requests naming none),
    through :func:`ragspec.loading.load_engine`, drafting from its response cache too
    (:func:`open_response_cache`; no second load: :func:`serve_engine`).

    Raises:
        ModelNotFoundError, ModelLoadError, EagleHeadMismatchError, DatastoreError,
            ConfigError: as :func:`ragspec.loading.load_engine`.
        ResponseLogHeldError, ResponseLogError: as :func:`open_response_cache`.
    """
    engine = load_engine(
        config.model,
        config.device,
        config.dtype,
        datastores=config.datastores,
        eagle=config.eagle,
        policy=config.policy,
        calibrate=config.calibrate,
        recalibrate=config.recalibrate,
        numerics=config.numerics,
        drafting=config.drafting,
    )
    cache = open_response_cache(
        engine, config.response_cache_tokens, config.response_log, spread=config.response_log_spread
    )
    return serve_engine(engine, engine.datastores, cache)


def serve_engine(
    engine: Engine, datastores: Mapping[str, Datastore], response_cache: Optional[ResponseCache]
) -> Engine:
    """A ready ``engine`` (built by the caller) as a server serves it: ``engine`` itself
    when it already drafts from ``datastores`` (none given: its own) and
    ``response_cache``, else the engine over its model drafting from them
    (:func:`ragspec.loading.engine_over`; no model loaded).

    Raises:
        ConfigError: as :func:`ragspec.loading.engine_over`.
    """
    named = dict(datastores) or dict(engine.datastores)
    if named == dict(engine.datastores) and response_cache is engine.parts.response_cache:
        return engine
    return engine_over(engine, named, response_cache)


def add_to_datastore(engine: Engine, name: str, texts: Sequence[str], source: str = "<texts>") -> DatastoreInfo:
    """Add ``texts`` (one document each) to ``engine``'s datastore ``name``, on disk and
    atomically (:func:`ragspec.datastore.add_texts_to_datastore`: a new shard, then the
    manifest replaced; a crash leaves the datastore as it was), then serve it reopened (the
    shards it held shared, the new one opened: :func:`serve_datastore`). Requests already
    started keep drafting from it as it was. ``source``: the new shard's source record.
    Returns the datastore's new info. (The server adds through the datastore's writer,
    :class:`ragspec.datastore.live.DatastoreWriter`, which serves each copy the same way.)

    Raises:
        DatastoreNotFoundError: ``engine`` has no datastore of that name.
        EmptyCorpusError, DatastoreInputError: no text, or a bad one (empty, binary, not
            valid Unicode); nothing is written.
        DatastoreError: the datastore is damaged or gone.
    """
    if name not in engine.datastores:
        raise DatastoreNotFoundError(name, tuple(engine.datastores))
    old = engine.datastores[name]
    add_texts_to_datastore(old.path, texts, engine.tokenizer, source=source)
    new = old.reopen()  # the shards ``old`` holds are shared, only the new one is opened
    serve_datastore(engine, name, new)
    logger.info("datastore %s: %d documents added, now %d", old.path, len(texts), new.num_documents)
    return new.info()


def serve_datastore(engine: Engine, name: str, datastore: Datastore) -> None:
    """Serve ``datastore`` (a new copy of ``engine``'s datastore ``name``: reopened after an
    addition, merged) from now on: the one place a served datastore is replaced
    (:meth:`Engine.swap_datastore`: its drafter composed again, no model loaded; requests
    already started keep the copy they drafted from).

    Raises:
        DatastoreNotFoundError: ``engine`` has no datastore of that name.
    """
    engine.swap_datastore(name, datastore)


def datastore_engines(engine: Engine, datastores: Sequence[tuple[str, str]]) -> dict[str, Engine]:
    """Deprecated: one engine serves every datastore (a request names it:
    ``RequestParams.datastore``); build it with :func:`ragspec.loading.load_engine`'s
    ``datastores`` or :func:`serve_engine`. This returns one engine per named datastore
    ``(name, directory)`` over ``engine``'s model (no model loaded).

    Raises:
        DatastoreError: a directory is not a datastore, or was built with another tokenizer.
    """
    warn_deprecated(
        "ragspec.serving.datastore_engines",
        "one engine with every datastore (load_engine(datastores=...), serve_engine), each request naming "
        "its own (RequestParams.datastore)",
    )
    opened = open_datastores(datastores, engine.tokenizer)
    cache = engine.parts.response_cache
    return {name: engine_over(engine, {name: ds}, cache) for name, ds in opened.items()}


def add_documents(engine: Engine, texts: Sequence[str], source: str = "<texts>") -> tuple[Engine, DatastoreInfo]:
    """Deprecated: :func:`add_to_datastore` (by the datastore's name). Adds ``texts`` to the
    default datastore of ``engine`` and serves it reopened there; returns ``engine`` and the
    datastore's new info.

    Raises:
        ConfigError: ``engine`` drafts from no datastore.
        EmptyCorpusError, DatastoreInputError, DatastoreError: as :func:`add_to_datastore`.
    """
    warn_deprecated("ragspec.serving.add_documents", "ragspec.serving.add_to_datastore(engine, name, texts)")
    name = engine.default_datastore
    if name is None:
        raise ConfigError("this engine drafts from no named datastore")
    return engine, add_to_datastore(engine, name, texts, source)


def open_response_cache(
    engine: Engine, max_tokens: int, log: Optional[str] = None, *, spread: bool = False
) -> Optional[ResponseCache]:
    """The cache of a server's own responses, holding up to ``max_tokens`` tokens (None when
    ``max_tokens`` is 0 or less), with the responses of the JSON-lines file ``log``; new
    responses are appended to that log as they finish (``ResponseCache.open_journal``: the
    log locked to this process, bad lines skipped with a warning, the log compacted; closed
    by ``close_response_log``). ``spread``: take the first of ``log``, ``log.1``, ...,
    ``log.63`` that no live process holds (replicas of one service).

    Raises:
        ResponseLogHeldError: another live process writes ``log`` (with ``spread``: all 64).
        ResponseLogError: the log path is unusable, or the log holds another model's responses.
    """
    if max_tokens <= 0:
        return None
    cache = ResponseCache(max_tokens, model=engine.model_name or "")
    if log:
        vocab = engine.target.vocab_size
        for i in range(64 if spread else 1):
            path = log if i == 0 else f"{log}.{i}"
            try:
                n = cache.open_journal(path, vocab_size=vocab)
            except ResponseLogHeldError:
                if not spread or i == 63:
                    raise
                continue
            logger.info("response cache: %d responses (%d tokens) from %s", n, cache.num_tokens, path)
            break
    return cache


def close_response_log(cache: ResponseCache, path: str) -> int:
    """At shutdown: the response log's journal closed (its last answers written, the log
    compacted), or a cache given without one saved to ``path``. Returns the responses written."""
    return cache.close_journal() if cache.journal is not None else cache.save(path)


def load_serving(config: ServingConfig) -> ServingEngines:
    """The engine ``config`` names, with its datastores and response cache
    (:func:`load_serving_engine`), and that cache.

    Raises:
        what :func:`load_serving_engine` raises.
    """
    engine = load_serving_engine(config)
    return ServingEngines(engine=engine, response_cache=engine.parts.response_cache)
