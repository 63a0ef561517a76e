"""The compiled kernels' two instruction-set paths (AVX-512 and AVX2/FMA, ragspec/backend/cpu/csrc/)
and their runtime dispatch (``RAGSPEC_CPU_ISA``, :func:`ragspec.backend.cpu.kernels.set_cpu_isa`).

Each path is checked against torch's float32 reference (F.linear / SDPA) within float32
rounding, ``quant_linear`` against ``skinny_linear`` over the de-quantized weight bit for
bit within one path, and every output row against the same row computed alone (batched
verification relies on it). ``few_query_attention`` gives the same bits on both paths (each
row's sums in the same order; AVX-512 shares the loads across rows), checked bit for bit.
The AVX-512 cases are skipped, with that reason, on a CPU without AVX-512."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from test_kernels import _BUILDABLE

from ragspec.backend.cpu import kernels
from ragspec.backend.cpu.quant import Q4_1, Q6_K, Q8_0, GGUFWeight


def _has_avx512() -> bool:
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        return False
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))


@pytest.fixture(scope="module")
def module():
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    mod = kernels._load_module()
    assert mod is not None, "the kernel failed to build on a machine that can build it"
    return mod


@pytest.fixture(params=["avx2", "avx512"])
def isa(request, module):
    if request.param == "avx512" and not _has_avx512():
        pytest.skip("this CPU lacks AVX-512 (F, BW, VL, DQ)")
    previous = kernels.set_cpu_isa(request.param)
    assert kernels.cpu_isa() == request.param
    yield request.param
    kernels.set_cpu_isa(previous)


def _random_blocks(out_features: int, in_features: int, fmt: int, gen: torch.Generator) -> GGUFWeight:
    blocks = in_features // 32
    if fmt == Q4_1:
        qs = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=gen)
        scales = (torch.randn(out_features, blocks, 2, generator=gen) * 0.02).half().float()  # float16 as in a GGUF
    elif fmt == Q8_0:
        qs = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
        scales = (torch.randn(out_features, blocks, generator=gen) * 0.01).half().float()
    else:  # Q6_K's values: q - 32 in [-32, 32), d * sc (float16 times int8) per 16 weights
        qs = torch.randint(-32, 32, (out_features, in_features), dtype=torch.int8, generator=gen)
        sc = torch.randint(-128, 128, (out_features, in_features // 16), generator=gen).float()
        scales = (torch.randn(out_features, 1, generator=gen) * 1e-4).half().float() * sc
    return GGUFWeight(qs, scales.contiguous(), fmt)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17])
@pytest.mark.parametrize("in_features,out_features", [(64, 96), (13, 7), (40, 9), (576, 33), (48, 5)])
def test_skinny_linear_matches_f_linear_on_each_path(isa, module, rows, in_features, out_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen)
    torch.testing.assert_close(module.skinny_linear(x, w, None), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(module.skinny_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0, Q6_K])
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (13, 32), (262, 576), (9, 1536)])
def test_quant_linear_equals_skinny_bit_for_bit_on_each_path(isa, module, fmt, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features + fmt)
    q = _random_blocks(out_features, in_features, fmt, gen)
    deq = q.dequantize()
    bias = torch.randn(out_features, generator=gen)
    for rows in (1, 2, 3, 4, 5, 7, 9, 10, 11, 13, 16, 17):  # 9+: even tiles of up to 5 rows
        x = torch.randn(rows, in_features, generator=gen)
        got = module.quant_linear(x, q.qs, q.scales, q.fmt, None)
        assert torch.equal(got, module.skinny_linear(x, deq, None)), (isa, rows)
        assert torch.equal(module.quant_linear(x, q.qs, q.scales, q.fmt, bias), module.skinny_linear(x, deq, bias))
        torch.testing.assert_close(got, F.linear(x, deq), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", [None, Q4_1, Q8_0, Q6_K])
def test_each_row_is_computed_as_if_alone_on_each_path(isa, module, fmt):
    """A row's value does not depend on the other rows of the call (batched == solo)."""
    gen = torch.Generator().manual_seed(11)
    in_features, out_features = 96, 70
    if fmt is None:
        w = torch.randn(out_features, in_features, generator=gen)

        def run(x):
            return module.skinny_linear(x, w, None)
    else:
        q = _random_blocks(out_features, in_features, fmt, gen)

        def run(x):
            return module.quant_linear(x, q.qs, q.scales, q.fmt, None)

    x = torch.randn(17, in_features, generator=gen)
    batched = run(x)
    for r in range(17):
        assert torch.equal(batched[r], run(x[r : r + 1])[0]), r
    for n in (2, 3, 4, 5, 9, 10, 13):
        assert torch.equal(run(x[:n]), batched[:n]), n


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 3, 16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 4, 4), (128, 4, 1), (256, 4, 1)])
@pytest.mark.parametrize("keys", [7, 64, 81, 200])
def test_few_query_attention_matches_sdpa_on_each_path(isa, module, q_len, head_dim, heads, kv_heads, keys):
    gen = torch.Generator().manual_seed(q_len * 31 + head_dim + keys)
    q = torch.randn(1, q_len, heads, head_dim, generator=gen).transpose(1, 2)
    kbuf = torch.randn(1, kv_heads, keys + 5, head_dim, generator=gen)
    vbuf = torch.randn(1, kv_heads, keys + 5, head_dim, generator=gen)
    k, v = kbuf[:, :, :keys], vbuf[:, :, :keys]
    mask = torch.rand(1, 1, q_len, keys, generator=gen) > 0.3
    mask[..., -1] = True
    if keys > 70:
        mask[0, 0, 0, :-1] = False  # a row that sees only its last key: whole key blocks hidden
    scale = head_dim**-0.5
    torch.testing.assert_close(
        module.few_query_attention(q, k, v, mask, scale), _sdpa(q, k, v, mask, scale), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        module.few_query_attention(q, k, v, None, 0.3), _sdpa(q, k, v, None, 0.3), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 4, 2), (128, 8, 2), (256, 4, 1), (64, 6, 6)])
