"""The CUDA backend's Triton kernels on CPU tensors (Triton's interpreter): each row's values
do not depend on how many rows share the launch nor on whose they are, bit for bit; they are
close to float64 references; a draft-tree row's attention equals the one-row step along the
accepted path once that path is committed."""

from __future__ import annotations

import os

# Triton's own interpreter mode, where triton is imported first here; the kernels also run
# interpreted on CPU tensors when another module imported triton without it
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from ragspec.backend.cuda import kernels as K  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_is_the_same_at_1_17_and_batched(dtype):
    g = _g(0)
    w = torch.randn(80, 96, generator=g).to(dtype)
    b = torch.randn(80, generator=g).to(dtype)
    x = torch.randn(17, 96, generator=g).to(dtype)
    other = torch.randn(23, 96, generator=g).to(dtype)
    y17 = K.linear(x, w, b)
    for i in (0, 5, 16):
        assert torch.equal(K.linear(x[i : i + 1], w, b), y17[i : i + 1])
    # the same rows after another request's rows (other tiles, other positions in a tile)
    mixed = K.linear(torch.cat([other, x]), w, b)
    assert torch.equal(mixed[23:], y17)
    ref = x.double() @ w.double().T + b.double()
    tol = 1e-4 if dtype == torch.float32 else 0.02 * ref.abs().max().item()
    assert (y17.double() - ref).abs().max().item() < tol


