"""The compiled prompt-chunk attention (ragspec/backend/cpu/csrc/prefill_attention.cpp) and
where the backend's forwards take it.

It runs where the compiled kernels use AVX-512; on other CPUs the loader's kernel answers
None for every call (tested here with the instruction set switched to AVX2) and the tests of
its values are skipped with that reason."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from ragspec.backend.cpu import kernels
from ragspec.backend.cpu.fastpaths import compiled_attention, is_causal_chunk
from ragspec.backend.cpu.kernels import _cpu_supported
from ragspec.backend.cpu.target import CPUTarget
from ragspec.types import DraftTree
from ragspec_testing import make_tiny_llama

_BUILDABLE = _cpu_supported() and bool(shutil.which(os.environ.get("CXX", "c++"))) and bool(shutil.which("ninja"))


@pytest.fixture(scope="module")
def prefill():
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernels (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    kernel = kernels.load_prefill_attention()
    assert kernel is not None, "the kernels failed to build on a machine that has AVX2, a compiler and ninja"
    if kernels.cpu_isa() != "avx512":
        pytest.skip("the prompt-chunk attention needs the AVX-512 kernels (this CPU runs AVX2)")
    return kernel


def _reference(q, k, v, scale):
    """Causal attention (row i sees keys 0 .. S - Q + i) in float64 -> float32 [1, Q, Hq, d]."""
    q_len, s_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, s_len, dtype=torch.bool).tril(s_len - q_len)
    out = F.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).float()


def _inputs(gen, q_len, keys, heads, kv_heads, head_dim):
    # the query as transformers hands it over ([1, Q, H, d] transposed), keys and values as
    # views of a larger cache buffer (ragspec's growable cache)
    q = torch.randn(1, q_len, heads, head_dim, generator=gen).transpose(1, 2)
    kbuf = torch.randn(1, kv_heads, keys + 29, head_dim, generator=gen)
    vbuf = torch.randn(1, kv_heads, keys + 29, head_dim, generator=gen)
    return q, kbuf[:, :, :keys], vbuf[:, :, :keys]


def _tiny_target(prefill, *, native: bool = False, native_chunks: bool = True):
    """A tiny Llama (head size 32) on the compiled kernels with the prompt-chunk attention
    ``prefill``: the transformers path, or the native step built on it."""
    from ragspec.backend.cpu.native_target import NativeTarget

    cpu = CPUTarget(
        make_tiny_llama(layers=2, head_dim=32, eos_token_id=None),
        skinny=kernels.load_skinny_linear(),
        attention_kernel=kernels.load_few_query_attention(),
        prefill_attention=prefill,
        route_attention=True,
    )
    return NativeTarget(cpu, kernels.load_decoder_step(), native_chunks=native_chunks) if native else cpu


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 1, 256), (8, 2, 64), (6, 6, 64), (16, 4, 128), (5, 1, 32)],
)
@pytest.mark.parametrize("q_len,keys", [(17, 17), (40, 40), (37, 300), (256, 700)])
def test_prefill_attention_matches_causal_sdpa(prefill, heads, kv_heads, head_dim, q_len, keys):
    """Every group shape the kernel tiles (query heads per key/value head 3, 4, 2, 1, 5),
    rows not a multiple of 16, cached keys before the chunk or none."""
    gen = torch.Generator().manual_seed(q_len * 131 + keys + heads)
    q, k, v = _inputs(gen, q_len, keys, heads, kv_heads, head_dim)
    scale = head_dim**-0.5
    out = prefill(q, k, v, scale)
    assert out.shape == (1, q_len, heads, head_dim)
    torch.testing.assert_close(out, _reference(q, k, v, scale), rtol=1e-5, atol=1e-5)


def test_prefill_attention_gives_each_row_the_same_bits_in_any_chunk(prefill):
    """A row's values depend on its query, position and keys alone (fixed 64-key blocks from
    key 0): a 700-token prompt's rows are the same bits computed whole or in chunks."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = _inputs(gen, 700, 700, 9, 3, 64)
    whole = prefill(q, k, v, 0.125)
    parts = [prefill(q[:, :, a:b], k[:, :, :b], v[:, :, :b], 0.125) for a, b in ((0, 256), (256, 273), (273, 700))]
    assert torch.equal(whole, torch.cat(parts, dim=1))


