"""Linear weights kept in their GGUF block format, for the compiled few-row kernel.

A plain decoding step of the default model streams every weight once: 540 MB as the float32
that transformers de-quantizes a GGUF to, 110 MB in the file's own formats (Q4_1 for the
decoder, Q8_0 for the tied output layer). ``quant_linear`` of :mod:`ragspec.backend.cpu.kernels`
multiplies few activation rows with such blocks directly (llama.cpp's layouts,
``ggml-quants``), and its output is bit for bit that of the float32 kernel over the
de-quantized weight (the de-quantization is exact in float32, see the kernel's source), so
greedy output is unchanged. Measured on the 2-core CPU, all 210 decoder linears of
SmolLM2-135M for one row: 22-25 ms float32, 14 ms from Q4_1; the output layer 5.3 -> 2.9 ms.
On an AVX-512 CPU the kernel de-quantizes in registers (one thread, a shared 2-vCPU Xeon):
decoder 13.6 -> 5.0 ms, output layer 5.2 -> 1.75 ms against its AVX2 path.

Each weight of the loaded model is matched to a GGUF tensor by content, not by name:
transformers permutes the rows of some tensors while loading (the query and key
projections of llama-family models), so the rows are paired by a hash of their bits and the
pairing is checked with ``torch.equal`` against the loaded weight. A weight with no exact
match keeps the float32 path. Read: Q4_1, Q8_0, Q5_0 (kept as Q8_0), Q4_K (kept as Q4_1) and
Q6_K (unpacked to int8 with a scale per 16 weights): every 2-D tensor of the two shipped
models (gemma3-270m's Q4_K_M file holds its output layer in Q8_0, most of its decoder in
Q5_0, the rest in Q8_0, Q4_K and Q6_K: 127 of its 127 weights now read from blocks, 91
before Q4_K/Q6_K; those 36 linears for one row 8.5-10 -> 2.7-4.8 ms per step on the AVX-512
path, a plain step 111-125 -> 90 ms at best, on the 2-core CPU loaded by other jobs); other
formats keep float32.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Union

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "GGUFWeight",
    "read_gguf_weights",
    "match_gguf_weights",
    "load_gguf_weights",
    "fast_order",
    "Q4_1",
    "Q8_0",
    "Q6_K",
    "Q4_1_FAST",
    "Q8_0_FAST",
]

Q4_1 = 0  # format codes of the compiled kernel's quant_linear
Q8_0 = 1
Q6_K = 2  # (Q6_K's values unpacked: int8 weights, a float32 scale per 16)
Q4_1_FAST = 3  # fast numerics (int8 activations, VNNI): Q4_1's codes in the kernel's order
Q8_0_FAST = 4  # fast numerics: Q8_0's codes + 128 as uint8 in the kernel's order
_BLOCK = 32  # weights per block of Q4_1 / Q8_0 (and per kernel step in every format)
_SUB6 = 16  # weights per scale of Q6_K
_SUPER = 256  # weights per super-block of the K formats (Q4_K, Q6_K)


@dataclass(frozen=True)
class GGUFWeight:
    """One linear weight [O, I] in a GGUF block format, laid out for ``quant_linear``.

    Attributes:
        qs: Q4_1: uint8 [O, I / 2] (per block of 32: byte j holds weight j in its low
            nibble, j + 16 in its high one); Q8_0, Q6_K: int8 [O, I].
        scales: float32, Q4_1: [O, I / 32, 2] (d, m: w = d * q + m); Q8_0: [O, I / 32] (d:
            w = d * q); Q6_K: [O, I / 16] (d: w = d * q).
        fmt: :data:`Q4_1`, :data:`Q8_0` or :data:`Q6_K`.
    """

    qs: torch.Tensor
    scales: torch.Tensor
    fmt: int

    def well_formed(self) -> bool:
        """Whether the kernel takes these tensors: a known format, ``qs`` uint8 (Q4_1 and
        the fast formats) or int8 (Q8_0, Q6_K) [O, *], ``scales`` float32 of the matching
        shape, both contiguous."""
        if self.fmt not in (Q4_1, Q8_0, Q6_K, Q4_1_FAST, Q8_0_FAST) or self.qs.dim() != 2:
            return False
        if not self.qs.is_contiguous() or self.qs.dtype != (torch.int8 if self.fmt in (Q8_0, Q6_K) else torch.uint8):
            return False
        rows, cols = self.shape
        scales = {
            Q4_1: (rows, cols // _BLOCK, 2),
            Q8_0: (rows, cols // _BLOCK),
            Q6_K: (rows, cols // _SUB6),
            Q4_1_FAST: (rows, 2, cols // _BLOCK),
            Q8_0_FAST: (rows, cols // _BLOCK),
        }[self.fmt]
        return (
            cols % _BLOCK == 0
            and (self.fmt not in (Q4_1_FAST, Q8_0_FAST) or (cols // _BLOCK) % 2 == 0)
            and self.scales.dtype == torch.float32
            and self.scales.is_contiguous()
            and tuple(self.scales.shape) == scales
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        rows = int(self.qs.shape[0])
        return rows, int(self.qs.shape[1]) * (2 if self.fmt in (Q4_1, Q4_1_FAST) else 1)

    @property
    def fast(self) -> bool:
        """Whether this weight is in a fast-numerics format (:meth:`to_fast`)."""
        return self.fmt in (Q4_1_FAST, Q8_0_FAST)

    def to_fast(self) -> "GGUFWeight":
        """The same weight for the kernel's fast numerics (``--numerics fast``): Q4_1 as
        format :data:`Q4_1_FAST`, Q8_0 as :data:`Q8_0_FAST` (the same codes and scales,
        reordered for AVX-512 VNNI dot products with int8 activations; see
        ``csrc/quant_linear.cpp``). Weights it cannot take (Q6_K, an odd number of blocks per
        row, already fast) are returned unchanged and keep their exact float32 arithmetic.
        """
        rows, cols = self.shape
        if self.fmt not in (Q4_1, Q8_0) or (cols // _BLOCK) % 2:
            return self
        order = torch.from_numpy(fast_order(cols))
        if self.fmt == Q8_0:
            codes = (self.qs.to(torch.int16) + 128).to(torch.uint8)[:, order]
            return GGUFWeight(codes.contiguous(), self.scales.contiguous(), Q8_0_FAST)
        q = self.qs.view(rows, cols // _BLOCK, 16)
        codes = torch.cat([q & 0x0F, q >> 4], dim=-1).reshape(rows, cols)[:, order]  # [O, I] kernel order
        packed = []
        for start, size in _fast_groups(cols):
            chunk = 64 if size == 2 * _BLOCK else 128  # codes per packed run
            g = codes[:, start : start + size].reshape(rows, -1, 2, chunk // 2)
            packed.append((g[:, :, 0] | (g[:, :, 1] << 4)).reshape(rows, -1))
        scales = self.scales.permute(0, 2, 1).contiguous()  # [O, 2, I / 32]: d row, m row
        return GGUFWeight(torch.cat(packed, dim=1).contiguous(), scales, Q4_1_FAST)

    def dequantize(self) -> torch.Tensor:
        """float32 [O, I], the values gguf-py's ``dequantize`` gives (and so transformers)."""
        rows, cols = self.shape
        if self.fast:
            order = torch.from_numpy(fast_order(cols))
            if self.fmt == Q8_0_FAST:
                codes = torch.empty_like(self.qs)
                codes[:, order] = self.qs
                q = (codes.to(torch.int16) - 128).to(torch.int8)
                return GGUFWeight(q.contiguous(), self.scales, Q8_0).dequantize()
            parts = []
            for start, size in _fast_groups(cols):
                chunk = 64 if size == 2 * _BLOCK else 128
                g = self.qs[:, start // 2 : (start + size) // 2].reshape(rows, -1, 1, chunk // 2)
                parts.append(torch.cat([g & 0x0F, g >> 4], dim=2).reshape(rows, -1))
            kernel_order = torch.cat(parts, dim=1)
            codes = torch.empty_like(kernel_order)
            codes[:, order] = kernel_order  # natural order
            blocks = codes.view(rows, cols // _BLOCK, _BLOCK)
            qs = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(rows, cols // 2).contiguous()
            return GGUFWeight(qs, self.scales.permute(0, 2, 1).contiguous(), Q4_1).dequantize()
        if self.fmt == Q4_1:
            q = self.qs.view(rows, cols // _BLOCK, 16)
            nibbles = torch.cat([q & 0x0F, q >> 4], dim=-1).float()  # [O, I / 32, 32]
            w = nibbles * self.scales[..., :1] + self.scales[..., 1:]  # d * q exact: one rounding
        else:
            per = _SUB6 if self.fmt == Q6_K else _BLOCK
            w = self.qs.view(rows, cols // per, per).float() * self.scales.unsqueeze(-1)
        return w.reshape(rows, cols)

    @classmethod
    def from_blocks(cls, raw: np.ndarray, fmt: Union[int, str], cols: int) -> "GGUFWeight":
        """From a GGUF tensor's raw bytes (llama.cpp's ``ggml-common.h`` layouts).

        Args:
            raw: uint8 [O, bytes per row].
            fmt: the file's format: :data:`Q4_1` (20 bytes per block of 32: float16 d and m,
                then the nibbles), :data:`Q8_0` (34: float16 d, then 32 int8), ``"Q5_0"``
                (22: float16 d, 32 high bits, then the low nibbles, w = d * (q - 16); kept
                as Q8_0 with q - 16 as the int8: 1.125 bytes a weight instead of 0.69, the
                same values), ``"Q4_K"`` (144 per super-block of 256: float16 d and dmin,
                12 bytes of 6-bit scales and mins for 8 blocks of 32, 128 bytes of nibbles;
                w = (d * sc) * q - dmin * m; kept as Q4_1 with d * sc and -(dmin * m) in
                float32: 0.75 bytes a weight instead of 0.56) or ``"Q6_K"`` (210 per 256:
                128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, float16
                d; w = (d * sc) * (q - 32) per 16 weights; kept as :data:`Q6_K`, q - 32 as
                int8 and d * sc in float32: 1.25 bytes a weight instead of 0.82).
            cols: I, weights per row (a multiple of 32; of 256 for the K formats).

        The scales are multiplied in float32 as gguf-py's ``dequantize`` does (products of a
        float16 and a 6- or 8-bit integer, exact), so :meth:`dequantize` gives its values.
        """
        rows = int(raw.shape[0])
        if fmt in ("Q4_K", "Q6_K", Q6_K):
            sup = np.asarray(raw).reshape(rows, cols // _SUPER, -1)  # [O, S, bytes per super-block]
            return cls._from_q4_k(sup, cols) if fmt == "Q4_K" else cls._from_q6_k(sup, cols)
        blocks = np.asarray(raw).reshape(rows, cols // _BLOCK, -1)
        if fmt == "Q5_0":
            nibbles = blocks[..., 6:, None] >> np.array([0, 4], dtype=np.uint8)  # [O, B, 16, 2]
            low = (nibbles & 0x0F).transpose(0, 1, 3, 2).reshape(rows, -1, _BLOCK)  # weight j, j + 16
            high = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [O, B, 1]: bit j for weight j
            high = ((high >> np.arange(_BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
            q = (low | (high << 4)).astype(np.int8) - np.int8(16)
            return cls(torch.from_numpy(q.reshape(rows, cols)), _half(blocks[..., 0:2]).contiguous(), Q8_0)
        if fmt == Q4_1:
            scales = torch.stack([_half(blocks[..., 0:2]), _half(blocks[..., 2:4])], dim=-1)
            qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 4:]).reshape(rows, cols // 2))
            return cls(qs, scales.contiguous(), Q4_1)
        qs = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols))
        return cls(qs, _half(blocks[..., 0:2]).contiguous(), Q8_0)

    @classmethod
    def _from_q4_k(cls, sup: np.ndarray, cols: int) -> "GGUFWeight":
        """Q4_K super-blocks uint8 [O, S, 144] -> Q4_1 blocks (8 per super-block)."""
        rows = int(sup.shape[0])
        d, dmin = _half(sup[..., 0:2]).numpy(), _half(sup[..., 2:4]).numpy()  # [O, S]
        packed = sup[..., 4:16].reshape(rows, -1, 3, 4)  # bytes 0-3: sc / high bits, 4-7: m / high bits, 8-11: low
        lo, mi, hi = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)  # [O, S, 8]
        mins = np.concatenate([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], axis=-1)
        scale = d[..., None] * sc.astype(np.float32)  # as gguf-py: d * sc, dmin * m in float32
        offset = -(dmin[..., None] * mins.astype(np.float32))
        scales = np.stack([scale, offset], axis=-1).reshape(rows, cols // _BLOCK, 2)
        # 4 chunks of 32 bytes per super-block: byte j holds weight j of block 2c (low nibble)
        # and weight j of block 2c + 1 (high)
        halves = sup[..., 16:].reshape(rows, -1, 4, 1, _BLOCK) >> np.array([0, 4], dtype=np.uint8).reshape(
            1, 1, 1, 2, 1
        )
        nib = (halves & 0x0F).reshape(rows, cols // _BLOCK, _BLOCK)  # [O, B, 32] weights in order
        qs = nib[..., :16] | (nib[..., 16:] << 4)  # Q4_1's order: byte j = weight j, j + 16
        return cls(torch.from_numpy(np.ascontiguousarray(qs).reshape(rows, cols // 2)), torch.from_numpy(scales), Q4_1)

    @classmethod
    def _from_q6_k(cls, sup: np.ndarray, cols: int) -> "GGUFWeight":
        """Q6_K super-blocks uint8 [O, S, 210] -> int8 [O, I] and a float32 scale per 16."""
        rows = int(sup.shape[0])
        # two halves of 128 weights: 64 bytes of nibbles (weights 0-63 low, 64-127 high) and
        # 32 bytes of 2-bit pairs (weight 32k + j at bits 2k of byte j)
        low = sup[..., :128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        high = sup[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
            1, 1, 1, 4, 1
        )
        q = ((low & 0x0F).reshape(rows, -1, 256) | ((high & 0x03).reshape(rows, -1, 256) << 4)).astype(np.int8)
        q = q - np.int8(32)  # [O, S, 256]
        sc = np.ascontiguousarray(sup[..., 192:208]).view(np.int8).astype(np.float32)  # [O, S, 16]
        scales = (_half(sup[..., 208:210]).numpy()[..., None] * sc).reshape(rows, cols // _SUB6)
        return cls(torch.from_numpy(q.reshape(rows, cols)), torch.from_numpy(np.ascontiguousarray(scales)), Q6_K)

    def take_rows(self, index: torch.Tensor) -> "GGUFWeight":
        """The same weight with its rows reordered: row i of the result is row index[i]."""
        return GGUFWeight(self.qs[index].contiguous(), self.scales[index].contiguous(), self.fmt)


def _fast_groups(cols: int) -> list[tuple[int, int]]:
    """(first weight, weights) of each group of blocks of the fast layout: groups of 16
    blocks of 32, then one each of 8, 4, 2 for the rest (an even number of blocks)."""
    groups, blk, nb = [], 0, cols // _BLOCK
    while blk < nb:
        left = nb - blk
        g = 16 if left >= 16 else 8 if left >= 8 else 4 if left >= 4 else 2
        groups.append((blk * _BLOCK, g * _BLOCK))
        blk += g
    return groups


def fast_order(cols: int) -> np.ndarray:
    """int64 [cols]: for each position of a row in the fast-numerics layout
    (``csrc/fast_numerics.cpp``, ``kvnni``), the weight's index in the row. Within a group of
    G blocks, position t * 64 + k * 4 + b (step t < G / 2, 32-bit lane k < 16, byte b < 4)
    holds weight t * 4L + (k % L) * 4 + b of the group's block k / L (L = 16 / G).

    Raises:
        ValueError: ``cols`` is not a multiple of 64 (an even number of blocks of 32).
    """
    if cols % (2 * _BLOCK):
        raise ValueError(f"fast numerics need rows of an even number of 32-weight blocks, got {cols} weights")
    order = np.empty(cols, dtype=np.int64)
    for start, size in _fast_groups(cols):
        g = size // _BLOCK
        lanes = 16 // g
        t = np.arange(g // 2)[:, None, None]
        k = np.arange(16)[None, :, None]
        b = np.arange(4)[None, None, :]
        order[start : start + size] = (start + (k // lanes) * _BLOCK + t * 4 * lanes + (k % lanes) * 4 + b).reshape(-1)
    return order


def quantize_q8_0(weight: torch.Tensor) -> GGUFWeight:
    """A float weight [O, I] (I a multiple of 32) as Q8_0 blocks, llama.cpp's
    ``quantize_row_q8_0``: per block of 32 weights d = max |w| / 127, q = round(w / d) (d
    kept in float32; an all-zero block d = 1). For a drafter's own layers (an EAGLE head's):
    a quarter of float32's bytes per step, the values changed by the rounding (~0.4% of a
    block's largest weight at most).

    Raises:
        ValueError: not a 2-D weight with in-features a multiple of 32.
    """
    if weight.dim() != 2 or int(weight.shape[1]) % _BLOCK:
        raise ValueError(f"Q8_0 needs a [O, I] weight with I a multiple of {_BLOCK}, got {tuple(weight.shape)}")
    rows, cols = (int(n) for n in weight.shape)
    w = weight.detach().to(torch.float32).reshape(rows, cols // _BLOCK, _BLOCK)
    d = w.abs().amax(dim=-1) / 127.0  # [O, I / 32]
    d = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(w / d[..., None]).clamp_(-127, 127).to(torch.int8).reshape(rows, cols)
    return GGUFWeight(q.contiguous(), d.contiguous(), Q8_0)


def _half(raw: np.ndarray) -> torch.Tensor:
    """uint8 [..., 2] (little-endian float16) -> float32 [...]."""
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32))


def read_gguf_weights(path: Union[str, os.PathLike]) -> list[GGUFWeight]:
    """The 2-D Q4_1, Q8_0, Q5_0, Q4_K and Q6_K tensors of a GGUF file as :class:`GGUFWeight`
    (rows = the file's ``ne1``, i.e. a linear layer's out-features); other tensors are skipped.

    Raises:
        OSError, ValueError: the file cannot be read or parsed (gguf-py's errors).
    """
    from gguf import GGMLQuantizationType, GGUFReader

    formats: dict[GGMLQuantizationType, Union[int, str]] = {
        GGMLQuantizationType.Q4_1: Q4_1,
        GGMLQuantizationType.Q8_0: Q8_0,
        GGMLQuantizationType.Q5_0: "Q5_0",
        GGMLQuantizationType.Q4_K: "Q4_K",
        GGMLQuantizationType.Q6_K: "Q6_K",
    }
    reader = GGUFReader(str(path))
    out: list[GGUFWeight] = []
    for tensor in reader.tensors:
        kind = tensor.tensor_type
        if len(tensor.shape) != 2 or kind not in formats:
            continue
        cols, rows = (int(n) for n in tensor.shape)
        fmt = formats[kind]
        if cols % (_SUPER if fmt in ("Q4_K", "Q6_K") else _BLOCK):
            continue
        out.append(GGUFWeight.from_blocks(np.asarray(tensor.data).reshape(rows, -1), fmt, cols))
    return out


def _row_hashes(weight: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """int64 [O]: a hash of each row's float32 bits (exact integer arithmetic, so equal rows
    hash equal wherever they sit)."""
    out = []
    for chunk in weight.split(4096):
        bits = chunk.contiguous().view(torch.int32).to(torch.int64)  # |bits| < 2^31
        out.append((bits * salt).sum(dim=1))  # salt < 2^16: no overflow below 2^16 columns
    return torch.cat(out)


def match_gguf_weights(candidates: list[GGUFWeight], weights: Mapping[str, torch.Tensor]) -> dict[str, GGUFWeight]:
    """Pair loaded float32 weights with GGUF tensors holding exactly their values.

    Args:
        candidates: from :func:`read_gguf_weights`.
        weights: name -> float32 [O, I] (a model's linear weights).

    Returns:
        name -> the GGUF weight, rows reordered as the loaded weight's, for every weight
        whose values some candidate's de-quantization equals exactly (``torch.equal``);
        the others are left out.
    """
    gen = torch.Generator().manual_seed(0x5EED)
    salts: dict[int, torch.Tensor] = {}

    def salt(cols: int) -> torch.Tensor:
        if cols not in salts:
            salts[cols] = torch.randint(1, 1 << 16, (cols,), generator=gen, dtype=torch.int64)
        return salts[cols]

    def key(rows: torch.Tensor, shape: tuple[int, ...]) -> tuple:
        return (shape, hashlib.sha256(np.sort(rows.numpy()).tobytes()).hexdigest())

    wanted = {n: w for n, w in weights.items() if w.dim() == 2 and w.dtype == torch.float32}
    shapes = {tuple(w.shape) for w in wanted.values()}
    pool: dict[tuple, tuple[GGUFWeight, torch.Tensor]] = {}  # (no de-quantized copies kept: 4 bytes a weight)
    for cand in candidates:
        if cand.shape not in shapes:
            continue
        h = _row_hashes(cand.dequantize(), salt(cand.shape[1]))
        pool.setdefault(key(h, cand.shape), (cand, h))
    matched: dict[str, GGUFWeight] = {}
    for name, w in wanted.items():
        h = _row_hashes(w.detach(), salt(w.shape[1]))
        hit = pool.get(key(h, tuple(w.shape)))
        if hit is None:
            continue
        cand, ch = hit
        index = torch.empty_like(h)
        index[torch.argsort(h)] = torch.argsort(ch)  # loaded row i = candidate row index[i]
        twin = cand.take_rows(index)
        if torch.equal(twin.dequantize(), w.detach()):
            matched[name] = twin
    logger.debug("%d of %d weights matched to GGUF blocks", len(matched), len(wanted))
    return matched


_CACHE_FORMAT = "ragspec-gguf-blocks-3"  # bump when the formats read change: older caches are rebuilt


def _load_cached(cache: Path, weights: Mapping[str, torch.Tensor]) -> Optional[dict[str, GGUFWeight]]:
    """The matches saved by :func:`load_gguf_weights`, if the file reads and every entry
    still equals its loaded weight exactly; else None."""
    from safetensors import safe_open

    try:
        with safe_open(str(cache), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != _CACHE_FORMAT:
                return None
            names = [n for n in meta if n != "format"]
            out = {n: GGUFWeight(f.get_tensor(f"{n}.qs"), f.get_tensor(f"{n}.scales"), int(meta[n])) for n in names}
    except Exception:  # unreadable, truncated, another format: match from the GGUF again
        return None
    for name, q in out.items():
        w = weights.get(name)
        if w is None or not q.well_formed() or tuple(w.shape) != q.shape or not torch.equal(q.dequantize(), w.detach()):
            return None
    return out


def _save_cached(cache: Path, matched: Mapping[str, GGUFWeight]) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    meta = {"format": _CACHE_FORMAT}
    for name, q in matched.items():
        tensors[f"{name}.qs"], tensors[f"{name}.scales"] = q.qs, q.scales
        meta[name] = str(q.fmt)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=meta)  # (writes a new file: mkstemp's mode is lost)
            os.chmod(tmp, 0o644)  # readable by every user of a shared cache, as the converted model
            os.replace(tmp, cache)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:  # a read-only cache: matched again at the next load
        logger.info("cannot save GGUF block matches to %s (%s)", cache, e)


def load_gguf_weights(
    path: Union[str, os.PathLike], weights: Mapping[str, torch.Tensor], cache: Optional[Path] = None
) -> dict[str, GGUFWeight]:
    """:func:`match_gguf_weights` over the tensors of the GGUF at ``path``, remembered in
    ``cache`` (a safetensors file): gguf-py parses the default model's file in ~4 s (its
    49152-entry vocabulary), the cached matches load and are re-checked (``torch.equal``
    of every entry with its loaded weight) in well under a second. A cache that does not
    read or no longer matches is rebuilt.

    Raises:
        OSError, ValueError: the GGUF cannot be read (gguf-py's errors).
    """
    if cache is not None and cache.is_file():
        cached = _load_cached(cache, weights)
        if cached is not None:
            return cached
    matched = match_gguf_weights(read_gguf_weights(path), weights)
    if cache is not None:
        _save_cached(cache, matched)
    return matched
