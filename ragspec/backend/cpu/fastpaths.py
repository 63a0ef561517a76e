"""CPU fast paths of the transformers backend: few-row linear layers through the compiled
kernels of :mod:`ragspec.backend.cpu.kernels` (float32 or GGUF blocks) or pre-packed oneDNN
weights, and the compiled attention kernel (verification rows, and prompt chunks while its
partial results fit the cache) as the backend's attention function
(:mod:`ragspec.backend.attention`) takes it.

All of it applies only inside the backend's own forwards (a :class:`KernelScope`), so
``model.generate`` and training keep transformers' kernels. Values change by float32
rounding only (summation order), like any multi-row verification.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Optional

import torch

from ..attention import AttentionKernel
from .kernels import SKINNY_MAX_ROWS

if TYPE_CHECKING:
    from .kernels import FewQueryAttention, PrefillAttention, QuantLinear, SkinnyLinear
    from .quant import GGUFWeight

__all__ = [
    "GGUFLinear",
    "KernelScope",
    "PACKED_MAX_ROWS",
    "bind_gguf_linear",
    "can_pack",
    "compiled_attention",
    "is_causal_chunk",
    "prefill_runs",
    "kernel_attention_applies",
    "pack_linear_forwards",
    "pack_weight",
    "packed_linear",
    "skinny_linear",
]

# few-row inputs (verification) take a pre-packed oneDNN weight from 2 rows up to this;
# float32 inputs of more rows (prefill chunks) take it too: MKL's sgemm re-packs the weight
# on every call, which costs a 256-row chunk ~8% more per row than a 700-row prompt (the
# default model's decoder linears, 2 threads: 40.5 against 37.6 us a row), while the
# packed weight runs 148 to 660 rows at 32-34 us a row, each row's values the same whatever
# the number of rows (measured on the 2-core AVX-512 CPU)
PACKED_MAX_ROWS = 64


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether pre-packed oneDNN linears apply: CPU, oneDNN built in, float32, or bfloat16
    where the CPU has oneDNN's bfloat16 support (AVX-512 BF16 / AVX-NE-CONVERT; elsewhere
    oneDNN refuses to pack a bfloat16 weight)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and _mkldnn_bf16_supported()


def _mkldnn_bf16_supported() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] re-laid out once for oneDNN (an opaque tensor for
    :func:`packed_linear`); one extra copy of the weight."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 8)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` [..., in] -> [..., out] through a weight from :func:`pack_weight` (no autograd)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class KernelScope:
    """Marks when fast few-row linear kernels apply to a model's layers: while ``active``
    (set by :class:`~ragspec.backend.cpu.target.CPUTarget` around its own forwards). Outside it
    (``model.generate``, training, user code) the layers compute with torch's ``F.linear``,
    unchanged. One per :class:`~ragspec.backend.cpu.target.CPUTarget`; not thread-safe across concurrent forwards (the engine runs one
    forward at a time).

    Attributes:
        active: the fast kernels apply.
        chunked: inputs of more than ``SKINNY_MAX_ROWS`` rows also go through the compiled
            kernel, in chunks of at most ``SKINNY_MAX_ROWS`` rows (set around a batched
            verification forward, whose rows come from several requests: the kernel computes
            each row independently, so every request's rows get exactly the values of its
            own forward).
    """

    __slots__ = ("active", "chunked")

    def __init__(self) -> None:
        self.active = False
        self.chunked = False


# a weight's GGUF-block twin bound to the compiled kernel: (x float32 [R, I], bias) -> [R, O]
GGUFLinear = Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def skinny_linear(
    skinny: Optional["SkinnyLinear"],
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    gguf: Optional[GGUFLinear] = None,
    chunked: bool = False,
) -> Optional[torch.Tensor]:
    """``x`` [..., in] -> [..., out] through the compiled few-row kernel of
    :mod:`ragspec.backend.cpu.kernels` where it applies (a kernel given, autograd off, float32 input and
    weight, a contiguous weight, at most ``SKINNY_MAX_ROWS`` rows, or any number of rows
    with ``chunked``: then in calls of at most ``SKINNY_MAX_ROWS`` rows); None elsewhere,
    for the caller's other path. ``gguf``: the same weight in GGUF blocks
    (:func:`~ragspec.backend.cpu.build.read_gguf_blocks`), used instead of ``weight`` where the kernel
    applies (bit-identical output, fewer bytes streamed).

    The kernel computes every output row from its input row alone, in the same order of
    operations whatever the number of rows (csrc/linear.cpp: one accumulator per
    (weight row, input row), split over output features only), so a row's values do not
    depend on the other rows of the call nor on the chunking."""
    if (
        skinny is None
        or torch.is_grad_enabled()
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not weight.is_contiguous()
    ):
        return None
    rows = x.numel() // x.shape[-1]
    if rows > SKINNY_MAX_ROWS and not chunked:
        return None
    x2 = x.reshape(rows, x.shape[-1])
    if rows <= SKINNY_MAX_ROWS:
        y = gguf(x2, bias) if gguf is not None else skinny(x2, weight, bias)
    else:
        parts = [
            gguf(x2[r : r + SKINNY_MAX_ROWS], bias)
            if gguf is not None
            else skinny(x2[r : r + SKINNY_MAX_ROWS], weight, bias)
            for r in range(0, rows, SKINNY_MAX_ROWS)
        ]
        y = torch.cat(parts, dim=0)  # [rows, out]
    return y.view(*x.shape[:-1], weight.shape[0])


def bind_gguf_linear(kernel: "QuantLinear", weight: "GGUFWeight") -> GGUFLinear:
    """``weight`` bound to the compiled ``quant_linear`` kernel, as :func:`skinny_linear`
    takes it."""

    def linear(x: torch.Tensor, bias: Optional[torch.Tensor], _q=weight) -> torch.Tensor:
        return kernel(x, _q.qs, _q.scales, _q.fmt, bias)

    return linear


def pack_linear_forwards(
    root: torch.nn.Module,
    *,
    min_rows: int,
    skinny: Optional["SkinnyLinear"] = None,
    scope: Optional[KernelScope] = None,
    gguf: Optional[Mapping[int, GGUFLinear]] = None,
    prefill_gguf: Optional[Mapping[int, GGUFLinear]] = None,
    packed_out: Optional[dict] = None,
) -> int:
    """Route every ``nn.Linear`` under ``root`` through fast few-row kernels when autograd
    is off: inputs of 1 .. ``SKINNY_MAX_ROWS`` rows through ``skinny`` (the compiled kernel
    of :mod:`ragspec.backend.cpu.kernels`, float32) when given, else inputs of ``min_rows`` ..
    ``PACKED_MAX_ROWS`` rows, and float32 inputs of more rows (prefill), through a
    pre-packed oneDNN weight; other inputs keep ``F.linear``. ``gguf``: weight ``data_ptr()`` -> the weight's GGUF-block twin, used by
    ``skinny``'s path. ``prefill_gguf``: the twins that also take inputs of more rows, in
    calls of ``SKINNY_MAX_ROWS`` rows (``--numerics fast``'s int8 twins: each row quantized
    and summed alone; a 660-token prefill of the default model 0.75 s against 0.91 s on the
    packed float32 weight, 2-core AVX-512 VNNI CPU). With a ``scope``, only while ``scope.active``. Modifies the modules in
    place (their ``forward``); the caller checks :func:`can_pack`. Returns the number of
    layers routed; ``packed_out`` (a dict), when given, receives weight ``data_ptr()`` -> its
    packed weight (the native step runs prompt chunks through the same ones).

    For few-row inputs MKL's sgemm re-packs the weight on every call (measured on the
    2-core CPU, two threads: 3 x 576 -> 8192 takes 4.6 ms through MKL, ~1 ms packed).
    """
    import torch.nn.functional as F

    n = 0
    for module in root.modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight
        bias = None if module.bias is None else module.bias.detach()
        packed = pack_weight(weight)
        if packed_out is not None:
            packed_out[weight.data_ptr()] = packed
        twin = gguf.get(weight.data_ptr()) if gguf else None
        many = prefill_gguf is not None and weight.data_ptr() in prefill_gguf

        def forward(x, _w=weight, _b=bias, _p=packed, _g=twin, _many=many):
            if (scope is None or scope.active) and not torch.is_grad_enabled():
                y = skinny_linear(skinny, x, _w, _b, _g, chunked=_many or (scope is not None and scope.chunked))
                if y is not None:
                    return y
                rows = x.numel() // x.shape[-1]
                if min_rows <= rows <= PACKED_MAX_ROWS or (rows > PACKED_MAX_ROWS and x.dtype == torch.float32):
                    return packed_linear(x, _p, _b)
            return F.linear(x, _w, _b)

        module.forward = forward  # type: ignore[method-assign]  # this instance's forward, on purpose
        n += 1
    return n


# A prefill chunk's attention (more than SKINNY_MAX_ROWS query rows) takes the compiled
# kernel too while its per-key-block partial results (Hq x Q x ceil(S / 64) x d float32,
# merged after) stay in the last-level cache: 256-row chunks of the default model
# (9 query / 3 key-value heads, d 64) over 512-3328 keys ran 1.2-1.7x faster than
# torch's SDPA (221 against 134 GFLOP/s at 768 keys), over 3840 keys and more (~35 MB of
# partial results against a 32 MB L3) 0.5x (measured on the 2-core AVX-512 CPU)
PREFILL_ATTENTION_PARTS_BYTES = 16 << 20
_KEY_BLOCK = 64  # keys per work item of the kernel (attention.cpp kKeyBlock)


def kernel_attention_applies(query, key, attention_mask, dropout, kwargs) -> bool:
    """Whether :func:`ragspec.backend.cpu.kernels.load_few_query_attention`'s kernel computes this call:
    one sequence of float32 queries on CPU, head size 32, 64, 128 or 256, no dropout, a
    bool mask (or none: one query attending every key, or a causal prompt chunk with as many
    keys as queries) and no extras (soft-capping, position biases, attention sinks, returned
    weights); more than ``SKINNY_MAX_ROWS`` queries (a prefill chunk) only while the
    kernel's partial results fit ``PREFILL_ATTENTION_PARTS_BYTES``."""
    q_len = query.shape[2]
    s_len = key.shape[2]
    if q_len > SKINNY_MAX_ROWS:
        parts = query.shape[1] * q_len * -(-s_len // _KEY_BLOCK) * query.shape[-1] * 4
        if parts > PREFILL_ATTENTION_PARTS_BYTES:
            return False
    return (
        not torch.is_grad_enabled()
        and query.device.type == "cpu"
        and query.dtype == torch.float32
        and key.dtype == torch.float32
        and query.shape[0] == 1
        and q_len >= 1
        and query.shape[-1] in (32, 64, 128, 256)
        and query.shape[1] % key.shape[1] == 0
        and not dropout
        and (
            (attention_mask is None and (q_len == 1 or q_len == s_len))
            or (
                attention_mask is not None
                and attention_mask.dtype == torch.bool
                and attention_mask.numel() == q_len * s_len
            )
        )
        and all(kwargs.get(k) is None for k in ("position_bias", "softcap", "s_aux", "sinks"))
        and not kwargs.get("output_attentions", False)
    )


def prefill_runs(kernel: Optional["PrefillAttention"], head_dim: int) -> bool:
    """Whether the prompt-chunk attention ``kernel`` runs now for ``head_dim``: its
    ``supported`` (:class:`~ragspec.backend.cpu.kernels.PrefillAttentionKernel`: AVX-512 and
    the head size); a kernel without one (a stand-in) where it is given."""
    if kernel is None:
        return False
    supported = getattr(kernel, "supported", None)
    return True if supported is None else bool(supported(head_dim))


def is_causal_chunk(mask: Optional[torch.Tensor], q_len: int, s_len: int) -> bool:
    """Whether ``mask`` (bool [1, 1, Q, S], or None) is a prompt chunk's causal mask: query
    row i sees keys 0 .. S - Q + i (None: a first chunk that transformers hands over without
    a mask, as many keys as queries)."""
    if mask is None:
        return q_len == s_len
    if mask.dtype != torch.bool or mask.numel() != q_len * s_len or s_len < q_len:
        return False
    causal = torch.ones(q_len, s_len, dtype=torch.bool, device=mask.device).tril(s_len - q_len)
    return torch.equal(mask.reshape(q_len, s_len), causal)


def compiled_attention(kernel: "FewQueryAttention", prefill: Optional["PrefillAttention"] = None) -> AttentionKernel:
    """The compiled few-query attention (:func:`ragspec.backend.cpu.kernels.load_few_query_attention`)
    as the attention function of the backend's own forwards takes it: run where
    :func:`kernel_attention_applies`, torch's SDPA elsewhere. A causal prompt chunk that
    transformers hands over without a mask (as many keys as queries) gets its causal mask
    here (bool [1, 1, Q, Q], lower triangle).

    With ``prefill`` (:func:`ragspec.backend.cpu.kernels.load_prefill_attention`), a prompt
    chunk (more than ``SKINNY_MAX_ROWS`` float32 queries) under a causal mask
    (:func:`is_causal_chunk`) takes that kernel instead, at any number of keys: each row's
    values the same bits whatever chunk computes it. Its verdict on a layer's mask is kept
    for the next layers (transformers hands every layer of a forward the same mask object).
    The backend hands the kernel with ``prefill`` to prompt forwards only: a verification's
    rows (a causal chain looks like a chunk) must get the one-row step's bits, which only
    the few-query kernel gives whatever the number of rows.
    """
    # (the last mask object judged, whether it was causal), replaced whole: a target used
    # from two threads never pairs one mask with the other's verdict
    seen: list = [(None, False)]

    def causal(mask, q_len, s_len):
        if mask is None:
            return q_len == s_len
        judged = seen[0]
        if judged[0] is not mask:
            judged = (mask, is_causal_chunk(mask, q_len, s_len))
            seen[0] = judged
        return bool(judged[1])

    def prefill_applies(query, key, attention_mask, dropout, kwargs):
        q_len, s_len = query.shape[2], key.shape[2]
        return (
            q_len > SKINNY_MAX_ROWS
            and query.shape[-1] % 16 == 0
            and prefill_runs(prefill, query.shape[-1])
            and kernel_attention_applies(query[:, :, :1], key, None, dropout, kwargs)  # every condition but the rows
            and causal(attention_mask, q_len, s_len)
        )

    def applies(query, key, attention_mask, dropout, kwargs):
        if prefill is not None and prefill_applies(query, key, attention_mask, dropout, kwargs):
            return True
        return kernel_attention_applies(query, key, attention_mask, dropout, kwargs)

    def run(query, key, value, mask, scale):
        q_len, s_len = query.shape[2], key.shape[2]
        if prefill is not None and q_len > SKINNY_MAX_ROWS and causal(mask, q_len, s_len):
            out = prefill(query, key, value, scale)
            if out is not None:
                return out
        if mask is None and q_len > 1:
            mask = torch.ones(q_len, s_len, dtype=torch.bool).tril(s_len - q_len)[None, None]
        return kernel(query, key, value, mask, scale)

    return AttentionKernel(applies=applies, run=run)
