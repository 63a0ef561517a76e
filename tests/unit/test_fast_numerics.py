"""Fast numerics (issue 18 item 4, ``--numerics fast``): the GGUF-block linears with int8
activations (per row and block of 32) and AVX-512 VNNI integer dot products
(csrc/fast_numerics.cpp ``kvnni``, :meth:`ragspec.backend.cpu.quant.GGUFWeight.to_fast`).

Checked: the layout (a permutation, the weights round-trip bit for bit); the kernel against a
float64 emulation of the same quantization (1e-5: only the float accumulation order
differs) and against float32 (the activations' rounding, ~0.5%); each output row bit for bit
its one-row call; the mode refused where VNNI is unavailable or masked off; and the
property the mode promises over llama.cpp: a verification forward gives every accepted row
exactly the bits a one-row step gives it, so speculative greedy output equals plain
decoding within the mode. Also the attention regression this needed (exact mode too): a
tree's rows bit for bit equal to one-row steps over the compacted path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_native_step import _STEPS, _llama, _quantized_llama, _target, kernels  # noqa: F401

from ragspec.backend.cpu import kernels as kernel_lib
from ragspec.backend.cpu.build import CPUSpeedUps, load_cpu_target, read_gguf_blocks
from ragspec.backend.cpu.kernels import load_quant_linear
from ragspec.backend.cpu.native_target import NativeTarget
from ragspec.backend.cpu.quant import Q4_1, Q4_1_FAST, Q6_K, Q8_0, Q8_0_FAST, GGUFWeight, fast_order
from ragspec.backend.cpu.target import CPUTarget
from ragspec.config import PLDConfig
from ragspec.drafters import PromptLookupDrafter
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.types import DraftTree
from ragspec_testing import assert_scripted_drafts_keep_greedy, make_char_tokenizer, make_tree


@pytest.fixture(scope="module")
def fast(kernels):  # noqa: F811
    if not kernel_lib.fast_numerics_supported():
        pytest.skip("this CPU lacks AVX-512 VNNI: --numerics fast is refused here (tested below)")
    return load_quant_linear()


def _random_weight(fmt: int, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    gen = torch.Generator().manual_seed(seed)
    if fmt == Q4_1:
        qs = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=gen)
        scales = torch.stack(
            [torch.rand(rows, cols // 32, generator=gen) * 0.05, torch.randn(rows, cols // 32, generator=gen) * 0.1],
            dim=-1,
        )
        return GGUFWeight(qs, scales.contiguous(), Q4_1)
    qs = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=gen)
    return GGUFWeight(qs, torch.rand(rows, cols // 32, generator=gen) * 0.01, Q8_0)


@pytest.mark.parametrize("cols", [64, 128, 576, 640, 1536, 1216])
def test_fast_order_is_a_permutation_of_each_row(cols):
    order = fast_order(cols)
    assert sorted(order.tolist()) == list(range(cols))
    # a group of 16 blocks: lane k of step t holds weights 4t .. 4t + 3 of block k
    if cols >= 512:
        assert order[:8].tolist() == [0, 1, 2, 3, 32, 33, 34, 35]
        assert order[64:68].tolist() == [4, 5, 6, 7]


def test_fast_order_refuses_an_odd_number_of_blocks():
    with pytest.raises(ValueError, match="even number"):
        fast_order(96)


@pytest.mark.parametrize("fmt,fast_fmt", [(Q4_1, Q4_1_FAST), (Q8_0, Q8_0_FAST)])
@pytest.mark.parametrize("cols", [64, 576, 1216])
def test_to_fast_keeps_every_weight_bit_for_bit(fmt, fast_fmt, cols):
    w = _random_weight(fmt, 7, cols)
    f = w.to_fast()
    assert f.fmt == fast_fmt and f.fast and f.well_formed() and f.shape == w.shape
    assert torch.equal(f.dequantize(), w.dequantize())
    assert torch.equal(f.take_rows(torch.tensor([3, 1])).dequantize(), w.dequantize()[[3, 1]])


def test_to_fast_leaves_what_it_cannot_take_exact():
    odd = _random_weight(Q4_1, 3, 96)  # 3 blocks per row
    assert odd.to_fast() is odd
    q6 = GGUFWeight(torch.zeros(2, 64, dtype=torch.int8), torch.ones(2, 4), Q6_K)
    assert q6.to_fast() is q6


def _emulated(w: GGUFWeight, x: torch.Tensor) -> torch.Tensor:
    """float64 emulation of the fast kernel: x quantized per row and block of 32 (d =
    max|x| / 127, q = round-half-even(x / d) in float32), exact integer block sums."""
    rows, cols = w.shape
    xb = x.view(x.shape[0], cols // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(xb * inv).clamp(-127, 127).double()  # torch.round: half to even, as cvtps
    d = (amax / 127.0).double()
    if w.fmt == Q4_1:
        b = w.qs.view(rows, cols // 32, 16)
        codes = torch.cat([b & 0x0F, b >> 4], dim=-1).double()
        dw, mw = w.scales[..., 0].double(), w.scales[..., 1].double()
    else:
        codes = w.qs.view(rows, cols // 32, 32).double()
        dw, mw = w.scales.double(), torch.zeros_like(w.scales, dtype=torch.float64)
    dots = torch.einsum("rbk,obk->rob", q, codes)  # [R, O, B] exact integers
    sums = q.sum(-1)  # [R, B]
    return (dots * dw[None] * d[:, None, :, 0] + mw[None] * (d[..., 0] * sums)[:, None]).sum(-1)


@pytest.mark.parametrize("fmt", [Q4_1, Q8_0])
@pytest.mark.parametrize("cols", [64, 128, 576, 1216])
def test_fast_kernel_is_the_int8_scheme_and_each_row_its_own(fast, fmt, cols):
    w = _random_weight(fmt, 45, cols, seed=cols)
    f = w.to_fast()
    x = torch.randn(19, cols, generator=torch.Generator().manual_seed(1))
    x[3] = 0.0  # an all-zero row: scale 0, output 0 (no division by zero)
    y = fast(x, f.qs, f.scales, f.fmt, None)
    emulated = _emulated(w, x)
    torch.testing.assert_close(y.double(), emulated, rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(y[3]) == 0
    exact = x.double() @ w.dequantize().double().T
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 2e-2  # the activations' rounding: visible, and small
    for r in range(19):  # every row alone, and every prefix, bit for bit
        assert torch.equal(fast(x[r : r + 1], f.qs, f.scales, f.fmt, None), y[r : r + 1]), r
    for n in (2, 8, 9, 16):
        assert torch.equal(fast(x[:n], f.qs, f.scales, f.fmt, None), y[:n]), n
    bias = torch.randn(45)
    assert torch.equal(fast(x, f.qs, f.scales, f.fmt, bias), y + bias)


def test_fast_numerics_are_refused_where_avx512_is_masked_off(kernels, tmp_path):  # noqa: F811
    path = tmp_path / "m.gguf"
    model = _quantized_llama(path)
    prev = kernel_lib.set_cpu_isa("avx2")
    try:
        assert not kernel_lib.fast_numerics_supported()
        with pytest.raises(ConfigError, match="AVX-512 VNNI"):
            read_gguf_blocks(model, path, load_quant_linear(), numerics="fast")
        f = _random_weight(Q4_1, 4, 64).to_fast()
        with pytest.raises(RuntimeError, match="VNNI"):
            load_quant_linear()(torch.randn(1, 64), f.qs, f.scales, f.fmt, None)
    finally:
        kernel_lib.set_cpu_isa(prev)
    with pytest.raises(ConfigError, match="numerics must be"):
        CPUSpeedUps(numerics="approximate")
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        load_cpu_target(model, CPUSpeedUps(numerics="fast"))  # no GGUF file given


def _fast_target(kernels, tmp_path, name="m.gguf", numerics="fast") -> NativeTarget:  # noqa: F811
    """The tiny quantized Llama over its GGUF blocks, the compiled kernels and the native step."""
    skinny, attention, step = kernels
    path = tmp_path / name
    model = _quantized_llama(path)
    blocks = read_gguf_blocks(model, path, load_quant_linear(), numerics=numerics)
    assert len(blocks.weights) == 2 * 7 + 1
    target = CPUTarget(model, skinny=skinny, attention_kernel=attention, gguf=blocks, route_attention=True)
    assert target.numerics == numerics and target.attention_routed
    native = NativeTarget(target, step)
    assert native.numerics == numerics
    return native


def _assert_verify_rows_equal_one_row_steps(target) -> None:
    """Every tree of ``_STEPS`` verified on one state and, on another with the same history,
    the root and the accepted path as one-row steps: each accepted row's logits bit for
    bit equal (the KV of the accepted path then equal too: the states go on together)."""
    prompt = list(range(5, 40))
    with torch.inference_mode():
        tree_state, step_state = target.new_state(), target.new_state()
        target.prefill(tree_state, prompt)
        target.prefill(step_state, prompt)
        for root, (tree, path) in zip((7, 9, 11, 13, 15), _STEPS):
            past = tree_state.length
            verified = target.verify_one(tree_state, root, tree, return_hidden=True)
            target.commit(tree_state, past, path)
            for row, token in zip([0] + [1 + p for p in path], [root] + [int(tree.tokens[p]) for p in path]):
                before = step_state.length
                one = target.verify_one(step_state, token, DraftTree.empty(), return_hidden=True)
                target.commit(step_state, before, [])
                assert torch.equal(verified.hidden[row], one.hidden[0]), (tree.tokens.tolist(), row)
                assert torch.equal(verified.logits[row], one.logits[0]), (tree.tokens.tolist(), row)


def test_tree_rows_differ_from_one_row_steps_regression(kernels):  # noqa: F811
    """Exact mode: few_query_attention summed a row's keys in the order of their buffer slots
    (a tree's nodes sit wherever the tree put them, one-row steps see the compacted path)
    and its last 1-7 keys of a block through other arithmetic than full groups of 8, so a
    verified row differed from the one-row step at its position by ~1e-5 (harmless for
    float32 greedy, fatal for int8 activations). Now keys go in each row's logical order."""
    _assert_verify_rows_equal_one_row_steps(_target(kernels, _llama(), native=True))
    _assert_verify_rows_equal_one_row_steps(_target(kernels, _llama(), native=False))


def test_attention_of_a_tree_row_equals_one_query_over_its_compacted_path(kernels):  # noqa: F811
    _, attention, _ = kernels
    gen = torch.Generator().manual_seed(3)
    past, heads, kv_heads, d = 61, 4, 2, 32  # the tree straddles the 64-key block boundary
    tree = make_tree(list(range(9)), [-1, 0, 0, 1, 2, 4, -1, 6, 3])
    rows = 1 + len(tree.tokens)
    keys = torch.randn(1, kv_heads, past + rows, d, generator=gen)
    values = torch.randn(1, kv_heads, past + rows, d, generator=gen)
    queries = torch.randn(1, heads, rows, d, generator=gen)
    parents = [-1] + [int(p) + 1 for p in tree.parents]  # row 0 = the root
    mask = torch.zeros(1, 1, rows, past + rows, dtype=torch.bool)
    mask[..., :past] = True
    for r in range(rows):
        a = r
        while a >= 0:
            mask[0, 0, r, past + a] = True
            a = parents[a]
    out = attention(queries, keys, values, mask, d**-0.5)  # [1, rows, heads, d]
    for r in range(rows):
        chain, a = [], r
        while a >= 0:
            chain.append(past + a)
            a = parents[a]
        idx = torch.tensor(list(range(past)) + chain[::-1])
        one = attention(queries[:, :, r : r + 1], keys[:, :, idx], values[:, :, idx], None, d**-0.5)
        assert torch.equal(out[:, r], one[:, 0]), r


def test_fast_verification_rows_equal_one_row_steps_bit_for_bit(fast, kernels, tmp_path):  # noqa: F811
    _assert_verify_rows_equal_one_row_steps(_fast_target(kernels, tmp_path))


def test_fast_speculative_greedy_equals_fast_plain_decoding(fast, kernels, tmp_path):  # noqa: F811
    tok = make_char_tokenizer()
    target = _fast_target(kernels, tmp_path)
    prompt = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    plain = Engine(target, tok, drafter=None, eos_token_ids=[]).generate(prompt, max_new_tokens=60, chat=False)
    assert plain.stats.num_drafted_tokens == 0
    ref = list(plain.token_ids)
    pld = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[])
    out = pld.generate(prompt, max_new_tokens=60, chat=False)
    assert out.stats.num_drafted_tokens > 0
    assert list(out.token_ids) == ref
    # every draft verified (no cost model): accepted 8-token chains and rejected ones
    assert_scripted_drafts_keep_greedy(target, tok, prompt, ref, 96)


