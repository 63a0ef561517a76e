"""Row-invariant Triton kernels of the CUDA backend, and their torch references.

Every kernel computes each row of its output from that row's inputs alone, with the same
instructions whatever the number of rows and whoever shares the launch: a fixed tile shape
and a fixed reduction order (no split-K, no autotuning on the row count), the row count
never a compile-time constant (``do_not_specialize``). So a verification row's values are
bit for bit those of a one-row step at the same position, batched with other requests or
not (the contract the CPU kernels of ``backend/csrc`` keep, carried to the GPU).

* :func:`linear`: ``x [R, K] @ w[N, K].T`` in tiles of ``LINEAR_BLOCK`` (M, N, K), the K
  blocks summed in order, float32 accumulation (bf16 / fp16 / fp32 in; fp32 products in
  IEEE precision, never TF32).
* :func:`rms_norm`: Llama's RMSNorm (``w * norm(x)``) and Gemma-3's (``(1 + w) * norm(x)``),
  one program per row.
* :func:`silu_mul`, :func:`gelu_tanh_mul`: the gated MLP activations, element-wise.
* :func:`tree_attention`: a flat batch of query rows, each attending to its own request's
  KV slot and its draft-tree ancestors; keys visited in the row's *logical* order (its
  committed context, then its root-to-self path) in blocks of ``ATTN_BLOCK_N`` keys with an
  online softmax, grouped-query heads sharing a program. A tree row therefore sums exactly
  as the one-row step does once its path is committed.

CPU tensors run the same kernels through Triton's interpreter (no ``TRITON_INTERPRET``
needed: the interpreted twin is built per kernel), so CI tests the GPU code without a GPU.
This module imports torch and triton only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch

try:  # triton is the CUDA extra's; the references below work without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

__all__ = [
    "ATTN_BLOCK_N",
    "LINEAR_BLOCK",
    "attention_reference",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "linear",
    "linear_reference",
    "rms_norm",
    "rms_norm_reference",
    "silu_mul",
    "silu_mul_reference",
    "tree_attention",
    "triton_available",
]

LINEAR_BLOCK = (16, 64, 64)
"""(rows, output columns, reduction) of one linear tile: fixed, whatever the row count."""
ATTN_BLOCK_N = 32
"""Keys per block of the attention's online softmax (in each row's logical order)."""
_ELEMENTWISE_BLOCK = 1024


def triton_available() -> bool:
    """Whether triton is importable (the kernels need it; the references do not)."""
    return triton is not None


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


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

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            from triton.runtime import interpreter
            from triton.runtime.jit import JITFunction

            twins: dict[Any, Any] = {}

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


def _launch(kernel: Any, device: torch.device) -> Any:
    """``kernel`` itself for CUDA tensors, its interpreted twin for CPU ones."""
    if triton is None:
        raise RuntimeError("the CUDA backend's kernels need triton (pip install triton)")
    if device.type == "cpu":
        return _interpreted(kernel)
    return kernel


if triton is not None:

    @triton.jit(do_not_specialize=["R"])
    def _linear_kernel(
        x_ptr,
        w_ptr,
        b_ptr,
        y_ptr,
        R,
        N,
        K: tl.constexpr,
        stride_xr,
        stride_wn,
        stride_yr,
        HAS_BIAS: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # the K blocks in order: no split-K
            kk = k0 + ks
            x = tl.load(
                x_ptr + rows[:, None] * stride_xr + kk[None, :], mask=(rows[:, None] < R) & (kk[None, :] < K), other=0.0
            )
            w = tl.load(
                w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0
            )
            if UPCAST or x.dtype == tl.float32:  # (the interpreter's dot takes float32 only)
                acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rows[:, None] * stride_yr + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rows[:, None] < R) & (cols[None, :] < N),
        )

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_xr, stride_yr, eps, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        x = tl.load(x_ptr + r * stride_xr + cols, mask=m, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / H
        normed = x * (1.0 / tl.sqrt(var + eps))
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if OFFSET:  # Gemma: (1 + w) * norm(x) in float32, then the model's dtype
            y = normed * (1.0 + w)
        else:  # Llama: w * norm(x) rounded to the model's dtype first
            y = normed.to(y_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(y_ptr + r * stride_yr + cols, y.to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _gated_act_kernel(g_ptr, u_ptr, y_ptr, n, GELU: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if GELU:  # gelu, tanh approximation: tanh(z) = 1 - 2 / (1 + exp(2 z))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
        else:  # silu
            a = g / (1.0 + tl.exp(-g))
        a = a.to(y_ptr.dtype.element_ty).to(tl.float32)  # the activation in the model's dtype
        tl.store(y_ptr + offs, (a * u).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _tree_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        slot_ptr,
        ctx_ptr,
        path_ptr,
        plen_ptr,
        base_ptr,
        scale,
        window,
        stride_qr,
        stride_qh,
        stride_ks,
        stride_kp,
        stride_kh,
        stride_or,
        stride_oh,
        stride_pr,
        GROUP: tl.constexpr,
        GROUP_P2: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_P2: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        r = tl.program_id(0)
        hk = tl.program_id(1)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        ctx = tl.load(ctx_ptr + r)
        plen = tl.load(plen_ptr + r)
        base = tl.load(base_ptr + r)
        length = ctx + plen  # keys of this row, in logical order: context, then its path
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, D_P2)
        gm = g < GROUP
        dm = d < HEAD_D
        heads = hk * GROUP + g
        q = tl.load(
            q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0
        )
        q = q.to(tl.float32)
        m_i = tl.full((GROUP_P2,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_P2,), dtype=tl.float32)
        acc = tl.zeros((GROUP_P2, D_P2), dtype=tl.float32)
        # local layers (window > 0): only keys within `window` of the query (position length - 1)
        lo = tl.where(window > 0, tl.maximum(length - window, 0) // BLOCK_N * BLOCK_N, 0)
        kv_base = slot * stride_ks + hk * stride_kh
        s0 = lo
        while s0 < length:  # (a while loop: Triton's interpreter cannot range over a loaded bound)
            lg = s0 + tl.arange(0, BLOCK_N)
            valid = (lg < length) & ((window <= 0) | (lg > length - 1 - window))
            in_path = lg >= ctx
            step = tl.load(path_ptr + r * stride_pr + tl.where(in_path, lg - ctx, 0), mask=valid & in_path, other=0)
            phys = tl.where(in_path, base + step, lg).to(tl.int64)
            kvm = valid[:, None] & dm[None, :]
            offs = kv_base + phys[:, None] * stride_kp + d[None, :]
            k = tl.load(k_ptr + offs, mask=kvm, other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, BLOCK_N]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + offs, mask=kvm, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
            s0 += BLOCK_N
        out = acc / l_i[:, None]
        tl.store(
            o_ptr + r * stride_or + heads[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=gm[:, None] & dm[None, :],
        )


# ---------------------------------------------------------------------------- launchers
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias``, each row on its own (row-invariant).

    Args:
        x: [R, K] (bf16, fp16 or fp32; rows contiguous).
        weight: [N, K], the same dtype as ``x`` (or fp32).
        bias: [N] or None.

    Returns:
        [R, N] in ``x``'s dtype (float32 accumulation).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    r, k = x.shape
    n = weight.shape[0]
    y = torch.empty((r, n), dtype=x.dtype, device=x.device)
    if r == 0:
        return y
    bm, bn, bk = LINEAR_BLOCK
    grid = (triton.cdiv(r, bm), triton.cdiv(n, bn))
    _launch(_linear_kernel, x.device)[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        r,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        HAS_BIAS=bias is not None,
        UPCAST=x.device.type == "cpu",
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
    )
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool = False) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [R, H] -> [R, H] in ``x``'s dtype: Llama's
    ``w * norm(x)`` (``offset=False``) or Gemma-3's ``(1 + w) * norm(x)`` (``offset=True``),
    the mean of squares in float32."""
    x = x if x.stride(-1) == 1 and x.is_contiguous() else x.contiguous()
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    y = torch.empty_like(x2)
    if x2.shape[0]:
        h = int(shape[-1])
        _launch(_rms_norm_kernel, x.device)[(x2.shape[0],)](
            x2, weight, y, h, x2.stride(0), y.stride(0), float(eps), OFFSET=bool(offset), BLOCK=_next_pow2(h)
        )
    return y.reshape(shape)


