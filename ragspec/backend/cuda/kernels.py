"""Row-invariant Triton kernels of the CUDA backend, and their torch references.

Every kernel computes each row of its output from that row's inputs alone, with the same
instructions whatever the number of rows and whoever shares the launch: a tile shape chosen
from the weight's shape only and a fixed reduction order (no split-K, no autotuning on the
row count), the row count never a compile-time constant (``do_not_specialize``). So a
verification row's values are bit for bit those of a one-row step at the same position,
batched with other requests or not (the contract the CPU kernels of ``backend/cpu/csrc``
keep, carried to the GPU).

A decoder layer of the step is nine launches:

* :func:`residual_norm` (twice): the residual add fused into the next RMSNorm (the first
  layer's reads the token embeddings; Gemma-3's also norms the block output before the add);
* :func:`linear` (q/k/v, o, down) and :func:`gated_linear` (gate/up with SiLU or GELU in
  its epilogue): ``x [R, K] @ w[N, K].T`` in tiles of :func:`linear_tiles`, the K blocks
  summed in order, float32 accumulation (fp32 products in IEEE precision, never TF32);
* :func:`rope_kv_write`: rotary embedding of the queries and keys (after Gemma-3's per-head
  norms), the keys and values written into the KV pool at each row's position, the cos/sin
  tables read at the row's position (no gather per layer);
* :func:`~ragspec.backend.cuda.attention.tree_attention` (two launches: keys in fixed
  logical chunks, then their ordered combine).

The step ends with the output layer (:func:`logits`, float32, soft-capped where the model
does) and :func:`argmax` (int32 per row, for greedy rows). Every kernel rounds where the
model's dtype rounds in transformers (a bf16 activation is rounded before it is multiplied),
so the values stay close to transformers' own forward.

CPU tensors run the same kernels through Triton's interpreter (no ``TRITON_INTERPRET``
needed: :mod:`~ragspec.backend.cuda.launch`), so CI tests the GPU code without a GPU. This
module imports torch and triton only.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from . import launch
from .attention import ATTN_BLOCK_N, ATTN_CHUNK, attention_reference, tree_attention
from .launch import matmul, next_pow2, tl, triton, triton_available

__all__ = [
    "ATTN_BLOCK_N",
    "ATTN_CHUNK",
    "LINEAR_BLOCK",
    "argmax",
    "attention_reference",
    "gated_linear",
    "gated_linear_reference",
    "gelu_tanh_mul",
    "gelu_tanh_mul_reference",
    "linear",
    "linear_reference",
    "linear_tiles",
    "logits",
    "logits_reference",
    "residual_norm",
    "residual_norm_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope_kv_reference",
    "rope_kv_write",
    "silu_mul",
    "silu_mul_reference",
    "tree_attention",
    "triton_available",
]

LINEAR_BLOCK = (16, 64, 64)
"""(rows, output columns, reduction) of the widest linear tile; :func:`linear_tiles` narrows
the columns for small weights. The rows and the reduction block never change."""
TARGET_PROGRAMS = 128
"""Column tiles a linear aims for (an H100 has 132 SMs): the widest tile that gives a weight
at least this many, else the narrowest (16 columns)."""
_ELEMENTWISE_BLOCK = 1024
_ACTS = {"none": 0, "silu": 1, "gelu_tanh": 2}


def linear_tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages) of a linear over a weight of ``n`` output columns
    and ``k`` inputs: a function of the weight's shape only, never of the row count (so
    every row of every call runs the same tile). The widest column tile of 128, 64 or 32
    that still gives :data:`TARGET_PROGRAMS` programs, else 16: a 576-column projection of
    the default model gets 36 programs, not 9. (Under Triton's interpreter, on CPU tensors,
    the widest tile of :data:`LINEAR_BLOCK`: fewer programs to interpret.)"""
    bm, _, bk = LINEAR_BLOCK
    bn = next((b for b in (128, 64, 32) if -(-int(n) // b) >= TARGET_PROGRAMS), 16)
    stages = 4 if int(k) >= 4 * bk else 2
    return bm, bn, bk, stages


if triton is not None:

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        if ACT == 2:  # gelu, tanh approximation: tanh(z) = 1 - 2 / (1 + exp(2 z))
            z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            a = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
        else:  # silu
            a = g / (1.0 + tl.exp(-g))
        return a

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
        softcap,
        HAS_BIAS: tl.constexpr,
        ACT: tl.constexpr,
        SOFTCAP: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        # y[R, N] = x @ w[:N].T; with ACT, y = act(x @ w[:N].T) * (x @ w[N:2N].T) (gate, up)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        dt = x_ptr.dtype.element_ty
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):  # the K blocks in order: no split-K
            kk = k0 + ks
            x = tl.load(
                x_ptr + rows[:, None] * stride_xr + kk[None, :], mask=(rows[:, None] < R) & (kk[None, :] < K), other=0.0
            )
            wm = (cols[None, :] < N) & (kk[:, None] < K)
            w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None], mask=wm, other=0.0)
            acc += matmul(x, w, UPCAST)
            if ACT != 0:
                u = tl.load(w_ptr + (cols[None, :] + N) * stride_wn + kk[:, None], mask=wm, other=0.0)
                acc_up += matmul(x, u, UPCAST)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if ACT != 0:  # gate and up rounded to the model's dtype, as two linear layers give them
            g = acc.to(dt).to(tl.float32)
            a = _act(g, ACT).to(dt).to(tl.float32)  # the activation in the model's dtype
            acc = a * acc_up.to(dt).to(tl.float32)
        if SOFTCAP:  # logits: rounded to the model's dtype, then cap * tanh(logit / cap) in float32
            z = acc.to(dt).to(tl.float32) / softcap
            acc = softcap * (1.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
        elif y_ptr.dtype.element_ty != dt:  # float32 logits of a bf16 model: rounded first
            acc = acc.to(dt).to(tl.float32)
        tl.store(
            y_ptr + rows[:, None] * stride_yr + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=(rows[:, None] < R) & (cols[None, :] < N),
        )

    @triton.jit
    def _norm(x, w, H, eps, OFFSET: tl.constexpr, dt: tl.constexpr):
        # RMSNorm of one row (float32 x, masked lanes 0): Llama w * norm(x), Gemma (1 + w) * norm(x)
        var = tl.sum(x * x, axis=0) / H
        normed = x * (1.0 / tl.sqrt(var + eps))
        if OFFSET:  # Gemma: (1 + w) * norm(x) in float32, then the model's dtype
            y = normed * (1.0 + w)
        else:  # Llama: w * norm(x) rounded to the model's dtype first
            y = normed.to(dt).to(tl.float32) * w
        return y.to(dt)

    @triton.jit
    def _residual_norm_kernel(
        x_ptr,
        d_ptr,
        tok_ptr,
        emb_ptr,
        w_in_ptr,
        w_ptr,
        h_ptr,
        H,
        stride_xr,
        stride_dr,
        stride_hr,
        stride_er,
        eps,
        emb_scale,
        MODE: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        OFFSET: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # MODE 0: x = embed[token] (* scale); 1: x += d; 2: x += norm(d, w_in); 3: x read only.
        # Then h = norm(x, w). One program per row; x updated in place (modes 0-2).
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = cols < H
        dt = h_ptr.dtype.element_ty
        if MODE == 0:
            tok = tl.load(tok_ptr + r).to(tl.int64)
            x = tl.load(emb_ptr + tok * stride_er + cols, mask=m, other=0.0)
            if HAS_SCALE:  # Gemma's sqrt(H), a scalar in the model's dtype
                x = (x.to(tl.float32) * emb_scale).to(dt)
            tl.store(x_ptr + r * stride_xr + cols, x, mask=m)
        else:
            x = tl.load(x_ptr + r * stride_xr + cols, mask=m, other=0.0)
            if MODE == 1:
                d = tl.load(d_ptr + r * stride_dr + cols, mask=m, other=0.0)
                x = (x.to(tl.float32) + d.to(tl.float32)).to(dt)
                tl.store(x_ptr + r * stride_xr + cols, x, mask=m)
            elif MODE == 2:
                d = tl.load(d_ptr + r * stride_dr + cols, mask=m, other=0.0).to(tl.float32)
                w_in = tl.load(w_in_ptr + cols, mask=m, other=0.0).to(tl.float32)
                dn = _norm(d, w_in, H, eps, OFFSET, dt)
                x = (x.to(tl.float32) + dn.to(tl.float32)).to(dt)
                tl.store(x_ptr + r * stride_xr + cols, x, mask=m)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        h = _norm(x.to(tl.float32), w, H, eps, OFFSET, dt)
        tl.store(h_ptr + r * stride_hr + cols, h, mask=m)

    @triton.jit
    def _gated_act_kernel(g_ptr, u_ptr, y_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
        a = _act(g, ACT).to(y_ptr.dtype.element_ty).to(tl.float32)  # the activation in the model's dtype
        tl.store(y_ptr + offs, (a * u).to(y_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _rope_kv_kernel(
        qkv_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        slot_ptr,
        wpos_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        qn_ptr,
        kn_ptr,
        stride_qkv,
        stride_cos,
        stride_qr,
        stride_qh,
        stride_ks,
        stride_kp,
        stride_kh,
        eps,
        HQ: tl.constexpr,
        HKV: tl.constexpr,
        H_P: tl.constexpr,
        KV_P: tl.constexpr,
        HEAD_D: tl.constexpr,
        HALF_P2: tl.constexpr,
        QK_NORM: tl.constexpr,
        OFFSET: tl.constexpr,
    ):
        # one program per row: its HQ query heads and HKV key heads rotated (rows of a
        # [H_P, half] tile, heads 0 .. HQ-1 queries then the keys), its values copied
        r = tl.program_id(0).to(tl.int64)
        half = HEAD_D // 2
        hh = tl.arange(0, H_P)
        i = tl.arange(0, HALF_P2)
        m = (hh[:, None] < HQ + HKV) & (i[None, :] < half)
        dt = q_ptr.dtype.element_ty
        src = qkv_ptr + r * stride_qkv + hh[:, None] * HEAD_D + i[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
        if QK_NORM:  # Gemma-3: RMSNorm of each head before the rotation
            isq = hh[:, None] < HQ
            w1 = tl.where(isq, tl.load(qn_ptr + i, mask=i < half, other=0.0)[None, :].to(tl.float32),
                          tl.load(kn_ptr + i, mask=i < half, other=0.0)[None, :].to(tl.float32))  # fmt: skip
            w2 = tl.where(isq, tl.load(qn_ptr + half + i, mask=i < half, other=0.0)[None, :].to(tl.float32),
                          tl.load(kn_ptr + half + i, mask=i < half, other=0.0)[None, :].to(tl.float32))  # fmt: skip
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_D + eps)
            rs = rstd[:, None]
            if OFFSET:
                x1 = (x1 * rs * (1.0 + w1)).to(dt).to(tl.float32)
                x2 = (x2 * rs * (1.0 + w2)).to(dt).to(tl.float32)
            else:
                x1 = ((x1 * rs).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
                x2 = ((x2 * rs).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        pos = tl.load(pos_ptr + r).to(tl.int64)
        im = i < half
        c1 = tl.load(cos_ptr + pos * stride_cos + i, mask=im, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos_ptr + pos * stride_cos + half + i, mask=im, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sin_ptr + pos * stride_cos + i, mask=im, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin_ptr + pos * stride_cos + half + i, mask=im, other=0.0).to(tl.float32)[None, :]
        # x * cos + rotate_half(x) * sin, each product rounded as transformers' bf16 ops round it
        o1 = ((x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)).to(dt)
        qm = m & (hh[:, None] < HQ)
        dst = q_ptr + r * stride_qr + hh[:, None] * stride_qh + i[None, :]
        tl.store(dst, o1, mask=qm)
        tl.store(dst + half, o2, mask=qm)
        slot = tl.load(slot_ptr + r).to(tl.int64)
        wp = tl.load(wpos_ptr + r).to(tl.int64)
        kvrow = slot * stride_ks + wp * stride_kp
        km = m & (hh[:, None] >= HQ)
        kdst = k_ptr + kvrow + (hh[:, None] - HQ) * stride_kh + i[None, :]
        tl.store(kdst, o1, mask=km)
        tl.store(kdst + half, o2, mask=km)
        hv = tl.arange(0, KV_P)
        j = tl.arange(0, 2 * HALF_P2)
        vm = (hv[:, None] < HKV) & (j[None, :] < HEAD_D)
        val = tl.load(qkv_ptr + r * stride_qkv + (HQ + HKV + hv[:, None]) * HEAD_D + j[None, :], mask=vm, other=0.0)
        tl.store(v_ptr + kvrow + hv[:, None] * stride_kh + j[None, :], val, mask=vm)

    @triton.jit
    def _argmax_kernel(x_ptr, y_ptr, stride_xr, V: tl.constexpr, BLOCK: tl.constexpr):
        # the first index of each row's maximum (as torch.argmax), blocks scanned in order
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        best = tl.max(tl.full((BLOCK,), float("-inf"), dtype=tl.float32), axis=0)
        best_i = tl.sum(tl.zeros((BLOCK,), dtype=tl.int32), axis=0)
        for v0 in range(0, V, BLOCK):
            x = tl.load(x_ptr + r * stride_xr + v0 + cols, mask=v0 + cols < V, other=float("-inf"))
            bm = tl.max(x, axis=0)
            bi = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32) + v0
            better = bm > best
            best_i = tl.where(better, bi, best_i)
            best = tl.where(better, bm, best)
        tl.store(y_ptr + r, best_i)


def _check_linear(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit")


def _linear_launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    n: int,
    act: str,
    out_dtype: torch.dtype,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    r, k = x.shape
    y = torch.empty((r, n), dtype=out_dtype, device=x.device)
    if r == 0:
        return y
    bm, bn, bk, stages = linear_tiles(n, k) if x.device.type != "cpu" else LINEAR_BLOCK + (1,)
    grid = (triton.cdiv(r, bm), triton.cdiv(n, bn))
    launch.launcher(_linear_kernel, x.device)[grid](
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
        float(softcap or 1.0),
        HAS_BIAS=bias is not None,
        ACT=_ACTS[act],
        SOFTCAP=bool(softcap),
        UPCAST=x.device.type == "cpu",
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        STAGES=stages,
    )
    return y


# ---------------------------------------------------------------------------- launchers
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T + bias``, each row on its own (row-invariant).

    Args:
        x: [R, K] (bf16, fp16 or fp32; rows contiguous).
        weight: [N, K], the same dtype as ``x`` (or fp32).
        bias: [N] or None.

    Returns:
        [R, N] in ``x``'s dtype (float32 accumulation).

    Raises:
        ValueError: shapes that do not fit.
    """
    _check_linear(x, weight)
    return _linear_launch(x, weight, bias, int(weight.shape[0]), "none", x.dtype)


def gated_linear(x: torch.Tensor, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(x @ gate.T) * (x @ up.T)`` in one launch (the gated MLP's first half with its
    activation in the epilogue), each row on its own. Gate and up are rounded to ``x``'s
    dtype before the activation, as two separate linear layers would give them.

    Args:
        x: [R, K].
        gate_up: [2 I, K], the gate's rows then the up projection's.
        act: ``"silu"`` (Llama) or ``"gelu_tanh"`` (Gemma-3).

    Returns:
        [R, I] in ``x``'s dtype.

    Raises:
        ValueError: shapes that do not fit, an odd row count of ``gate_up`` or an unknown
            activation.
    """
    _check_linear(x, gate_up)
    if gate_up.shape[0] % 2 or act not in ("silu", "gelu_tanh"):
        raise ValueError(f"gated_linear: gate_up {tuple(gate_up.shape)} with activation {act!r}")
    return _linear_launch(x, gate_up, None, int(gate_up.shape[0]) // 2, act, x.dtype)


def logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """The output layer: ``hidden @ weight.T (+ bias)`` rounded to ``hidden``'s dtype, then
    float32, soft-capped (``cap * tanh(logits / cap)``) when ``softcap`` is given.

    Args:
        hidden: [R, H]; weight: [V, H]; bias: [V] or None.

    Returns:
        float32 [R, V].
    """
    _check_linear(hidden, weight)
    return _linear_launch(hidden, weight, bias, int(weight.shape[0]), "none", torch.float32, softcap)


def residual_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: Optional[torch.Tensor] = None,
    delta_weight: Optional[torch.Tensor] = None,
    tokens: Optional[torch.Tensor] = None,
    embed: Optional[torch.Tensor] = None,
    embed_scale: Optional[float] = None,
    offset: bool = False,
) -> None:
    """The residual stream's update fused with the next RMSNorm, in place, one program per
    row: ``x = embed[tokens] (* embed_scale)`` when ``tokens`` is given, else ``x += delta``
    (``x += norm(delta, delta_weight)`` with ``delta_weight``: Gemma-3's norms after a
    block), else ``x`` unchanged; then ``h = norm(x, weight)``.

    Args:
        x: [R, H] the residual stream (written unless only read).
        h: [R, H] the normed output.
        weight: [H] the norm's weight; ``offset``: Gemma's ``(1 + w)``.
        delta: [R, H] a block's output; delta_weight: [H] its norm, or None.
        tokens: [R] int token ids; embed: [V, H]; embed_scale: Gemma's ``sqrt(H)`` as the
            model's dtype holds it.
    """
    r, hid = x.shape
    if not r:
        return
    mode = 0 if tokens is not None else 3 if delta is None else 2 if delta_weight is not None else 1
    d = delta if delta is not None else x
    emb = embed if embed is not None else x
    launch.launcher(_residual_norm_kernel, x.device)[(r,)](
        x,
        d,
        tokens if tokens is not None else x,
        emb,
        delta_weight if delta_weight is not None else weight,
        weight,
        h,
        hid,
        x.stride(0),
        d.stride(0),
        h.stride(0),
        emb.stride(0),
        float(eps),
        float(embed_scale or 1.0),
        MODE=mode,
        HAS_SCALE=embed_scale is not None,
        OFFSET=bool(offset),
        BLOCK=next_pow2(hid),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool = False) -> torch.Tensor:
    """RMSNorm of each row of ``x`` [..., H] -> the same shape in ``x``'s dtype: Llama's
    ``w * norm(x)`` (``offset=False``) or Gemma-3's ``(1 + w) * norm(x)`` (``offset=True``),
    the mean of squares in float32."""
    x = x if x.is_contiguous() else x.contiguous()
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.empty_like(x2)
    residual_norm(x2, y, weight, eps, offset=offset)
    return y.reshape(x.shape)


def _gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        grid = (triton.cdiv(n, _ELEMENTWISE_BLOCK),)
        launch.launcher(_gated_act_kernel, gate.device)[grid](gate, up, y, n, ACT=_ACTS[act], BLOCK=_ELEMENTWISE_BLOCK)
    return y


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (Llama's MLP), element-wise, in ``gate``'s dtype."""
    return _gated(gate, up, "silu")


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma-3's MLP), element-wise, in ``gate``'s dtype."""
    return _gated(gate, up, "gelu_tanh")


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    heads: int,
    *,
    q_norm: Optional[torch.Tensor] = None,
    k_norm: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    offset: bool = False,
) -> torch.Tensor:
    """Rotary embedding of the queries and keys of ``qkv`` (after per-head RMSNorms where
    given: Gemma-3), the keys and values written into the pool at each row's slot and
    position; one program per row.

    Args:
        qkv: [R, (Hq + 2 Hkv) d] the q/k/v projection's output.
        cos, sin: [C, d] rotary tables (read at each row's position).
        positions: [R] int rotary positions; slots, write_pos: [R] int pool slot and position.
        k_pool, v_pool: [S, C, Hkv, d] one layer's keys / values (unit stride along d).
        heads: Hq.
        q_norm, k_norm: [d] per-head norm weights, or None.

    Returns:
        q: [R, Hq, d] in ``qkv``'s dtype.
    """
    r = int(qkv.shape[0])
    hkv, d = int(k_pool.shape[2]), int(k_pool.shape[3])
    if qkv.shape[1] != (heads + 2 * hkv) * d or cos.stride(1) != 1 or k_pool.stride(3) != 1:
        raise ValueError(f"rope_kv_write: qkv {tuple(qkv.shape)} does not fit {heads} + 2 x {hkv} heads of {d}")
    qkv = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    q = torch.empty((r, heads, d), dtype=qkv.dtype, device=qkv.device)
    if not r:
        return q
    norm = q_norm is not None
    launch.launcher(_rope_kv_kernel, qkv.device)[(r,)](
        qkv,
        cos,
        sin,
        positions,
        slots,
        write_pos,
        q,
        k_pool,
        v_pool,
        q_norm if norm else cos,
        k_norm if norm else cos,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        k_pool.stride(2),
        float(eps),
        HQ=heads,
        HKV=hkv,
        H_P=next_pow2(heads + hkv),
        KV_P=next_pow2(hkv),
        HEAD_D=d,
        HALF_P2=next_pow2(d // 2),
        QK_NORM=norm,
        OFFSET=bool(offset),
    )
    return q


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The first index of each row's maximum (``torch.argmax(x, -1)``): float32 [R, V] ->
    int32 [R]."""
    r, v = x.shape
    y = torch.empty((r,), dtype=torch.int32, device=x.device)
    if r:
        block = min(4096, next_pow2(v))
        launch.launcher(_argmax_kernel, x.device)[(r,)](x, y, x.stride(0), V=v, BLOCK=block)
    return y


# ---------------------------------------------------------------------------- references
def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` in ``x``'s dtype (cuBLAS / BLAS: not row-invariant)."""
    return torch.nn.functional.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def gated_linear_reference(x: torch.Tensor, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """:func:`gated_linear` as two torch linear layers and transformers' activation."""
    gu = linear_reference(x, gate_up)
    i = gu.shape[1] // 2
    fn = gelu_tanh_mul_reference if act == "gelu_tanh" else silu_mul_reference
    return fn(gu[:, :i], gu[:, i:])


def logits_reference(
    hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None
) -> torch.Tensor:
    """:func:`logits` in torch (transformers' order: the linear in the model's dtype, then
    float32 and the soft cap)."""
    out = linear_reference(hidden, weight, bias).float()
    if softcap:
        out = torch.tanh(out / softcap) * softcap
    return out


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, *, offset: bool = False) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` (``offset=False``) / ``Gemma3RMSNorm`` (``offset=True``)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def residual_norm_reference(
    x: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    delta: Optional[torch.Tensor] = None,
    delta_weight: Optional[torch.Tensor] = None,
    tokens: Optional[torch.Tensor] = None,
    embed: Optional[torch.Tensor] = None,
    embed_scale: Optional[float] = None,
    offset: bool = False,
) -> None:
    """:func:`residual_norm` in torch (transformers' ops, in place into ``x`` and ``h``)."""
    if tokens is not None and embed is not None:
        e = embed[tokens.long()]
        x.copy_(e * torch.tensor(embed_scale, dtype=e.dtype) if embed_scale is not None else e)
    elif delta is not None:
        d = rms_norm_reference(delta, delta_weight, eps, offset=offset) if delta_weight is not None else delta
        x.copy_(x + d)
    h.copy_(rms_norm_reference(x, weight, eps, offset=offset))


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as transformers' Llama MLP computes it."""
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_pytorch_tanh(gate) * up`` as transformers' Gemma-3 MLP computes it."""
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_kv_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    write_pos: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    heads: int,
    *,
    q_norm: Optional[torch.Tensor] = None,
    k_norm: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    offset: bool = False,
) -> torch.Tensor:
    """:func:`rope_kv_write` in torch (transformers' ``apply_rotary_pos_emb``)."""
    r = qkv.shape[0]
    hkv, d = int(k_pool.shape[2]), int(k_pool.shape[3])
    q = qkv[:, : heads * d].reshape(r, heads, d)
    k = qkv[:, heads * d : (heads + hkv) * d].reshape(r, hkv, d)
    v = qkv[:, (heads + hkv) * d :].reshape(r, hkv, d)
    if q_norm is not None and k_norm is not None:
        q = rms_norm_reference(q, q_norm, eps, offset=offset)
        k = rms_norm_reference(k, k_norm, eps, offset=offset)
    pos = positions.long()
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # [R, 1, d]
    q = (q * c + _rotate_half(q) * s).contiguous()
    k = k * c + _rotate_half(k) * s
    sl, wp = slots.long(), write_pos.long()
    k_pool[sl, wp] = k
    v_pool[sl, wp] = v
    return q


def default_scale(head_dim: int) -> float:
    """The usual attention scale ``head_dim ** -0.5``."""
    return 1.0 / math.sqrt(head_dim)
