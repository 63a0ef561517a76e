"""The one builder of engines: model, backend built with its speed-ups, datastore, EAGLE head,
drafter composition, latency calibration, EOS ids.

Front ends (the CLI, the server, LangChain, ``ragspec eagle``, the examples) build engines
only through :func:`load_engine` (over a model they already hold: :func:`select_target`,
:func:`engine_for_target`, :func:`engine_with_drafter`). One engine
serves every datastore it is built with: a request names the one it drafts from
(``RequestParams.datastore``); :func:`engine_over` gives a server's engine over a model
already loaded (its datastores, its response cache). Nothing is set on an engine after construction.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import torch

from .calibrate import measure_latency_model
from .composition import DrafterParts, compose_drafter
from .config import AUTO_DRAFTING, DRAFTING_MODES, NUMERICS, PLDConfig, PolicyConfig, check_drafting
from .deprecation import warn_deprecated
from .drafters.base import CompositeDrafter, Drafter
from .drafters.response_cache import ResponseCache, ResponseCacheDrafter
from .engine import Engine
from .errors import ConfigError
from .policy import LatencyModel
from .progress import step

if TYPE_CHECKING:
    from .backend.base import Target
    from .datastore import Datastore
    from .eagle import EagleDrafter, EagleTreeConfig
    from .models import ModelSpec

logger = logging.getLogger(__name__)

__all__ = [
    "DRAFTING_MODES",
    "load_engine",
    "engine_for_target",
    "engine_with_drafter",
    "engine_on_target",
    "load_target",
    "select_target",
    "load_eagle",
    "open_datastores",
    "datastore_name",
    "compose_drafter",
    "engine_over",
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
    as fast or faster in every category (``docs/bench/drafting-retrieval-vs-merged-run{1,2}.json``).
    On CUDA ``"auto"`` is what the GPU check measured faster on this GPU model, the head
    merged with retrieval or retrieval alone
    (:func:`ragspec.backend.cuda.drafting.recorded_drafting`), else ``"merged"``.

    Raises:
        ConfigError: ``drafting`` is neither ``"auto"`` nor one of :data:`DRAFTING_MODES`.
    """
    if check_drafting(drafting) == AUTO_DRAFTING:
        device = torch.device(device)
        if device.type != "cuda":
            return "retrieval"
        if not torch.cuda.is_available():  # (a CUDA device named on a machine without one)
            return "merged"
        from .backend.cuda.drafting import recorded_drafting
        from .models import cache_dir

        return recorded_drafting(torch.cuda.get_device_name(device), cache_dir()) or "merged"
    return drafting


CUDA_SLOTS = 48
"""Default KV slots of the CUDA backend: a server's default ``max_active + max_queue`` (8 + 32)
with room to spare; each slot holds the model's context (at most 4096 positions)."""


def _cuda_backend_unavailable(model: torch.nn.Module, wanted: Optional[bool]) -> Optional[str]:
    """Why ragspec's CUDA backend will not serve ``model`` (switched off, triton missing, an
    architecture it does not run), or None."""
    if wanted is None:
        wanted = os.environ.get("RAGSPEC_CUDA_BACKEND", "1") != "0"
    if not wanted:
        return "switched off: RAGSPEC_CUDA_BACKEND=0"
    from .backend.cuda import unsupported_reason

    return unsupported_reason(model)


