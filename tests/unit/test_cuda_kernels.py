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