def test_prefill_attention_rejects_what_it_does_not_compute(prefill):
    q, k = torch.randn(1, 4, 20, 64), torch.randn(1, 2, 30, 64)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        prefill(torch.randn(1, 3, 20, 64), k, k, 1.0)  # 3 query heads over 2 key/value heads
    with pytest.raises(RuntimeError, match="at least as many keys"):
        prefill(q, k[:, :, :10], k[:, :, :10], 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        prefill(q.double(), k.double(), k.double(), 1.0)
    assert prefill(torch.randn(1, 4, 20, 40), torch.randn(1, 2, 30, 40), torch.randn(1, 2, 30, 40), 1.0) is None  # d 40


def test_prefill_attention_answers_none_while_the_kernels_run_avx2(prefill):
    previous = kernels.set_cpu_isa("avx2")
    try:
        q, k = torch.randn(1, 4, 20, 64), torch.randn(1, 2, 30, 64)
        assert prefill(q, k, k, 1.0) is None
    finally:
        kernels.set_cpu_isa(previous)


def test_is_causal_chunk_recognises_only_the_causal_mask():
    causal = torch.ones(20, 50, dtype=torch.bool).tril(30)[None, None]
    assert is_causal_chunk(causal, 20, 50)
    assert is_causal_chunk(None, 20, 20) and not is_causal_chunk(None, 20, 21)
    window = causal.clone()
    window[..., 0] = False  # a sliding window's first key out of reach
    assert not is_causal_chunk(window, 20, 50)
    assert not is_causal_chunk(causal.float(), 20, 50)
    assert not is_causal_chunk(causal, 20, 49)


class _Counting:
    """Stands in for a compiled kernel: SDPA, counting calls by query count."""

    def __init__(self, causal: bool = False) -> None:
        self.queries: list[int] = []
        self.causal = causal

    def __call__(self, q, k, *rest):
        self.queries.append(int(q.shape[2]))
        if self.causal:  # prefill_attention(q, k, v, scale)
            v, scale = rest
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
        else:  # few_query_attention(q, k, v, mask, scale)
            v, mask, scale = rest
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


def test_prompt_chunks_take_the_prefill_kernel_and_steps_the_few_query_one():
    """Through a target's own forwards: a first chunk (no mask) and a later chunk (causal
    mask over cached keys) run the prefill kernel, at any number of keys (no parts budget);
    verification rows run the few-query kernel."""
    model = make_tiny_llama(layers=2, head_dim=32)
    few, chunk = _Counting(), _Counting(causal=True)
    target = CPUTarget(model, attention_kernel=few, prefill_attention=chunk, route_attention=True)
    with torch.inference_mode():
        state = target.new_state()
        target.prefill(state, list(range(3, 23)))
        assert chunk.queries == [20, 20] and few.queries == []
        target.prefill(state, list(range(5, 45)))  # a later chunk over the 20 cached tokens
        assert chunk.queries == [20, 20, 40, 40]
        target.verify_one(state, 7, DraftTree.chain([8, 9]))
        assert few.queries == [3, 3] and chunk.queries == [20, 20, 40, 40]


def test_a_chunk_the_prefill_kernel_declines_takes_the_few_query_kernel():
    """The prefill kernel answers None (another instruction set now, another head size): the
    chunk's attention is the few-query kernel's under the causal mask."""
    few = _Counting()
    declined: list[int] = []

    def decline(q, k, v, scale):
        declined.append(int(q.shape[2]))
        return None

    routed = compiled_attention(few, decline)
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 4, 30, 64, generator=g),
        torch.randn(1, 2, 30, 64, generator=g),
        torch.randn(1, 2, 30, 64, generator=g),
    )
    with torch.inference_mode():
        assert routed.applies(q, k, None, 0.0, {})
        out = routed.run(q, k, v, None, 0.125)
    assert declined == [30] and few.queries == [30]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_non_causal_chunk_mask_does_not_take_the_prefill_kernel():
    """A sliding window's mask (keys out of reach behind the row) is not the causal one: the
    chunk keeps the few-query kernel under its own mask."""
    few, chunk = _Counting(), _Counting(causal=True)
    routed = compiled_attention(few, chunk)
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 20, 64, generator=g),
        torch.randn(1, 2, 50, 64, generator=g),
        torch.randn(1, 2, 50, 64, generator=g),
    )
    window = torch.ones(20, 50, dtype=torch.bool).tril(30).triu(10)[None, None]
    with torch.inference_mode():
        assert routed.applies(q, k, window, 0.0, {})
        out = routed.run(q, k, v, window, 0.125)
    assert chunk.queries == [] and few.queries == [20]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=window, scale=0.125, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_greedy_with_the_prefill_kernel_matches_generate(prefill):
    """The prompt's attention through the prefill kernel (whole, and a later chunk over
    cached keys), decoding through the few-query kernel: greedy tokens equal
    ``model.generate``'s, drafts accepted or rejected."""
    from ragspec_testing import assert_scripted_drafts_keep_greedy, greedy_reference, make_char_tokenizer

    tok = make_char_tokenizer()
    prompt = tok("the cat sat on the mat. the dog sat on the log. the cat sat on the")["input_ids"]
    assert len(prompt) > 2 * kernels.SKINNY_MAX_ROWS
    ref = greedy_reference(make_tiny_llama(layers=2, head_dim=32, eos_token_id=None), prompt, 60)
    calls: list[int] = []

    def counted(q, k, v, scale):
        calls.append(int(q.shape[2]))
        return prefill(q, k, v, scale)

    target = _tiny_target(counted)
    assert_scripted_drafts_keep_greedy(target, tok, prompt, ref, 96)
    assert calls and all(c > kernels.SKINNY_MAX_ROWS for c in calls)