def select_target(
    model: torch.nn.Module,
    *,
    cpu_kernels: Optional[bool] = None,
    cache: Optional[Union[str, Path]] = None,
    gguf: Optional[Union[str, Path]] = None,
    numerics: str = "exact",
    speed_ups: bool = True,
    use_cuda_backend: Optional[bool] = None,
    cuda_slots: int = CUDA_SLOTS,
) -> "Target":
    """The backend for a loaded transformers model, chosen once, here, from its device (read
    from its parameters; its dtype decides which speed-ups apply), built whole with its
    speed-ups (one choice, made here: nothing is installed on the target afterwards).

    * CPU: :func:`~ragspec.backend.cpu.build.load_cpu_target` with the
      :class:`~ragspec.backend.cpu.build.CPUSpeedUps` chosen from the arguments and the
      environment (``RAGSPEC_CPU_KERNELS``, ``RAGSPEC_NATIVE_STEP``): the fused C++ step's
      target (:class:`~ragspec.backend.cpu.native_target.NativeTarget`) for a float32 Llama
      with the compiled kernels, else the kernel-routed transformers target
      (:class:`~ragspec.backend.cpu.target.CPUTarget`: compiled few-row linear and
      attention kernels for float32, the GGUF file's blocks; pre-packed oneDNN weights for
      bfloat16);
    * CUDA: ragspec's CUDA backend (:func:`ragspec.backend.cuda.load_cuda_target`) for the
      models it serves;
    * any other device: the device-neutral :class:`~ragspec.backend.hf.HFTarget`, its
      attention routed through ragspec's function (``route_attention``).

    Args:
        model: a loaded ``PreTrainedModel`` for causal LM (eval mode, on its device).
        cpu_kernels: on the CPU with float32 weights, ragspec's compiled kernels (None: on
            unless ``RAGSPEC_CPU_KERNELS=0``).
        cache: ragspec's cache folder (the compiled kernels live in it).
        gguf: the GGUF file the model was loaded from, or None.
        numerics: ``"exact"`` or ``"fast"`` (:data:`ragspec.config.NUMERICS`).
        speed_ups: False: the backend for the device without its speed-ups (the EAGLE
            trainer, which trains through the model's own forward).
        use_cuda_backend: on CUDA, ragspec's CUDA backend
            (:func:`ragspec.backend.cuda.load_cuda_target`) for the models it serves (None: on
            unless ``RAGSPEC_CUDA_BACKEND=0``); off, or a model it cannot run: the
            device-neutral target, with a warning naming the reason.
        cuda_slots: the CUDA backend's KV slots: most requests holding a KV state at once
            (a server's ``max_active + max_queue`` at most).

    Raises:
        ConfigError: ``numerics`` is unknown, or ``"fast"`` where it cannot be served (not a
            GGUF model, no compiled kernel, not a float32 CPU model, a CPU without AVX-512
            VNNI).
    """
    from .backend.hf import HFTarget

    if numerics not in NUMERICS:
        raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
    device = next(model.parameters()).device
    if device.type == "cpu":
        from .backend.cpu.build import CPUSpeedUps, load_cpu_target
        from .backend.cpu.kernels import cpu_kernels_enabled
        from .backend.cpu.native import native_step_enabled

        choice = None
        if speed_ups:
            choice = CPUSpeedUps(
                compiled_kernels=cpu_kernels if cpu_kernels is not None else cpu_kernels_enabled(),
                native_step=native_step_enabled(),
                gguf=Path(gguf) if gguf else None,
                numerics=numerics,
                cache=Path(cache) if cache else None,
            )
        return load_cpu_target(model, choice)
    if device.type == "cuda" and speed_ups:
        # ragspec/backend/cuda/: a static KV pool, the flat batch of every request's rows,
        # CUDA graphs, row-invariant Triton kernels (numerics "exact") or cuBLAS ("fast")
        reason = _cuda_backend_unavailable(model, use_cuda_backend)
        if reason is None:
            from .backend.cuda import load_cuda_target

            return load_cuda_target(model, numerics=numerics, max_slots=cuda_slots)
        logger.warning("the CUDA backend is not used (%s): transformers' eager forwards instead", reason)
    # every other device (and CUDA without its backend) keeps the device-neutral target
    if numerics == "fast":
        raise ConfigError(
            "--numerics fast needs a GGUF model and ragspec's compiled CPU kernels on a float32 CPU model"
        )
    return HFTarget(model, route_attention=speed_ups)