def test_linear_without_bias_and_odd_sizes():
    g = _g(1)
    w = torch.randn(33, 70, generator=g)
    x = torch.randn(3, 70, generator=g)
    y = K.linear(x, w)
    assert y.shape == (3, 33)
    assert torch.allclose(y.double(), x.double() @ w.double().T, atol=1e-4)
    assert K.linear(x[:0], w).shape == (0, 33)
    with pytest.raises(ValueError):
        K.linear(x, w[:, :10])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm_row_invariant_and_close(dtype, offset):
    g = _g(2)
    x = (3 * torch.randn(17, 48, generator=g)).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    y = K.rms_norm(x, w, 1e-6, offset=offset)
    assert torch.equal(K.rms_norm(x[4:5], w, 1e-6, offset=offset), y[4:5])
    ref = K.rms_norm_reference(x, w, 1e-6, offset=offset)
    atol = 1e-5 if dtype == torch.float32 else 0.05
    assert torch.allclose(y.float(), ref.float(), atol=atol, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_activations_close_and_elementwise(dtype):
    g = _g(3)
    gate = (2 * torch.randn(17, 40, generator=g)).to(dtype)
    up = torch.randn(17, 40, generator=g).to(dtype)
    atol = 1e-5 if dtype == torch.float32 else 0.05
    for fn, ref in ((K.silu_mul, K.silu_mul_reference), (K.gelu_tanh_mul, K.gelu_tanh_mul_reference)):
        y = fn(gate, up)
        assert torch.allclose(y.float(), ref(gate, up).float(), atol=atol, rtol=1e-2)
        assert torch.equal(fn(gate[7:8], up[7:8]), y[7:8])


def _pool(slots=3, cap=96, hkv=2, d=8, seed=4, dtype=torch.float32):
    g = _g(seed)
    return (
        torch.randn(slots, cap, hkv, d, generator=g).to(dtype),
        torch.randn(slots, cap, hkv, d, generator=g).to(dtype),
    )


def _meta(rows):
    """rows: (slot, ctx, path, base) -> the kernel's int32 tensors."""
    width = max(1, max(len(p) for _, _, p, _ in rows))
    path = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, (_, _, p, _) in enumerate(rows):
        path[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    return (
        i32([r[0] for r in rows]),
        i32([r[1] for r in rows]),
        path,
        i32([len(r[2]) for r in rows]),
        i32([r[3] for r in rows]),
    )


@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 1)])
def test_tree_attention_close_to_float64(hq, hkv):
    kp, vp = _pool(hkv=hkv)
    rows = [(0, 40, [], 0), (1, 10, [0, 2, 3], 10), (1, 33, [], 0), (2, 70, [0, 1], 70), (2, 1, [], 0)]
    meta = _meta(rows)
    q = torch.randn(len(rows), hq, 8, generator=_g(5))
    out = K.tree_attention(q, kp, vp, *meta, scale=8**-0.5)
    ref = K.attention_reference(q, kp, vp, *meta, scale=8**-0.5, dtype=torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-5
    win = K.tree_attention(q, kp, vp, *meta, scale=8**-0.5, window=7)
    ref = K.attention_reference(q, kp, vp, *meta, scale=8**-0.5, window=7, dtype=torch.float64)
    assert (win.double() - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_attention_row_alone_equals_row_batched(dtype):
    kp, vp = _pool(dtype=dtype)
    rows = [(0, 40, [], 0), (1, 30, [0, 2, 5], 30), (2, 65, [], 0)] + [(2, 50 + i, [], 0) for i in range(14)]
    meta = _meta(rows)
    q = torch.randn(len(rows), 4, 8, generator=_g(6)).to(dtype)
    out = K.tree_attention(q, kp, vp, *meta, scale=8**-0.5)
    for i in (0, 1, 16):
        one = _meta([rows[i]])
        assert torch.equal(K.tree_attention(q[i : i + 1], kp, vp, *one, scale=8**-0.5), out[i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_rows_equal_one_row_steps_along_the_committed_path(dtype):
    """A tree below a root at position 45 (the key blocks of 32 cross at 64): nodes 0 and 2
    branch; the accepted path root -> 1 -> 3 -> 4. Once that path is copied into place (the
    pool's commit), a one-row step at each of its positions gives the tree row's output."""
    kp, vp = _pool(slots=1, dtype=dtype)
    past = 45
    parents = [-1, -1, 1, 1, 3]  # nodes 0..4 (rows 1..5); row 0 is the root
    paths = [[0]]
    for n, p in enumerate(parents):
        paths.append((paths[0] if p < 0 else paths[p + 1]) + [n + 1])
    rows = [(0, past, path, past) for path in paths]
    q = torch.randn(len(rows), 4, 8, generator=_g(7)).to(dtype)
    tree_out = K.tree_attention(q, kp, vp, *_meta(rows), scale=8**-0.5)
    accepted = [1, 3, 4]  # nodes
    kc, vc = kp.clone(), vp.clone()
    for i, node in enumerate(accepted):  # compact: node's entry -> past + 1 + i
        kc[0, past + 1 + i] = kp[0, past + 1 + node]
        vc[0, past + 1 + i] = vp[0, past + 1 + node]
    for i, row in enumerate([0] + [n + 1 for n in accepted]):
        step = _meta([(0, past + 1 + i, [], 0)])  # causal: keys 0 .. past + i
        one = K.tree_attention(q[row : row + 1], kc, vc, *step, scale=8**-0.5)
        assert torch.equal(one, tree_out[row : row + 1]), f"row {row}"


def test_kernels_run_on_cpu_when_triton_was_imported_without_its_interpreter():
    """Another module (torch, a test) may import triton before TRITON_INTERPRET is set: the
    kernels still run on CPU tensors (their interpreted twins)."""
    import subprocess
    import sys

    code = (
        "import triton, torch\n"
        "from ragspec.backend.cuda import kernels as K\n"
        "x = torch.randn(3, 40); w = torch.randn(5, 40)\n"
        "assert torch.allclose(K.linear(x, w), x @ w.T, atol=1e-5)\n"
        "assert torch.allclose(K.rms_norm(x, w[0], 1e-6), K.rms_norm_reference(x, w[0], 1e-6), atol=1e-5)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ---------------------------------------------------------------------------- fused kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_kernels_give_a_row_alone_what_it_gets_batched(dtype):
    """gated linear (SiLU and GELU epilogues), residual add + norm (embedding, add, Gemma's
    normed add, norm only), rotary + KV write and the output layer with its soft cap and
    argmax: each row's values are the same alone as among 17 rows, bit for bit."""
    g = _g(10)
    x = torch.randn(17, 96, generator=g).to(dtype)
    gu = (0.2 * torch.randn(2 * 40, 96, generator=g)).to(dtype)
    for act in ("silu", "gelu_tanh"):
        y = K.gated_linear(x, gu, act)
        assert torch.equal(K.gated_linear(x[6:7], gu, act), y[6:7])
    lm = torch.randn(70, 96, generator=g).to(dtype)
    logits = K.logits(x, lm, None, 5.0)
    assert logits.dtype == torch.float32 and torch.equal(K.logits(x[16:17], lm, None, 5.0), logits[16:17])
    assert torch.equal(K.argmax(logits[3:4]), K.argmax(logits)[3:4])
    hid, w = 48, torch.randn(48, generator=g).to(dtype)
    emb = torch.randn(30, hid, generator=g).to(dtype)
    tok = torch.tensor([3, 9, 29, 0, 1] * 3 + [7, 8], dtype=torch.int32)
    delta = torch.randn(17, hid, generator=g).to(dtype)
    for kw in (dict(tokens=tok, embed=emb, embed_scale=6.0), dict(delta=delta), dict(delta=delta, delta_weight=w), {}):
        base = torch.randn(17, hid, generator=_g(11)).to(dtype)
        xa, ha = base.clone(), torch.empty_like(base)
        K.residual_norm(xa, ha, w, 1e-6, offset=True, **kw)
        one = {k: (v[4:5] if isinstance(v, torch.Tensor) and v.shape[0] == 17 else v) for k, v in kw.items()}
        xb, hb = base[4:5].clone(), torch.empty_like(base[4:5])
        K.residual_norm(xb, hb, w, 1e-6, offset=True, **one)
        assert torch.equal(xb, xa[4:5]) and torch.equal(hb, ha[4:5]), sorted(kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "gemma"])
def test_rope_kv_write_equals_transformers_rotation_and_writes_the_slot(dtype, qk_norm):
    g = _g(12)
    hq, hkv, d, cap = 4, 2, 8, 40
    qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=g).to(dtype)
    cos, sin = torch.randn(cap, d, generator=g).to(dtype), torch.randn(cap, d, generator=g).to(dtype)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    pos, slots, wpos = i32([0, 3, 39, 7, 7]), i32([0, 1, 1, 2, 2]), i32([0, 3, 39, 4, 5])
    norms = dict(q_norm=torch.randn(d, generator=g).to(dtype), k_norm=torch.randn(d, generator=g).to(dtype))
    kw = dict(norms, offset=True) if qk_norm else {}
    pools = [(torch.zeros(3, cap, hkv, d, dtype=dtype), torch.zeros(3, cap, hkv, d, dtype=dtype)) for _ in range(2)]
    q = K.rope_kv_write(qkv, cos, sin, pos, slots, wpos, *pools[0], hq, **kw)
    ref = K.rope_kv_reference(qkv, cos, sin, pos, slots, wpos, *pools[1], hq, **kw)
    atol = 1e-5 if dtype == torch.float32 else 0.1
    assert torch.allclose(q.float(), ref.float(), atol=atol)
    assert torch.allclose(pools[0][0].float(), pools[1][0].float(), atol=atol)
    assert torch.equal(pools[0][1], pools[1][1])  # values copied as they are
    assert int((pools[0][0] != 0).any(-1).any(-1).sum()) == 5  # five entries written, no other
    one = K.rope_kv_write(qkv[2:3], cos, sin, pos[2:3], slots[2:3], wpos[2:3], *pools[0], hq, **kw)
    assert torch.equal(one, q[2:3])


def test_linear_tiles_depend_on_the_weight_shape_only():
    # the default model's projections: small ones get narrow tiles (more programs), the
    # output layer wide ones; the row and reduction blocks never change
    assert K.linear_tiles(576, 576)[:3] == (16, 16, 64)
    assert K.linear_tiles(1536, 576)[:3] == (16, 16, 64)
    assert K.linear_tiles(49152, 576)[:3] == (16, 128, 64)
    assert K.linear_tiles(4096, 1536)[1] == 32


def test_argmax_takes_the_first_of_equal_maxima_across_blocks():
    x = torch.full((3, 9000), -1.0)
    x[0, [5, 4100, 8999]] = 2.0  # the first block's
    x[1, [4097, 8200]] = 3.0  # the second block's first
    x[2, 8999] = 0.5
    assert K.argmax(x).tolist() == [5, 4097, 8999] == torch.argmax(x, -1).tolist()


# ---------------------------------------------------------------------------- chunked attention
def _long_pool(dtype, cap=1100, seed=13):
    g = _g(seed)
    return (
        torch.randn(3, cap, 2, 8, generator=g).to(dtype),
        torch.randn(3, cap, 2, 8, generator=g).to(dtype),
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_attention_at_contexts_1_255_256_257_and_1000(dtype):
    """Contexts on both sides of the 256-key chunk boundary (and several chunks): close to
    float64, each row alone equal to the row batched, local windows too."""
    assert K.ATTN_CHUNK == 256
    kp, vp = _long_pool(dtype)
    rows = [(0, 1, [], 0), (1, 255, [], 0), (1, 256, [], 0), (2, 257, [], 0), (2, 1000, [], 0)]
    meta = _meta(rows)
    q = torch.randn(len(rows), 4, 8, generator=_g(14)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 0.02
    for window in (0, 300):
        out = K.tree_attention(q, kp, vp, *meta, scale=8**-0.5, window=window)
        ref = K.attention_reference(q, kp, vp, *meta, scale=8**-0.5, window=window, dtype=torch.float64)
        assert (out.double() - ref).abs().max().item() < tol
        for i in (0, 2, 3, 4):
            one = K.tree_attention(q[i : i + 1], kp, vp, *_meta([rows[i]]), scale=8**-0.5, window=window)
            assert torch.equal(one, out[i : i + 1]), (window, i)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("past", [250, 255, 510], ids=["path-crosses-256", "root-at-255", "context-across-chunks"])
def test_tree_rows_equal_one_row_steps_across_chunk_boundaries(dtype, past):
    """A tree whose paths cross the logical chunk boundary (256, 512) inside the path or
    at the root: once the accepted path is committed, the one-row step at each of its
    positions gives the tree row's output bit for bit (the split points are logical
    positions, the same for both)."""
    kp, vp = _long_pool(dtype, cap=600, seed=15)
    parents = [-1, -1, 1, 2, 3, 1, 4, 6]  # nodes 0..7; the path root -> 1 -> 2 -> 3 -> 4 -> 6 -> 7
    paths = [[0]]
    for n, p in enumerate(parents):
        paths.append((paths[0] if p < 0 else paths[p + 1]) + [n + 1])
    rows = [(0, past, path, past) for path in paths]
    q = torch.randn(len(rows), 4, 8, generator=_g(16)).to(dtype)
    tree_out = K.tree_attention(q, kp, vp, *_meta(rows), scale=8**-0.5)
    accepted = [1, 2, 3, 4, 6, 7]
    kc, vc = kp.clone(), vp.clone()
    for i, node in enumerate(accepted):  # the pool's commit: node's entry -> past + 1 + i
        kc[0, past + 1 + i] = kp[0, past + 1 + node]
        vc[0, past + 1 + i] = vp[0, past + 1 + node]
    for i, row in enumerate([0] + [n + 1 for n in accepted]):
        one = K.tree_attention(q[row : row + 1], kc, vc, *_meta([(0, past + 1 + i, [], 0)]), scale=8**-0.5)
        assert torch.equal(one, tree_out[row : row + 1]), f"row {row}"