def test_native_step_runs_prompt_chunks_bit_for_bit_like_transformers_forward(prefill):
    """With the prompt-chunk attention and the packed weights, the native step prefills a
    first chunk and a later one (past NATIVE_EXTEND_GEMM_ROWS rows) in one call each: hidden
    states, logits and KV entries equal transformers' forward of the same chunks bit for
    bit, and so do the verification steps after them."""
    from ragspec.backend.cpu.native_target import NATIVE_EXTEND_GEMM_ROWS

    targets = [_tiny_target(prefill, native=True, native_chunks=chunks) for chunks in (True, False)]
    native, hf = targets
    assert native.native_step.packed and not hf.native_step.packed
    calls: list[int] = []
    forward = hf.kernel_path.forward
    hf.kernel_path.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)  # type: ignore[method-assign]
    prompt = torch.randint(
        3, 96, (40 + NATIVE_EXTEND_GEMM_ROWS + 20,), generator=torch.Generator().manual_seed(7)
    ).tolist()
    with torch.inference_mode():
        states = [t.new_state() for t in targets]
        for part in (prompt[:40], prompt[40:]):
            a, b = (t.prefill(s, part, return_hidden=True) for t, s in zip(targets, states))
            assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
        assert len(calls) == 2  # both chunks took transformers' forward on the other target
        n = len(prompt)
        assert torch.equal(states[0].buffer[..., :n, :], states[1].buffer[..., :n, :])
        root = int(a.logits.argmax())
        a, b = (t.verify_one(s, root, DraftTree.chain([5, 6, 7]), return_hidden=True) for t, s in zip(targets, states))
        assert torch.equal(a.logits, b.logits)