def load_target(
    model: Optional[str] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    *,
    cache: Optional[Union[str, Path]] = None,
    cpu_kernels: Optional[bool] = None,
    numerics: str = "exact",
) -> tuple["Target", Any, "ModelSpec"]:
    """Load a model (registry name, GGUF file or HF folder; None = the default model) into
    the backend for its device, built with its speed-ups (:func:`select_target`).

    ``numerics``: ``"exact"`` (default) or ``"fast"`` (:data:`ragspec.config.NUMERICS`).

    Returns:
        (target, tokenizer, model spec).

    Raises:
        ModelNotFoundError: the model is not fetched / the path does not exist.
        ModelLoadError: the file is broken.
        ConfigError: ``numerics="fast"`` where it cannot be served (not a GGUF model, no
            compiled kernel, a CPU without AVX-512 VNNI).
    """
    from .models import load_model, resolve_model

    spec = resolve_model(model, cache=Path(cache) if cache else None)
    with step(f"loading {spec.name}", "GGUF" if spec.kind == "gguf" else "transformers folder"):
        hf_model, tokenizer = load_model(spec, device=device, dtype=dtype)
        target = select_target(hf_model, cpu_kernels=cpu_kernels, cache=cache, gguf=spec.gguf_file, numerics=numerics)
    return target, tokenizer, spec


