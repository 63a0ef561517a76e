"""The native decoder step (issue 18 item 2, ragspec/backend/cpu/native.py and
csrc/decoder_step.cpp): every decoder layer of a Llama model in one C++ call over a
per-request KV buffer.

Checked against two references: ragspec's transformers path with the same compiled kernels
(``torch.equal``: the same kernels on the same inputs, the element-wise math in
transformers' order) and transformers' plain forward (float32 rounding: close hidden states,
equal argmax); KV compaction against a fresh prefill of the accepted path; a batched step
against each request's solo step (bit for bit); the engine against ``model.generate``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_kernels import _BUILDABLE

from ragspec.backend.base import Capability, VerifyItem
from ragspec.backend.cpu.build import CPUSpeedUps, load_cpu_target, read_gguf_blocks
from ragspec.backend.cpu.kernels import (
    load_decoder_step,
    load_few_query_attention,
    load_quant_linear,
    load_skinny_linear,
)
from ragspec.backend.cpu.native import NativeDecoder, NativeKVState, native_step_enabled, native_step_unsupported
from ragspec.backend.cpu.native_target import NATIVE_EXTEND_GEMM_ROWS, NativeTarget
from ragspec.backend.cpu.quant import Q4_1, Q6_K, Q8_0
from ragspec.backend.cpu.target import CPUTarget
from ragspec.backend.hf import KVState
from ragspec.config import DecodeConfig, PLDConfig, PolicyConfig
from ragspec.drafters import PromptLookupDrafter
from ragspec.engine import Engine
from ragspec.errors import ConfigError
from ragspec.loading import select_target
from ragspec.types import DraftTree
from ragspec_testing import (
    assert_scripted_drafts_keep_greedy,
    greedy_reference,
    make_char_tokenizer,
    make_tiny_llama,
    make_tree,
    random_k_blocks,
)


@pytest.fixture(scope="module")
def kernels():
    if not _BUILDABLE:
        pytest.skip("this machine cannot build the kernel (needs Linux x86-64 with AVX2, a C++ compiler and ninja)")
    skinny, attention, step = load_skinny_linear(), load_few_query_attention(), load_decoder_step()
    assert skinny is not None and attention is not None and step is not None, "the kernel library failed to build"
    return skinny, attention, step


def _llama(seed: int = 0, *, hidden: int = 64, head_dim: int = 32, heads: int = 4, kv_heads: int = 2, layers: int = 3):
    """A tiny random Llama (vocab 96, intermediate 2 x hidden + 32, 512 positions)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 32,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.pad_token_id = 0
    return model


def _target(kernels, model, native: bool):
    """ragspec's transformers path with the compiled kernels, or the native step built on it."""
    skinny, attention, step = kernels
    target = CPUTarget(model, skinny=skinny, attention_kernel=attention, route_attention=True)
    assert target.attention_routed and target.skinny is skinny
    return NativeTarget(target, step) if native else target


# (prompt length, root token, tree) of the steps each comparison runs, in order
_STEPS = [
    (DraftTree.empty(), []),  # plain decoding: one row, no mask
    (DraftTree.chain([3, 4, 5]), [0, 1, 2]),  # a chain, all accepted
    (make_tree([10, 11, 12, 13, 14], [-1, -1, 1, 2, 0]), [1, 2, 3]),  # a tree; the path is no prefix of the rows
    (make_tree(list(range(20, 35)), [-1] + list(range(14))), [0]),  # 16 rows
    (DraftTree.chain([9, 8]), []),  # a chain, all rejected
]