@pytest.mark.parametrize("native", [False, True])
def test_a_batched_verification_of_over_16_rows_keeps_each_solo_step_regression(prefill, native):
    """Bug: with the prompt-chunk paths in, a verification forward of more than 16 rows in
    all (two requests' draft chains of 9 rows each) took the packed weights in the native
    step (rows past 16 looked like a prompt chunk), so each request's rows differed from its
    solo step in the last bits (batched logprobs then differed from plain ones). Only
    prefills take the prompt-chunk paths now: each request's rows equal its solo
    verification bit for bit, through the native step and through transformers' forward."""
    from ragspec.backend.base import VerifyItem

    batched, solo = _tiny_target(prefill, native=native), _tiny_target(prefill, native=native)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (50, 37)]
    drafts = [DraftTree.chain(torch.randint(3, 96, (8,), generator=gen).tolist()) for _ in prompts]
    with torch.inference_mode():
        together = [batched.new_state() for _ in prompts]
        alone = [solo.new_state() for _ in prompts]
        for p, a, b in zip(prompts, together, alone):
            batched.prefill(a, p)
            solo.prefill(b, p)
        outs = batched.verify([VerifyItem(s, 7, d, False, False) for s, d in zip(together, drafts)])
        for s, d, out in zip(alone, drafts, outs):
            ref = solo.verify_one(s, 7, d)
            assert torch.equal(out.logits, ref.logits)


def test_alternating_masks_keep_their_own_verdicts():
    """Layers of two kinds (gemma3: sliding window and full attention) hand over two mask
    objects in turn: each call takes the kernel its own mask allows."""
    few, chunk = _Counting(), _Counting(causal=True)
    routed = compiled_attention(few, chunk)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 20, 64, generator=g)
    k, v = torch.randn(1, 2, 50, 64, generator=g), torch.randn(1, 2, 50, 64, generator=g)
    causal = torch.ones(20, 50, dtype=torch.bool).tril(30)[None, None]
    window = causal & torch.ones(20, 50, dtype=torch.bool).triu(10)[None, None]
    with torch.inference_mode():
        for mask in (causal, window, causal, window):
            assert routed.applies(q, k, mask, 0.0, {})
            routed.run(q, k, v, mask, 0.125)
    assert chunk.queries == [20, 20] and few.queries == [20, 20]


def test_an_instruction_set_switch_keeps_prompt_chunks_causal_regression(prefill):
    """Bug: the native step chose between the prompt-chunk attention and the few-query
    kernel (with the causal mask it builds) by the kernels' instruction set at two points
    of a forward; switched to AVX2 in between, later layers ran the few-query kernel without
    a mask (every row seeing every key). The choice is made once per forward now. Here:
    a step built under AVX-512 prefilling after a switch to AVX2 stays causal (its values
    those of AVX-512's to float32 rounding), and a target built under AVX2 does not route
    prompt chunks through the step at all."""
    prompt = torch.randint(3, 96, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    native = _tiny_target(prefill, native=True)
    assert native.native_step.packed
    with torch.inference_mode():
        ref = native.prefill(native.new_state(), prompt, return_hidden=True)
        previous = kernels.set_cpu_isa("avx2")
        try:
            switched = native.prefill(native.new_state(), prompt, return_hidden=True)
            assert not _tiny_target(prefill, native=True).native_step.packed  # built under AVX2: transformers' forward
        finally:
            kernels.set_cpu_isa(previous)
    torch.testing.assert_close(switched.hidden, ref.hidden, rtol=1e-4, atol=1e-4)


def test_under_avx2_a_long_chunk_keeps_the_parts_budget(prefill, monkeypatch):
    """Where the prompt-chunk kernel does not run (the kernels switched to AVX2), a chunk
    past the few-query kernel's parts budget takes SDPA again, as before the kernel."""
    from ragspec.backend.cpu import fastpaths

    few = _Counting()
    routed = compiled_attention(few, prefill)
    q, k = torch.randn(1, 4, 20, 64), torch.randn(1, 2, 20, 64)  # a first chunk: causal without a mask
    monkeypatch.setattr(fastpaths, "PREFILL_ATTENTION_PARTS_BYTES", 1024)
    with torch.inference_mode():
        assert routed.applies(q, k, None, 0.0, {})  # AVX-512: the prompt-chunk kernel, any size
        previous = kernels.set_cpu_isa("avx2")
        try:
            assert not routed.applies(q, k, None, 0.0, {})  # past the budget: SDPA
        finally:
            kernels.set_cpu_isa(previous)
