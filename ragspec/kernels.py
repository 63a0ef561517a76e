"""Optional compiled CPU kernel for few-row linear layers (plain decoding and verification).

Decoding multiplies one activation row (verification: a few) with every weight matrix, so a
step costs streaming the weights from memory once. On the 2-core AMD EPYC CPU of our CI,
MKL's float32 sgemv/sgemm for one row streams ~10 GB/s, oneDNN's pre-packed path ~13 GB/s,
while the memory system delivers ~25 GB/s to a plain reduction. ``csrc/skinny_linear.cpp``
(AVX2/FMA, ATen's thread pool) streams each weight row once for all rows of the input and
reaches ~20 GB/s: the decoder's linear layers of SmolLM2-135M for one row 36-47 ms -> 25 ms,
for 8 rows (oneDNN) 49 -> 36 ms.

The kernel is compiled on first use with ``torch.utils.cpp_extension.load`` (about 45 s;
needs a C++ compiler and ninja) into ``~/.cache/ragspec/kernels/<torch version>``, and
loaded from there afterwards (~1 s). Where it cannot be built or loaded (no compiler, no
AVX2, another platform), :func:`load_skinny_linear` returns None and callers keep torch's
own kernels (as they do with ``RAGSPEC_CPU_KERNELS=0``): the kernel only makes things faster, never different
in kind (its values equal ``F.linear``'s up to float32 summation order).
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

__all__ = ["SKINNY_MAX_ROWS", "SkinnyLinear", "load_skinny_linear", "cpu_kernels_enabled"]

# rows up to which the compiled kernel beats oneDNN's pre-packed linear (measured on the
# 2-core CPU for the default model's shapes: 16 rows 62 vs 64 ms, 24 rows 68 vs 77 ms but
# with a smaller margin than the noise); above it torch's kernels are used
SKINNY_MAX_ROWS = 16

# x float32 [R, I], weight float32 [O, I] (contiguous), bias float32 [O] or None -> [R, O]
SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

_SOURCE = Path(__file__).with_name("csrc") / "skinny_linear.cpp"


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


def load_skinny_linear(cache_dir: Optional[Path] = None) -> Optional[SkinnyLinear]:
    """Build (first call) or load the few-row linear kernel; None where it is unavailable.

    Args:
        cache_dir: where compiled kernels live (default ``~/.cache/ragspec/kernels``); one
            sub-folder per torch version.

    Returns:
        ``skinny_linear(x, weight, bias)``: x float32 [R, I], weight float32 [O, I]
        contiguous, bias float32 [O] or None -> float32 [R, O] (no autograd), or None when
        the CPU lacks AVX2/FMA, no C++ compiler is found or the build fails (logged as
        a warning). ``RAGSPEC_CPU_KERNELS`` is the caller's to check
        (:func:`cpu_kernels_enabled`; ``Engine.from_pretrained`` does).
    """
    if not _cpu_supported():
        logger.debug("compiled CPU kernels skipped: needs Linux x86-64 with AVX2")
        return None
    if not (shutil.which(os.environ.get("CXX", "c++")) and shutil.which("ninja")):
        logger.info("compiled CPU kernels skipped: no C++ compiler or ninja found (torch's kernels are used)")
        return None
    base = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "ragspec" / "kernels"
    build = base / f"torch-{torch.__version__.replace('+', '-')}"
    try:
        from torch.utils.cpp_extension import load

        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            logger.warning("compiling the CPU decoding kernel (first use only, ~45 s) into %s", build)
        module = load(
            name="ragspec_skinny_linear",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # compiler errors, missing headers, a broken cache folder
        logger.warning("compiled CPU kernel unavailable (%s); torch's kernels are used", str(exc).splitlines()[0][:200])
        return None
    return module.skinny_linear
