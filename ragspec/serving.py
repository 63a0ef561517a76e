"""Serving's engine assembly: the engine a server serves, one engine per named datastore
over the same model, and the cache of the server's own responses.

The REST service (``ragspec serve``, :func:`ragspec.integrations.server.create_app`) and
each Ray Serve replica (:mod:`ragspec.integrations.ray`) build what they serve here, from a
:class:`ServingConfig` (:meth:`ragspec.integrations.settings.ServerSettings.serving_config`
makes one from the service's settings). Engines come from :mod:`ragspec.loading`, the one
builder of engines; nothing here loads a model twice: the datastore engines and the
response cache reuse the loaded model and backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .config import AUTO_DRAFTING, PolicyConfig
from .datastore import Datastore, DatastoreInfo, add_texts_to_datastore
from .drafters.response_cache import ResponseCache
from .engine import Engine
from .errors import ConfigError, DatastoreError, ResponseLogHeldError
from .loading import load_engine, with_datastore

logger = logging.getLogger(__name__)

__all__ = [
    "ServingConfig",
    "ServingEngines",
    "load_serving_engine",
    "datastore_engines",
    "add_documents",
    "open_response_cache",
    "close_response_log",
    "load_serving",
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
    """What a serving process serves: the engine, the named datastores' engines (same model
    and backend), the response cache (None: none). The engines do not draft from the
    cache yet: the server adds it (:func:`ragspec.loading.with_response_cache`) when it serves them."""

    engine: Engine
    datastore_engines: dict[str, Engine]
    response_cache: Optional[ResponseCache]


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
    calibration, through :func:`ragspec.loading.load_engine` (no datastore: those are
    :func:`datastore_engines`).

    Raises:
        ModelNotFoundError, ModelLoadError, EagleHeadMismatchError, ConfigError: as
            :func:`ragspec.loading.load_engine`.
    """
    return load_engine(
        config.model,
        config.device,
        config.dtype,
        eagle=config.eagle,
        policy=config.policy,
        calibrate=config.calibrate,
        recalibrate=config.recalibrate,
        numerics=config.numerics,
        drafting=config.drafting,
    )


def datastore_engines(engine: Engine, datastores: Sequence[tuple[str, str]]) -> dict[str, Engine]:
    """One engine per named datastore ``(name, directory)``: the same model, backend and
    latency model as ``engine``, the drafter composed as :mod:`ragspec.loading` composes
    it, with that datastore (:func:`ragspec.loading.with_datastore`; no model loaded).

    Raises:
        DatastoreError: a directory is not a datastore, or was built with another tokenizer.
    """
    out: dict[str, Engine] = {}
    for name, directory in datastores:
        ds = Datastore.open(directory, tokenizer=engine.tokenizer)
        out[name] = with_datastore(engine, ds)
        logger.info("datastore %r: %s", name, directory)
    return out


def add_documents(engine: Engine, texts: Sequence[str], source: str = "<texts>") -> tuple[Engine, DatastoreInfo]:
    """Add ``texts`` (one document each) to the datastore ``engine`` drafts from, on disk
    and atomically (:func:`ragspec.datastore.add_texts_to_datastore`: a new shard, then the
    manifest replaced; a crash leaves the datastore as it was), and return an engine
    drafting from the datastore reopened with them (same model, backend, lookup settings
    and drafter composition, response cache included: :func:`ragspec.loading.with_datastore`;
    no model loaded) and the datastore's new info. ``engine`` is left as it is: the requests
    that hold it keep drafting from the datastore as it was. ``source``: the new shard's
    source record.

    Raises:
        ConfigError: ``engine`` drafts from no datastore.
        EmptyCorpusError, DatastoreInputError: no text, or a bad one (empty, binary, not
            valid Unicode); nothing is written.
        DatastoreError: the datastore is damaged or gone.
    """
    old = engine.datastore
    if old is None:
        raise ConfigError("this engine drafts from no datastore")
    add_texts_to_datastore(old.path, texts, engine.tokenizer, source=source)
    new = old.reopen()  # the shards ``old`` holds are shared, only the new one is opened
    logger.info("datastore %s: %d documents added, now %d", old.path, len(texts), new.num_documents)
    return with_datastore(engine, new), new.info()


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
    """The engine, the datastores' engines and the response cache ``config`` names, loaded
    in that order (:func:`load_serving_engine`, :func:`datastore_engines`,
    :func:`open_response_cache`).

    Raises:
        what those raise (a model, head, datastore or response log that does not load).
    """
    engine = load_serving_engine(config)
    variants = datastore_engines(engine, config.datastores)
    cache = open_response_cache(
        engine, config.response_cache_tokens, config.response_log, spread=config.response_log_spread
    )
    return ServingEngines(engine=engine, datastore_engines=variants, response_cache=cache)