def _gated(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
        _launch(_gated_act_kernel, gate.device)[grid](gate, up, y, n, GELU=gelu, BLOCK=_ELEMENTWISE_BLOCK)
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Llama's MLP), element-wise, in ``gate``'s dtype."""
    return _gated(gate, up, gelu=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma-3's MLP), element-wise, in ``gate``'s dtype."""
    return _gated(gate, up, gelu=True)


def tree_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    ctx_len: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
    path_base: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Attention of a flat batch of query rows over a position-indexed KV pool.

    Row r attends, in this logical order, to the keys at positions ``0 .. ctx_len[r] - 1``
    of slot ``slots[r]`` and then to those at positions ``path_base[r] + path[r, j]`` for
    ``j < path_len[r]`` (its draft-tree path, root to itself). A causal row has
    ``path_len`` 0; a tree row ``ctx_len = past``, ``path_base = past``.

    Args:
        q: [R, Hq, d] queries (rotary applied).
        k_pool, v_pool: [S, C, Hkv, d] one layer's keys/values (the row's own already written).
        slots, ctx_len, path_len, path_base: int32 [R].
        path: int32 [R, P] (P >= 1).
        scale: the score scale (``d ** -0.5`` for Llama).
        window: local attention: only keys ``> position - window`` (0: all).

    Returns:
        [R, Hq, d] in ``q``'s dtype.
    """
    r, hq, d = q.shape
    hkv = int(k_pool.shape[2])
    if hq % hkv:
        raise ValueError(f"tree_attention: {hq} query heads are not a multiple of {hkv} key-value heads")
    if k_pool.stride(3) != 1 or v_pool.stride() != k_pool.stride() or q.stride(2) != 1:
        raise ValueError("tree_attention: the pool and the queries need unit stride along the head size")
    o = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    if r == 0:
        return o
    group = hq // hkv
    _launch(_tree_attention_kernel, q.device)[(r, hkv)](
        q,
        k_pool,
        v_pool,
        o,
        slots,
        ctx_len,
        path,
        path_len,
        path_base,
        float(scale),
        int(window),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        o.stride(0),
        o.stride(1),
        path.stride(0),
        GROUP=group,
        GROUP_P2=_next_pow2(group),
        HEAD_D=d,
        D_P2=_next_pow2(d),
        BLOCK_N=ATTN_BLOCK_N,
    )
    return o


# ---------------------------------------------------------------------------- references
def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` in ``x``'s dtype (cuBLAS / BLAS: not row-invariant)."""
    return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool = False) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` (``offset=False``) / ``Gemma3RMSNorm`` (``offset=True``)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as transformers' Llama MLP computes it."""
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_pytorch_tanh(gate) * up`` as transformers' Gemma-3 MLP computes it."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    ctx_len: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
    path_base: torch.Tensor,
    *,
    scale: float,
    window: int = 0,
    dtype: Optional[torch.dtype] = None,
    trim: bool = True,
    invariant: bool = True,
) -> torch.Tensor:
    """:func:`tree_attention` in torch (each row's keys gathered, one masked softmax over
    all rows at once), computed in ``dtype`` (default float32; float64 for a reference) and
    returned in ``q``'s dtype. On CPU (``trim``) the gather is as wide as the longest row's
    keys; elsewhere as wide as a slot (C positions: no host synchronisation). ``invariant``:
    products summed along an axis (no batched GEMM), so that a row's values are its own
    whoever shares the call and whatever the gather's width (but neither fast nor bit-equal
    to the kernel); else batched matrix products (fast mode on CPU)."""
    cdt = dtype or torch.float32
    r, hq, d = q.shape
    cap, hkv = int(k_pool.shape[1]), int(k_pool.shape[2])
    if r == 0:
        return torch.empty_like(q)
    if trim and q.device.type == "cpu":  # gather only as many keys as the longest row has (a host read)
        cap = max(1, min(cap, int((ctx_len.long() + path_len.long()).max())))
    lg = torch.arange(cap, device=q.device)[None, :]  # logical index [1, C]
    full = int(k_pool.shape[1])
    ctx = ctx_len.long()[:, None]
    length = ctx + path_len.long()[:, None]
    in_path = lg >= ctx
    step_idx = (lg - ctx).clamp(0, path.shape[1] - 1)
    phys = torch.where(in_path, path_base.long()[:, None] + path.long().gather(1, step_idx), lg).clamp(0, full - 1)
    valid = lg < length
    if window > 0:
        valid &= lg > length - 1 - window
    sl = slots.long()[:, None].expand(-1, cap)
    k = k_pool[sl, phys].to(cdt)  # [R, C, Hkv, d]
    v = v_pool[sl, phys].to(cdt)
    group = hq // hkv
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [R, Hq, C, d]
    if invariant:  # products summed along one axis: each row's sums are its own
        s = (q.to(cdt)[:, :, None, :] * k).sum(-1) * scale  # [R, Hq, C]
    else:
        s = (q.to(cdt)[:, :, None, :] @ k.transpose(-1, -2))[:, :, 0] * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    if invariant:
        return (p[..., None] * v).sum(2).to(q.dtype)
    return (p[:, :, None, :] @ v)[:, :, 0].to(q.dtype)


def default_scale(head_dim: int) -> float:
    """The usual attention scale ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(head_dim)
