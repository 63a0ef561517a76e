"""Chunked exact tree attention: flash-decoding made row-invariant.

Row r of a flat batch attends, in its *logical* order, to the keys at positions
``0 .. ctx_len[r] - 1`` of its slot and then to those at ``path_base[r] + path[r, j]`` for
``j < path_len[r]`` (its draft-tree ancestors, root to itself). The logical keys are split
into chunks of :data:`ATTN_CHUNK` positions: one program per (row, key-value head, chunk)
runs an online softmax over its chunk in blocks of :data:`ATTN_BLOCK_N` keys (a pipelined
loop, ``tl.dot`` with the grouped-query heads padded to 16 rows), and a second launch
combines each row's chunks in chunk order. The split points are logical positions, never a
function of the row count or of who shares the launch, so:

* a row's values are the same alone or batched (row invariance);
* a draft-tree row sums exactly as the one-row step at the same position does once its path
  is committed (the same logical keys, in the same chunks and blocks).

Local layers (``window`` > 0: Gemma-3's sliding layers) see only keys ``> position -
window``; chunks wholly outside the window are skipped by both launches alike.

This module imports torch and triton only.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import launch
from .launch import matmul, next_pow2, tl, triton

__all__ = ["ATTN_BLOCK_N", "ATTN_CHUNK", "attention_reference", "tree_attention"]

ATTN_CHUNK = 256
"""Logical key positions per chunk (one program each); the combine visits them in order."""
ATTN_BLOCK_N = 64
"""Keys per block of a chunk's online softmax."""
_MIN_DOT = 16  # tl.dot's smallest tile side