def load_eagle(
    eagle: Optional[Union[str, Path]],
    target: "Target",
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


def open_datastores(datastores: Sequence[tuple[str, Union[str, Path]]], tokenizer: Any) -> dict[str, "Datastore"]:
    """The named datastores ``(name, folder)`` opened for ``tokenizer`` (memory maps,
    warmed), in order.

    Raises:
        ConfigError: a name given twice, or empty.
        DatastoreError: a folder is not a datastore, or was built with another tokenizer.
    """
    from .datastore import Datastore

    out: dict[str, Datastore] = {}
    for name, folder in datastores:
        if not name or name in out:
            raise ConfigError(f"datastore names must be unique and non-empty, got {name!r} twice or empty")
        with step(f"opening the datastore {name} ({folder})"):
            out[name] = Datastore.open(folder, tokenizer=tokenizer, warm=True)
        logger.info("datastore %r: %s", name, folder)
    return out


def datastore_name(folder: Union[str, Path]) -> str:
    """The name a datastore given by its folder alone is served under: the folder's name."""
    return Path(folder).resolve().name or "datastore"


def load_engine(
    model: Optional[str] = None,
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    *,
    datastore: Optional[Union[str, Path]] = None,
    datastores: Sequence[tuple[str, Union[str, Path]]] = (),
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
    """Load a model and build an engine with prompt-lookup drafting, plus datastores and an
    EAGLE head when given.

    Args:
        model: registry name (``smollm2-135m-instruct``, ``gemma3-270m``), a GGUF file or
            a local HF folder; None = the default model.
        device: ``cpu``, ``cuda``, ``cuda:1`` ... (default: CUDA when present).
        dtype: ``fp32``, ``bf16``, ``fp16`` (default: bf16 on CUDA, fp32 on CPU).
        datastore: a datastore folder (``ragspec datastore build``), the default of requests
            naming none, served under its folder's name (:func:`datastore_name`).
        datastores: ``(name, folder)`` of more datastores requests may name
            (``RequestParams.datastore``); without ``datastore`` the first is the default.
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
        DatastoreError: a datastore cannot be opened for this tokenizer.
        EagleHeadMismatchError: the head was trained for another model.
        ConfigError: an unknown ``drafting`` or ``numerics``, or ``numerics="fast"``
            where it cannot be served; datastore names given twice.
    """
    from .models import eos_token_ids

    check_drafting(drafting)  # an unknown mode fails before any load
    named = ([(datastore_name(datastore), datastore)] if datastore else []) + list(datastores)
    target, tokenizer, spec = load_target(model, device, dtype, cache=cache, cpu_kernels=cpu_kernels, numerics=numerics)
    stores = open_datastores(named, tokenizer)
    eagle_drafter, eagle_path = load_eagle(eagle, target, spec)
    _warn_headless(eagle_drafter, drafting, spec)
    drafting = resolve_drafting(drafting, target.device)
    latency = _calibrated(target, spec, cache, cpu_kernels, numerics, recalibrate) if calibrate else None
    policy = _device_policy(target, latency, policy)
    parts = DrafterParts(
        pld=pld,
        datastore=next(iter(stores.values()), None),
        eagle=eagle_drafter,
        eagle_path=eagle_path,
        drafting=drafting,
    )
    return Engine(
        target,
        tokenizer,
        drafter=parts.drafter_with(parts.datastore),
        policy=policy,
        latency=latency,
        eos_token_ids=eos_token_ids(target.model, tokenizer),
        model_name=spec.name,
        parts=parts,
        datastores=stores,
    )


def _warn_headless(eagle: Optional["EagleDrafter"], drafting: str, spec: "ModelSpec") -> None:
    """Say so where a drafting mode that needs a head (merged, select) has none."""
    if eagle is None and drafting in ("merged", "select"):
        logger.warning(
            "--drafting %s needs an EAGLE head, and none is loaded (--eagle none, or no head shipped for %s): "
            "drafts come from retrieval alone",
            drafting,
            spec.name,
        )


def _device_policy(target: "Target", latency: Optional[LatencyModel], policy: PolicyConfig) -> PolicyConfig:
    """``policy``, with the draft budget from the measured latency table on a GPU (16-64
    nodes: verification rows are nearly free there) unless the caller chose one."""
    if latency is None or target.device.type != "cuda" or policy.max_draft_tokens != PolicyConfig().max_draft_tokens:
        return policy
    from .backend.cuda import gpu_draft_policy

    return gpu_draft_policy(latency.table, policy)


def _from_pretrained(
    cls: type[Engine], model: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None, **kwargs
) -> Engine:
    """Deprecated alias of :func:`load_engine` (the same arguments), kept one release: it
    warns and names ``ragspec.load_engine``."""
    warn_deprecated("Engine.from_pretrained", "ragspec.load_engine(...) (the same arguments)")
    return load_engine(model, device, dtype, **kwargs)


# Engine.from_pretrained was removed without a deprecation period; it is back for one release
# as the alias above. Set here, where engines are built: the engine module imports nothing of
# this one (no import cycle), and ragspec's __init__ imports this module, so every Engine has it.
Engine.from_pretrained = classmethod(_from_pretrained)  # type: ignore[assignment]  # a classmethod is callable


def _calibrated(
    target: "Target",
    spec: "ModelSpec",
    cache: Optional[Union[str, Path]],
    cpu_kernels: Optional[bool],
    numerics: str,
    recalibrate: Optional[bool],
) -> LatencyModel:
    """The target's measured latency model, from the calibration cache when one measured on
    the same machine, model, dtype, threads, backend and kernel build is there."""
    from . import models
    from .backend.cpu.kernels import kernel_dir
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
        kernels=(
            f"{type(target).__name__}|{kernel_dir(folder).name}|torch-{torch.__version__}|{numerics}"
            f"|cpu_kernels={cpu_kernels}|{switches}"
        ),
    )
    return cached_latency(
        lambda: measure_latency_model(target), key, CalibrationCache(folder / "calibration"), recalibrate
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


def engine_with_drafter(
    target: "Target",
    tokenizer,
    drafter: Optional[Drafter],
    *,
    policy: PolicyConfig = PolicyConfig(),
    latency: Optional[LatencyModel] = None,
    eos_token_ids: Sequence[int] = (),
    model_name: str = "",
) -> Engine:
    """An engine over an already loaded target drafting with ``drafter`` as its caller
    composed it (None: plain decoding), e.g. the drafter sets ``ragspec eagle bench``
    compares. Its drafting reads ``"custom"`` (:attr:`Engine.drafting`): not composed here,
    so :func:`with_drafting` cannot recompose it. ``latency``: None = the reference CPU's
    table until refined online. No I/O."""
    return Engine(
        target,
        tokenizer,
        drafter=drafter,
        policy=policy,
        latency=latency,
        eos_token_ids=eos_token_ids,
        model_name=model_name,
    )


def engine_on_target(
    engine: Engine,
    target: "Target",
    *,
    drafter: Optional[Drafter],
    policy: Optional[PolicyConfig] = None,
    latency: Optional[LatencyModel] = None,
) -> Engine:
    """An engine like ``engine`` (its tokenizer, end-of-sequence ids, name, drafter parts
    and datastores) over another target of the same model, built by the caller with other
    options (e.g. the CUDA backend's numerics, KV slots or graphs, as the GPU check
    compares them), drafting with ``drafter`` (None: plain decoding). ``policy``,
    ``latency``: None keeps ``engine``'s. No I/O."""
    return Engine(
        target,
        engine.tokenizer,
        drafter=drafter,
        policy=policy if policy is not None else engine.policy,
        latency=latency if latency is not None else engine.latency,
        eos_token_ids=engine.eos_token_ids,
        model_name=engine.model_name,
        parts=engine.parts,
        datastores=engine.datastores if engine.parts.composed else None,
    )


def engine_over(
    engine: Engine,
    datastores: Optional[Mapping[str, "Datastore"]] = None,
    response_cache: Optional[ResponseCache] = None,
) -> Engine:
    """The engine a server serves over ``engine``'s model, backend, head, policy and latency
    model (no model loaded, no I/O): drafting from exactly the named ``datastores`` (the
    first the default of requests naming none; None: none) and ``response_cache`` (None:
    none), composed as ``engine``'s drafter was (for an engine whose drafter was not
    composed here: the datastores and the cache alone). Without datastores, an engine whose
    drafter was not composed here keeps it, with the cache beside it.

    Raises:
        ConfigError: another response cache for an engine whose drafter was not composed
            here and has one already.
    """
    parts = engine.parts
    named = dict(datastores or {})
    drafter: Optional[Drafter]
    custom = parts.pld is None and parts.eagle is None and parts.datastore is None
    if named or not custom:
        parts = dataclasses.replace(parts, datastore=next(iter(named.values()), None), response_cache=response_cache)
        drafter = parts.drafter_with(parts.datastore)
    elif parts.response_cache is not None and response_cache is not parts.response_cache:
        raise ConfigError("this engine's drafter was not composed by ragspec.loading and already has a response cache")
    elif parts.response_cache is not None:
        drafter = engine.drafter  # the same cache beside the same drafter
    else:
        # an engine whose drafter was not composed here: the cache beside that drafter
        own = ResponseCacheDrafter(response_cache) if response_cache is not None else None
        if engine.drafter is None or own is None:
            drafter = engine.drafter or own
        else:
            drafter = CompositeDrafter([engine.drafter, own])
        parts = dataclasses.replace(parts, response_cache=response_cache)
    return engine.with_drafter(drafter, parts, datastores=named)


def _named_datastores(engine: Engine) -> dict[str, "Datastore"]:
    """``engine``'s named datastores; its default alone, named by its folder, when it has
    none named."""
    if engine.datastores:
        return dict(engine.datastores)
    ds = engine.parts.datastore
    return {datastore_name(ds.path): ds} if ds is not None else {}


def with_datastore(engine: Engine, datastore: Optional["Datastore"]) -> Engine:
    """Deprecated: one engine serves every datastore, and a request names the one it drafts
    from (``RequestParams.datastore``); build the engine with its datastores
    (:func:`load_engine`'s ``datastores``, :func:`engine_over`). This returns
    ``engine_over(engine, {name: datastore})`` (no model loaded)."""
    warn_deprecated(
        "ragspec.loading.with_datastore",
        "one engine with every datastore (load_engine(datastores=...), engine_over), each request naming "
        "its own (RequestParams.datastore)",
    )
    named = {datastore_name(datastore.path): datastore} if datastore is not None else {}
    return engine_over(engine, named, engine.parts.response_cache)


def with_response_cache(engine: Engine, cache: Optional[ResponseCache]) -> Engine:
    """Deprecated: give the response cache when the engine is built (:func:`engine_over`). This returns ``engine_over(engine, its datastores, cache)``.

    Raises:
        ConfigError: an engine whose drafter was not composed here, and already has a cache.
    """
    warn_deprecated("ragspec.loading.with_response_cache", "engine_over(engine, engine.datastores, cache)")
    return engine_over(engine, _named_datastores(engine), cache)


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
    if not parts.composed:
        raise ConfigError("this engine's drafter was not composed by ragspec.loading: no parts to recompose")
    parts = dataclasses.replace(parts, drafting=resolve_drafting(drafting, engine.target.device))
    return engine.with_drafter(parts.drafter_with(parts.datastore), parts)