@pytest.mark.parametrize("head_dim,hidden,prompt_len", [(32, 64, 40), (64, 128, 70), (32, 64, 9)])
def test_native_step_is_bit_identical_to_the_kernel_path(kernels, head_dim, hidden, prompt_len):
    """Prefill (transformers' forward, copied into the buffer), then plain, chain and tree
    steps with commits: hidden states, logits and the KV entries equal the transformers
    path's with the same kernels, bit for bit."""
    make = lambda: _llama(head_dim=head_dim, hidden=hidden)  # noqa: E731
    ref, nat = _target(kernels, make(), False), _target(kernels, make(), True)
    prompt = torch.randint(3, 96, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        sr, sn = ref.new_state(), nat.new_state()
        assert isinstance(sr, KVState) and isinstance(sn, NativeKVState)
        a, b = ref.prefill(sr, prompt[:-1], return_hidden=True), nat.prefill(sn, prompt[:-1], return_hidden=True)
        assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
        root = prompt[-1]
        for tree, path in _STEPS:
            past = sr.length
            assert sn.length == past
            a = ref.verify_one(sr, root, tree, return_hidden=True)
            b = nat.verify_one(sn, root, tree, return_hidden=True)
            assert torch.equal(a.hidden, b.hidden), f"{tree.num_nodes} nodes: hidden differ"
            assert torch.equal(a.logits, b.logits)
            ref.commit(sr, past, path)
            nat.commit(sn, past, path)
            assert sr.length == sn.length == past + 1 + len(path)
            for i, layer in enumerate(sr.cache.layers):
                assert torch.equal(layer.keys[0], sn.buffer[i, 0, :, : sn.length])
                assert torch.equal(layer.values[0], sn.buffer[i, 1, :, : sn.length])
            root = int(a.logits[len(path)].argmax())


def _full_forward(model, ids):
    """transformers' plain forward (no ragspec kernels) over ``ids`` -> (hidden [T, H], logits [T, V])."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0], out.logits[0]


def test_native_step_matches_transformers_plain_forward(kernels):
    """Against transformers' own forward over the whole sequence (model.generate's
    numerics): every verified row's hidden state within float32 rounding, argmax equal,
    for plain, chain and tree steps, and after commits."""
    model = _llama(head_dim=64, hidden=128)
    nat = _target(kernels, _llama(head_dim=64, hidden=128), True)
    seq = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        state = nat.new_state()
        pre = nat.prefill(state, seq[:-1], return_hidden=True)
        h, lg = _full_forward(model, seq[:-1])
        torch.testing.assert_close(pre.hidden, h, rtol=1e-4, atol=1e-4)
        root = seq[-1]
        for tree, path in _STEPS:
            past = state.length
            out = nat.verify_one(state, root, tree, return_hidden=True)
            parents = tree.parents.tolist()
            for row in range(tree.num_nodes + 1):
                # the row's context: the committed tokens, the root, its ancestors, itself
                chain, node = [], row - 1
                while node >= 0:
                    chain.append(int(tree.tokens[node]))
                    node = parents[node]
                h, lg = _full_forward(model, seq + chain[::-1])
                torch.testing.assert_close(out.hidden[row], h[-1], rtol=1e-4, atol=1e-4)
                assert int(out.logits[row].argmax()) == int(lg[-1].argmax())
            nat.commit(state, past, path)
            seq = seq + [int(tree.tokens[i]) for i in path]
            root = int(out.logits[len(path)].argmax())
            seq = seq + [root]
            assert state.length == len(seq) - 1


def test_native_prefill_in_chunks_matches_transformers_prefill(kernels):
    """A prompt of 40 tokens through the native step in chunks of 16 (``native_prefill_rows``
    below it) gives the hidden states and KV entries of transformers' prefill to float32
    rounding; extending a filled state always runs natively."""
    nat = _target(kernels, _llama(), True)
    in_chunks = NativeTarget(nat.kernel_path, kernels[2], native_prefill_rows=10**6)
    prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        copied = nat.new_state()
        a = nat.prefill(copied, prompt, return_hidden=True)
        chunked = in_chunks.new_state()
        b = in_chunks.prefill(chunked, prompt, return_hidden=True)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-4, atol=1e-5)
        assert int(a.logits.argmax()) == int(b.logits.argmax())
        assert copied.length == chunked.length == 40
        # (the two prefills' attention sums in different orders: the compiled kernel over the
        # prompt's chunk, per-row in the native step; a near-zero entry may differ by ~1e-5)
        torch.testing.assert_close(copied.buffer[..., :40, :], chunked.buffer[..., :40, :], rtol=1e-4, atol=3e-5)
        nat.prefill(chunked, [5, 6, 7])
        assert chunked.length == 43


def test_native_prefill_chunk_extension_is_slow_regression(kernels):
    """Bug: a later chunk of a chunked prefill extended a filled native state 16 rows per
    native call (the whole model streamed through the few-row kernel ~16 times per 256-token
    chunk). Chunks over ``NATIVE_EXTEND_GEMM_ROWS`` rows now go through transformers'
    forward writing into the state's own buffer: hidden states, KV entries and the next
    decoding step match a whole-prompt prefill."""
    nat = _target(kernels, _llama(), True)
    first, rest = 30, NATIVE_EXTEND_GEMM_ROWS + 20
    prompt = torch.randint(3, 96, (first + rest,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        whole = nat.new_state()
        a = nat.prefill(whole, prompt, return_hidden=True)
        parts = nat.new_state()
        nat.prefill(parts, prompt[:first])
        b = nat.prefill(parts, prompt[first:], return_hidden=True)
        assert parts.length == whole.length == len(prompt)
        torch.testing.assert_close(a.hidden[first:], b.hidden, rtol=1e-4, atol=1e-5)
        assert int(a.logits.argmax()) == int(b.logits.argmax())
        n = len(prompt)
        torch.testing.assert_close(whole.buffer[..., :n, :], parts.buffer[..., :n, :], rtol=1e-4, atol=1e-5)
        root = int(a.logits.argmax())
        empty = make_tree([], [])
        x = nat.verify_one(whole, root, empty)
        y = nat.verify_one(parts, root, empty)
        assert int(x.logits[0].argmax()) == int(y.logits[0].argmax())
        torch.testing.assert_close(x.logits, y.logits, rtol=1e-4, atol=1e-4)


def test_commit_compaction_equals_a_fresh_prefill_of_the_accepted_path(kernels):
    nat = _target(kernels, _llama(), True)
    prompt = torch.randint(3, 96, (25,), generator=torch.Generator().manual_seed(4)).tolist()
    tree = make_tree([10, 11, 12, 13, 14, 15], [-1, -1, 1, 2, 0, 3])
    with torch.inference_mode():
        for path in ([1, 2, 3, 5], [0, 4], [], [1]):
            state = nat.new_state()
            nat.prefill(state, prompt[:-1])
            past = state.length
            nat.verify_one(state, prompt[-1], tree)
            nat.commit(state, past, path)
            accepted = prompt + [int(tree.tokens[i]) for i in path]
            fresh = nat.new_state()
            nat.prefill(fresh, accepted)
            assert state.length == fresh.length == len(accepted)
            n = state.length
            torch.testing.assert_close(state.buffer[..., :n, :], fresh.buffer[..., :n, :], rtol=1e-4, atol=1e-5)
            # the next step from either state: the same argmax
            a = nat.verify_one(state, 7, DraftTree.chain([8]))
            b = nat.verify_one(fresh, 7, DraftTree.chain([8]))
            torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))
            # rollback only lowers the length; the buffer is not reallocated
            buf = state.buffer
            nat.rollback(state, n - 1)
            assert state.length == n - 1 and state.buffer is buf


def test_batched_native_verify_gives_each_request_exactly_its_solo_step(kernels, monkeypatch):
    """3 requests of different lengths (a plain step, a chain, a tree) in one native call:
    logits (full and lazy), hidden states and the KV buffers after commit equal each
    request's solo step bit for bit."""
    batched, solo = _target(kernels, _llama(), True), _target(kernels, _llama(), True)
    calls: list[int] = []
    inner = batched.native_step.forward

    def spy(states, *args, **kwargs):
        calls.append(len(states))
        return inner(states, *args, **kwargs)

    monkeypatch.setattr(batched.native_step, "forward", spy)
    gen = torch.Generator().manual_seed(5)
    lens = (20, 75, 140)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in lens]
    trees = [DraftTree.empty(), DraftTree.chain([4, 5, 6]), make_tree([10, 11, 12, 13, 14], [-1, -1, 1, 2, 0])]
    paths = [[], [0, 1], [1, 2]]
    with torch.inference_mode():
        sb, ss = [batched.new_state() for _ in lens], [solo.new_state() for _ in lens]
        for a, b, p in zip(sb, ss, prompts):
            batched.prefill(a, p[:-1])
            solo.prefill(b, p[:-1])
        calls.clear()
        for rnd in range(2):
            pasts = [s.length for s in sb]
            items = [
                VerifyItem(s, p[-1], t, hidden=True, lazy_logits=i == 1)
                for i, (s, p, t) in enumerate(zip(sb, prompts, trees))
            ]
            outs = batched.verify(items)
            assert calls == [3] * (rnd + 1)  # one native call for all three
            for i, (s, p, t) in enumerate(zip(ss, prompts, trees)):
                ref = solo.verify_one(s, p[-1], t, return_hidden=True)
                logits = outs[i].row_logits.full() if i == 1 else outs[i].logits
                assert torch.equal(logits, ref.logits), f"request {i}: logits differ from its solo step"
                assert torch.equal(outs[i].hidden, ref.hidden)
            for i, path in enumerate(paths):
                batched.commit(sb[i], pasts[i], path)
                solo.commit(ss[i], pasts[i], path)
                n = ss[i].length
                assert sb[i].length == n
                assert torch.equal(sb[i].buffer[..., :n, :], ss[i].buffer[..., :n, :])