def test_fast_and_exact_numerics_differ_only_by_the_activations_rounding(fast, kernels, tmp_path):  # noqa: F811
    exact = _fast_target(kernels, tmp_path, "e.gguf", numerics="exact")
    fast_t = _fast_target(kernels, tmp_path, "f.gguf")
    prompt = list(range(5, 30))
    with torch.inference_mode():
        se, sf = exact.new_state(), fast_t.new_state()
        exact.prefill(se, prompt)
        fast_t.prefill(sf, prompt)
        a = exact.verify_one(se, 7, DraftTree.chain([3, 4, 5]), return_hidden=True)
        b = fast_t.verify_one(sf, 7, DraftTree.chain([3, 4, 5]), return_hidden=True)
    assert not torch.equal(a.hidden, b.hidden)
    rel = ((a.hidden - b.hidden).norm() / a.hidden.norm()).item()
    assert rel < 0.05, rel
    assert np.isfinite(b.logits.numpy()).all()


# --------------------------------------------------------------------------- float16 KV cache
def _attention_case(gen, d, heads, kv_heads, q, past, masked):
    """Queries float32 [1, heads, q, d]; keys/values float16 views [1, kv_heads, past + q, d]
    of a larger buffer (as the native step passes them); a tree-like mask or None."""
    s = past + q
    buf = torch.randn(2, kv_heads, s + 37, d, generator=gen).half()
    keys, values = buf[0, :, :s][None], buf[1, :, :s][None]
    queries = torch.randn(1, heads, q, d, generator=gen)
    mask = None
    if masked:
        mask = torch.ones(1, 1, q, s, dtype=torch.bool)
        mask[..., past:] = torch.rand(q, q, generator=gen) > 0.5
        for i in range(q):
            mask[0, 0, i, past + i] = True
            mask[0, 0, i, past + i + 1 :] = False
    return queries, keys, values, mask