if triton is not None:

    @triton.jit
    def _attn_block(
        q, m_i, l_i, acc, k_ptr, v_ptr, path_ptr, kv_base, lg0, ctx, length, base, window, scale, stride_kp, d, dm,
        BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        # one block of keys (logical indices lg0 ..) into a chunk's online softmax
        lg = lg0 + tl.arange(0, BLOCK_N)
        valid = (lg < length) & ((window <= 0) | (lg >= length - window))
        in_path = lg >= ctx
        step = tl.load(path_ptr + tl.where(in_path, lg - ctx, 0), mask=valid & in_path, other=0)
        phys = tl.where(in_path, base + step, lg)  # pool position (int32: a slot's offsets fit)
        kvm = valid[:, None] & dm[None, :]
        offs = phys[:, None] * stride_kp + d[None, :]
        k = tl.load(k_ptr + kv_base + offs, mask=kvm, other=0.0)
        v = tl.load(v_ptr + kv_base + offs, mask=kvm, other=0.0)
        s = matmul(q, tl.trans(k), UPCAST)  # [G, BLOCK_N]
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if q.dtype == tl.float32:
            pv = matmul(p, v, UPCAST)
        else:  # P rounded to the model's dtype for the second product, as transformers does
            pv = matmul(p.to(q.dtype), v, UPCAST)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit(do_not_specialize=["stride_pr"])
    def _attn_chunk_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
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
        stride_pr,
        HQ: tl.constexpr,
        NUM_CHUNKS: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_P: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_P: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        STAGES: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        hk = tl.program_id(1)
        c = tl.program_id(2)
        ctx = tl.load(ctx_ptr + r)
        length = ctx + tl.load(plen_ptr + r)  # keys of this row, in logical order: context, then its path
        start = c * CHUNK
        if start >= length:
            return
        if (window > 0) & (start + CHUNK <= length - window):  # wholly before a local layer's window
            return
        slot = tl.load(slot_ptr + r).to(tl.int64)
        base = tl.load(base_ptr + r)
        g = tl.arange(0, GROUP_P)
        d = tl.arange(0, D_P)
        gm = g < GROUP
        dm = d < HEAD_D
        heads = hk * GROUP + g
        q = tl.load(
            q_ptr + r * stride_qr + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0
        )
        m_i = tl.full((GROUP_P,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GROUP_P,), dtype=tl.float32)
        acc = tl.zeros((GROUP_P, D_P), dtype=tl.float32)
        kv_base = slot * stride_ks + hk * stride_kh
        prow = path_ptr + r * stride_pr
        # the chunk's blocks that hold a key: blocks wholly masked would leave the softmax
        # unchanged (no key: alpha 1, p 0), so the values are those of all CHUNK // BLOCK_N
        lo = tl.where(window > 0, tl.maximum(length - window - start, 0) // BLOCK_N, 0)
        hi = tl.minimum((length - start + BLOCK_N - 1) // BLOCK_N, CHUNK // BLOCK_N)
        if UPCAST:  # the interpreter cannot range over a loaded bound
            b = lo
            while b < hi:
                m_i, l_i, acc = _attn_block(
                    q, m_i, l_i, acc, k_ptr, v_ptr, prow, kv_base, start + b * BLOCK_N, ctx, length, base, window,
                    scale, stride_kp, d, dm, BLOCK_N, UPCAST,
                )  # fmt: skip
                b += 1
        else:
            for b in tl.range(lo, hi, num_stages=STAGES):
                m_i, l_i, acc = _attn_block(
                    q, m_i, l_i, acc, k_ptr, v_ptr, prow, kv_base, start + b * BLOCK_N, ctx, length, base, window,
                    scale, stride_kp, d, dm, BLOCK_N, UPCAST,
                )  # fmt: skip
        part = (r * HQ + heads) * NUM_CHUNKS + c  # [G]
        tl.store(m_ptr + part, m_i, mask=gm)
        tl.store(l_ptr + part, l_i, mask=gm)
        tl.store(acc_ptr + part[:, None] * HEAD_D + d[None, :], acc, mask=gm[:, None] & dm[None, :])

    @triton.jit
    def _attn_combine_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        o_ptr,
        ctx_ptr,
        plen_ptr,
        window,
        stride_or,
        stride_oh,
        HQ: tl.constexpr,
        HQ_P: tl.constexpr,
        NUM_CHUNKS: tl.constexpr,
        NC_P: tl.constexpr,
        HEAD_D: tl.constexpr,
        D_P: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # one program per row: each query head's chunks (partial softmaxes), in chunk order
        r = tl.program_id(0).to(tl.int64)
        length = tl.load(ctx_ptr + r) + tl.load(plen_ptr + r)
        lo = tl.where(window > 0, tl.maximum(length - window, 0) // CHUNK, 0)
        hi = (length + CHUNK - 1) // CHUNK
        h = tl.arange(0, HQ_P)
        cs = tl.arange(0, NC_P)
        d = tl.arange(0, D_P)
        used = (h[:, None] < HQ) & (cs[None, :] >= lo) & (cs[None, :] < hi)  # [HQ_P, NC_P]
        part = (r * HQ + h[:, None]) * NUM_CHUNKS + cs[None, :]
        m = tl.load(m_ptr + part, mask=used, other=float("-inf"))
        mx = tl.max(m, axis=1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # (padding heads)
        w = tl.where(used, tl.exp(m - mx[:, None]), 0.0)
        lsum = tl.sum(tl.load(l_ptr + part, mask=used, other=0.0) * w, axis=1)
        am = used[:, :, None] & (d[None, None, :] < HEAD_D)
        acc = tl.load(acc_ptr + part[:, :, None] * HEAD_D + d[None, None, :], mask=am, other=0.0)
        out = tl.sum(acc * w[:, :, None], axis=1) / tl.where(lsum == 0.0, 1.0, lsum)[:, None]  # [HQ_P, D_P]
        om = (h[:, None] < HQ) & (d[None, :] < HEAD_D)
        tl.store(o_ptr + r * stride_or + h[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=om)


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
    """Attention of a flat batch of query rows over a position-indexed KV pool (see the
    module docstring): two launches, the row count never a compile-time constant.

    A causal row has ``path_len`` 0 and ``ctx_len = position + 1``; a tree row ``ctx_len =
    past`` and ``path_base = past``.

    Args:
        q: [R, Hq, d] queries (rotary applied).
        k_pool, v_pool: [S, C, Hkv, d] one layer's keys/values (the row's own already written).
        slots, ctx_len, path_len, path_base: int32 [R].
        path: int32 [R, P] (P >= 1).
        scale: the score scale (``d ** -0.5`` for Llama).
        window: local attention: only keys ``> position - window`` (0: all).

    Returns:
        [R, Hq, d] in ``q``'s dtype.

    Raises:
        ValueError: query heads not a multiple of the key-value heads, or strides the
            kernel cannot read.
    """
    r, hq, d = q.shape
    cap, hkv = int(k_pool.shape[1]), int(k_pool.shape[2])
    if hq % hkv:
        raise ValueError(f"tree_attention: {hq} query heads are not a multiple of {hkv} key-value heads")
    if k_pool.stride(3) != 1 or v_pool.stride() != k_pool.stride() or q.stride(2) != 1:
        raise ValueError("tree_attention: the pool and the queries need unit stride along the head size")
    o = torch.empty((r, hq, d), dtype=q.dtype, device=q.device)
    if r == 0:
        return o
    group = hq // hkv
    chunks = -(-cap // ATTN_CHUNK)
    m = torch.empty((r, hq, chunks), dtype=torch.float32, device=q.device)
    lse = torch.empty_like(m)
    acc = torch.empty((r, hq, chunks, d), dtype=torch.float32, device=q.device)
    interpreted = q.device.type == "cpu"  # (tl.dot's tiles need 16 rows and columns; the interpreter does not)
    dp = next_pow2(d) if interpreted else max(_MIN_DOT, next_pow2(d))
    gp = next_pow2(group) if interpreted else max(_MIN_DOT, next_pow2(group))
    launch.launcher(_attn_chunk_kernel, q.device)[(r, hkv, chunks)](
        q,
        k_pool,
        v_pool,
        m,
        lse,
        acc,
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
        path.stride(0),
        HQ=hq,
        NUM_CHUNKS=chunks,
        GROUP=group,
        GROUP_P=gp,
        HEAD_D=d,
        D_P=dp,
        CHUNK=ATTN_CHUNK,
        BLOCK_N=ATTN_BLOCK_N,
        STAGES=2,
        UPCAST=interpreted,
    )
    _combine_chunks(m, lse, acc, o, ctx_len, path_len, window)
    return o


def _combine_chunks(
    m: torch.Tensor,
    lse: torch.Tensor,
    acc: torch.Tensor,
    o: torch.Tensor,
    ctx_len: torch.Tensor,
    path_len: torch.Tensor,
    window: int,
) -> None:
    """:func:`tree_attention`'s second launch: each row's chunk partials (``m``, ``lse``:
    float32 [R, Hq, C]; ``acc``: float32 [R, Hq, C, d]) combined, in a fixed order, into
    ``o`` [R, Hq, d]."""
    r, hq, chunks = m.shape
    d = int(o.shape[2])
    launch.launcher(_attn_combine_kernel, o.device)[(r,)](
        m,
        lse,
        acc,
        o,
        ctx_len,
        path_len,
        int(window),
        o.stride(0),
        o.stride(1),
        HQ=hq,
        HQ_P=next_pow2(hq),
        NUM_CHUNKS=chunks,
        NC_P=next_pow2(chunks),
        HEAD_D=d,
        D_P=next_pow2(d),
        CHUNK=ATTN_CHUNK,
    )


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
