"""Optional compiled CPU kernels for decoding and verification: few-row linear layers and
few-query attention over the KV cache.

Decoding multiplies one activation row (verification: a few) with every weight matrix, so a
step costs streaming the weights from memory once. On the 2-core AMD EPYC CPU of our CI,
MKL's float32 sgemv/sgemm for one row streams ~10 GB/s, oneDNN's pre-packed path ~13 GB/s,
while the memory system delivers ~25 GB/s to a plain reduction. ``csrc/linear.cpp``
(AVX2/FMA, ATen's thread pool) streams each weight row once for all rows of the input and
reaches ~20 GB/s: the decoder's linear layers of SmolLM2-135M for one row 36-47 ms -> 25 ms,
for 8 rows (oneDNN) 49 -> 36 ms.

``quant_linear`` (:func:`load_quant_linear`) is the same kernel over weights kept in their
GGUF block format (:mod:`ragspec.backend.cpu.quant`): the same sums bit for bit, a fifth of the bytes.

Both linear kernels have an AVX-512F variant (16 lanes, two accumulators per output, for 1-3
rows the de-quantization fused into the FMA loop), chosen at the first call from the CPU's
flags; AVX2/FMA stays the fallback and ``RAGSPEC_CPU_ISA=avx2`` masks AVX-512 off
(:func:`cpu_isa`, :func:`set_cpu_isa`). The paths sum in another order (values agree to
float32 rounding); within one path ``quant_linear`` equals ``skinny_linear`` over the
de-quantized weight bit for bit and each output row is independent of the call's other rows.
Measured on a 2-vCPU Intel Xeon with AVX-512 (shared with other jobs, one thread, best of
repeats; ratios within one run): the default model's 210 decoder linears from Q4_1 per step
13.6 -> 5.0 ms at 1 row, 11.0 -> 6.1 at 2, 20.0 -> 12.1 at 4, 22.8 -> 21.3 at 8, 46 -> 40 at
16; the Q8_0 output layer (49152 x 576) 5.2 -> 1.75 ms at 1 row, 11.1 -> 3.8 at 4; a plain
step at 700 tokens of context 70-77 -> 50-51 ms (same conditions).

The same library holds ``few_query_attention`` (:func:`load_few_query_attention`): the
attention of 1-16 new tokens over the cache, split over blocks of cached keys (torch's CPU
SDPA splits only over heads and query blocks, 9 small items for a decoding step of the
default model): per step at 789 cached tokens, interleaved, 74 -> 61 ms for one token, 91 ->
79 ms for 4.

The same library holds ``prefill_attention`` (:func:`load_prefill_attention`, AVX-512 only):
a prompt chunk's causal attention, the chunk's query rows as the vector lanes (flash
attention's online softmax, with each row's softmax statistics lane-wise): a 256-row chunk of
the default model ~390-410 GFLOP/s over 768-3000 keys against 200-230 for
``few_query_attention`` and 140-165 for torch's SDPA, with no partial results to merge.

The same library holds ``DecoderStep`` (:func:`load_decoder_step`, ``csrc/decoder_step.cpp``):
every decoder layer of a Llama-architecture model for a step's rows in one call, calling
the kernels above directly (see :mod:`ragspec.backend.cpu.native`).

The kernel is compiled on first use with ``torch.utils.cpp_extension.load`` (about 45 s;
needs a C++ compiler and ninja) into ragspec's cache (``<cache>/kernels/``, see
:func:`kernel_dir`), and imported from there afterwards (well under a second; a read-only
cache works). Where it cannot be built or loaded (no compiler, no AVX2, another
platform), :func:`load_skinny_linear` returns None and callers keep torch's own kernels (as
they do with ``RAGSPEC_CPU_KERNELS=0``): the kernel only makes things faster, never
different in kind (its values equal ``F.linear``'s up to float32 summation order).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from ragspec.progress import step

logger = logging.getLogger(__name__)

__all__ = [
    "SKINNY_MAX_ROWS",
    "SkinnyLinear",
    "QuantLinear",
    "FewQueryAttention",
    "PrefillAttention",
    "PrefillAttentionKernel",
    "load_skinny_linear",
    "load_quant_linear",
    "load_few_query_attention",
    "load_prefill_attention",
    "load_decoder_step",
    "fast_numerics_supported",
    "kernel_dir",
    "missing_sources",
    "cpu_kernels_enabled",
    "cpu_isa",
    "set_cpu_isa",
    "KERNEL_STATES",
    "KernelStatus",
    "kernel_status",
]

# rows up to which the compiled kernel beats oneDNN's pre-packed linear (measured on the
# 2-core CPU for the default model's shapes: 16 rows 62 vs 64 ms, 24 rows 68 vs 77 ms but
# with a smaller margin than the noise); above it torch's kernels are used
SKINNY_MAX_ROWS = 16

# x float32 [R, I], weight float32 [O, I] (contiguous), bias float32 [O] or None -> [R, O]
SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

# x float32 [R, I], qs uint8 [O, I/2] (Q4_1) or int8 [O, I] (Q8_0, Q6_K), scales float32, format
# code (ragspec.backend.cpu.quant.Q4_1 / Q8_0 / Q6_K), bias float32 [O] or None -> [R, O]
QuantLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, Optional[torch.Tensor]], torch.Tensor]

# query [1, Hq, Q, d], key/value [1, Hkv, S, d], mask bool [1, 1, Q, S] or None, scale -> [1, Q, Hq, d]
FewQueryAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], float], torch.Tensor]
# query [1, Hq, Q, d], key/value [1, Hkv, S, d] (causal: row i sees keys 0 .. S - Q + i), scale -> [1, Q, Hq, d]
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], Optional[torch.Tensor]]

_CSRC = Path(__file__).with_name("csrc")
# the extension's translation units, one per kernel family (csrc/cpu_kernels.h says which holds
# what), and its headers: every file whose change must rebuild it (the hash). The wheel carries
# them all as package data (tests/unit/test_wheel_contents.py).
_SOURCES = tuple(
    _CSRC / name
    for name in (
        "isa.cpp",
        "linear.cpp",
        "quant_linear.cpp",
        "fast_numerics.cpp",
        "attention.cpp",
        "prefill_attention.cpp",
        "decoder_step.cpp",
        "module.cpp",
    )
)
_HEADERS = tuple(_CSRC / name for name in ("cpu_kernels.h", "kernel_simd.h", "kernel_simd512.h", "linear_tiles.h"))
_HASHED = (*_SOURCES, *_HEADERS)


def cpu_kernels_enabled(value: Optional[str] = None) -> bool:
    """Whether compiled CPU kernels are wanted: ``value`` (default: the environment variable
    ``RAGSPEC_CPU_KERNELS``) unset, empty or anything but ``0``/``false``/``no``/``off``."""
    if value is None:
        value = os.environ.get("RAGSPEC_CPU_KERNELS", "")
    return value.strip().lower() not in ("0", "false", "no", "off")


def _cpu_supported() -> bool:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        return False
    return capability in ("AVX2", "AVX512")


_NAME = "ragspec_cpu_kernels"  # the extension module's name (its PyInit_ symbol)
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
_STALE_BUILD_S = 3600.0  # unfinished build folders older than this are removed


def kernel_dir(cache_dir: Optional[Path] = None) -> Path:
    """Folder of the compiled kernel: ``<cache>/kernels/<torch>-<python>-<hash>``, the hash
    over the kernel's source and compile flags, so a changed source builds anew and any
    checkout or environment with the same torch reuses the same build. ``cache_dir``
    default: ragspec's cache (``$RAGSPEC_CACHE``, else ``$XDG_CACHE_HOME/ragspec``, else
    ``~/.cache/ragspec``).

    Raises:
        FileNotFoundError: a kernel source is missing (:func:`missing_sources`).
    """
    if cache_dir is None:
        from ...models import cache_dir as default_cache

        cache_dir = default_cache()
    digest = hashlib.sha256()
    for path in _HASHED:  # name and content of every source: a changed, added or renamed file builds anew
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join(_CFLAGS).encode())
    tag = f"torch-{torch.__version__.replace('+', '-')}-py{sys.version_info[0]}{sys.version_info[1]}-{digest.hexdigest()[:12]}"
    return Path(cache_dir) / "kernels" / tag


def missing_sources() -> list[str]:
    """The kernel sources (``csrc/`` files, by name) missing from this installation: none
    from a checkout or a wheel (package data); an install that lost them cannot build the
    kernels (:func:`load_skinny_linear` then returns None with one warning)."""
    return [path.name for path in _HASHED if not path.is_file()]


def _import_built(path: Path) -> ModuleType:
    """Import the built extension from ``path`` (no build system, no lock: works from a
    read-only cache); once per process (``sys.modules``)."""
    loaded = sys.modules.get(_NAME)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_NAME] = module
    logger.debug("compiled CPU kernels loaded from %s: %s path", path, module.cpu_isa())
    return module


def _build(final: Path) -> ModuleType:
    """Compile into a private temporary folder next to ``final`` and move the library into
    place (an atomic rename): concurrent builders never wait on each other's lock, and a
    build killed half-way leaves only its own temporary folder (removed by later builds
    once stale) instead of a lock that blocks every later start."""
    from torch.utils.cpp_extension import load

    base = final.parent
    base.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for old in base.glob(f"{final.name}.build-*"):
        try:
            if now - old.stat().st_mtime > _STALE_BUILD_S:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.build-", dir=base))
    try:
        module = load(
            name=_NAME,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(tmp),
            verbose=False,
        )
        final.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / f"{_NAME}.so", final / f"{_NAME}.so")
        return module
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_skinny_linear(cache_dir: Optional[Path] = None) -> Optional[SkinnyLinear]:
    """Load the few-row linear kernel, building it first when it is not in the cache; None
    where it is unavailable.

    Args:
        cache_dir: ragspec's cache folder (default as :func:`kernel_dir`); the kernel lives
            in its ``kernels/`` sub-folder.

    Returns:
        ``skinny_linear(x, weight, bias)``: x float32 [R, I], weight float32 [O, I]
        contiguous, bias float32 [O] or None -> float32 [R, O] (no autograd), or None when
        the CPU lacks AVX2/FMA or the kernel can be neither loaded nor built (no C++
        compiler or ninja, a failed build: logged as a warning, torch's kernels are used).
        A cached library that fails to load (a corrupt file) is rebuilt once.
        ``RAGSPEC_CPU_KERNELS`` is the caller's to check (:func:`cpu_kernels_enabled`;
        :func:`ragspec.loading.load_engine` does).
    """
    module = _load_module(cache_dir)
    return None if module is None else module.skinny_linear


def load_quant_linear(cache_dir: Optional[Path] = None) -> Optional[QuantLinear]:
    """Load the few-row linear kernel over GGUF blocks (same library and conditions as
    :func:`load_skinny_linear`).

    Returns:
        ``quant_linear(x, qs, scales, fmt, bias)``: x float32 [R, I] (I a multiple of 32),
        the weight as a :class:`ragspec.backend.cpu.quant.GGUFWeight`'s ``qs``/``scales``/``fmt``, bias
        float32 [O] or None -> float32 [R, O], bit for bit ``skinny_linear`` over the
        de-quantized weight (no autograd); or None where unavailable.
    """
    module = _load_module(cache_dir)
    return None if module is None else module.quant_linear


def load_few_query_attention(cache_dir: Optional[Path] = None) -> Optional[FewQueryAttention]:
    """Load the few-query attention kernel (same library and conditions as
    :func:`load_skinny_linear`; loading both builds and imports once).

    Returns:
        ``few_query_attention(query, key, value, mask, scale)``: query float32 [1, Hq, Q, d],
        key/value float32 [1, Hkv, S, d] (Hq a multiple of Hkv, d a multiple of 8, last
        dimension contiguous), mask bool [1, 1, Q, S] (True = attend) or None, scale float
        -> float32 [1, Q, Hq, d] (no autograd), or None where unavailable.
    """
    module = _load_module(cache_dir)
    return None if module is None else module.few_query_attention


def load_prefill_attention(cache_dir: Optional[Path] = None) -> Optional[PrefillAttention]:
    """Load the prompt-chunk attention kernel (same library and conditions as
    :func:`load_skinny_linear`), where it runs: the kernels use AVX-512 (not on AVX2-only
    CPUs, nor with ``RAGSPEC_CPU_ISA=avx2``).

    Returns:
        ``prefill_attention(query, key, value, scale)``: query float32 [1, Hq, Q, d], key/value
        float32 [1, Hkv, S, d] (S >= Q, Hq a multiple of Hkv, last dimension contiguous);
        query row i attends causally to keys 0 .. S - Q + i -> float32 [1, Q, Hq, d] (no
        autograd), or None for this call where the kernels do not run AVX-512 now or d is not
        a multiple of 16; the loader returns None where the library is unavailable. Each row's values are the same
        bits whatever the chunk it is computed in (the keys are taken in fixed blocks of 64
        from key 0); they agree with SDPA to float32 rounding.
    """
    module = _load_module(cache_dir)
    return None if module is None else PrefillAttentionKernel(module)


class PrefillAttentionKernel:
    """The compiled prompt-chunk attention (:func:`load_prefill_attention`): call it as
    ``kernel(query, key, value, scale)``; :meth:`supported` says whether it runs now."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def supported(self, head_dim: int) -> bool:
        """Whether calls of this head size run now: the kernels use AVX-512 (the
        instruction set can switch at run time, :func:`set_cpu_isa`) and ``head_dim`` is
        a multiple of 16 (at most 512)."""
        return bool(self._module.prefill_attention_supported(int(head_dim)))

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> Optional[torch.Tensor]:
        if not self.supported(int(query.shape[-1])):
            return None  # the caller's other kernel
        return self._module.prefill_attention(query, key, value, scale)