def test_buffer_grows_geometrically_and_keeps_its_entries(kernels):
    nat = _target(kernels, _llama(layers=1), True)
    ref = _target(kernels, _llama(layers=1), False)
    with torch.inference_mode():
        sn, sr = nat.new_state(), ref.new_state()
        assert sn.capacity == 0
        prompt = list(range(3, 60))
        nat.prefill(sn, prompt)
        ref.prefill(sr, prompt)
        caps = {sn.capacity}
        tok = 5
        for _ in range(300):  # past the first capacity (57 + 256)
            a = nat.verify_one(sn, tok, DraftTree.empty())
            b = ref.verify_one(sr, tok, DraftTree.empty())
            assert torch.equal(a.logits, b.logits)
            tok = int(a.logits[0].argmax())
            caps.add(sn.capacity)
        assert sorted(caps) == [57 + 256, 2 * (57 + 256)]
        assert torch.equal(sr.cache.layers[0].keys[0], sn.buffer[0, 0, :, : sn.length])


def test_native_step_switch_and_supported_models(kernels, monkeypatch):
    """The builder chooses the fused-step target where the step runs the model, else the
    kernel-routed one, which says why not; a state of one target is refused by the other."""
    monkeypatch.setenv("RAGSPEC_NATIVE_STEP", "0")
    assert not native_step_enabled()
    off = select_target(_llama(layers=1))
    assert type(off) is CPUTarget and off.skinny is not None and isinstance(off.new_state(), KVState)
    assert off.capability(Capability.SPEED_UPS).native_step_off == "switched off: RAGSPEC_NATIVE_STEP=0"
    monkeypatch.setenv("RAGSPEC_NATIVE_STEP", "")
    assert native_step_enabled() and native_step_enabled("1") and not native_step_enabled("off")
    on = select_target(_llama(layers=1))
    assert type(on) is NativeTarget and isinstance(on.new_state(), NativeKVState)
    assert on.capability(Capability.SPEED_UPS).native_step_off is None
    assert on.capability(Capability.FUSED_STEP).decoder is on.native_step
    # no compiled kernels: no native step
    plain = load_cpu_target(_llama(layers=1), CPUSpeedUps(compiled_kernels=False))
    assert type(plain) is CPUTarget and plain.capability(Capability.FUSED_STEP) is None
    assert "switched off" in plain.capability(Capability.SPEED_UPS).native_step_off
    with pytest.raises(ConfigError, match="few-row kernel"):
        NativeTarget(plain, kernels[2])
    # head size 8, a Gemma-3 model: transformers' forward
    tiny8 = load_cpu_target(make_tiny_llama(layers=1))
    assert type(tiny8) is CPUTarget and "sizes" in native_step_unsupported(tiny8.model.get_decoder())
    from test_batched_verify import _tiny_gemma3

    gemma = load_cpu_target(_tiny_gemma3())
    assert type(gemma) is CPUTarget and "model type" in native_step_unsupported(gemma.model.get_decoder())
    assert "model type" in gemma.capability(Capability.SPEED_UPS).native_step_off
    with pytest.raises(ValueError, match="unsupported"):
        NativeDecoder(kernels[2], gemma.model.get_decoder())
    with pytest.raises(ConfigError, match="cannot run this model"):
        NativeTarget(gemma, kernels[2])
    # a state of one target on the other: a typed error
    with torch.inference_mode():
        with pytest.raises(ConfigError):
            plain.prefill(on.new_state(), [5, 6])
        with pytest.raises(ConfigError):
            on.prefill(plain.new_state(), [5, 6])