@pytest.mark.parametrize("isa", ["avx2", "auto"])
def test_attention_over_float16_keys_is_the_float32_kernel_over_them_widened(kernels, isa):  # noqa: F811
    """A float16 KV cache (fast numerics) is read widened to float32, exactly: every path
    (one-row items, the AVX-512 tiles of 4+ rows, masked trees, a block boundary) gives the
    float32 call's bits over ``keys.float()``, so a verified row still equals the one-row
    step at its position."""
    _, attention, _ = kernels
    prev = kernel_lib.set_cpu_isa(isa)
    try:
        gen = torch.Generator().manual_seed(11)
        for d, heads, kv_heads in ((64, 9, 3), (32, 4, 2), (128, 8, 1)):
            for q, past, masked in ((1, 700, False), (2, 61, True), (5, 130, True), (9, 63, False)):
                queries, keys, values, mask = _attention_case(gen, d, heads, kv_heads, q, past, masked)
                out = attention(queries, keys, values, mask, d**-0.5)
                ref = attention(queries, keys.float(), values.float(), mask, d**-0.5)
                assert out.dtype == torch.float32
                assert torch.equal(out, ref), (d, heads, q, past, masked)
    finally:
        kernel_lib.set_cpu_isa(prev)


def test_attention_of_several_requests_in_one_call_equals_each_alone(kernels):  # noqa: F811
    """The native step's batched attention (one parallel region for all requests of a layer)
    gives each request exactly its own call's output, float32 and float16 caches mixed."""
    _, attention, _ = kernels
    many = kernel_lib._load_module().few_query_attention_many
    gen = torch.Generator().manual_seed(5)
    cases = [_attention_case(gen, 64, 9, 3, q, past, masked) for q, past, masked in ((1, 700, False), (5, 300, True))]
    cases += [_attention_case(gen, 64, 9, 3, 3, 64, True), _attention_case(gen, 64, 9, 3, 9, 1000, True)]
    cases[0] = (cases[0][0], cases[0][1].float(), cases[0][2].float(), None)
    outs = many([c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases], [c[3] for c in cases], 0.125)
    assert len(outs) == len(cases)
    for out, (queries, keys, values, mask) in zip(outs, cases):
        assert torch.equal(out, attention(queries, keys, values, mask, 0.125))
    with pytest.raises(RuntimeError, match="one key, value and mask per query"):
        many([cases[0][0]], [], [], [], 0.125)