def cpu_isa(cache_dir: Optional[Path] = None) -> Optional[str]:
    """The instruction set the compiled kernels use: ``"avx512"`` (AVX-512 F/BW/VL/DQ, where
    the CPU has it) or ``"avx2"`` (AVX2/FMA: other CPUs, or ``RAGSPEC_CPU_ISA=avx2`` in the
    environment at the kernels' first call); None where the kernels are unavailable (same
    conditions as :func:`load_skinny_linear`, which it builds or loads first)."""
    module = _load_module(cache_dir)
    return None if module is None else str(module.cpu_isa())


def set_cpu_isa(name: str, cache_dir: Optional[Path] = None) -> str:
    """Switch the compiled kernels of this process to ``"avx2"``, ``"avx512"`` or ``"auto"``
    (the CPU's best unless ``RAGSPEC_CPU_ISA=avx2``), e.g. to test both paths on an AVX-512
    machine; returns the previous one. The two paths sum in another order (values agree
    to float32 rounding); within one path ``quant_linear`` equals ``skinny_linear`` over
    the de-quantized weight bit for bit.

    Raises:
        RuntimeError: the kernels are unavailable, ``name`` is unknown, or ``"avx512"`` on
            a CPU without it.
    """
    module = _load_module(cache_dir)
    if module is None:
        raise RuntimeError("the compiled CPU kernels are unavailable on this machine")
    return str(module.set_cpu_isa(name))


