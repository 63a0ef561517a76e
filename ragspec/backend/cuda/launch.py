"""How the CUDA backend's Triton kernels are launched: compiled on CUDA tensors, through
Triton's interpreter on CPU tensors (so CI tests the GPU code without a GPU).

Triton is the CUDA extra's: this module imports without it (:func:`triton_available` says
whether it is there) and every launcher raises a clear error when it is needed and missing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:  # triton is the CUDA extra's; the torch references work without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = ["launcher", "matmul", "next_pow2", "tl", "triton", "triton_available"]


def triton_available() -> bool:
    """Whether triton is importable (the kernels need it; the references do not)."""
    return triton is not None


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


if triton is not None:

    @triton.jit
    def matmul(a, b, INTERPRETED: tl.constexpr):
        """``a [M, K] @ b [K, N]`` with float32 accumulation: ``tl.dot`` compiled (tensor
        cores for bf16 / fp16, IEEE float32 products for float32, never TF32); under the
        interpreter the products summed along K in order (numpy's matmul is not: a BLAS
        kernel sums a row differently at another position of the tile)."""
        if INTERPRETED:
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif a.dtype == tl.float32:
            return tl.dot(a, b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b.to(a.dtype))

else:  # pragma: no cover - exercised where triton is absent
    matmul = None


class _Interpreted:
    """The interpreter twin of a ``@triton.jit`` kernel, for CPU tensors.

    Triton's own interpreter mode (``TRITON_INTERPRET=1``) must be on before triton is
    imported: its standard library (``tl.sum``, ``tl.zeros``...) is then built for the
    interpreter. Here triton may have been imported without it (by torch, another test...):
    while a kernel runs interpreted, calls to the library's compiled functions run their
    Python source through the interpreter as well (with the language patched as the
    interpreter patches it, restored afterwards)."""

    def __init__(self, kernel: Any) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self._fn = InterpretedFunction(getattr(kernel, "fn", kernel))
        self._twins: dict[Any, Any] = {}  # the library's and our helpers, rewritten once

    def __getitem__(self, grid: Any) -> Any:
        twins = self._twins

        def launch(*args: Any, **kwargs: Any) -> Any:
            from triton.runtime import interpreter
            from triton.runtime.jit import JITFunction

            def device_call(jit_fn: Any, *a: Any, **kw: Any) -> Any:
                fn = twins.get(id(jit_fn))  # (hashing a JITFunction inspects its globals)
                if fn is None:
                    fn = twins[id(jit_fn)] = interpreter.InterpretedFunction(jit_fn.fn).rewrite()
                return fn(*a, **kw)

            # the library's functions see triton.language.core as the interpreter patches it
            scope = interpreter._patch_lang(tl.standard.sum.fn)
            saved = JITFunction.__call__
            JITFunction.__call__ = device_call
            try:
                return self._fn[grid](*args, **kwargs)
            finally:
                JITFunction.__call__ = saved
                scope.restore()

        return launch


@functools.lru_cache(maxsize=None)
def _interpreted(kernel: Any) -> _Interpreted:
    return _Interpreted(kernel)


def launcher(kernel: Any, device: torch.device) -> Any:
    """``kernel`` itself for CUDA tensors, its interpreted twin for CPU ones (index it with
    the grid, then call it with the arguments).

    Raises:
        RuntimeError: triton is not installed.
    """
    if triton is None:
        raise RuntimeError("the CUDA backend's kernels need triton (pip install triton)")
    if device.type == "cpu":
        return _interpreted(kernel)
    return kernel