def test_fast_numerics_keep_the_kv_cache_in_float16(fast, kernels, tmp_path):  # noqa: F811
    """Fast numerics store keys/values in float16 (half the bytes a step's attention reads,
    as llama.cpp's default cache); exact numerics keep float32. A chunked prefill whose later
    chunk runs transformers' forward over the float16 buffer agrees with the one-shot
    prefill to float16 rounding (amplified by the int8 activations of the prefill's
    linears, which re-round what the float16 keys and values changed), and the buffer stays
    float16."""
    fast_t = _fast_target(kernels, tmp_path, "f.gguf")
    exact = _fast_target(kernels, tmp_path, "e.gguf", numerics="exact")
    assert fast_t.new_state().buffer.dtype == torch.float16
    assert exact.new_state().buffer.dtype == torch.float32
    prompt = [5 + (i * 7) % 50 for i in range(200)]
    with torch.inference_mode():
        whole, chunked = fast_t.new_state(), fast_t.new_state()
        ref = fast_t.prefill(whole, prompt).logits
        fast_t.prefill(chunked, prompt[:100])
        out = fast_t.prefill(chunked, prompt[100:]).logits
    assert chunked.length == whole.length == len(prompt)
    assert chunked.buffer.dtype == torch.float16
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 5e-2, rel