def fast_numerics_supported(cache_dir: Optional[Path] = None) -> bool:
    """Whether ``quant_linear``'s fast-numerics formats (int8 activations, AVX-512 VNNI; see
    :meth:`ragspec.backend.cpu.quant.GGUFWeight.to_fast`) run here: the kernels are available,
    the CPU has AVX-512 F/BW/VL/DQ and VNNI, and AVX-512 is not masked off
    (``RAGSPEC_CPU_ISA=avx2``, :func:`set_cpu_isa`)."""
    module = _load_module(cache_dir)
    return module is not None and bool(module.fast_numerics_supported())


def load_decoder_step(cache_dir: Optional[Path] = None) -> Optional[type]:
    """Load the fused decoder step of Llama-architecture models (``csrc/decoder_step.cpp``,
    same library and conditions as :func:`load_skinny_linear`).

    Returns:
        the ``DecoderStep`` class (built once per model by
        :func:`ragspec.backend.cpu.native.build_decoder_step`), or None where unavailable.
    """
    module = _load_module(cache_dir)
    return None if module is None else getattr(module, "DecoderStep", None)


def _load_module(cache_dir: Optional[Path] = None):
    """The compiled extension module (imported from the cache, built first when missing),
    or None where it is unavailable (see :func:`load_skinny_linear`)."""
    return _load_module_why(cache_dir)[0]


