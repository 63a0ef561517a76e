"""Building the CPU backend: the speed-ups chosen once (:class:`CPUSpeedUps`, the one value
:func:`ragspec.loading.select_target` passes), what they need loaded (the compiled kernels,
the GGUF file's blocks: :func:`read_gguf_blocks`), and the target built whole from them
(:func:`load_cpu_target`): the fused C++ step's
(:class:`~ragspec.backend.cpu.native_target.NativeTarget`) where it runs the model, else the
kernel-routed transformers target (:class:`~ragspec.backend.cpu.target.CPUTarget`).
Nothing is installed on a target after it is built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch

from ...config import NUMERICS
from ...errors import ConfigError
from .fastpaths import can_pack
from .native import native_step_unsupported
from .native_target import NativeTarget
from .target import CPUTarget, GGUFBlocks

if TYPE_CHECKING:
    from .kernels import QuantLinear

logger = logging.getLogger(__name__)

__all__ = ["CPUSpeedUps", "load_cpu_target", "read_gguf_blocks"]


@dataclass(frozen=True)
class CPUSpeedUps:
    """The CPU backend's speed-ups, chosen before its target is built.

    Attributes:
        compiled_kernels: route few-row linears and attention through ragspec's compiled CPU
            kernels (:mod:`ragspec.backend.cpu.kernels`: built on first use, ~45 s, then
            cached; float32 models only); where they cannot be built, torch's kernels serve.
        native_step: with the compiled kernels on a Llama-architecture model, decoding and
            verification run every decoder layer in one C++ call
            (:class:`~ragspec.backend.cpu.native_target.NativeTarget`).
        gguf: the GGUF file the model was loaded from: with the compiled kernels, the linear
            weights it holds exactly are read from its blocks (:func:`read_gguf_blocks`; the
            same output bit for bit, fewer bytes per step). None: float32 weights.
        numerics: ``"exact"`` (float32 arithmetic) or ``"fast"`` (opt-in: the GGUF-block
            linears with int8 activations and the native step's KV in float16).
        cache: ragspec's cache folder (the compiled kernels live in it); None: the default
            (``$RAGSPEC_CACHE`` or ``~/.cache/ragspec``).

    Raises:
        ConfigError: ``numerics`` is unknown.
    """

    compiled_kernels: bool = True
    native_step: bool = True
    gguf: Optional[Path] = None
    numerics: str = "exact"
    cache: Optional[Path] = None

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {self.numerics!r}")


def read_gguf_blocks(
    model: torch.nn.Module, path: Union[str, Path], kernel: Optional["QuantLinear"], numerics: str = "exact"
) -> Optional[GGUFBlocks]:
    """The decoder's linear weights and the output layer's in the GGUF file's own block
    formats (:mod:`ragspec.backend.cpu.quant`: Q4_1, Q8_0, Q5_0, Q4_K, Q6_K), for the
    compiled ``quant_linear`` kernel. Each weight is matched to the file by content and
    checked for exact equality; weights without an exact twin keep float32. Costs ~0.75-1.25
    bytes of memory per weight; the matches are cached beside the converted model
    (``<stem>.hf/``: the first load ~7 s, later ones well under a second).

    ``numerics="fast"`` (opt-in, ``--numerics fast``) keeps the Q4_1 and Q8_0 weights in the
    kernel's fast formats (:meth:`~ragspec.backend.cpu.quant.GGUFWeight.to_fast`): their
    linears quantize each activation row to int8 per block of 32 and sum integer dot
    products (AVX-512 VNNI), as llama.cpp does, but every row alone, so a verification
    forward still gives each row what a one-row step gives it (speculative == plain decoding
    within the mode, bit for bit); its values differ from float32 by the activations'
    rounding (~0.5% of a linear's output), so greedy output can differ from transformers'.
    Other formats (Q6_K) keep float32 arithmetic.

    Args:
        model: the loaded causal LM (``path`` is the GGUF it was loaded from).
        path: the GGUF file.
        kernel: the compiled kernel (:func:`ragspec.backend.cpu.kernels.load_quant_linear`).
        numerics: ``"exact"`` or ``"fast"``.

    Returns:
        the matched blocks, or None without ``kernel``, for other dtypes than float32, or
        where the file cannot be read (a warning says why; the float32 weights serve).

    Raises:
        ConfigError: ``numerics="fast"`` on a CPU without AVX-512 VNNI (or with AVX-512
            masked off), or where the file cannot be read.
    """
    if kernel is None or next(model.parameters()).dtype != torch.float32:
        return None
    from ...models import converted_model_dir
    from .quant import load_gguf_weights

    decoder = model.get_decoder()  # type: ignore[operator]  # PreTrainedModel's
    weights = {name: module.weight for name, module in decoder.named_modules() if type(module) is torch.nn.Linear}
    weights["lm_head"] = model.get_output_embeddings().weight  # type: ignore[operator]
    cache = converted_model_dir(Path(path)).parent / "gguf_blocks.safetensors"
    try:
        matched = load_gguf_weights(path, weights, cache)
    except Exception as e:  # gguf-py raises many types on a file it cannot parse
        if numerics == "fast":
            raise ConfigError(f"--numerics fast: cannot read GGUF blocks from {path} ({type(e).__name__}: {e})")
        logger.warning("cannot read GGUF blocks from %s (%s: %s); float32 weights are used", path, type(e).__name__, e)
        return None
    if numerics == "fast":
        from .kernels import fast_numerics_supported

        if not fast_numerics_supported():
            raise ConfigError(
                "--numerics fast needs AVX-512 VNNI (and AVX-512 not masked off by RAGSPEC_CPU_ISA=avx2); "
                "this CPU runs --numerics exact only"
            )
        matched = {name: q.to_fast() for name, q in matched.items()}
    logger.debug("%d of %d linear weights served from GGUF blocks of %s", len(matched), len(weights), path)
    return GGUFBlocks(kernel, {weights[name].data_ptr(): q for name, q in matched.items()}, numerics)


def load_cpu_target(
    model: torch.nn.Module, speed_ups: Optional[CPUSpeedUps] = CPUSpeedUps()
) -> Union[CPUTarget, NativeTarget]:
    """The CPU backend for a loaded model, built whole with ``speed_ups`` (None: none, the
    model's own forward but for the output layer's packed weight: the EAGLE trainer's).

    Loads what the speed-ups need: the compiled kernels (built on first use), the GGUF
    blocks. The fused-step target where the native step is chosen and runs the model (a
    float32 Llama, the compiled library holding the step), else the kernel-routed target,
    which records why not (``Capability.SPEED_UPS``, ``ragspec doctor``).

    Raises:
        ConfigError: the model is not on the CPU; ``numerics="fast"`` where it cannot be
            served (no GGUF file, no compiled kernel, not a float32 model, a CPU without
            AVX-512 VNNI).
    """
    if speed_ups is None:
        return CPUTarget(model)
    from .kernels import (
        load_decoder_step,
        load_few_query_attention,
        load_prefill_attention,
        load_quant_linear,
        load_skinny_linear,
    )

    cache = Path(speed_ups.cache) if speed_ups.cache else None
    float32 = next(model.parameters()).dtype == torch.float32
    skinny = load_skinny_linear(cache) if float32 and speed_ups.compiled_kernels else None
    if speed_ups.numerics == "fast" and (skinny is None or speed_ups.gguf is None):
        raise ConfigError(
            "--numerics fast needs a GGUF model and ragspec's compiled CPU kernels on a float32 CPU model"
        )
    gguf = None
    if skinny is not None and speed_ups.gguf is not None:
        gguf = read_gguf_blocks(model, speed_ups.gguf, load_quant_linear(cache), speed_ups.numerics)
    step_cls = load_decoder_step(cache) if skinny is not None and speed_ups.native_step else None
    off = _native_step_off(model, speed_ups, skinny is not None, step_cls)
    target = CPUTarget(
        model,
        pack_linears=True,
        skinny=skinny,
        # the same compiled library as the kernel: already built and imported above
        attention_kernel=load_few_query_attention(cache) if skinny is not None else None,
        prefill_attention=load_prefill_attention(cache) if skinny is not None else None,
        gguf=gguf,
        route_attention=True,
        native_step_off=off if off is not None else "the native step is the target built on this one",
    )
    if off is not None or step_cls is None:
        logger.debug("native decoder step off: %s", off)
        return target
    return NativeTarget(target, step_cls)


def _native_step_off(
    model: torch.nn.Module, speed_ups: CPUSpeedUps, compiled: bool, step_cls: Optional[type]
) -> Optional[str]:
    """Why the fused step will not run ``model`` with ``speed_ups``, in words; None: it will."""
    dtype = next(model.parameters()).dtype
    if not compiled:
        if dtype != torch.float32:
            return f"needs float32 weights, the model's are {str(dtype).removeprefix('torch.')}"
        if not speed_ups.compiled_kernels:
            return "the compiled CPU kernels are switched off (RAGSPEC_CPU_KERNELS=0)"
        return "the compiled CPU kernels are not available (ragspec doctor says why)"
    if not speed_ups.native_step:
        return "switched off: RAGSPEC_NATIVE_STEP=0"
    if step_cls is None:
        return "the compiled library holds no decoder step"
    if not can_pack(torch.device("cpu"), dtype):  # the kernel is used only with oneDNN packing
        return "needs the compiled few-row kernel in use and float32 weights"
    reason = native_step_unsupported(model.get_decoder())  # type: ignore[operator]  # PreTrainedModel's
    return None if reason is None else f"the model is not one it runs: {reason}"
