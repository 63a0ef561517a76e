"""The one builder of engines: model, backend and its speed-ups, datastore, EAGLE head,
drafter composition, latency calibration, EOS ids.

Front ends (the CLI, the server, LangChain, ``ragspec eagle``, the examples) build engines
only through :func:`load_engine`; an engine for another datastore over the same model comes
from :func:`with_datastore` (no reload). Nothing is set on an engine after construction.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import torch

from .config import AUTO_DRAFTING, DRAFTING_MODES, NUMERICS, PLDConfig, PolicyConfig, check_drafting
from .drafters.base import CompositeDrafter, Drafter
from .drafters.merged import MergedDrafter
from .drafters.prompt_lookup import PromptLookupDrafter
from .drafters.response_cache import ResponseCache, ResponseCacheDrafter
from .drafters.selecting import SelectingDrafter
from .engine import DrafterParts, Engine
from .errors import ConfigError
from .policy import LatencyModel

if TYPE_CHECKING:
    from .backend.base import Target
    from .backend.hf import HFTarget
    from .datastore import Datastore
    from .eagle import EagleDrafter, EagleTreeConfig
    from .models import ModelSpec

logger = logging.getLogger(__name__)

__all__ = [
    "DRAFTING_MODES",
    "load_engine",
    "engine_for_target",
    "load_target",
    "load_eagle",
    "compose_drafter",
    "with_datastore",
    "with_response_cache",
    "with_drafting",
    "AUTO_DRAFTING",
    "resolve_drafting",
]


def resolve_drafting(drafting: str, device: torch.device) -> str:
    """The drafting mode ``drafting`` names on ``device``: ``"auto"`` is ``"merged"`` on
    CUDA and ``"retrieval"`` elsewhere; any mode of :data:`DRAFTING_MODES` is itself.

    Why ``"retrieval"`` on a CPU: there the shipped head's proposal costs about a third of a
    target step (a level ~0.8 ms: its layer 0.25 ms, the draft-vocabulary logits and top-k
    0.35 ms, Python the rest; the root's level 0.22 ms) against a 6-7 ms step whose extra
    verification rows cost ~1.2 ms each, so its nodes rarely pay. Measured on the 2-core
    Xeon, 3 dev prompts x 6 categories, 128 tokens, interleaved in one ``ragspec bench
    --draft-budgets 8,0 --also-drafting retrieval`` run, twice: decode-phase gain over
    drafting off 1.16x / 1.16x with retrieval alone against 1.08x / 1.09x merged, retrieval
    as fast or faster in every category (``docs/bench/issue22-retrieval-vs-merged-run{1,2}.json``).
    On CUDA a head level is a small part of a step, as in EAGLE's own measurements.

    Raises:
        ConfigError: ``drafting`` is neither ``"auto"`` nor one of :data:`DRAFTING_MODES`.
    """
    if check_drafting(drafting) == AUTO_DRAFTING:
        return "merged" if torch.device(device).type == "cuda" else "retrieval"
    return drafting


def load_target(
    model: Optional[str] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    *,
    cache: Optional[Union[str, Path]] = None,
    cpu_kernels: Optional[bool] = None,
    numerics: str = "exact",
) -> tuple["HFTarget", Any, "ModelSpec"]:
    """Load a model (registry name, GGUF file or HF folder; None = the default model) into
    the transformers backend, with its speed-ups installed
    (:meth:`~ragspec.backend.hf.HFTarget.speed_up`).

    ``numerics``: ``"exact"`` (default) or ``"fast"`` (:data:`ragspec.config.NUMERICS`).

    Returns:
        (target, tokenizer, model spec).

    Raises:
        ModelNotFoundError: the model is not fetched / the path does not exist.
        ModelLoadError: the file is broken.
        ConfigError: ``numerics="fast"`` where it cannot be served (not a GGUF model, no
            compiled kernel, a CPU without AVX-512 VNNI).
    """
    from . import models
    from .backend.hf import HFTarget

    spec = models.resolve_model(model, cache=Path(cache) if cache else None)
    hf_model, tokenizer = models.load_model(spec, device=device, dtype=dtype)
    target = HFTarget(hf_model)
    if numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    target.speed_up(cpu_kernels, cache=cache, gguf=spec.gguf_file, numerics=numerics)
    return target, tokenizer, spec


def load_eagle(
    eagle: Optional[Union[str, Path]],
    target: "HFTarget",
    spec: Optional["ModelSpec"] = None,
    tree: Optional["EagleTreeConfig"] = None,
) -> tuple[Optional["EagleDrafter"], Optional[str]]:
    """The EAGLE head an ``eagle`` option names (a folder; ``"auto"``: the head shipped for
    this model when its fingerprint matches; None/``""``/``"none"``: none) as a drafter.

    Returns:
        (drafter or None, the head's folder or None).

    Raises:
        ModelLoadError: not a head folder, unreadable weights.
        EagleHeadMismatchError: the head was trained for another model.
    """
    from .eagle import EagleDrafter, EagleTreeConfig, load_eagle_head, resolve_head

    path = resolve_head(eagle, target, spec)
    if path is None:
        return None, None
    head = load_eagle_head(path, target=target, model_spec=spec)
    return EagleDrafter(head, target, tree or EagleTreeConfig()), str(path)


def compose_drafter(
    pld: Optional[PLDConfig],
    datastores: Sequence["Datastore"] = (),
    eagle: Optional["EagleDrafter"] = None,
    response_cache: Optional[ResponseCache] = None,
    drafting: str = "merged",
) -> Optional[Drafter]:
    """Retrieval (prompt lookup, then each datastore, then the response cache: the longest
    suffix match wins) and, with a head, retrieval and the head together as ``drafting``
    says (:data:`DRAFTING_MODES`). None when there is nothing to draft with.

    Raises:
        ConfigError: an unknown ``drafting``.
    """
    if drafting not in DRAFTING_MODES:
        raise ConfigError(f"unknown drafting mode {drafting!r}: use one of {', '.join(DRAFTING_MODES)}")
    retrieval: list[Drafter] = [PromptLookupDrafter(pld)] if pld is not None else []
    if datastores:
        from .datastore import DatastoreDrafter

        retrieval.extend(DatastoreDrafter(ds) for ds in datastores)
    if response_cache is not None:
        retrieval.append(ResponseCacheDrafter(response_cache))
    base: Optional[Drafter] = None
    if len(retrieval) == 1:
        base = retrieval[0]
    elif retrieval:
        base = CompositeDrafter(retrieval)
    if eagle is None or drafting == "retrieval":
        return base
    if base is None:
        return eagle
    if drafting == "select":
        # retrieval when its match is worth more than the head's draft (calibrated per
        # request), the head otherwise
        return SelectingDrafter(base, eagle)
    # one tree: retrieval's, the head's, and retrieval's copies after the head's tokens
    return MergedDrafter(base, eagle)


def load_engine(
    model: Optional[str] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    *,
    datastore: Optional[Union[str, Path]] = None,
    eagle: Optional[Union[str, Path]] = "auto",
    pld: PLDConfig = PLDConfig(),
    policy: PolicyConfig = PolicyConfig(),
    calibrate: bool = True,
    cache: Optional[Union[str, Path]] = None,
    cpu_kernels: Optional[bool] = None,
    drafting: str = AUTO_DRAFTING,
    numerics: str = "exact",
    recalibrate: Optional[bool] = None,
) -> Engine:
    """Load a model and build an engine with prompt-lookup drafting, plus a datastore and
    an EAGLE head when given.

    Args:
        model: registry name (``smollm2-135m-instruct``, ``gemma3-270m``), a GGUF file or
            a local HF folder; None = the default model.
        device: ``cpu``, ``cuda``, ``cuda:1`` ... (default: CUDA when present).
        dtype: ``fp32``, ``bf16``, ``fp16`` (default: bf16 on CUDA, fp32 on CPU).
        datastore: a datastore folder (``ragspec datastore build``).
        eagle: a head folder; ``"auto"`` (default) the head shipped with ragspec for this
            model when there is one and its fingerprint matches (one ships for the default
            model), else none; None, ``""`` or ``"none"``: no head.
        pld: prompt-lookup settings.
        policy: draft-size settings.
        calibrate: measure the target's forward latency at start-up (a few seconds), or
            reuse the table measured on the same machine, model, dtype, threads and kernel
            build (:mod:`ragspec.calibration_cache`, under ``<cache>/calibration/``); else
            the reference CPU's table until refined online.
        cache: ragspec's cache folder (default ``$RAGSPEC_CACHE`` or ``~/.cache/ragspec``).
        cpu_kernels: on a CPU with float32 weights, route the model's few-row linear
            layers and attention through ragspec's compiled kernels and, for a GGUF model,
            read the weights it holds in Q4_1/Q8_0/Q5_0/Q4_K/Q6_K blocks from those blocks
            (the same output bit for bit). None (default): on unless ``RAGSPEC_CPU_KERNELS=0``.
        drafting: how retrieval and the head share a step (:data:`DRAFTING_MODES`);
            ``"auto"`` (default): ``"merged"`` on CUDA, ``"retrieval"`` elsewhere
            (:func:`resolve_drafting`; the head stays loaded, :func:`with_drafting`
            switches to it without loading anything).
        numerics: the target's arithmetic, ``"exact"`` (default: float32, greedy output
            token-identical to transformers') or ``"fast"`` (opt-in: int8 activations in
            the GGUF-block linears on a CPU with AVX-512 VNNI; speculative == plain within
            the mode; :data:`ragspec.config.NUMERICS`).
        recalibrate: with ``calibrate``, measure even where a cached table fits (None: when
            ``RAGSPEC_RECALIBRATE`` is 1/true/yes/on).

    Raises:
        ModelNotFoundError: the model is not fetched / the path does not exist.
        ModelLoadError: the file is broken.
        DatastoreError: the datastore cannot be opened for this tokenizer.
        EagleHeadMismatchError: the head was trained for another model.
        ConfigError: an unknown ``drafting`` or ``numerics``, or ``numerics="fast"``
            where it cannot be served.
    """
    from . import models

    check_drafting(drafting)  # an unknown mode fails before any load
    target, tokenizer, spec = load_target(model, device, dtype, cache=cache, cpu_kernels=cpu_kernels, numerics=numerics)
    stores = []
    if datastore:
        from .datastore import Datastore

        stores.append(Datastore.open(datastore, tokenizer=tokenizer, warm=True))
    eagle_drafter, eagle_path = load_eagle(eagle, target, spec)
    if eagle_drafter is None and drafting in ("merged", "select"):
        logger.warning(
            "--drafting %s needs an EAGLE head, and none is loaded (--eagle none, or no head shipped for %s): "
            "drafts come from retrieval alone",
            drafting,
            spec.name,
        )
    drafting = resolve_drafting(drafting, target.device)
    latency = _calibrated(target, spec, cache, cpu_kernels, numerics, recalibrate) if calibrate else None
    return Engine(
        target,
        tokenizer,
        drafter=compose_drafter(pld, stores, eagle_drafter, drafting=drafting),
        policy=policy,
        latency=latency,
        eos_token_ids=models.eos_token_ids(target.model, tokenizer),
        model_name=spec.name,
        parts=DrafterParts(
            pld=pld,
            datastore=stores[0] if stores else None,
            eagle=eagle_drafter,
            eagle_path=eagle_path,
            drafting=drafting,
        ),
    )


def _calibrated(
    target: "HFTarget",
    spec: "ModelSpec",
    cache: Optional[Union[str, Path]],
    cpu_kernels: Optional[bool],
    numerics: str,
    recalibrate: Optional[bool],
) -> LatencyModel:
    """The target's measured latency model, from the calibration cache when one measured on
    the same machine, model, dtype, threads and kernel build is there."""
    import os

    from . import models
    from .backend.kernels import kernel_dir
    from .calibration_cache import (
        CalibrationCache,
        CalibrationKey,
        cached_latency,
        files_fingerprint,
        machine_fingerprint,
    )

    if recalibrate is None:
        recalibrate = os.environ.get("RAGSPEC_RECALIBRATE", "").strip().lower() in ("1", "true", "yes", "on")
    folder = Path(cache) if cache else models.cache_dir()
    device = torch.device(target.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    switches = ",".join(
        f"{v}={os.environ.get(v, '')}" for v in ("RAGSPEC_CPU_KERNELS", "RAGSPEC_NATIVE_STEP", "RAGSPEC_CPU_ISA")
    )
    key = CalibrationKey(
        machine=machine_fingerprint(gpu=gpu),
        model=f"{spec.kind}|{spec.sha256 or files_fingerprint(spec.path)}",
        device=str(device),
        dtype=str(target.dtype),
        threads=torch.get_num_threads(),
        kernels=f"{kernel_dir(folder).name}|torch-{torch.__version__}|{numerics}|cpu_kernels={cpu_kernels}|{switches}",
    )
    return cached_latency(
        lambda: LatencyModel.measure(target), key, CalibrationCache(folder / "calibration"), recalibrate
    )


def engine_for_target(
    target: "Target",
    tokenizer,
    *,
    eos_token_ids: Sequence[int] = (),
    pld: PLDConfig = PLDConfig(),
    model_name: str = "",
) -> Engine:
    """An engine over an already loaded target with prompt-lookup drafting and the reference
    latency table (no I/O, no calibration): e.g. the EAGLE trainer's response generation
    over the model it already holds."""
    return Engine(
        target,
        tokenizer,
        drafter=compose_drafter(pld),
        eos_token_ids=eos_token_ids,
        model_name=model_name,
        parts=DrafterParts(pld=pld),
    )


def with_datastore(engine: Engine, datastore: Optional["Datastore"]) -> Engine:
    """An engine over the same model and backend as ``engine`` whose drafter is composed
    the same way, with ``datastore`` instead of ``engine``'s (None: without one). No
    model is loaded."""
    parts = engine.parts
    drafter = compose_drafter(
        parts.pld, [datastore] if datastore is not None else [], parts.eagle, parts.response_cache, parts.drafting
    )
    return engine.with_drafter(drafter, dataclasses.replace(parts, datastore=datastore))


def with_response_cache(engine: Engine, cache: Optional[ResponseCache]) -> Engine:
    """An engine over the same model and backend as ``engine`` that also drafts from
    ``cache`` and caches each finished response in it (None: without a cache). No model is
    loaded. See :mod:`ragspec.drafters.response_cache`."""
    parts = engine.parts
    drafter: Optional[Drafter]
    if parts.pld is None and parts.eagle is None and parts.datastore is None:
        # an engine whose drafter was not composed here: the cache beside that drafter
        if parts.response_cache is not None:
            raise ConfigError("this engine already drafts from a response cache")
        own = ResponseCacheDrafter(cache) if cache is not None else None
        if engine.drafter is None or own is None:
            drafter = engine.drafter or own
        else:
            drafter = CompositeDrafter([engine.drafter, own])
    else:
        stores = [parts.datastore] if parts.datastore is not None else []
        drafter = compose_drafter(parts.pld, stores, parts.eagle, cache, parts.drafting)
    return engine.with_drafter(drafter, dataclasses.replace(parts, response_cache=cache))


def with_drafting(engine: Engine, drafting: str) -> Engine:
    """An engine over the same model, backend and drafter parts as ``engine`` (one composed
    by :func:`load_engine`), retrieval and the head sharing each step as ``drafting`` says
    (:data:`DRAFTING_MODES`, or ``"auto"``: :func:`resolve_drafting` on the engine's
    device). No model is loaded.

    Raises:
        ConfigError: an unknown ``drafting``, or an engine whose drafter was not composed
            here.
    """
    parts = engine.parts
    if parts.pld is None and parts.eagle is None and parts.datastore is None and parts.response_cache is None:
        raise ConfigError("this engine's drafter was not composed by ragspec.loading: no parts to recompose")
    drafting = resolve_drafting(drafting, getattr(engine.target, "device", torch.device("cpu")))
    stores = [parts.datastore] if parts.datastore is not None else []
    drafter = compose_drafter(parts.pld, stores, parts.eagle, parts.response_cache, drafting)
    return engine.with_drafter(drafter, dataclasses.replace(parts, drafting=drafting))