def _load_module_why(cache_dir: Optional[Path] = None, build: bool = True) -> tuple[Any, Optional[str], str]:
    """(module or None, why not: None when loaded, the status (:data:`KERNEL_STATES`)).
    ``build`` False: a library not in the cache is not compiled (status ``"not_built"``)."""
    if not _cpu_supported():
        logger.debug("compiled CPU kernels skipped: needs Linux x86-64 with AVX2")
        return None, "needs Linux on x86-64 with AVX2 (torch reports %s)" % _torch_capability(), "unsupported_cpu"
    missing = missing_sources()
    if missing:
        logger.warning(
            "ragspec's compiled CPU kernels cannot be built: their sources are missing from %s (%s); torch's "
            "kernels are used (slower decoding). Reinstall ragspec from a wheel or checkout that carries "
            "ragspec/backend/cpu/csrc/, or set RAGSPEC_CPU_KERNELS=0 to silence this",
            _CSRC,
            ", ".join(missing),
        )
        return None, f"kernel sources missing from {_CSRC}: {', '.join(missing)}", "sources_missing"
    final = kernel_dir(cache_dir)
    built = final / f"{_NAME}.so"
    if built.is_file():
        try:
            return _import_built(built), None, "active"
        except Exception as exc:  # a truncated or corrupt file: rebuild it below
            logger.warning("cached CPU kernel %s does not load (%s); rebuilding it", built, str(exc)[:200])
            try:
                built.unlink()
            except OSError:
                pass
    if not build:
        return None, f"not built yet in {final} (built on first use)", "not_built"
    if not (shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja")):
        logger.warning(
            "ragspec's CPU decoding kernel is not built and cannot be (no C++ compiler or ninja found): "
            "torch's kernels are used (slower; RAGSPEC_CPU_KERNELS=0 silences this)"
        )
        lacking = [name for name in (os.environ.get("CXX", "c++"), "ninja") if not shutil.which(name)]
        return None, f"no C++ compiler or ninja on PATH (missing: {', '.join(lacking)})", "no_compiler"
    try:
        with step("compiling the CPU decoding kernels", "first use only, a few minutes on 2 cores"):
            module = _build(final)
        logger.debug("compiled CPU kernels built into %s: %s path", final, module.cpu_isa())
        return module, None, "active"
    except Exception as exc:  # compiler errors, missing headers, an unwritable cache
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        logger.warning("compiled CPU kernel unavailable (%s); torch's kernels are used", first)
        return None, f"compiling failed: {first}", "compile_error"


def _torch_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - very old torch
        return "unknown"


KERNEL_STATES = (
    "active",
    "disabled",
    "unsupported_cpu",
    "sources_missing",
    "not_built",
    "no_compiler",
    "compile_error",
)
"""What :func:`kernel_status` can say of the compiled kernels: loaded (``active``), switched off
(``RAGSPEC_CPU_KERNELS=0``), a CPU or platform they do not run on, sources missing from the
installation, not in the cache (asked not to build), no C++ compiler or ninja, a failed build."""


@dataclass(frozen=True)
class KernelStatus:
    """Whether ragspec's compiled CPU kernels are in use here, and why not.

    Attributes:
        state: one of :data:`KERNEL_STATES` (``"active"``: loaded).
        reason: why they are not active, in words; None when active.
        isa: the instruction set they use (``"avx512"``, ``"avx2"``) when active, else None.
        fast_numerics: whether ``--numerics fast``'s formats run (AVX-512 VNNI, see
            :func:`fast_numerics_supported`).
        decoder_step: whether the library holds the fused decoder step
            (:func:`load_decoder_step`).
        kernel_dir: the cache folder of the compiled library (None: sources missing).
        missing_sources: kernel sources missing from the installation (by name).
    """

    state: str
    reason: Optional[str] = None
    isa: Optional[str] = None
    fast_numerics: bool = False
    decoder_step: bool = False
    kernel_dir: Optional[Path] = None
    missing_sources: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Whether the compiled kernels are loaded."""
        return self.state == "active"


def kernel_status(
    cache_dir: Optional[Path] = None, *, build: bool = True, enabled: Optional[bool] = None
) -> KernelStatus:
    """Load the compiled kernels as the CPU backend would (building them first where they
    are not in the cache, unless ``build`` is False) and say whether they are active and,
    if not, why (the same warnings as :func:`load_skinny_linear` are logged).

    Args:
        cache_dir: ragspec's cache folder (default as :func:`kernel_dir`).
        build: compile the library when it is not in the cache (minutes on a small CPU).
        enabled: whether the kernels are wanted (None: :func:`cpu_kernels_enabled`, i.e.
            unless ``RAGSPEC_CPU_KERNELS=0``).
    """
    missing = tuple(missing_sources())
    folder = None if missing else kernel_dir(cache_dir)
    if not (cpu_kernels_enabled() if enabled is None else enabled):
        return KernelStatus(
            "disabled", "switched off: RAGSPEC_CPU_KERNELS=0", kernel_dir=folder, missing_sources=missing
        )
    module, reason, state = _load_module_why(cache_dir, build=build)
    if module is None:
        return KernelStatus(state, reason, kernel_dir=folder, missing_sources=missing)
    return KernelStatus(
        "active",
        isa=str(module.cpu_isa()),
        fast_numerics=bool(module.fast_numerics_supported()),
        decoder_step=getattr(module, "DecoderStep", None) is not None,
        kernel_dir=folder,
    )