def test_native_step_rejects_a_buffer_of_the_wrong_shape(kernels):
    nat = _target(kernels, _llama(layers=1), True)
    native = nat.native_step
    with torch.inference_mode():
        state = nat.new_state()
        nat.prefill(state, [5, 6, 7])
        bad = NativeKVState(torch.zeros(1, 2, 1, 16, 32), 3)  # one kv head instead of two
        with pytest.raises(RuntimeError, match="kv buffer"):
            native.forward([bad], torch.tensor([4]), torch.tensor([3]), [0, 1], [None])
        with pytest.raises(RuntimeError, match="mask"):
            native.forward([state], torch.tensor([4, 5]), torch.tensor([3, 4]), [0, 2], [torch.ones(2, 3).bool()])


# ---------------------------------------------------------------------------------------
# GGUF blocks: fused q|k|v and gate|up groups where the formats agree, separate calls else


def _quantized_llama(path):
    """A tiny Llama (head size 32) whose linears are gguf-py round trips written to a GGUF
    at ``path``: q/k/o/gate/up Q4_1, v Q5_0 (read as Q8_0: the q|k|v group is not fused),
    down Q8_0, the output layer Q8_0."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    kinds = {Q4_1: GGMLQuantizationType.Q4_1, Q8_0: GGMLQuantizationType.Q8_0, "Q5_0": GGMLQuantizationType.Q5_0}
    model = _llama(layers=2)
    writer = GGUFWriter(str(path), "llama")
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            fmt = Q8_0 if name == "lm_head" or name.endswith("down_proj") else "Q5_0" if "v_proj" in name else Q4_1
            raw = quants.quantize(module.weight.numpy().astype(np.float32), kinds[fmt])
            module.weight.copy_(torch.from_numpy(quants.dequantize(raw, kinds[fmt]).astype(np.float32)))
            writer.add_tensor(name, raw, raw_dtype=kinds[fmt])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return model


def test_native_step_over_gguf_blocks_is_bit_identical(kernels, tmp_path):
    skinny, attention, step = kernels
    path = tmp_path / "m.gguf"
    model = _quantized_llama(path)
    targets = []
    for native in (False, True):
        m = _quantized_llama(tmp_path / f"copy{native}.gguf") if native else model
        blocks = read_gguf_blocks(m, path, load_quant_linear())
        assert len(blocks.weights) == 2 * 7 + 1
        t = CPUTarget(m, skinny=skinny, attention_kernel=attention, gguf=blocks, route_attention=True)
        targets.append(NativeTarget(t, step) if native else t)
    ref, nat = targets
    assert nat.native_step.gguf_linears == 14
    _assert_steps_bit_identical(ref, nat)


def _assert_steps_bit_identical(ref, nat):
    """Prefill a 35-token prompt, then verify every tree of ``_STEPS`` on both targets:
    hidden states and logits bit for bit equal, the same accepted paths committed."""
    prompt = list(range(5, 40))
    with torch.inference_mode():
        sr, sn = ref.new_state(), nat.new_state()
        ref.prefill(sr, prompt)
        nat.prefill(sn, prompt)
        for tree, path in _STEPS:
            past = sr.length
            a, b = ref.verify_one(sr, 7, tree, return_hidden=True), nat.verify_one(sn, 7, tree, return_hidden=True)
            assert torch.equal(a.hidden, b.hidden) and torch.equal(a.logits, b.logits)
            ref.commit(sr, past, path)
            nat.commit(sn, past, path)


def _k_quantized_llama(path):
    """A tiny Llama with hidden size 256 (the K formats' super-block) whose linears are
    random Q4_K / Q6_K blocks written to a GGUF at ``path`` (the same ones at every call):
    q/k/v Q4_K (read as Q4_1: one fused group), o Q6_K, gate/up Q6_K (one fused group of
    int8 with scales per 16), the output layer Q6_K; down (in-features 544) Q8_0."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    model = _llama(layers=2, hidden=256, heads=8, kv_heads=2, head_dim=32)
    writer = GGUFWriter(str(path), "llama")
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if name.endswith("down_proj"):
                kind = GGMLQuantizationType.Q8_0
                raw = quants.quantize(module.weight.numpy().astype(np.float32), kind)
                deq = torch.from_numpy(quants.dequantize(raw, kind).astype(np.float32))
            else:
                kind = (
                    GGMLQuantizationType.Q4_K
                    if name.split(".")[-1] in ("q_proj", "k_proj", "v_proj")
                    else GGMLQuantizationType.Q6_K
                )
                raw, deq = random_k_blocks(*module.weight.shape, kind.name, gen, scale=0.1)
            module.weight.copy_(deq)
            writer.add_tensor(name, raw, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return model


def test_native_step_over_k_format_blocks_is_bit_identical(kernels, tmp_path):
    """Q4_K and Q6_K weights (gemma3-270m's formats; here in a Llama) through the native
    step, fused groups of either format included: bit for bit the kernel path's values."""
    from ragspec.backend.cpu.native import _group

    skinny, attention, step = kernels
    path = tmp_path / "m.gguf"
    targets = []
    for native in (False, True):
        m = _k_quantized_llama(path if not native else tmp_path / "copy.gguf")
        blocks = read_gguf_blocks(m, path, load_quant_linear())
        assert len(blocks.weights) == 2 * 7 + 1
        t = CPUTarget(m, skinny=skinny, attention_kernel=attention, gguf=blocks, route_attention=True)
        targets.append(NativeTarget(t, step) if native else t)
    ref, nat = targets
    assert nat.native_step.gguf_linears == 14
    layer = nat.model.model.layers[0]
    twins = nat.kernel_path.gguf_blocks
    qkv = _group([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj], twins)
    gate_up = _group([layer.mlp.gate_proj, layer.mlp.up_proj], twins)
    assert [g[3] for g in qkv] == [Q4_1] and [g[3] for g in gate_up] == [Q6_K]  # each one fused call
    _assert_steps_bit_identical(ref, nat)


# ---------------------------------------------------------------------------------------
# the engine


def test_engine_greedy_with_the_native_step_equals_transformers_generate(kernels):
    tok = make_char_tokenizer()
    target = select_target(_llama(head_dim=32, hidden=64))
    assert isinstance(target, NativeTarget)
    reference_model = _llama(head_dim=32, hidden=64)
    prompt = tok("the cat sat on the mat. the cat sat on the mat. the cat")["input_ids"]
    ref = greedy_reference(reference_model, prompt, 60)
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), eos_token_ids=[])
    out = engine.generate(prompt, max_new_tokens=60, chat=False)
    assert out.stats.num_drafted_tokens > 0
    assert list(out.token_ids) == ref
    # every draft verified (no cost model): accepted 8-token chains and rejected ones
    assert_scripted_drafts_keep_greedy(target, tok, prompt, ref, 96)


def test_engine_steps_requests_together_through_one_native_call(kernels, monkeypatch):
    tok = make_char_tokenizer()
    target = select_target(_llama())
    calls: list[int] = []
    inner = target.native_step.forward

    def spy(states, *args, **kwargs):
        calls.append(len(states))
        return inner(states, *args, **kwargs)

    monkeypatch.setattr(target.native_step, "forward", spy)
    reference_model = _llama()
    texts = ["the cat sat on the mat. the cat", "a dog ran to the park, a dog ran", "rain and rain and"]
    engine = Engine(target, tok, drafter=PromptLookupDrafter(PLDConfig()), policy=PolicyConfig(adaptive=False))
    reqs = [engine.start(t, chat=False, decode=DecodeConfig(max_new_tokens=30)) for t in texts]
    tokens: list[list[int]] = [[] for _ in texts]
    while any(not r.done for r in reqs):
        active = [i for i, r in enumerate(reqs) if not r.done]
        for i, chunk in zip(active, engine.step([reqs[i] for i in active])):
            tokens[i].extend(chunk.token_ids)
    assert max(calls) == 3  # the three requests verified in one native call
    for t, got in zip(texts, tokens):
        assert got == greedy_reference(reference_model, tok(t)["input_ids"], 30)