def test_few_query_attention_is_bit_identical_on_both_paths(module, half, head_dim, heads, kv_heads):
    """The AVX-512 path (position_rows for classes of fewer than 4 rows, the transposed tiles
    above) gives every row attend_row's bits: a row keeps its values whichever path, tile
    or ISA computes it, so a one-position step and a verification row agree bit for bit."""
    if not _has_avx512():
        pytest.skip("this CPU lacks AVX-512 (F, BW, VL, DQ)")
    gen = torch.Generator().manual_seed(head_dim + heads)
    previous = kernels.cpu_isa()
    try:
        for keys in (1, 7, 63, 64, 65, 130, 741):
            for q_len in (1, 2, 3, 5):
                if q_len > keys:
                    continue
                q = torch.randn(1, heads, q_len, head_dim, generator=gen)
                k = torch.randn(1, kv_heads, keys, head_dim, generator=gen)
                v = torch.randn(1, kv_heads, keys, head_dim, generator=gen)
                if half:
                    k, v = k.half(), v.half()
                mask = torch.rand(1, 1, q_len, keys, generator=gen) > 0.3
                mask[..., 0] = True
                for m in (None, mask):
                    kernels.set_cpu_isa("avx2")
                    ref = module.few_query_attention(q, k, v, m, head_dim**-0.5)
                    kernels.set_cpu_isa("avx512")
                    got = module.few_query_attention(q, k, v, m, head_dim**-0.5)
                    assert torch.equal(got, ref), (keys, q_len, m is None)
    finally:
        kernels.set_cpu_isa(previous)


def test_dispatch_picks_the_cpus_best_and_the_environment_masks_avx512(module):
    code = "from ragspec.backend.cpu import kernels; print(kernels.cpu_isa())"
    env = dict(os.environ)
    env.pop("RAGSPEC_CPU_ISA", None)
    best = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert best.stdout.strip() == ("avx512" if _has_avx512() else "avx2")
    env["RAGSPEC_CPU_ISA"] = "avx2"
    masked = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert masked.stdout.strip() == "avx2"


def test_set_cpu_isa_rejects_unknown_names_and_restores(module):
    before = kernels.cpu_isa()
    with pytest.raises(RuntimeError, match="expected 'avx2', 'avx512' or 'auto'"):
        kernels.set_cpu_isa("sse2")
    assert kernels.cpu_isa() == before
    assert kernels.set_cpu_isa("avx2") == before
    assert kernels.set_cpu_isa("auto") == "avx2"
    assert kernels.cpu_isa() == ("avx512" if _has_avx512() and os.environ.get("RAGSPEC_CPU_ISA") != "avx2" else "avx2")
    kernels.set_cpu_isa(before)