def test_fast_prefill_rows_run_through_the_int8_twins_each_row_alone(fast, kernels, tmp_path):  # noqa: F811
    """Issue 41: ``--numerics fast`` prefilled with float32 activations; its prefill rows now
    take the int8 twins (16 rows a call), each row quantized and summed alone, so a
    prefill chunk's linear rows do not depend on the chunking."""
    target = _fast_target(kernels, tmp_path)
    fast_linears = [
        m
        for m in target.model.model.modules()
        if type(m) is torch.nn.Linear and target.kernel_path.gguf_blocks[m.weight.data_ptr()].fast
    ]
    assert fast_linears
    gen = torch.Generator().manual_seed(11)
    scope = target.kernel_path._scope
    scope.active = True
    try:
        with torch.inference_mode():
            for lin in fast_linears:
                x = torch.randn(100, lin.in_features, generator=gen)
                whole = lin(x)
                rows = torch.cat([lin(x[i : i + 1]) for i in range(100)])
                assert torch.equal(whole, rows)  # the one-row kernel's values, every row
                ref = torch.nn.functional.linear(x, lin.weight)
                assert not torch.equal(whole, ref)  # int8 activations, not float32
                rel = ((whole - ref).norm() / ref.norm()).item()
                assert rel < 0.05, rel
    finally:
        scope.active = False
    # exact numerics: prefill rows stay float32 (the packed weight)
    exact = _fast_target(kernels, tmp_path, "e.gguf", numerics="exact")
    lin = next(m for m in exact.model.model.modules() if type(m) is torch.nn.Linear)
    x = torch.randn(100, lin.in_features, generator=gen)
    exact.kernel_path._scope.active = True
    try:
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
    finally:
        exact.kernel_path._scope.active = False
